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
    NumPy" on every import without it); the megatron extra brings what the examples import; the
    plot extra (docs/rl.md's `examples/rollout.py --plot`) brings matplotlib, and bench holds it."""
    setup = _setup_kwargs()
    names = [re.split(r"[<>=!\[ ]", r)[0] for r in setup["install_requires"]]
    assert "numpy" in names and "torch" in names
    megatron = [re.split(r"[<>=!\[ ]", r)[0] for r in setup["extras_require"]["megatron"]]
    assert {"megatron-core", "pyyaml", "tqdm"} <= set(megatron)
    plot = set(setup["extras_require"]["plot"])
    assert "matplotlib" in plot and plot <= set(setup["extras_require"]["bench"])


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


# ---------------------------------------------------------------- the layout, before Megatron's checks
def _parse_as_rank(monkeypatch, capsys, name, argv, rank, world):
    """example_common.parse_args as rank `rank` of a torchrun launch of `world` processes:
    (exit status or None, stderr)."""
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setattr(sys, "argv", [f"examples/{name}.py"] + argv)
    code = None
    try:
        example_common.parse_args(name, "doc")
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name,world,argv,expected", [
    ("pretrain_gpt", 3, ["--tp", "2"],
     "3 processes do not split into data-parallel replicas of TP x PP x CP = 2 x 1 x 1 = 2 ranks: "
     "launch a multiple of 2 (torchrun --nproc_per_node) or change --tp / --pp / --cp"),
    ("sft", 6, ["--tp", "2", "--pp", "2"], "6 processes do not split into data-parallel replicas of "
     "TP x PP x CP = 2 x 2 x 1 = 4 ranks"),
    ("pretrain_gpt", 3, ["--tp", "3"],
     "model.num_attention_heads (4) must be a multiple of the tensor-parallel size (3)"),
    ("pretrain_gpt", 2, ["--tp", "2", "model.ffn_hidden_size=33"],
     "the MLP width (33, model.ffn_hidden_size or 4 x model.hidden_size) must be a multiple of the "
     "tensor-parallel size (2)"),
    ("pretrain_gpt", 3, ["--pp", "3"],
     "model.num_layers (4) must be a multiple of the pipeline-parallel size (3)"),
    ("pretrain_gpt", 3, ["train.global_batch_size=16", "train.micro_batch_size=2"],
     "train.global_batch_size (16) must split into DP = 3 data-parallel replicas x micro-batches of "
     "train.micro_batch_size (2)"),
    ("grpo", 3, ["rollout.num_prompts=8"],
     "rollout.num_prompts (8) must be a multiple of the data-parallel size DP = 3"),
])
def test_layout_is_checked_before_megatron(monkeypatch, capsys, name, world, argv, expected):
    """A layout the processes cannot hold ends in one line from rank 0 (status 2), before any
    process group exists; the other ranks print nothing and wait for rank 0 to end the launch."""
    waits = []
    monkeypatch.setattr(example_common.time, "sleep", waits.append)
    code, err = _parse_as_rank(monkeypatch, capsys, name, argv, 0, world)
    assert code == 2 and err.startswith(f"examples/{name}.py: error: {expected}") and err.count("\n") == 1, err
    assert waits == []
    code, err = _parse_as_rank(monkeypatch, capsys, name, argv, world - 1, world)
    assert (code, err) == (2, "")
    assert waits == [example_common.OTHER_RANKS_WAIT_S]


@pytest.mark.parametrize("name,world,argv", [("pretrain_gpt", 4, ["--tp", "2"]), ("pretrain_gpt", 2, []),
                                             ("grpo", 4, ["--tp", "2", "rollout.num_prompts=8"])])
def test_layouts_that_fit_pass(monkeypatch, capsys, name, world, argv):
    code, err = _parse_as_rank(monkeypatch, capsys, name, argv, 0, world)
    assert (code, err) == (None, "")


def test_more_processes_than_gpus_ends_in_one_line(monkeypatch, capsys):
    """torchrun with more processes on a machine than it has GPUs (the README's 4-process command
    on a one-GPU machine): one line saying what to do, exit status 2, on every rank, instead of
    CUDA's "invalid device ordinal" traceback from the ranks past the last GPU."""
    monkeypatch.setattr(example_common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(example_common.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(example_common.torch.cuda, "set_device", lambda *a: pytest.fail("set_device reached"))
    monkeypatch.setattr(example_common, "OTHER_RANKS_WAIT_S", 0)
    monkeypatch.setattr(sys, "argv", ["examples/pretrain_gpt.py"])
    for rank in (0, 3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        monkeypatch.setenv("WORLD_SIZE", "4")
        with pytest.raises(SystemExit) as exit_info:
            example_common.init_distributed({"megatron_cfg": {}}, seed=0)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == ("pretrain_gpt.py: error: torchrun started 4 processes on this machine, which has 1 "
                           "GPU(s): run one process per GPU (--nproc_per_node 1, with --tp / --pp to match), or "
                           "on the CPU with CUDA_VISIBLE_DEVICES=\"\" (gloo)"), err


def test_torchrun_with_a_world_size_the_layout_does_not_divide():
    """`torchrun --nproc_per_node 3 examples/pretrain_gpt.py --tp 2`: rank 0's one line, once,
    instead of Megatron's `world_size (3) is not divisible by 2` traceback on every rank."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                           "examples/pretrain_gpt.py", "--tp", "2"], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=240)
    message = ("examples/pretrain_gpt.py: error: 3 processes do not split into data-parallel replicas "
               "of TP x PP x CP = 2 x 1 x 1 = 2 ranks")
    assert proc.returncode != 0
    assert proc.stdout == ""
    ours = [line for line in proc.stderr.splitlines() if "examples/pretrain_gpt.py: error:" in line]
    assert len(ours) == 1 and ours[0].startswith(message), proc.stderr
    assert "not divisible" not in proc.stderr, proc.stderr
    # torchrun's own report may carry one traceback (its ChildFailedError); no rank printed one
    assert proc.stderr.count("Traceback (most recent call last)") <= 1, proc.stderr


def test_torchrun_with_a_bad_flag_prints_it_once():
    """`torchrun --nproc_per_node 2 examples/grpo.py --task nonsense`: argparse's usage and error
    from rank 0 only (each rank parses the same command line; it printed once per rank). The rank
    exits with status 2, which torchrun's report names, and torchrun itself exits with 1 (its
    status for any failed launch, as docs/integration.md says)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "examples/grpo.py", "--task", "nonsense"], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=240)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "examples/grpo.py: error:" in line]
    # (how the choices are quoted after it differs between Python versions)
    assert len(errors) == 1 and errors[0].startswith(
        "examples/grpo.py: error: argument --task: invalid choice: 'nonsense'"), proc.stderr
    assert proc.stderr.count("usage: examples/grpo.py") == 1, proc.stderr
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stderr


def test_argparse_errors_are_printed_by_rank_zero_only(monkeypatch, capsys):
    monkeypatch.setattr(example_common.time, "sleep", lambda s: None)
    for rank, printed in (("0", True), ("1", False)):
        code, err = _parse_as_rank(monkeypatch, capsys, "sft", ["--tp", "two"], rank, 2)
        assert code == 2
        assert ("examples/sft.py: error: argument --tp: invalid int value: 'two'" in err) == printed, err
        assert ("usage: examples/sft.py" in err) == printed, err


# ---------------------------------------------------------------- the RL chain: --load, --save, --task
def _checkpoint_dir(tmp_path, **changes) -> str:
    """A directory that --load's check takes for a checkpoint of the default RL model (with
    `changes`): its model_config.json (the check reads nothing else)."""
    import json

    from example_checkpoint import MODEL_CONFIG, model_identity
    from example_config import load_config

    identity = model_identity(load_config("grpo", os.path.join(EXAMPLES_DIR, "configs", "grpo.yaml")))
    identity.update(changes)
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / MODEL_CONFIG).write_text(json.dumps({"model": identity}))
    return str(path)


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_load_of_another_model_ends_in_one_line(monkeypatch, capsys, tmp_path, name):
    """Every setting that differs is named, checkpoint value first, before any process starts."""
    path = _checkpoint_dir(tmp_path, **{"model.num_layers": 6, "data.seq_length": 32})
    rc, out, err = _run_main(monkeypatch, capsys, name, ["--load", path])
    assert (rc, out) == (2, "")
    assert err == (f"examples/{name}.py: error: --load {path}: the checkpoint's model does not match "
                   "the config: model.num_layers 6 in the checkpoint, 4 in the config; "
                   "data.seq_length 32 in the checkpoint, 16 in the config (set them with "
                   "section.key=VALUE)\n")
    # the same model passes the check (and the launch without torchrun is what stops it then)
    rc, out, err = _run_main(monkeypatch, capsys, name, ["--load", path, "model.num_layers=6",
                                                          "--seq-length", "32"])
    assert rc == 2 and "error: launch with torchrun" in err


def test_load_and_save_mistakes_end_in_one_line(monkeypatch, capsys, tmp_path):
    missing = str(tmp_path / "nowhere")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    for argv, expected in (
            (["--load", missing], f"--load {missing}: no such directory"),
            (["--load", str(tmp_path / "notes")],
             f"--load {tmp_path / 'notes'}: not a checkpoint written by --save (no model_config.json in it)"),
            (["--save", str(tmp_path / "notes")],
             f"--save {tmp_path / 'notes'}: the directory holds files that are not a checkpoint of these "
             "examples (no model_config.json); choose a new or empty directory")):
        rc, out, err = _run_main(monkeypatch, capsys, "grpo", argv)
        assert (rc, out, err) == (2, "", f"examples/grpo.py: error: {expected}\n")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_task_flag_sets_the_rollout_task(monkeypatch):
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    for name in ("sft", "dpo", "grpo"):
        monkeypatch.setattr(sys, "argv", [f"examples/{name}.py", "--task", "reverse"])
        assert example_common.parse_args(name, "doc").cfg["rollout"]["task"] == "reverse"


def test_rl_chain_help_and_a_bad_stage(monkeypatch, capsys):
    chain = _load("rl_chain")
    with pytest.raises(SystemExit) as exit_info:
        chain.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: examples/rl_chain.py")
    assert "--grpo-args" in out and "--gpu" in out
    with pytest.raises(SystemExit) as exit_info:
        chain.main(["--stages", "sft,ppo"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.splitlines()[-1] == ("examples/rl_chain.py: error: --stages takes a comma-separated list "
                                    "of sft, grpo, dpo; got 'sft,ppo'")
