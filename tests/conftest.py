import importlib
import os
import sys
import tempfile

import pytest

# Importing megatron compiles/caches under /tmp: keep that inside a private temp dir.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "megatron_fused_ce_inductor"))
sys.path.insert(0, os.path.dirname(__file__))  # `from dist import run_workers`, `import reference`

import dist  # noqa: E402  (imports torch; its gloo workers re-apply this file's monkeypatches)
import reference  # noqa: E402

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # the README's `-n 2`: pytest-xdist's worker processes
    # share the cores: each worker's intra-op threads its share of them, not all of them each
    dist.torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

_UNSET = object()


class _MonkeyPatch(pytest.MonkeyPatch):
    """pytest's monkeypatch, also remembering which attributes it set or deleted: tests/dist.py
    re-applies them in the gloo workers, which run in processes of their own and would otherwise
    see the modules' original constants (tests shrink tile sizes this way)."""

    def __init__(self):
        super().__init__()
        self.patched = []  # [(owner, attribute name)]

    def _note(self, target, name):
        if isinstance(target, str):  # the "package.module.attribute" form
            path, name = target.rsplit(".", 1)
            target = _resolve(path)
        self.patched.append((target, name))

    def setattr(self, target, name=_UNSET, value=_UNSET, raising=True):
        args = [a for a in (name, value) if a is not _UNSET]
        super().setattr(target, *args, raising=raising)
        self._note(target, name)

    def delattr(self, target, name=_UNSET, raising=True):
        args = [name] if name is not _UNSET else []
        super().delattr(target, *args, raising=raising)
        self._note(target, name)


def _resolve(path):
    parts = path.split(".")
    found = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            found = getattr(found, part)
        except AttributeError:
            found = importlib.import_module(".".join(parts[:i]))
    return found


@pytest.fixture
def monkeypatch():
    patcher = _MonkeyPatch()
    dist.PATCHERS.append(patcher)
    try:
        yield patcher
    finally:
        dist.PATCHERS.remove(patcher)
        patcher.undo()


@pytest.fixture(autouse=True)
def no_deferred_error_left():
    """A test leaves no error found on the device unread (ops/deferred_errors.py): a call that
    returned NaN there and recorded why must be looked at by the test that made it, not surface in
    a later test's agreement (a test filtering NaN rows out would pass on wrong results)."""
    yield
    from megatron_fused_ce.ops import deferred_errors

    try:
        deferred_errors.check_deferred_errors()
    except ValueError as error:
        pytest.fail(f"the test left a deferred error unread: {error}")


@pytest.fixture(autouse=True)
def no_grpo_kernel_fallback_left():
    """A test leaves GRPO's per-token kernel in use: a call whose kernel failed (a compiler bug,
    linear_grpo._kernel_failed) sends every later call of its config to the definition, so that a
    later test of the kernel would check the definition instead."""
    yield
    linear_grpo = sys.modules.get("megatron_fused_ce.losses.linear_grpo")
    if linear_grpo is not None and linear_grpo._FAILED_CONFIGS:
        failed = set(linear_grpo._FAILED_CONFIGS)
        linear_grpo._FAILED_CONFIGS.clear()
        pytest.fail(f"the test left GRPO's per-token kernel failed for {failed}")


@pytest.fixture
def reference_kernel(monkeypatch):
    """QuACK's one-pass row kernel replaced by its torch contract (cute_backend.reference_kernel) and
    declared available for chunks of any size, so that the chunk loop's use of it runs on CPU;
    returns the list of calls (row counts)."""
    from megatron_fused_ce.ops.backends import cute_backend

    calls = []

    def counted(x, target, *args, **kwargs):
        calls.append(x.shape[0])
        return cute_backend.reference_kernel(x, target, *args, **kwargs)

    monkeypatch.setattr(cute_backend, "_kernel", lambda: counted)
    monkeypatch.setattr(cute_backend, "_available", lambda device: True)
    monkeypatch.setattr(cute_backend, "MIN_CHUNK_WORK", 0)  # (the tests' chunks hold far less work)
    return calls


_SKIPPED_MODULES = []  # (module, reason) of test modules that skipped themselves at import


def pytest_collectreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        _SKIPPED_MODULES.append((report.nodeid, report.longrepr[2].removeprefix("Skipped: ")))


def pytest_sessionfinish(session, exitstatus):
    """A run whose every selected module skipped itself (`torchrun --nproc_per_node 2 -m pytest
    tests/test_multigpu.py -m multigpu` on a machine without 2 GPUs) ends with exit status 0 and
    the reason, not pytest's 5 ("no tests ran"), which torchrun would report as a failed child.
    In a pytest-xdist worker, what its tests measured goes to the controller, which prints the
    tables (pytest_testnodedown)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["reference_tables"] = reference.export()
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and _SKIPPED_MODULES:
        session.exitstatus = pytest.ExitCode.OK
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for module, reason in _SKIPPED_MODULES:
            line = f"{module} skipped: {reason}"
            reporter.write_line(line) if reporter is not None else print(line)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a finished worker's measurements joined into the run's tables."""
    reference.merge(getattr(node, "workeroutput", {}).get("reference_tables", []))


def pytest_terminal_summary(terminalreporter):
    """What the tests measured, one table per kind of quantity (reference.tables()): errors against
    the float64 reference, differences between two computations, error ratios, memory ratios."""
    for heading, results in reference.tables():
        lines = reference.table(results)
        if lines:
            terminalreporter.section(heading)
            for line in lines:
                terminalreporter.write_line(line)
