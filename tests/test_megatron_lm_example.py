"""examples/megatron_lm_pretrain.py (Megatron-LM's pretrain_gpt.py conventions + the two fused-CE
lines) on forked gloo ranks: a couple of iterations and the first batch's fused-vs-unfused loss and
MTP losses (`torchrun --nproc_per_node 4 examples/megatron_lm_pretrain.py ...` runs the same); and
docs/integration.md's torchrun command itself, checked for a clean screen and a falling loss."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

import megatron_harness  # noqa: F401  (megatron-core imported before forking)
from dist import run_workers
from example_runner import without_dependency_syntax_warnings

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                    "megatron_lm_pretrain.py")
_spec = importlib.util.spec_from_file_location("megatron_example_megatron_lm_pretrain", PATH)
EXAMPLE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EXAMPLE)

FAST = ["--train-iters", "2", "--seq-length", "32", "--hidden-size", "32", "--vocab-size", "200",
        "--global-batch-size", "4", "--log-interval", "1", "--use-linear-ce-fusion-loss",
        "--linear-ce-fusion-chunk-size", "16", "--compare-unfused"]


def example_worker(rank, world, argv):
    EXAMPLE.main(argv)


@pytest.mark.parametrize("world,argv", [
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--mtp-num-layers", "1"]),
    (2, ["--tensor-model-parallel-size", "2", "--mtp-num-layers", "2",
         "--untie-embeddings-and-output-weights", "--no-calculate-per-token-loss"]),
], ids=["tp2-pp2-mtp1", "tp2-mtp2-untied-meanloss"])
def test_megatron_lm_example(world, argv, capfd):
    run_workers(example_worker, world, FAST + argv, timeout=180)
    text = capfd.readouterr().out
    assert "fused linear CE: on" in text
    line = next(line for line in text.splitlines() if line.startswith("first batch"))
    names = re.findall(r"(lm loss|mtp_\d loss) fused", line)
    depths = int(argv[argv.index("--mtp-num-layers") + 1])
    assert names == ["lm loss"] + [f"mtp_{d + 1} loss" for d in range(depths)], line
    differences = [float(x) for x in re.findall(r"\|difference\| ([0-9.e+-]+)", line)]
    assert len(differences) == len(names) and max(differences) <= 1e-4, line
    assert "iteration 2/2: lm loss" in text and f"mtp_{depths} loss" in text.split("iteration 2/2")[1]


def test_documented_run_learns_on_a_clean_screen():
    """docs/integration.md's command for this script, run as a user runs it: exit 0; nothing on the
    screen but the header, the first-batch comparison and the iteration lines (no megatron-core or
    torch warning); the lm loss falls clearly over its 20 iterations (it sat at ln(vocab) = 6.9
    when the mock data were not learnable)."""
    root = os.path.dirname(os.path.dirname(PATH))
    guide = open(os.path.join(root, "docs", "integration.md")).read()
    command = re.search(r"`OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 (examples/megatron_lm_pretrain\.py[^`]*)`",
                        guide).group(1).split()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONWARNINGS")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    if torch.cuda.device_count() < 2:  # a GPU a process, else on the CPU, as the guide runs it
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                          + command,
                          cwd=root, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=240)
    assert proc.returncode == 0, proc.stdout
    text = without_dependency_syntax_warnings(proc.stdout, root)
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0].startswith("world 2: TP 2 x PP 1 x DP 1 on ") and lines[1].startswith("first batch"), lines
    assert all(line.startswith("iteration ") for line in lines[2:]), text
    assert not re.search(r"warn|Traceback", text, re.IGNORECASE), text
    losses = [float(x) for x in re.findall(r"^iteration \d+/20: lm loss ([0-9.]+)", text, re.M)]
    assert len(losses) == 5 and losses[0] > 6.5 and losses[-1] < 4.5, text


# ------------------------------------------------------------------------------------------------
# examples/megatron_lm_real_pretrain_gpt.py (Megatron-LM's own loop, megatron-core >= 0.19) and the
# handling of Megatron-LM's cross-entropy flags, shared with the stand-in
# ------------------------------------------------------------------------------------------------
import argparse  # noqa: E402

from megatron_fused_ce.megatron import add_fused_ce_args  # noqa: E402
from megatron_fused_ce.megatron.megatron_lm import (  # noqa: E402
    fused_ce_config_from_args,
    superseded_loss_flags,
)

REAL_PATH = os.path.join(os.path.dirname(PATH), "megatron_lm_real_pretrain_gpt.py")
_real_spec = importlib.util.spec_from_file_location("megatron_example_real_pretrain_gpt", REAL_PATH)
REAL = importlib.util.module_from_spec(_real_spec)
_real_spec.loader.exec_module(REAL)


def test_real_script_exits_without_megatron_training():
    if REAL.megatron_training_error() is None:
        pytest.skip("megatron.training is importable here")
    result = subprocess.run([sys.executable, REAL_PATH, "--use-linear-ce-fusion-loss"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result
    assert "megatron.training is not importable" in result.stderr
    assert "megatron-core wheels >= 0.19" in result.stderr


def test_stand_in_shares_the_real_scripts_functions():
    assert EXAMPLE.loss_func is sys.modules["megatron_lm_real_pretrain_gpt"].loss_func
    assert EXAMPLE.build_gpt_datasets is sys.modules["megatron_lm_real_pretrain_gpt"].build_gpt_datasets


def _args(argv):
    return EXAMPLE.parse_args(argv, extra_args_provider=add_fused_ce_args)


def test_cross_entropy_flags():
    logged = []
    # both fusions named: the fused layer supersedes megatron's logits fusion, which stays in args
    args = _args(["--use-linear-ce-fusion-loss", "--cross-entropy-loss-fusion"])
    config = fused_ce_config_from_args(args, log=logged.append)
    assert config.enabled and args.cross_entropy_loss_fusion
    assert superseded_loss_flags(args) == ["--cross-entropy-loss-fusion"]
    assert len(logged) == 1 and "--cross-entropy-loss-fusion" in logged[0]
    # megatron's own fusion alone: nothing to reconcile
    logged.clear()
    args = _args(["--cross-entropy-loss-fusion"])
    assert not fused_ce_config_from_args(args, log=logged.append).enabled and not logged
    assert superseded_loss_flags(args) == []
    # --fp16-lm-cross-entropy (Megatron-LM's flag; not in the stand-in's parser)
    args = argparse.Namespace(use_linear_ce_fusion_loss=True, fp16_lm_cross_entropy=True)
    assert superseded_loss_flags(args) == ["--fp16-lm-cross-entropy"]
    # megatron-core refuses te's cross-entropy fusion; so does the shared check
    for argv in (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
                 ["--use-linear-ce-fusion-loss", "--cross-entropy-loss-fusion",
                  "--cross-entropy-fusion-impl", "te"]):
        with pytest.raises(ValueError, match="cross-entropy-fusion-impl native"):
            fused_ce_config_from_args(_args(argv))
    # te named without the fusion flag is inert, as in Megatron-LM
    assert fused_ce_config_from_args(_args(["--use-linear-ce-fusion-loss",
                                            "--cross-entropy-fusion-impl", "te"])).enabled


def test_fused_flags_do_not_clash_with_megatron_lm_names():
    """add_fused_ce_args next to the stand-in's copies of Megatron-LM's flags: argparse would raise
    on a duplicate option; every fused flag's dest is read back by FusedCEConfig, and no Megatron-LM
    dest (here: the stand-in's) reads as a near-miss of one of the package's keys."""
    from megatron_fused_ce.megatron.config import near_miss

    args = _args(["--use-linear-ce-fusion-loss", "--linear-ce-fusion-chunk-size", "64",
                  "--linear-ce-fusion-memory-mode", "lean"])
    config = fused_ce_config_from_args(args)
    assert (config.enabled, config.chunk_size, config.memory_mode) == (True, 64, "lean")
    assert [key for key in vars(args) if near_miss(key)] == []


def test_real_script_installs_the_grad_accum_fusion_standin(monkeypatch):
    """With --gradient-accumulation-fusion (Megatron-LM's default) and no Apex, the real script puts
    the pure-torch stand-in in place before the model is built, in one logged line; with the fusion
    off it changes nothing."""
    import importlib.util

    from megatron.core.tensor_parallel import layers

    from megatron_fused_ce.megatron import grad_accum_fusion

    if importlib.util.find_spec(grad_accum_fusion.MODULE_NAME) is not None:
        pytest.skip("Apex's fused_weight_gradient_mlp_cuda is installed: nothing to stand in for")
    monkeypatch.delitem(sys.modules, grad_accum_fusion.MODULE_NAME, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    logged = []
    assert REAL.install_grad_accum_fusion_standin(argparse.Namespace(gradient_accumulation_fusion=False),
                                                  logged.append) is None
    assert not logged and not layers._grad_accum_fusion_available
    try:
        used = REAL.install_grad_accum_fusion_standin(
            argparse.Namespace(gradient_accumulation_fusion=True), logged.append)
        assert used == "standin" and layers._grad_accum_fusion_available
        assert len(logged) == 1 and "stand-in" in logged[0] and "fused_weight_gradient_mlp_cuda" in logged[0]
    finally:
        grad_accum_fusion.uninstall_wgrad_accumulation_standin()
