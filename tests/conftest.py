import os
import sys
import tempfile

# Importing megatron compiles/caches under /tmp: keep that inside a private temp dir.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "megatron_fused_ce_inductor"))
sys.path.insert(0, os.path.dirname(__file__))  # `from dist import run_workers`, `import reference`

import torch  # noqa: E402  (imported once here so that forked workers inherit it)

import reference  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    """Print the worst errors against the float64 reference that the accuracy tests measured."""
    if reference.ERRORS:
        terminalreporter.section("worst relative error vs float64 dense reference (||out-ref||/||ref||)")
        for line in reference.error_table():
            terminalreporter.write_line(line)
