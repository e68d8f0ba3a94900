"""The pieces benchmarks/simcluster.py's ``SimCluster`` is built from: its errors, link rates and
the tbf parameters, the result records, the checks and translation of commands, and the
processes in a network namespace (finding, stopping, reading their output). Imported by
benchmarks/simcluster.py, which re-exports the public names: import them from there
(``from benchmarks.simcluster import SimClusterError``). What the cluster is and measures:
benchmarks/simcluster.py's docstring.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence, TextIO


class SimClusterError(RuntimeError):
    """The simulated cluster cannot be set up, or a run failed and ``check=True``."""


class SimClusterRunError(SimClusterError):
    """A run failed (a node exited non-zero, or the run timed out); ``.result`` has it."""

    def __init__(self, message: str, result: RunResult) -> None:
        super().__init__(message)
        self.result = result


# --------------------------------------------------------------------------- rates

_RATE_UNITS_BIT_S = {
    # tc's own units: "bit" suffixes are bits per second, "bps" ones are BYTES per second.
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9,
}


def parse_rate_bit_s(rate: str | int | None) -> int | None:
    """'200mbit' -> 200_000_000 bits/s; None or 'unlimited' -> None (no shaping)."""
    if rate is None:
        return None
    if isinstance(rate, int):
        bit_s = rate
    else:
        text = rate.strip().lower()
        if text in ("", "unlimited", "none", "inf"):
            return None
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
        if not m or (m.group(2) or "bit") not in _RATE_UNITS_BIT_S:
            raise SimClusterError(
                f"cannot parse rate {rate!r}: use e.g. '200mbit', '1gbit', '500kbit' or 'unlimited'"
            )
        bit_s = int(float(m.group(1)) * _RATE_UNITS_BIT_S[m.group(2) or "bit"])
    if bit_s <= 0:
        raise SimClusterError(f"rate must be positive, got {rate!r}")
    return bit_s


def tbf_params(rate_bit_s: int) -> tuple[int, str]:
    """(burst_bytes, latency) for ``tc qdisc ... tbf``.

    The bucket holds 1 ms worth of the rate (32 KiB at least, a few full frames, which
    is 1.3 ms at 200mbit). A bigger bucket reaches the rate just as well, but it refills
    while the ranks compute and then lets a whole collective through at veth speed: with
    10 ms (1.25 MB at 1gbit) a 1 MiB all-reduce between idle ranks took 1.7 ms instead
    of the ~9 ms that 1 Gbit/s allows, which is not the slow link we want to simulate.
    Smaller still and the kernel's qdisc timer, late on a loaded machine, starts costing
    rate. Latency bounds the queue: packets that would wait longer than 50 ms are
    dropped, so TCP's congestion control sees the bottleneck instead of a huge buffer.
    """
    return max(rate_bit_s // 8 // 1000, 32 * 1024), "50ms"


# ------------------------------------------------------------------------ results


@dataclass
class RunResult:
    """One ``SimCluster.run``: per-node return codes and outputs, time and traffic."""

    command: list[str]
    rate: str
    nodes: int
    nproc_per_node: int
    returncodes: list[int]
    wall_s: float
    veth_tx_bytes: int  # node 0 -> node 1: payload plus TCP/IP headers
    veth_rx_bytes: int  # node 1 -> node 0
    outputs: list[str] = field(repr=False)
    timed_out: bool = False
    failed_node: int | None = None  # first node that exited non-zero by itself
    killed_nodes: list[int] = field(default_factory=list)  # stopped by us

    @property
    def veth_total_bytes(self) -> int:
        return self.veth_tx_bytes + self.veth_rx_bytes

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def describe_failure(self) -> str:
        if self.ok:
            return ""
        if self.timed_out:
            return f"timed out after {self.wall_s:.1f} s; killed nodes {self.killed_nodes}"
        parts = [f"node {self.failed_node} exited with {self.returncodes[self.failed_node]}"]
        if self.killed_nodes:
            parts.append(f"killed the other node(s) {self.killed_nodes}")
        return "; ".join(parts)

    def summary(self) -> dict:
        """Everything but the outputs, for printing and JSON."""
        d = asdict(self)
        del d["outputs"]
        d["veth_total_bytes"] = self.veth_total_bytes
        d["ok"] = self.ok
        return d


@dataclass
class BandwidthResult:
    """One direction of ``measure_bandwidth``: TCP goodput over the shaped veth."""

    direction: str  # "node0->node1"
    rate: str
    configured_mbit_s: float | None  # None when unlimited
    payload_bytes: int
    seconds: float
    achieved_mbit_s: float


# ------------------------------------------------------------ commands and checks


def _ip_tools_missing() -> list[str]:
    # shutil.which is looked up on the module each time so tests can monkeypatch it.
    return [tool for tool in ("ip", "tc") if shutil.which(tool) is None]


def preflight() -> None:
    """Raise SimClusterError, before touching anything, if we cannot build a cluster."""
    if not sys.platform.startswith("linux"):
        raise SimClusterError(f"simcluster needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise SimClusterError(
            "simcluster must run as root: creating network namespaces, veth pairs and tc "
            "qdiscs needs CAP_NET_ADMIN/CAP_SYS_ADMIN (run it with sudo, or in a container "
            "started with --privileged or --cap-add NET_ADMIN --cap-add SYS_ADMIN)"
        )
    missing = _ip_tools_missing()
    if missing:
        raise SimClusterError(
            f"simcluster needs the iproute2 tools, missing: {', '.join(missing)} "
            "(install them with `apt-get install iproute2`, or your distribution's iproute2 package)"
        )


def _sh(argv: Sequence[str], what: str, hint: str = "") -> str:
    """Run one setup command; a failure becomes a SimClusterError saying what and why."""
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        msg = f"{what} failed: `{shlex.join(argv)}` -> {proc.stderr.strip() or proc.returncode}"
        raise SimClusterError(msg + (f" ({hint})" if hint else ""))
    return proc.stdout


def _is_python(word: str) -> bool:
    return word == sys.executable or re.fullmatch(r"python[\d.]*", os.path.basename(word)) is not None


def torchrun_target(cmd: Sequence[str] | str) -> list[str]:
    """``python [-u] script.py args`` -> ``script.py args``; ``python -m mod args`` -> ``-m mod args``.

    torchrun takes the script (or ``-m module``) itself and starts its own interpreter
    per rank, so the leading python goes; ``-u`` is implied (PYTHONUNBUFFERED is set
    so that output streams live). Other interpreter flags have no torchrun spelling.
    """
    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    if not argv or not _is_python(argv[0]):
        raise SimClusterError(
            f"the command must start with python followed by a script or -m module, got {argv!r}"
        )
    rest = argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if not rest:
        raise SimClusterError("the command has no script or -m module after python")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise SimClusterError("`python -m` needs a module name")
        return rest
    if rest[0].startswith("-"):
        raise SimClusterError(
            f"interpreter option {rest[0]!r} cannot be passed through torchrun: write the code "
            "to a script, or set the matching environment variable (e.g. PYTHONWARNINGS)"
        )
    return rest


# ----------------------------------------------------------- processes in a netns


def _netns_file(name: str) -> str:
    # iproute2 bind-mounts each named namespace here (NETNS_RUN_DIR, /run == /var/run).
    return f"/run/netns/{name}" if os.path.isdir("/run/netns") else f"/var/run/netns/{name}"


def pids_in_netns(name: str) -> list[int]:
    """All live processes whose network namespace is ``name`` (what `ip netns pids` lists).

    Every process we start in a namespace stays in it, including torchrun's workers,
    which torchrun puts in sessions of their own: so this finds them even after their
    parent is gone, where killing a process group would miss them.
    """
    try:
        st = os.stat(_netns_file(name))
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            pst = os.stat(f"/proc/{entry}/ns/net")  # zombies have none: they don't count
        except OSError:
            continue
        if (pst.st_dev, pst.st_ino) == (st.st_dev, st.st_ino):
            found.append(int(entry))
    return found


def _signal_quietly(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(targets: Sequence[tuple[str, subprocess.Popen | None]], grace_s: float = 5.0) -> None:
    """Stop everything in the given namespaces: SIGTERM, then SIGKILL after ``grace_s``.

    ``targets`` pairs a namespace with the torchrun started in it (or None). All get
    SIGTERM at once, so stopping two nodes costs one grace period, not two.
    """
    def running(proc: subprocess.Popen | None) -> bool:
        return proc is not None and proc.poll() is None

    # SIGTERM to torchrun's own group first: it forwards the signal to its workers and
    # waits for them, which is the orderly way down.
    for netns, proc in targets:
        if running(proc):
            _signal_quietly(proc.pid, signal.SIGTERM, group=True)  # type: ignore[union-attr]
        for pid in pids_in_netns(netns):
            _signal_quietly(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not any(running(proc) or pids_in_netns(netns) for netns, proc in targets):
            break
        time.sleep(0.05)
    else:
        for netns, proc in targets:
            if running(proc):
                _signal_quietly(proc.pid, signal.SIGKILL, group=True)  # type: ignore[union-attr]
            for pid in pids_in_netns(netns):
                _signal_quietly(pid, signal.SIGKILL)
    for _, proc in targets:
        if proc is not None:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel; the namespace still goes, and the process with it


def _pump(proc: subprocess.Popen, node: int, sink: list[str], stream: TextIO | None,
          lock: threading.Lock) -> None:
    """Copy one node's combined stdout/stderr into ``sink`` and, prefixed, to ``stream``."""
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if stream is not None:
            with lock:
                stream.write(f"[node {node}] {line}" if line.endswith("\n") else f"[node {node}] {line}\n")
                stream.flush()
    proc.stdout.close()
