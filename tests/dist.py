"""Gloo worker processes for tensor-/pipeline-parallel tests on CPU.

`run_workers(fn, world_size, *args)` starts `world_size` processes, joins them into one gloo group
through a fresh FileStore (no ports to collide), calls `fn(rank, world_size, *args)` in each and
returns the list of per-rank results, in rank order.

The workers are forked from a multiprocessing forkserver: a process that imported torch, megatron-core
and this package once (_PRELOAD) and never ran anything else, so it is single-threaded when it forks.
Forking the pytest process itself was cheaper to set up but forked a process with live gloo / OpenMP /
autograd threads, which occasionally crashed the children inside native code. With TESTS_SPAWN_WORKERS
set (or where there is no forkserver) the workers are spawned instead (each imports torch again).

These workers are CPU ranks on a machine with GPUs too: the forkserver starts, and every worker runs,
with CUDA_VISIBLE_DEVICES="" (whatever the test's environment says), so torch sees no CUDA device,
the server never initializes CUDA before it forks, and megatron-core on CPU (enable_cpu_mode) does
exactly what it does on a CPU-only machine instead of putting its weights on the GPU. A function that
needs the GPU asks for it: `run_workers(fn, n, *args, cuda=True)` spawns its workers (a fresh process
may initialize CUDA; a forked one must not inherit a parent that did) with the test's environment as
it is, so they see the test's GPUs; the default group is gloo all the same (make NCCL subgroups in
`fn`). The multi-GPU NCCL suites (tests/test_multigpu*.py) run under torchrun, not here.

What a worker sees of the test process, since it does not inherit its memory:
- `fn` and `args` are pickled: `fn` must be a module-level function, found by module and name (the
  forkserver also imports the modules of tests/ that the test process had imported when it started
  the server, test and helper modules alike, so a worker finds its module loaded; tests/conftest.py
  puts tests/ on sys.path);
- `os.environ` as it is at the call (not as it was when the forkserver started), with
  CUDA_VISIBLE_DEVICES="" unless `cuda=True`;
- the attributes that a running test's `monkeypatch.setattr` / `delattr` changed on modules and
  module-level classes (tests/conftest.py registers every monkeypatch fixture here); a patched value
  that cannot be pickled is an error at the call, not a silent difference between test and worker;
- the test process's stdout / stderr file descriptors (pytest's capture), and faulthandler on them.

Failures: a Python exception in a worker is raised in the test as WorkerError with the worker's
traceback; a worker killed by a signal (a crash in native code) as WorkerCrash naming the signal, the
rank and `fn`, with no retry; a worker still running after `timeout` seconds (a hang in a collective)
is killed and reported as WorkerTimeout (spawned workers get SPAWN_IMPORT_S more: they import torch
and megatron again). Once one rank has failed, the others get GRACE seconds to finish (their peers
may now wait forever in a collective), then are killed.

`fn` may use the default group (`dist.group.WORLD`), make subgroups, or call
`init_megatron_parallel(tp, pp)` to set up `megatron.core.parallel_state` on top of it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import types

import torch
import torch.distributed as dist

# Imported once in the forkserver, before it forks any worker (by this module, in the server: see the end
# of this file). A name that fails to import is skipped there, so the list may name optional pieces; a
# worker that needs it then fails on its own import, with the error in the test's report.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer",
    "megatron.core.transformer.multi_token_prediction",
    "megatron_fused_ce",
    "megatron_fused_ce.losses",
    "megatron_fused_ce.megatron",
]

GRACE = 10.0  # seconds the other ranks get to finish once one rank has failed
SPAWN_IMPORT_S = 60.0  # more seconds for a spawned worker, which imports torch and megatron again

# The environment of the CPU workers and of the forkserver on top of the test's: no CUDA device.
# torch.cuda.is_available() then asks NVML, which reads the empty list and answers 0 without
# initializing the driver (the driver's own count would start a driver thread in the forkserver).
NO_CUDA = {"CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def _cpu_start_method() -> str:
    if os.environ.get("TESTS_SPAWN_WORKERS") or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return "forkserver"


_CTX = multiprocessing.get_context(_cpu_start_method())  # the CPU workers
_CUDA_CTX = multiprocessing.get_context("spawn")  # run_workers(..., cuda=True)
if _CTX.get_start_method() == "forkserver":
    # Only this module by name: it imports _PRELOAD in the server itself, where an import that fails
    # in any way (not only ImportError, as multiprocessing's own preload allows) cannot kill the server.
    _CTX.set_forkserver_preload(["dist"])
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_PRELOAD_TESTS_ENV = "DIST_FORKSERVER_PRELOAD_TESTS"  # set only while the forkserver starts
_server_started = False


@contextlib.contextmanager
def _environ(values: dict):
    """os.environ with `values` set, for the processes started meanwhile; restored afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_forkserver() -> None:
    """Start the forkserver (once), with no CUDA device visible to it, telling it which modules of
    tests/ this process has imported: it imports them too, so that a worker does not import its test
    module (and what that imports) anew on every call."""
    global _server_started
    if _server_started or _CTX.get_start_method() != "forkserver":
        return
    names = sorted(name for name, module in list(sys.modules.items())
                   if name != "conftest" and "." not in name
                   and os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == _TESTS_DIR)
    # The server imports its preload list before it takes this process's sys.path (Python 3.11 does
    # not apply the sys_path it is given): PYTHONPATH carries it (tests/ included) while it starts.
    pythonpath = os.pathsep.join(path for path in sys.path if path and os.path.isdir(path))
    with _environ({_PRELOAD_TESTS_ENV: ",".join(names), "PYTHONPATH": pythonpath, **NO_CUDA}):
        multiprocessing.forkserver.ensure_running()
    _server_started = True


class WorkerTimeout(RuntimeError):
    pass


class WorkerError(RuntimeError):
    pass


class WorkerCrash(RuntimeError):
    pass


# ------------------------------------------------------------------ monkeypatches reaching workers
PATCHERS: list = []  # live monkeypatch fixtures (tests/conftest.py); each has `.patched`: [(owner, name)]
_ABSENT = object()


def _owner_address(owner):
    """(module name, qualified name or None) by which a worker finds `owner`, or None."""
    if isinstance(owner, types.ModuleType):
        return owner.__name__, None
    module, qualname = getattr(owner, "__module__", None), getattr(owner, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<locals>" not in qualname:
        found = sys.modules.get(module)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is owner:
            return module, qualname
    return None


def _patches_for_workers() -> list:
    """[(module, qualname, attribute, pickled value or None for deleted)] of every attribute that a
    live monkeypatch fixture set or deleted, with its value now."""
    patches, seen = [], set()
    for patcher in PATCHERS:
        for owner, name in patcher.patched:
            if (id(owner), name) in seen:
                continue
            seen.add((id(owner), name))
            address = _owner_address(owner)
            if address is None:
                raise WorkerError(f"monkeypatch changed {owner!r}.{name}, which the workers cannot find by "
                                  "module and name: patch a module or a module-level class instead")
            value = getattr(owner, name, _ABSENT)
            try:
                payload = None if value is _ABSENT else pickle.dumps(value)
            except Exception as err:
                raise WorkerError(f"monkeypatch set {'.'.join(filter(None, address))}.{name} to {value!r}, "
                                  f"which cannot be pickled for the workers ({err}): patch with a "
                                  "module-level function or plain data") from err
            patches.append((*address, name, payload))
    return patches


def _apply_patches(patches) -> None:
    for module, qualname, name, payload in patches:
        owner = importlib.import_module(module)
        for part in (qualname.split(".") if qualname else ()):
            owner = getattr(owner, part)
        if payload is None:
            if hasattr(owner, name):
                delattr(owner, name)
        else:
            setattr(owner, name, pickle.loads(payload))


# ------------------------------------------------------------------ workers
class _ParentFd:
    """A file descriptor of the test process, handed to the worker when the Process is started
    (multiprocessing passes it through the forkserver / spawn launcher); unpickles to the worker's
    copy of it."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _ParentFd._detach, (multiprocessing.reduction.DupFd(self.fd),)

    @staticmethod
    def _detach(dup) -> int:
        return dup.detach()


def _worker(rank, world_size, store_path, env, call, out_fds, conn):
    try:
        # The test's output capture (pytest's captured fds), so that prints and native crash reports
        # of the worker land in the test's report.
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), out_fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        faulthandler.enable(file=sys.stderr, all_threads=True)
        os.environ.clear()
        os.environ.update(env)
        fn, args, patches = pickle.loads(call)  # imports fn's test module, with the test's environment
        _apply_patches(patches)
        torch.set_num_threads(1)  # 2-core CI machine, up to 4 workers
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        # Every rank's gloo connections are up before any rank may return and exit: a rank that
        # leaves while a peer is still connecting fails that peer's init ("Connection closed by peer").
        dist.barrier()
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
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # no interpreter teardown: megatron / gloo atexit work is not needed here


def _fn_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def run_workers(fn, world_size: int, *args, timeout: float = 60.0, cuda: bool = False):
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; return their results in rank order.

    The ranks are CPU processes that see no CUDA device; with `cuda=True` they are spawned with the
    test's environment (its GPUs visible).

    Raises WorkerCrash if a worker died by a signal, WorkerError if one raised (with its traceback),
    WorkerTimeout if one did not finish within `timeout` seconds."""
    name = _fn_name(fn)
    ctx = _CUDA_CTX if cuda else _CTX
    spawned = ctx.get_start_method() == "spawn"
    try:
        call = pickle.dumps((fn, args, _patches_for_workers()))
    except WorkerError:
        raise
    except Exception as err:
        raise WorkerError(f"run_workers({name}): the function and its arguments must be picklable "
                          f"(a module-level function, plain data): {err}") from err
    if not cuda:
        _start_forkserver()
    hidden = {} if cuda else NO_CUDA
    env = dict(os.environ, **hidden)  # a forked worker takes it from here, not from the server
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs, pipes = [], []
        try:
            with _environ(hidden if spawned else {}):  # a spawned worker's CUDA starts with this
                for rank in range(world_size):
                    parent_conn, child_conn = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_worker, name=f"{name}[rank {rank}]",
                                       args=(rank, world_size, store_path, env, call,
                                             (_ParentFd(1), _ParentFd(2)), child_conn))
                    proc.start()
                    child_conn.close()
                    procs.append(proc)
                    pipes.append(parent_conn)
            results, errors, crashed, hung = _collect(procs, pipes,
                                                      timeout + (SPAWN_IMPORT_S if spawned else 0.0))
            # Ranks that finished get a few seconds to exit on their own (a crash on the way out is
            # still a crash); ranks still running are killed.
            exit_deadline = time.monotonic() + 5.0
            for rank, proc in enumerate(procs):
                if rank not in hung:
                    proc.join(timeout=max(0.0, exit_deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            for conn in pipes:
                conn.close()
    for rank, proc in enumerate(procs):
        if rank not in hung and rank not in crashed and proc.exitcode is not None and proc.exitcode < 0 \
                and proc.exitcode != -signal.SIGKILL:
            crashed[rank] = signal.Signals(-proc.exitcode).name

    lines = [f"--- rank {rank} killed by {sig} ---" for rank, sig in sorted(crashed.items())]
    lines += [f"--- rank {rank} ---\n{errors[rank]}" for rank in sorted(errors)]
    if hung and (errors or crashed):
        lines.append(f"--- ranks {hung}: still running {GRACE}s after that, killed ---")
    if crashed:
        what = ", ".join(f"rank {rank} by {sig}" for rank, sig in sorted(crashed.items()))
        raise WorkerCrash(f"run_workers({name}): worker killed ({what}), a crash in native code; "
                          "its stack is in the test's captured stderr\n" + "\n".join(lines))
    if errors:
        raise WorkerError(f"run_workers({name}) failed on ranks {sorted(errors)}:\n" + "\n".join(lines))
    if hung:
        allowance = f" (+{SPAWN_IMPORT_S:.0f}s to start)" if spawned else ""
        raise WorkerTimeout(f"run_workers({name}): ranks {hung} did not finish within {timeout}s{allowance} "
                            "(hang in a collective?)")
    return results


def _collect(procs, pipes, timeout):
    """Read each rank's result as it comes; notice a rank that dies without one.
    Returns (results, {rank: traceback}, {rank: signal name}, [ranks still running])."""
    world_size = len(procs)
    results, done = [None] * world_size, [False] * world_size
    errors, crashed = {}, {}
    rank_of = {conn: rank for rank, conn in enumerate(pipes)}
    rank_of.update({proc.sentinel: rank for rank, proc in enumerate(procs)})
    deadline = time.monotonic() + timeout
    while not all(done):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waiting = [obj for rank in range(world_size) if not done[rank]
                   for obj in (pipes[rank], procs[rank].sentinel)]
        for ready in multiprocessing.connection.wait(waiting, timeout=remaining):
            rank = rank_of[ready]
            if done[rank]:
                continue
            conn, proc = pipes[rank], procs[rank]
            gone = ready == proc.sentinel
            if conn.poll(0):
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:  # pipe closed without a result: the worker is on its way out
                    gone = True
                else:
                    (results if status == "ok" else errors)[rank] = payload
                    done[rank] = True
                    continue
            if gone:
                proc.join()
                if proc.exitcode is not None and proc.exitcode < 0:
                    crashed[rank] = signal.Signals(-proc.exitcode).name
                else:
                    errors[rank] = f"exited with status {proc.exitcode} without a result"
                done[rank] = True
        if (errors or crashed) and not all(done):
            deadline = min(deadline, time.monotonic() + GRACE)
    return results, errors, crashed, [rank for rank in range(world_size) if not done[rank]]


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


if _PRELOAD_TESTS_ENV in os.environ:
    # Only in the forkserver (started with no CUDA device visible: see _start_forkserver): _PRELOAD,
    # then the test process's modules of tests/. The variable goes first, so that no process forked
    # from here repeats this. One intra-op thread, so that a tensor op at a module's import starts no
    # thread pool in the server. A module that fails here is imported, and fails, in the worker.
    _tests = [name for name in os.environ.pop(_PRELOAD_TESTS_ENV).split(",") if name]
    torch.set_num_threads(1)
    for _name in _PRELOAD + _tests:
        try:
            importlib.import_module(_name)
        except BaseException:  # noqa: B036
            pass
