"""benchmarks/overlap_timeline.py's merge of every rank's trace: the peers' comm-thread lanes
are moved to rank 0's time base, and the per-job table reads each rank's hop in job order (no
cluster; in-process, synthetic traces)."""

from __future__ import annotations

import json

import pytest

from benchmarks import overlap_timeline as tl

HOP, JOB = tl.PEER_LANES[1], tl.PEER_LANES[0]


def _write(path, rank, t0, events):
    path.write_text(json.dumps({"system": "zeropp", "rank": rank, "t0": t0, "events": events}))


def test_peers_are_moved_to_rank_0s_clock_and_keep_only_the_comm_thread_lanes(tmp_path):
    out = tmp_path / "zeropp.json"
    _write(out, 0, 100.0, [["compute", "B3", 0.1, 0.2], [HOP, "hop 2", 0.30, 0.35]])
    # rank 2 started its step 0.5 s after rank 0 did: its 0.1 s is rank 0's 0.6 s
    _write(tmp_path / "zeropp.rank2.json", 2, 100.5, [["compute", "B3", 0.0, 0.1], [JOB, "job", 0.05, 0.2],
                                                       [HOP, "hop 2", 0.1, 0.3]])
    trace = tl.with_peers(out)
    assert trace["events"][0] == ["compute", "B3", 0.1, 0.2]  # rank 0's own lanes untouched
    assert list(trace["peers"]) == ["2"]
    lanes = {e[0]: e[2:] for e in trace["peers"]["2"]}
    assert set(lanes) == {JOB, HOP}  # the peer's compute lane is not carried
    assert lanes[HOP] == pytest.approx([0.6, 0.8])
    assert lanes[JOB] == pytest.approx([0.55, 0.7])


def test_the_hop_table_lists_every_ranks_hop_per_job_in_time_order(tmp_path):
    trace = {"system": "zeropp_delta",
             "events": [[HOP, "hop 2", 0.50, 0.52], [HOP, "hop 2", 0.30, 0.45]],  # out of order on purpose
             "peers": {"1": [[HOP, "hop 2", 0.10, 0.45], [JOB, "job", 0.0, 0.5]], "3": []}}
    lines = tl.hop_table(trace).splitlines()
    assert lines[0].startswith("zeropp_delta:")
    assert lines[1] == "  job 1  0: 0.300 (0.150)  1: 0.100 (0.350)"
    assert lines[2] == "  job 2  0: 0.500 (0.020)"  # rank 1 has no second hop, rank 3 none at all
    assert len(lines) == 3


def test_the_cpu_table_reads_every_ranks_scheduler_view_in_job_order(tmp_path):
    out = tmp_path / "zeropp.json"
    threads0 = [["comm", "job", 0.5, 0.6, 0.02, 0.07], ["comm", "job", 0.2, 0.45, 0.03, 0.2],
                ["main", "step", 0.0, 0.8, 0.4, 0.2], ["process", "step", 0.0, 0.8, 0.5, 0.3]]
    out.write_text(json.dumps({"system": "zeropp_delta", "rank": 0, "t0": 10.0, "events": [], "threads": threads0}))
    # rank 1 started 0.1 s later: its spans move by 0.1 s, its CPU and delay stay
    (tmp_path / "zeropp.rank1.json").write_text(json.dumps(
        {"system": "zeropp_delta", "rank": 1, "t0": 10.1, "events": [],
         "threads": [["main", "step", 0.0, 0.7, 0.35, 0.1], ["process", "step", 0.0, 0.7, 0.45, 0.2]]}))
    trace = tl.with_peers(out)
    assert trace["peer_threads"]["1"][0][:2] == ["main", "step"]
    assert trace["peer_threads"]["1"][0][2:] == pytest.approx([0.1, 0.8, 0.35, 0.1])
    lines = tl.cpu_table(trace).splitlines()
    assert lines[1] == ("  rank 0: step 0.800, process CPU 0.500; training thread 0.400/0.200; "
                        "comm jobs 0.250/0.030/0.200  0.100/0.020/0.070")
    assert lines[2] == "  rank 1: step 0.700, process CPU 0.450; training thread 0.350/0.100; comm jobs "
    assert len(lines) == 3


def test_thread_stat_counts_this_threads_cpu():
    import time

    from benchmarks.bench_train import thread_stat

    cpu0, _ = thread_stat()
    end = time.thread_time() + 0.03  # 30 ms of this thread's CPU, however busy the machine
    while time.thread_time() < end:
        pass
    cpu1, _ = thread_stat()
    # zeros where the kernel has no schedstat; older kernels may lag the running thread by a tick
    assert cpu1 == cpu0 == 0.0 or 0.02 <= cpu1 - cpu0 <= 0.05
