"""The examples (examples/*.py) loaded as modules and run by forked gloo workers: `example_worker`
runs one example's main(), shared by tests/test_megatron_examples.py and the Megatron tests that
run an example end to end.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import megatron_harness  # noqa: F401  (megatron-core imported before forking)

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.append(EXAMPLES_DIR)  # for their `from example_common import ...` (appended: shadows nothing)


def without_dependency_syntax_warnings(text: str, root: str) -> str:
    """`text` less Python's compile-time SyntaxWarnings (and the source line each quotes) about an
    installed dependency's own source, printed where its bytecode was not written at install (pip
    --no-compile): they are not the example's output; one about a file under `root` stays."""
    return re.sub(r"^(?P<path>[^\n]*)\.py:\d+: SyntaxWarning: [^\n]*\n[^\n]*\n",
                  lambda m: m.group(0) if m.group("path").startswith(root) else "", text, flags=re.M)


def _load(name):
    """Import examples/<name>.py as `megatron_example_<name>` (no generic top-level names)."""
    spec = importlib.util.spec_from_file_location(f"megatron_example_{name}",
                                                  os.path.join(EXAMPLES_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLES = {name: _load(name) for name in ("pretrain_gpt", "sft", "dpo", "grpo")}
FAST = ["--tp", "2", "--pp", "2", "--steps", "2", "--seq-length", "32",
        "model.num_layers=2", "model.hidden_size=32"]


def example_worker(rank, world, name, argv):
    """The example's main() with `argv`; returns how often it called its log-prob passes and built
    its frozen copies."""
    module = EXAMPLES[name]
    sys.argv = [f"{name}.py"] + argv
    calls = {"compute_logprobs": 0, "build_frozen_copy": 0}
    for fn in calls:
        if hasattr(module, fn):
            original = getattr(module, fn)

            def counted(*args, _fn=fn, _original=original, **kwargs):
                calls[_fn] += 1
                return _original(*args, **kwargs)

            setattr(module, fn, counted)
    module.main()
    return calls
