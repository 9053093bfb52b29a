"""tests/dist.py's gloo workers: how failures reach the test, and what of the test process the workers
see now that they are not forked from it.

A worker killed by a signal (a crash in native code) must fail the test at once, naming the signal,
the rank and the function: a retry would hide a real crash. A Python exception comes back with the
worker's traceback. The workers get the test's environment, its monkeypatched module attributes and
its captured output, which forked workers used to inherit. They are CPU ranks, GPUs or not: they see
no CUDA device unless the test asks for one (`cuda=True`)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as torch_dist

import dist
from dist import WorkerCrash, WorkerError, WorkerTimeout, run_workers

PATCHABLE = "as imported"  # monkeypatched by a test below; read by a worker


def _log_start(log, rank):
    with open(log, "a") as f:
        f.write(f"{rank}\n")


def _abort_on_rank_1(rank, world_size, log):
    _log_start(log, rank)
    if rank == 1:
        os.abort()
    return rank


def _segfault_on_rank_0(rank, world_size):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def test_a_crashed_worker_fails_the_run_once_without_retry(tmp_path, capfd):
    log = tmp_path / "starts"
    with pytest.raises(WorkerCrash) as crash:
        run_workers(_abort_on_rank_1, 2, str(log), timeout=30)
    message = str(crash.value)
    assert "rank 1 by SIGABRT" in message and "_abort_on_rank_1" in message, message
    assert "rank 0" not in message.split("\n", 1)[0]  # rank 0 finished normally
    assert sorted(log.read_text().split()) == ["0", "1"]  # each rank started exactly once: no retry
    # the worker's native stack (faulthandler) reaches the test's captured stderr
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "_abort_on_rank_1" in err, err


def test_a_segfault_names_the_signal_and_rank():
    with pytest.raises(WorkerCrash, match=r"rank 0 by SIGSEGV"):
        run_workers(_segfault_on_rank_0, 2, timeout=30)


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        _nested_failure(rank)
    return rank


def _nested_failure(rank):
    raise ValueError(f"bad input on rank {rank}")


def test_a_python_exception_comes_back_with_its_traceback():
    with pytest.raises(WorkerError) as error:
        run_workers(_raise_on_rank_1, 2, timeout=30)
    message = str(error.value)
    assert "_raise_on_rank_1" in message.split("\n", 1)[0]
    assert "--- rank 1 ---" in message and "--- rank 0 ---" not in message
    assert "Traceback (most recent call last)" in message
    assert "in _nested_failure" in message and "ValueError: bad input on rank 1" in message


def _raise_on_rank_0_while_rank_1_works_on(rank, world_size):
    if rank == 0:
        raise RuntimeError("rank 0 gave up")
    time.sleep(120)  # e.g. a long computation before the next collective
    return rank


def test_a_failed_rank_does_not_leave_the_test_waiting_for_the_timeout(monkeypatch):
    monkeypatch.setattr(dist, "GRACE", 1.0)
    start = time.monotonic()
    with pytest.raises(WorkerError) as error:
        run_workers(_raise_on_rank_0_while_rank_1_works_on, 2, timeout=120)
    assert time.monotonic() - start < 60  # the grace period, not the 120 s timeout
    message = str(error.value)
    assert "failed on ranks [0]" in message and "RuntimeError: rank 0 gave up" in message
    assert "ranks [1]: still running 1.0s after that, killed" in message, message


def _sleep_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(120)
    return rank


def test_a_hung_worker_is_reported_as_a_timeout():
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"ranks \[1\] did not finish within 2"):
        run_workers(_sleep_on_rank_1, 2, timeout=2)
    spawned = dist._CTX.get_start_method() == "spawn"  # (TESTS_SPAWN_WORKERS) time to import torch
    assert time.monotonic() - start < 60 + (dist.SPAWN_IMPORT_S if spawned else 0)


def _identify(rank, world_size):
    time.sleep(0.3 * (world_size - 1 - rank))  # the highest rank answers first
    return rank, os.getpid(), torch_dist.get_rank(), torch_dist.get_world_size()


def test_results_come_back_in_rank_order():
    results = run_workers(_identify, 3, timeout=60)
    assert [r[0] for r in results] == [0, 1, 2]
    assert [r[2:] for r in results] == [(0, 3), (1, 3), (2, 3)]  # the gloo group matches
    assert len({r[1] for r in results} | {os.getpid()}) == 4  # one process per rank, none is pytest


def _server_threads(rank, world_size):
    with open(f"/proc/{os.getppid()}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return os.getppid(), threads


@pytest.mark.skipif(dist._CTX.get_start_method() != "forkserver" or not os.path.exists("/proc/self/status"),
                    reason="workers are spawned here (TESTS_SPAWN_WORKERS), or no /proc")
def test_workers_are_forked_from_a_single_threaded_server():
    """The reason for the forkserver: fork() of a process with other threads running (pytest's, after
    gloo / OpenMP / autograd started theirs) can leave a child's allocator or gloo state broken."""
    ((parent, threads),) = run_workers(_server_threads, 1)
    assert parent != os.getpid()
    assert threads == 1


def _read_environment(rank, world_size):
    return os.environ.get("DIST_HARNESS_SET"), os.environ.get("DIST_HARNESS_UNSET", "absent")


def _read_patched(rank, world_size):
    return PATCHABLE


def test_workers_see_the_tests_environment_and_patches(monkeypatch):
    run_workers(_identify, 1)  # the forkserver, if any, now exists: what follows is sent per call
    monkeypatch.setenv("DIST_HARNESS_SET", "set by the test")
    monkeypatch.setenv("DIST_HARNESS_UNSET", "there before the call")
    monkeypatch.delenv("DIST_HARNESS_UNSET")
    monkeypatch.setattr(sys.modules[__name__], "PATCHABLE", "patched by the test")
    assert run_workers(_read_environment, 2) == [("set by the test", "absent")] * 2
    assert run_workers(_read_patched, 2) == ["patched by the test"] * 2


def test_a_patch_the_workers_cannot_receive_is_an_error(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "PATCHABLE", lambda: None)
    with pytest.raises(WorkerError, match="PATCHABLE.*cannot be pickled"):
        run_workers(_read_patched, 1)


def test_a_function_the_workers_cannot_import_is_an_error():
    def local(rank, world_size):
        return rank

    with pytest.raises(WorkerError, match="must be picklable"):
        run_workers(local, 1)


def _cuda_view(rank, world_size):
    server_env = None
    if dist._CTX.get_start_method() == "forkserver" and os.path.exists(f"/proc/{os.getppid()}/environ"):
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:  # the server's environment at its start
            server_env = [entry.decode() for entry in f.read().split(b"\0")
                          if entry.startswith(b"CUDA_VISIBLE_DEVICES=")]
    # torch.cuda._initialized: the flag as the forkserver left it (is_initialized() is False in any
    # forked child, and a CUDA build marks the child "bad fork" once the server merely counted devices)
    return (os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available(), torch.cuda.device_count(),
            torch.cuda._initialized, server_env)


def test_cpu_workers_see_no_cuda_device_where_the_test_does(monkeypatch):
    """On a GPU machine the gloo ranks are CPU ranks as in CPU CI (where a device is visible,
    enable_cpu_mode() changes nothing and megatron-core puts its weights on the GPU). Neither the
    forkserver nor its workers see one, whatever the test's environment says, and the server never
    initializes CUDA before it forks."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    for visible, available, count, server_initialized, server_env in run_workers(_cuda_view, 2):
        assert (visible, available, count, server_initialized) == ("", False, 0, False)
        assert server_env in (None, ["CUDA_VISIBLE_DEVICES="]), server_env
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the test process's own is left as it was


def test_the_cpu_workers_start_method_does_not_depend_on_cuda(monkeypatch):
    monkeypatch.delenv("TESTS_SPAWN_WORKERS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if "forkserver" in multiprocessing.get_all_start_methods():
        assert dist._cpu_start_method() == "forkserver"


def _parent_and_devices(rank, world_size):
    return os.getppid(), os.environ.get("CUDA_VISIBLE_DEVICES")


def test_cuda_workers_are_spawned_with_the_tests_devices(monkeypatch):
    """`cuda=True`: fresh processes (a forked child must not inherit a CUDA-initialized parent), children
    of the test process, with its CUDA_VISIBLE_DEVICES."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run_workers(_parent_and_devices, 1, cuda=True) == [(os.getpid(), "0")]
