"""Forked gloo workers for tensor-/pipeline-parallel tests on CPU.

`run_workers(fn, world_size, *args)` forks `world_size` processes from the already-imported test
process (torch and megatron are imported once, in the parent: forking costs ~0.1 s, spawning ~10 s;
on a CUDA machine they are spawned, see _CTX),
joins them into one gloo group through a fresh FileStore (no ports to collide), calls
`fn(rank, world_size, *args)` in each and returns the list of per-rank results. A worker exception
is re-raised in the parent with the worker's traceback; a worker that does not finish within
`timeout` seconds (a hang in a collective) is killed and reported as `WorkerTimeout`.

`fn` may use the default group (`dist.group.WORLD`), make subgroups, or call
`init_megatron_parallel(tp, pp)` to set up `megatron.core.parallel_state` on top of it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

# On a machine with CUDA, the parent's first backward starts autograd's device threads, after which a
# forked child cannot run autograd at all: spawn there (each worker imports torch again, ~seconds).
_CTX = multiprocessing.get_context(
    "spawn" if torch.cuda.is_available() or os.environ.get("TESTS_SPAWN_WORKERS") else "fork")


class WorkerTimeout(RuntimeError):
    pass


class WorkerError(RuntimeError):
    pass


def _worker(rank, world_size, store_path, fn, args, conn):
    try:
        torch.set_num_threads(1)  # 2-core CI machine, up to 4 workers
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # plain pickle copies tensor data; torch's multiprocessing pickler would pass shared-memory
        # handles that die with this process
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            conn.close()
            os._exit(0)  # skip pytest's atexit handlers in the child


_CRASH_SIGNALS = {signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS}


class WorkerCrash(RuntimeError):
    pass


def run_workers(fn, world_size: int, *args, timeout: float = 60.0):
    """Run fn(rank, world_size, *args) on `world_size` forked gloo ranks; return their results.

    A worker killed by SIGABRT / SIGSEGV / SIGBUS (not a Python error: e.g. glibc's
    "malloc_consolidate(): unaligned fastbin chunk detected" inside gloo, seen about once in a few
    full CPU runs of the Megatron DDP / FSDP cases, in processes forked from a multithreaded pytest)
    gets the whole run retried once, with a warning on stderr; a second crash fails the test."""
    try:
        return _run_workers_once(fn, world_size, args, timeout)
    except WorkerCrash as crash:
        print(f"run_workers({getattr(fn, '__name__', fn)}): {crash}; retrying once", file=sys.stderr, flush=True)
        return _run_workers_once(fn, world_size, args, timeout)


def _run_workers_once(fn, world_size: int, args, timeout: float):
    if _CTX.get_start_method() == "spawn":
        timeout += 60.0  # each worker imports torch (and megatron) again
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs, pipes = [], []
        for rank in range(world_size):
            parent_conn, child_conn = _CTX.Pipe(duplex=False)
            proc = _CTX.Process(target=_worker, args=(rank, world_size, store_path, fn, args, child_conn))
            proc.start()
            child_conn.close()
            procs.append(proc)
            pipes.append(parent_conn)

        results, errors, hung = [None] * world_size, [], []
        deadline = time.monotonic() + timeout
        for rank, (proc, conn) in enumerate(zip(procs, pipes)):
            remaining = max(0.0, deadline - time.monotonic())
            if conn.poll(remaining):
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, payload = "error", "worker exited without a result"
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"--- rank {rank} ---\n{payload}")
            else:
                hung.append(rank)
        crashed = []
        for rank, proc in enumerate(procs):
            proc.join(timeout=0 if hung else 5)
            if proc.exitcode is not None and -proc.exitcode in _CRASH_SIGNALS:
                crashed.append(f"rank {rank} killed by {signal.Signals(-proc.exitcode).name}")
            if proc.is_alive():
                proc.kill()
                proc.join()
        if crashed:
            raise WorkerCrash(", ".join(crashed))
        if hung:
            raise WorkerTimeout(f"ranks {hung} did not finish within {timeout}s (hang in a collective?)"
                                + ("\n" + "\n".join(errors) if errors else ""))
        if errors:
            raise WorkerError("\n".join(errors))
        return results


def init_megatron_parallel(tp: int = 1, pp: int = 1, **kwargs):
    """Initialize megatron.core.parallel_state on the workers' gloo group (CPU)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **kwargs
    )
    return parallel_state


def init_nccl_once() -> None:
    """The torchrun NCCL suites' process group (tests/test_multigpu*.py), made once per process
    whichever file runs first. No device_id: NCCL communicators are then made on a group's first
    collective, not eagerly for each of the ~20 groups every test's Megatron initialization creates
    (they pile up across tests until NCCL's CUDA allocations fail: the FSDP cases failed, then hung,
    when they ran after a file that had initialized with device_id)."""
    import datetime

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=3))
