import os
import sys
import tempfile

import pytest

# Importing megatron compiles/caches under /tmp: keep that inside a private temp dir.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "megatron_fused_ce_inductor"))
sys.path.insert(0, os.path.dirname(__file__))  # `from dist import run_workers`, `import reference`

import torch  # noqa: E402,F401  (imported once here so that forked workers inherit it)

import reference  # noqa: E402

_SKIPPED_MODULES = []  # (module, reason) of test modules that skipped themselves at import


def pytest_collectreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        _SKIPPED_MODULES.append((report.nodeid, report.longrepr[2].removeprefix("Skipped: ")))


def pytest_sessionfinish(session, exitstatus):
    """A run whose every selected module skipped itself (`torchrun --nproc_per_node 2 -m pytest
    tests/test_multigpu.py -m multigpu` on a machine without 2 GPUs) ends with exit status 0 and
    the reason, not pytest's 5 ("no tests ran"), which torchrun would report as a failed child."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and _SKIPPED_MODULES:
        session.exitstatus = pytest.ExitCode.OK
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for module, reason in _SKIPPED_MODULES:
            line = f"{module} skipped: {reason}"
            reporter.write_line(line) if reporter is not None else print(line)


def pytest_terminal_summary(terminalreporter):
    """The worst errors against the float64 reference that the accuracy tests measured, and,
    apart from them, the memory ratios that the memory tests measured."""
    if reference.ERRORS:
        terminalreporter.section("worst relative error vs float64 dense reference (||out-ref||/||ref||)")
        for line in reference.error_table():
            terminalreporter.write_line(line)
    if reference.MEMORY:
        terminalreporter.section("memory: largest tensor the op allocated / the dense [N, V] logits")
        for line in reference.memory_table():
            terminalreporter.write_line(line)
