"""tests/dist.py's gloo workers: a worker killed by a signal (a crash in native code, not a Python
error) gets the run retried once; a second crash fails the test."""

from __future__ import annotations

import os
import signal

import pytest

from dist import WorkerCrash, run_workers


def _abort_once(rank, world_size, marker):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    return rank


def _segfault_always(rank, world_size):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def test_a_crashed_worker_is_retried_once(tmp_path):
    assert run_workers(_abort_once, 2, str(tmp_path / "crashed"), timeout=20) == [0, 1]
    assert (tmp_path / "crashed").exists()


def test_a_second_crash_fails():
    with pytest.raises(WorkerCrash, match="SIGSEGV"):
        run_workers(_segfault_always, 2, timeout=20)
