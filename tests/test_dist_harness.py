"""tests/_dist.py itself: a failed call reports every rank's failure, not only the first."""

from __future__ import annotations

import time

import pytest

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(120)


def _fail_late_and_early(rank, world):
    if rank == 0:
        time.sleep(0.5)  # the cause, reported after the peer's consequence
        raise RuntimeError("the cause, on rank 0")
    raise ConnectionError("connection closed by peer, on rank 1")


def test_a_failed_call_shows_the_other_ranks_failures_too():
    with pytest.raises(AssertionError) as info:
        run_ranks(_fail_late_and_early, 2)
    text = str(info.value)
    assert "connection closed by peer, on rank 1" in text and "the cause, on rank 0" in text
