"""What a newcomer sees at the command line, before any training starts: `--help` of every example,
a launch without torchrun, a mistake in a flag or the config, a missing package (one line each,
exit status 2, no traceback); and what the core install brings."""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from dist import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(ROOT, "examples")
sys.path.append(EXAMPLES_DIR)  # appended: shadows nothing

import example_common  # noqa: E402

TRAINING_EXAMPLES = ("pretrain_gpt", "sft", "dpo", "grpo")
ALL_EXAMPLES = TRAINING_EXAMPLES + ("logprobs_tp_demo",)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"megatron_example_{name}",
                                                  os.path.join(EXAMPLES_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_main(monkeypatch, capsys, name, argv):
    """examples/<name>.py's main() in this process, as `python examples/<name>.py argv` would run
    it (no torchrun environment): (exit status, stdout, stderr)."""
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", [f"examples/{name}.py"] + argv)
    with pytest.raises(SystemExit) as exit_info:
        _load(name).main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.mark.parametrize("name", ALL_EXAMPLES)
def test_help(monkeypatch, capsys, name):
    rc, out, err = _run_main(monkeypatch, capsys, name, ["--help"])
    assert rc == 0 and err == ""
    assert out.startswith(f"usage: examples/{name}.py"), out
    split = [line for line in out.splitlines() if re.search(r"[A-Za-z]-$", line)]
    assert split == []  # no word broken at a hyphen ("--compare- unfused", "block- diagonal")
    # every option has a help text: on its line, or (argparse's layout) on the next, indented
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^  -", line) and not re.match(r"^  \S.*\S  +\S", line):
            assert re.match(r"^ {8,}\S", lines[i + 1]), line


@pytest.mark.parametrize("name", TRAINING_EXAMPLES)
def test_every_flag_has_help(name):
    parser = example_common.build_parser(name, "doc")
    for action in parser._actions:
        assert action.help, action.option_strings or action.dest
    epilog = parser.format_help().split("config keys")[1]
    assert "train:" in epilog and "megatron_cfg:" in epilog


@pytest.mark.parametrize("name,argv,expected", [
    # no torchrun: the exact command to run instead
    ("dpo", ["--pp", "2", "--compare-unfused"],
     "examples/dpo.py: error: launch with torchrun (one process per GPU or CPU rank): "
     "OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/dpo.py --pp 2 --compare-unfused"),
    ("logprobs_tp_demo", ["--tokens", "64"],
     "examples/logprobs_tp_demo.py: error: launch with torchrun (one process per GPU or CPU rank): "
     "OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/logprobs_tp_demo.py --tokens 64"),
    # config mistakes are reported first (with or without torchrun)
    ("sft", ["trian.steps=3"],
     "examples/sft.py: error: unknown section 'trian' (override 'trian.steps=3'); did you mean 'train'?"),
    ("grpo", ["--config", "nowhere.yaml"],
     "examples/grpo.py: error: [Errno 2] No such file or directory: 'nowhere.yaml'"),
    ("grpo", ["grpo.loss_type=ppo"], "examples/grpo.py: error: grpo: loss_type must be one of"),
    ("grpo", ["rollout.task=add"],
     "examples/grpo.py: error: rollout.task must be one of count, copy, reverse; got 'add'"),
])
def test_mistakes_end_in_one_line(monkeypatch, capsys, name, argv, expected):
    rc, out, err = _run_main(monkeypatch, capsys, name, argv)
    assert rc == 2 and out == ""
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_as_a_newcomer_types_it():
    """Real processes: `python examples/sft.py --tp 2` (no torchrun) and a typo in an override.
    One line on stderr each (no warnings, no traceback), exit status 2."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(PYTHONPATH=ROOT, PYTHONWARNINGS="default")
    runs = {
        "examples/sft.py: error: launch with torchrun (one process per GPU or CPU rank): "
        "OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/sft.py --tp 2": ["examples/sft.py", "--tp", "2"],
        "examples/pretrain_gpt.py: error: unknown key 'train.stepz' (override 'train.stepz=3'); "
        "did you mean 'train.steps'?": ["examples/pretrain_gpt.py", "train.stepz=3"],
    }
    procs = {expected: subprocess.Popen([sys.executable] + argv, cwd=ROOT, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for expected, argv in runs.items()}
    for expected, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode, out, err) == (2, "", expected + "\n")


def test_config_error_is_printed_by_rank_zero_only(monkeypatch, capsys):
    for rank, printed in (("0", True), ("3", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "trian.steps=3"])
        with pytest.raises(SystemExit) as exit_info:
            example_common.parse_args("pretrain_gpt", "doc")
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert ("unknown section 'trian'" in err) == printed


@pytest.mark.parametrize("module,package", [("yaml", "pyyaml"), ("tqdm", "tqdm"),
                                            ("megatron.core", "megatron-core")])
def test_missing_package_gives_install_hint(monkeypatch, capsys, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        example_common.require_packages("examples/sft.py", (module,))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"examples/sft.py: error: {package} is not installed (the "
                                       f'examples need the megatron extra): pip install -e ".[megatron]"\n')


def _cpu_mode_without_megatron(rank, world):
    from megatron_fused_ce.megatron import enable_cpu_mode

    sys.modules["megatron.core"] = None
    try:
        enable_cpu_mode()
    except ModuleNotFoundError as err:
        return str(err), err.name
    return None


def test_enable_cpu_mode_without_megatron_gives_install_hint():
    (result,) = run_workers(_cpu_mode_without_megatron, 1)  # forked: the test process is untouched
    assert result is not None, "enable_cpu_mode() did not raise"
    message, name = result
    assert name == "megatron"
    assert message == ('enable_cpu_mode() needs megatron-core, which is not installed: pip install '
                       '"megatron_fused_ce[megatron]" (from a checkout: pip install -e ".[megatron]")')


def _setup_kwargs():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
            if kw.arg in ("install_requires", "extras_require")}


def test_install_requirements():
    """The core install brings numpy (torch's CPU wheel does not, and warns "Failed to initialize
    NumPy" on every import without it); the megatron extra brings what the examples import."""
    setup = _setup_kwargs()
    names = [re.split(r"[<>=!\[ ]", r)[0] for r in setup["install_requires"]]
    assert "numpy" in names and "torch" in names
    megatron = [re.split(r"[<>=!\[ ]", r)[0] for r in setup["extras_require"]["megatron"]]
    assert {"megatron-core", "pyyaml", "tqdm"} <= set(megatron)


def test_multigpu_suite_on_a_cpu_machine_exits_0():
    """`torchrun --nproc_per_node 2 -m pytest tests/test_multigpu*.py -m multigpu -q` on a machine
    without 2 GPUs: each rank says why it skipped and exits 0 (pytest's "no tests ran", exit 5,
    would be a torchrun ChildFailedError). Run here as one rank of it."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(PYTHONPATH=ROOT, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", CUDA_VISIBLE_DEVICES="")
    files = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "test_multigpu*.py")))
    proc = subprocess.run([sys.executable, "-m", "pytest", *files, "-m", "multigpu",
                           "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "tests/test_multigpu.py skipped: needs torchrun with >= 2 CUDA GPUs" in proc.stdout
    for f in files:
        assert f"{f} skipped: needs torchrun" in proc.stdout, f
