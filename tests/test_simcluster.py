"""benchmarks/simcluster.py: refusals everywhere; real 2-namespace runs where we are root.

The real runs build two network namespaces joined by a tbf-shaped veth and start one
torchrun per namespace, so they need root and iproute2 (CI runs as root); elsewhere
they skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import simcluster
from benchmarks.simcluster import SimCluster, SimClusterError


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _alive(pid: int) -> bool:
    # A zombie has exited; it only waits for a parent (maybe a non-reaping init) to reap it.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def can_simulate() -> None:
    """Skip unless a cluster can really be built here (root, ip/tc, namespaces allowed)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("simcluster needs Linux network namespaces")
    if os.geteuid() != 0:
        pytest.skip("simcluster needs root (network namespaces, veth and tc need CAP_NET_ADMIN)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"simcluster needs iproute2 ({', '.join(missing)} missing: apt-get install iproute2)")
    try:
        with SimCluster(rate="200mbit"):
            pass
    except SimClusterError as e:
        pytest.skip(f"cannot build a simulated cluster here: {e}")


# ------------------------------------------------------------ refusals (run anywhere)


def test_refuses_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "geteuid", lambda: 1000, raising=False)
    with pytest.raises(SimClusterError, match="root"):
        SimCluster(rate="200mbit")


def test_refuses_without_tc(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: None if name == "tc" else real_which(name, *a, **kw))
    with pytest.raises(SimClusterError, match=r"tc.*iproute2"):
        SimCluster(rate="200mbit")


def test_rates_and_tbf_parameters() -> None:
    assert simcluster.parse_rate_bit_s("200mbit") == 200_000_000
    assert simcluster.parse_rate_bit_s("1gbit") == 1_000_000_000
    assert simcluster.parse_rate_bit_s("10mbps") == 80_000_000  # tc: bps are bytes/s
    assert simcluster.parse_rate_bit_s("unlimited") is None
    assert simcluster.parse_rate_bit_s(None) is None
    with pytest.raises(SimClusterError, match="rate"):
        simcluster.parse_rate_bit_s("fast")
    assert simcluster.tbf_params(1_000_000_000) == (125_000, "50ms")
    assert simcluster.tbf_params(200_000_000)[0] == 32 * 1024  # the floor


def test_command_translation() -> None:
    assert simcluster.torchrun_target(["python", "train.py", "--x", "1"]) == ["train.py", "--x", "1"]
    assert simcluster.torchrun_target("python3 -u -m pkg.mod a") == ["-m", "pkg.mod", "a"]
    assert simcluster.torchrun_target([sys.executable, "s.py"]) == ["s.py"]
    for bad in (["torchrun", "s.py"], ["python", "-c", "pass"], ["python"]):
        with pytest.raises(SimClusterError):
            simcluster.torchrun_target(bad)


# ------------------------------------------------------------------ real clusters

ALL_REDUCE = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((2**18,), float(rank + 1))  # 1 MiB of fp32
    dist.all_reduce(t)
    assert torch.all(t == world * (world + 1) / 2), t[:4]
    print(f"rank {rank} of {world} all_reduce ok", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(120)
def test_all_reduce_crosses_the_shaped_link(can_simulate: None, tmp_path: Path) -> None:
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    with SimCluster(rate="200mbit") as cluster:
        names = set(cluster.netns)
        assert names <= _netns_names()
        res = cluster.run(["python", str(script)], nproc_per_node=1, timeout_s=90, echo=False)
    assert res.returncodes == [0, 0], res.outputs
    assert res.ok and not res.timed_out
    assert "rank 0 of 2 all_reduce ok" in res.outputs[0]
    assert "rank 1 of 2 all_reduce ok" in res.outputs[1]
    # The 1 MiB all-reduce went over the veth, and in both directions (ring: each rank
    # sends half in reduce-scatter and half in all-gather).
    assert res.veth_total_bytes == res.veth_tx_bytes + res.veth_rx_bytes >= 2**20
    assert res.veth_tx_bytes >= 2**19 and res.veth_rx_bytes >= 2**19
    assert res.wall_s > 0
    assert not names & _netns_names()


FAIL_ON_NODE_1 = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    node = os.environ["GROUP_RANK"]
    (out / f"pid{node}").write_text(str(os.getpid()))
    if node == "1":
        # Fail only once node 0's worker runs, so there is something to kill there.
        for _ in range(600):
            if (out / "pid0").exists():
                break
            time.sleep(0.1)
        print("node 1 failing", flush=True)
        sys.exit(1)
    time.sleep(600)
    """
)


@pytest.mark.timeout(120)
def test_failing_node_stops_the_other(can_simulate: None, tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_NODE_1)
    with SimCluster(rate="200mbit") as cluster:
        names = set(cluster.netns)
        t0 = time.monotonic()
        with pytest.raises(simcluster.SimClusterRunError, match="node 1 exited with 1") as info:
            cluster.run(["python", str(script), str(tmp_path)], nproc_per_node=1, timeout_s=90,
                        echo=False, check=True)
        elapsed_s = time.monotonic() - t0
        res = info.value.result
        # Stopped because node 1 failed, not because node 0 finished or the timeout hit.
        assert elapsed_s < 60
        assert not res.ok and not res.timed_out
        assert res.failed_node == 1 and res.returncodes[1] == 1
        assert res.killed_nodes == [0] and res.returncodes[0] != 0
        assert "node 1 exited with 1" in res.describe_failure()
        assert "node 1 failing" in res.outputs[1]
        # Both workers (torchrun started them in sessions of their own) are gone already.
        pids = [int((tmp_path / f"pid{k}").read_text()) for k in (0, 1)]
        assert not [pid for pid in pids if _alive(pid)]
        assert simcluster.pids_in_netns(cluster.netns[0]) == []
    assert not names & _netns_names()


@pytest.mark.timeout(60)
def test_namespaces_removed_on_interrupt(can_simulate: None) -> None:
    with pytest.raises(KeyboardInterrupt):
        with SimCluster(rate="1gbit") as cluster:
            names = set(cluster.netns)
            assert names <= _netns_names()
            raise KeyboardInterrupt
    assert not names & _netns_names()
