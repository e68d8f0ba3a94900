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
