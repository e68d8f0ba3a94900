"""A simulated low-bandwidth 2-node cluster on one Linux machine.

Two network namespaces stand in for two nodes. A veth pair joins them, and a token
bucket (``tc ... tbf``) on the egress of both ends caps the link at a chosen rate. One
``torchrun`` is started per namespace (``--nnodes 2 --node_rank k``), so ranks of one
"node" talk over that namespace's own stack (loopback speed) and only cross-node
traffic pays for the slow link: the shape of a real multi-node job, which is what
ZeRO++ (hpZ keeps the secondary gather inside a node, qwZ/qgZ shrink what crosses)
is about. Needs root (namespaces and qdiscs need CAP_NET_ADMIN) and iproute2.

    # any torch.distributed script, 2 nodes x 2 ranks, cross-node link at 200 Mbit/s
    sudo python benchmarks/simcluster.py --nproc-per-node 2 --rate 200mbit \\
        --json out.json -- python benchmarks/some_script.py --its-args
    sudo python benchmarks/simcluster.py --nproc-per-node 1 --rate 1gbit -- python -m pkg.mod

    # check the shaping: 16 MiB over the link in each direction, no torch involved
    sudo python benchmarks/simcluster.py --rate 200mbit --selftest

    # as a library
    from benchmarks.simcluster import SimCluster
    with SimCluster(rate="200mbit") as cluster:
        res = cluster.run(["python", "train.py"], nproc_per_node=2, timeout_s=900)
        print(res.wall_s, res.veth_tx_bytes, res.veth_rx_bytes, res.returncodes)

What it measures, per run: ``wall_s`` from launching both torchruns until both have
exited (so it includes interpreter start-up, ``import torch`` and the rendezvous:
compare runs of one script, or time the interesting part inside the script), and the
bytes node 0's veth sent (``veth_tx_bytes``, node 0 -> node 1) and received
(``veth_rx_bytes``), the difference of the kernel's interface counters before and
after the run. That is all cross-node traffic: payload plus TCP/IP headers, plus the
rendezvous store's and gloo's set-up chatter. A script doing one all-reduce of 1 MiB
between two single-rank nodes shows 1.11 MB each way.

Measured on a 2-core CPU VM shared with other jobs (load average 15-20 throughout, so
expect less spread on a quiet machine), torch 2.13 CPU, iproute2 6.1, tbf burst =
max(1 ms of the rate, 32 KiB), latency 50 ms.

``python benchmarks/simcluster.py --rate R --selftest`` (16 MiB each way; TCP goodput
timed by the receiver after a 2 MiB warm-up), several runs:

    configured   achieved, both directions
    200mbit      162-191 Mbit/s, mostly 180-191
    1gbit        740-973 Mbit/s, median ~870
    unlimited    6-21 Gbit/s (CPU-bound)

tbf counts whole frames, so TCP payload tops out at 1448/1514 = 95.6% of the rate
(191 and 956 Mbit/s): at 200mbit the link is exact when the CPU keeps up; at 1gbit the
loaded VM's scheduling costs another ~10%.

``python benchmarks/simcluster.py --nproc-per-node 1 --rate R -- python allreduce.py``
with a gloo all_reduce of 2**18 fp32 (1 MiB) between 2 nodes x 1 rank, 10 timed calls
after a warm-up (a 2-rank ring moves 1 MiB each way, 44 ms at 191 Mbit/s):

    200mbit      min 44 ms, median 49 ms
    1gbit        min 8.4 ms, median 15 ms
    unlimited    min 2.0 ms, median 6.8 ms

With 2 nodes x 2 ranks at 200mbit the same all_reduce took min 62 ms, median 93 ms
(the 4-rank ring crosses the link once in each direction with 1.5 MiB). A whole run
of such a script (two torchruns, imports, rendezvous) takes 16-25 s wall on the loaded
VM, 6 s when it was quieter.

Cleanup: the namespaces (and with them the veth) are deleted in ``__exit__``, also on
exceptions and Ctrl-C, and by an atexit hook and SIGTERM/SIGHUP handlers as a safety
net. Only a SIGKILL of this process leaves them behind; remove those with
``ip netns list`` / ``ip netns delete zpp-<pid>-<n>-<k>``.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

if not __package__:  # run as a script: benchmarks/ is sys.path[0], the repository root is needed for benchmarks.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.simcluster_base import (  # noqa: E402
    BandwidthResult,
    RunResult,
    SimClusterError,
    SimClusterRunError,
    _pump,
    _sh,
    _stop,
    parse_rate_bit_s,
    pids_in_netns,
    preflight,
    tbf_params,
    torchrun_target,
)

# The library's names, those of benchmarks/simcluster_base.py included (tests/test_simcluster.py reads them here).
__all__ = ["BandwidthResult", "RunResult", "SimCluster", "SimClusterError", "SimClusterRunError", "main",
           "measure_bandwidth", "parse_rate_bit_s", "pids_in_netns", "preflight", "tbf_params", "torchrun_target"]


# --------------------------------------------------------------- the cluster

# Namespaces of clusters not yet torn down, for the atexit / signal safety net.
_LIVE: dict[int, SimCluster] = {}
_LIVE_LOCK = threading.Lock()
_SAVED_HANDLERS: dict[int, object] = {}
_instance_ids = itertools.count(1)


def _cleanup_live() -> None:
    for cluster in list(_LIVE.values()):
        cluster.close()


atexit.register(_cleanup_live)


def _raise_on_signal(signum: int, frame: object) -> None:
    # Turn SIGTERM/SIGHUP into an exception so `with` blocks unwind and __exit__ runs.
    raise SystemExit(128 + signum)


def _install_signal_net() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if sig not in _SAVED_HANDLERS and signal.getsignal(sig) == signal.SIG_DFL:
            _SAVED_HANDLERS[sig] = signal.signal(sig, _raise_on_signal)


def _restore_signal_net() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in list(_SAVED_HANDLERS.items()):
        signal.signal(sig, handler)  # type: ignore[arg-type]
        del _SAVED_HANDLERS[sig]


class SimCluster:
    """Two network namespaces joined by a (shaped) veth pair; run torchrun jobs across them.

    Use as a context manager: ``__enter__`` builds the namespaces, ``__exit__`` removes
    them. ``rate`` is a tc rate ('200mbit', '1gbit') or None / 'unlimited'.
    """

    def __init__(self, rate: str | int | None = "unlimited", nodes: int = 2) -> None:
        preflight()
        if nodes != 2:
            raise SimClusterError(
                f"nodes={nodes}: only 2 nodes are supported (one veth pair joins exactly two namespaces)"
            )
        self.nodes = nodes
        self.rate_bit_s = parse_rate_bit_s(rate)
        self.rate_label = "unlimited" if self.rate_bit_s is None else str(rate)
        pid, seq = os.getpid(), next(_instance_ids)
        self.netns = [f"zpp-{pid}-{seq}-{k}" for k in range(nodes)]
        # Each veth end is created straight inside its namespace, so the names never
        # meet the host's interfaces; they only need to be unique within a namespace.
        self.veth = [f"zv{pid % 10**7}-{k}" for k in range(nodes)]
        # The /30 lives only inside the namespaces; deriving it from pid and instance
        # just keeps concurrent clusters' addresses apart in logs.
        x = (pid + seq) % 256
        self.addrs = [f"10.77.{x}.{k + 1}" for k in range(nodes)]
        self._created: list[str] = []
        self._runs = 0

    # -- setup / teardown -------------------------------------------------------

    def __enter__(self) -> SimCluster:
        with _LIVE_LOCK:
            _LIVE[id(self)] = self
        _install_signal_net()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for ns in self.netns:
            _sh(["ip", "netns", "add", ns], "creating network namespace",
                "network namespaces need root with CAP_SYS_ADMIN and a writable /run/netns; "
                "in a container, start it with --privileged")
            self._created.append(ns)
        _sh(["ip", "link", "add", self.veth[0], "netns", self.netns[0], "type", "veth",
             "peer", "name", self.veth[1], "netns", self.netns[1]],
            "creating the veth pair", "the kernel needs the veth module: modprobe veth")
        for ns, dev, addr in zip(self.netns, self.veth, self.addrs):
            _sh(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev], "assigning an address")
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"], "bringing lo up")
            _sh(["ip", "-n", ns, "link", "set", dev, "up"], "bringing the veth up")
            if self.rate_bit_s is not None:
                # Egress of both ends: each direction of the link gets its own bucket.
                burst_bytes, latency = tbf_params(self.rate_bit_s)
                _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{self.rate_bit_s}bit", "burst", str(burst_bytes), "latency", latency],
                    "adding the tbf qdisc", "the kernel needs the sch_tbf module: modprobe sch_tbf")
        # Jobs enter a namespace with `ip netns exec`, which also remounts /sys; find out
        # now, not as two failed torchruns, if this machine does not allow that.
        _sh(["ip", "netns", "exec", self.netns[0], sys.executable, "-c", "pass"],
            "running a process inside the namespace",
            "ip netns exec needs CAP_SYS_ADMIN to mount /sys; in a container, start it with --privileged")

    def close(self) -> None:
        """Kill whatever still runs in our namespaces and delete them (idempotent)."""
        _stop([(ns, None) for ns in self._created], grace_s=2.0)
        for ns in reversed(self._created):
            # Deleting the namespace destroys the veth end in it, and so the pair.
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self._created.clear()
        with _LIVE_LOCK:
            _LIVE.pop(id(self), None)
            if not _LIVE:
                _restore_signal_net()

    # -- helpers ----------------------------------------------------------------

    def _need_built(self) -> None:
        if len(self._created) != self.nodes:
            raise SimClusterError("the cluster is not set up: use it as `with SimCluster(...) as cluster:`")

    def veth_counters_bytes(self) -> tuple[int, int]:
        """(tx, rx) byte counters of node 0's veth, as the kernel keeps them."""
        out = _sh(["ip", "-n", self.netns[0], "-j", "-s", "link", "show", "dev", self.veth[0]],
                  "reading veth counters")
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def popen(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace, in a process group of its own."""
        self._need_built()
        return subprocess.Popen(["ip", "netns", "exec", self.netns[node], *argv],
                                env=env, start_new_session=True, **kwargs)  # type: ignore[arg-type]

    def node_env(self, node: int, env: dict[str, str] | None = None) -> dict[str, str]:
        """Our defaults < the caller's environment < ``env`` < what the topology dictates."""
        merged = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        merged.update(os.environ)
        merged.update(env or {})
        # gloo binds to the address of the interface named here; MASTER_ADDR is where
        # node 0's rendezvous store listens. Anything else cannot work in the namespace.
        merged["GLOO_SOCKET_IFNAME"] = self.veth[node]
        merged["MASTER_ADDR"] = self.addrs[0]
        return merged

    # -- running a job ------------------------------------------------------------

    def run(self, cmd: Sequence[str] | str, nproc_per_node: int = 1, timeout_s: float = 900,
            env: dict[str, str] | None = None, echo: bool = True,
            check: bool = False, kill_grace_s: float = 5.0) -> RunResult:
        """Run ``python script.py args`` (or ``python -m mod args``) as a 2-node torchrun job.

        Output of node k is collected in ``outputs[k]`` and, with ``echo``, written
        live to stdout with a ``[node k] `` prefix. When a node exits non-zero the others
        are stopped; so are all at ``timeout_s``. The result says which; with
        ``check=True`` a failure raises SimClusterRunError instead.
        """
        self._need_built()
        target = torchrun_target(cmd)
        command = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        # A fresh namespace has nothing listening, so any high port will do; a new one
        # per run keeps a previous run's sockets in TIME_WAIT out of the way.
        port = 29500 + self._runs % 1000
        self._runs += 1

        tx0, rx0 = self.veth_counters_bytes()
        procs: list[subprocess.Popen] = []
        readers: list[threading.Thread] = []
        lines: list[list[str]] = [[] for _ in range(self.nodes)]
        lock = threading.Lock()
        timed_out, failed_node, killed = False, None, []
        t0 = time.monotonic()
        try:
            for k in range(self.nodes):
                argv = [sys.executable, "-m", "torch.distributed.run",
                        "--nnodes", str(self.nodes), "--node_rank", str(k),
                        "--nproc-per-node", str(nproc_per_node),
                        "--master-addr", self.addrs[0], "--master-port", str(port), *target]
                proc = self.popen(k, argv, env=self.node_env(k, env), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                procs.append(proc)
                reader = threading.Thread(target=_pump, daemon=True,
                                          args=(proc, k, lines[k], sys.stdout if echo else None, lock))
                reader.start()
                readers.append(reader)

            deadline = t0 + timeout_s
            while True:
                codes = [p.poll() for p in procs]  # every one, each time: no short-circuit
                failed_node = next((k for k, rc in enumerate(codes) if rc not in (None, 0)), None)
                if failed_node is not None or None not in codes:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.02)
        finally:
            # Normal end, failure, timeout or an exception here (Ctrl-C): nothing of
            # this run may outlive it, including workers whose torchrun is gone.
            killed = [k for k, p in enumerate(procs) if p.poll() is None]
            _stop(list(zip(self.netns, procs)), grace_s=kill_grace_s)
        wall_s = time.monotonic() - t0
        for reader in readers:
            reader.join(timeout=5.0)
        tx1, rx1 = self.veth_counters_bytes()

        result = RunResult(
            command=command, rate=self.rate_label, nodes=self.nodes, nproc_per_node=nproc_per_node,
            returncodes=[p.returncode for p in procs], wall_s=wall_s,
            veth_tx_bytes=tx1 - tx0, veth_rx_bytes=rx1 - rx0,
            outputs=["".join(node_lines) for node_lines in lines],
            timed_out=timed_out, failed_node=failed_node, killed_nodes=killed,
        )
        if check and not result.ok:
            raise SimClusterRunError(f"simcluster run failed: {result.describe_failure()}", result)
        return result

    # -- checking the shaping -------------------------------------------------------

    def measure_bandwidth(self, payload_bytes: int = 16 << 20,
                          timeout_s: float = 120) -> list[BandwidthResult]:
        """TCP goodput over the veth in each direction, with a bare python socket pair."""
        self._need_built()
        burst_bytes = 0 if self.rate_bit_s is None else tbf_params(self.rate_bit_s)[0]
        warmup_bytes = min(max(payload_bytes // 8, 2 * burst_bytes), payload_bytes // 2)
        results = []
        for src, dst in ((0, 1), (1, 0)):
            port = 40000 + self._runs % 1000
            self._runs += 1
            receiver = self.popen(dst, [sys.executable, "-c", _RECEIVER, self.addrs[dst], str(port),
                                        str(payload_bytes), str(warmup_bytes)],
                                  env=self.node_env(dst), stdout=subprocess.PIPE, text=True)
            sender = None
            try:
                assert receiver.stdout is not None
                if receiver.stdout.readline().strip() != "ready":
                    raise SimClusterError("bandwidth receiver did not start")
                sender = self.popen(src, [sys.executable, "-c", _SENDER, self.addrs[dst], str(port),
                                          str(payload_bytes)], env=self.node_env(src))
                out, _ = receiver.communicate(timeout=timeout_s)
                sender.wait(timeout=timeout_s)
            finally:
                _stop([(self.netns[dst], receiver), (self.netns[src], sender)], grace_s=2.0)
            if receiver.returncode != 0 or not out.strip():
                raise SimClusterError(f"bandwidth receiver failed (exit {receiver.returncode})")
            got = json.loads(out)
            results.append(BandwidthResult(
                direction=f"node{src}->node{dst}", rate=self.rate_label,
                configured_mbit_s=None if self.rate_bit_s is None else self.rate_bit_s / 1e6,
                payload_bytes=got["bytes"], seconds=got["seconds"],
                achieved_mbit_s=got["bytes"] * 8 / got["seconds"] / 1e6,
            ))
        return results


# The bandwidth probe: plain sockets, so it measures the link and not torch. The receiver
# starts its clock only after a warm-up share of the payload has arrived: that leaves out
# connection set-up, TCP slow start and the token bucket's initial burst (which would
# let the first burst_bytes through at veth speed), so what remains is the steady rate.
_RECEIVER = r"""
import json, socket, sys, time
addr, port, n, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
srv = socket.create_server((addr, port))
print("ready", flush=True)
conn, _ = srv.accept()
buf = bytearray(1 << 20)
got = timed = 0
start = None
while got < n:
    k = conn.recv_into(buf)
    if k == 0:
        break
    got += k
    if start is None:
        if got >= warmup:
            start = time.perf_counter()
    else:
        timed += k
seconds = time.perf_counter() - start
conn.sendall(b"k")
print(json.dumps({"bytes": timed, "seconds": seconds}), flush=True)
"""

_SENDER = r"""
import socket, sys
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conn = socket.create_connection((addr, port), timeout=60)
chunk = bytes(1 << 20)
left = n
while left > 0:
    conn.sendall(chunk[:min(left, len(chunk))])
    left -= min(left, len(chunk))
conn.recv(1)
"""


def measure_bandwidth(rate: str | int | None, payload_bytes: int = 16 << 20) -> list[BandwidthResult]:
    """Build a cluster at ``rate`` and measure the goodput of its link in both directions."""
    with SimCluster(rate=rate) as cluster:
        return cluster.measure_bandwidth(payload_bytes)


# ------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is the job; argparse would try to read its flags.
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv

    parser = argparse.ArgumentParser(
        prog="simcluster.py",
        description="Run a torch.distributed script as a 2-node torchrun job over a shaped veth link.",
        usage="%(prog)s --nproc-per-node P --rate 200mbit [--json OUT] -- python script.py args...",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    parser.add_argument("--rate", default="unlimited", help="link rate: 200mbit, 1gbit, unlimited")
    parser.add_argument("--nodes", type=int, default=2, help="number of nodes (only 2 is supported)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="kill the job after this long")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--selftest", action="store_true",
                        help="measure the link's goodput with 16 MiB each way (no command needed)")
    args = parser.parse_args(own)
    if not command and not args.selftest:
        parser.error("give a command after --, e.g. -- python script.py, or --selftest")

    try:
        if command:
            torchrun_target(command)  # refuse a command torchrun cannot take before building anything
        with SimCluster(rate=args.rate, nodes=args.nodes) as cluster:
            summary: dict = {}
            if args.selftest:
                bw = cluster.measure_bandwidth()
                for r in bw:
                    conf = "unlimited" if r.configured_mbit_s is None else f"{r.configured_mbit_s:.0f} Mbit/s"
                    print(f"selftest {r.direction}: {r.achieved_mbit_s:.1f} Mbit/s achieved, {conf} configured "
                          f"({r.payload_bytes} B in {r.seconds:.3f} s)")
                summary["selftest"] = [asdict(r) for r in bw]
            rc = 0
            if command:
                res = cluster.run(command, nproc_per_node=args.nproc_per_node, timeout_s=args.timeout_s)
                summary.update(res.summary())
                print(f"simcluster: {res.nodes} nodes x {res.nproc_per_node} ranks, rate {res.rate}")
                print(f"  wall_s          {res.wall_s:.2f}")
                print(f"  veth_tx_bytes   {res.veth_tx_bytes}  (node 0 -> node 1)")
                print(f"  veth_rx_bytes   {res.veth_rx_bytes}  (node 1 -> node 0)")
                print(f"  veth_total      {res.veth_total_bytes}")
                print(f"  returncodes     {res.returncodes}")
                if not res.ok:
                    print(f"  FAILED: {res.describe_failure()}")
                    # timeout(1)'s convention for a timeout; else the failed node's code
                    # (a signal's negative code, or none, becomes 1).
                    rc = 124 if res.timed_out else res.returncodes[res.failed_node or 0]
                    rc = rc if 0 < rc < 256 else 1
    except SimClusterError as e:
        print(f"simcluster: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # The with block has already stopped the job and removed the namespaces.
        print("simcluster: interrupted; job stopped, namespaces removed", file=sys.stderr)
        return 130
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
