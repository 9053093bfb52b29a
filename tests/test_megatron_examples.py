"""The examples' main() on 4 forked gloo ranks (TP=2 x PP=2, and TP=2 x CP=2), a couple of steps
each, with the first-batch fused-vs-unfused comparison; GRPO (real rollouts) running only the
log-prob passes it needs and its importance-ratio report; the RL chain (SFT, then GRPO and DPO
from its Megatron distributed checkpoint, reloaded in other layouts) and GRPO's reward gain; and
one real torchrun launch, checked for a clean screen.
(`torchrun --nproc_per_node 4 examples/<name>.py --tp 2 --pp 2` runs the same code.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import megatron_harness  # noqa: F401  (megatron-core imported before forking)
from dist import run_workers
from example_runner import EXAMPLES, EXAMPLES_DIR, FAST, example_worker, without_dependency_syntax_warnings


# the RL examples: fewer prompts for DPO's pairs and for the evaluations (one at the first step
# and one after the last)
SMALL_RL = {"sft": ["eval.num_prompts=4"],
            "dpo": ["rollout.num_prompts=2", "rollout.samples_per_prompt=4", "eval.num_prompts=4",
                    "train.global_batch_size=4", "train.micro_batch_size=2"],
            "grpo": ["rollout.num_prompts=2", "rollout.samples_per_prompt=4"]}


@pytest.mark.parametrize("name,extra", [
    ("pretrain_gpt", []),
    ("sft", ["data.pack=true"] + SMALL_RL["sft"]),  # several demonstrations per row (cu_seqlens)
    ("dpo", SMALL_RL["dpo"]),
    ("grpo", ["data.prompt_length=24"] + SMALL_RL["grpo"]),
])
def test_example_runs(name, extra, capfd):
    run_workers(example_worker, 4, name, FAST + ["--compare-unfused"] + extra, timeout=120)
    out = capfd.readouterr()
    text = out.out + out.err
    assert "fused linear CE: on" in text
    assert "|difference|" in text
    difference = float(text.split("|difference| ")[1].split()[0])
    assert difference <= 1e-4
    if name == "grpo":
        # the on-policy loss is 0 by construction: the line compares the log-probs, which are not
        line = next(line for line in text.splitlines() if line.startswith("first rollout"))
        fused, unfused = map(float, re.search(r"mean fused (\S+) vs unfused (\S+),", line).groups())
        assert "log-probs of its 72 response tokens" in line and fused < -0.5, line
        assert abs(fused - unfused) <= 1e-5
    else:
        assert "first batch" in text


CP_FAST = ["--tp", "2", "--cp", "2", "--steps", "2", "--seq-length", "32", "model.num_layers=2",
           "model.hidden_size=32"]


@pytest.mark.parametrize("name,extra", [
    ("pretrain_gpt", []),
    ("sft", ["data.pack=true"] + SMALL_RL["sft"]),  # THD packing
    ("dpo", SMALL_RL["dpo"]),
    ("grpo", ["data.prompt_length=24"] + SMALL_RL["grpo"]),
])
def test_example_runs_with_context_parallelism(name, extra, capfd):
    """`--tp 2 --cp 2 --compare-unfused`: every sequence split over 2 CP ranks (GatheredKVAttention
    in the local layer spec), the fused-vs-unfused line of the first batch."""
    run_workers(example_worker, 4, name, CP_FAST + ["--compare-unfused"] + extra, timeout=120)
    out = capfd.readouterr()
    text = out.out + out.err
    assert "world 4 = TP 2 x CP 2 x PP 1 x DP 1" in text
    difference = float(text.split("|difference| ")[1].split()[0])
    assert difference <= 1e-4


@pytest.mark.parametrize("overrides,per_step,frozen", [
    (["grpo.beta=0", "grpo.force_on_policy_ratio=true"], 0, 0),  # the sampler's log-probs only
    (["grpo.beta=0"], 0, 0),                          # the sampler's log-probs serve as the old
    (["grpo.beta=0", "rollout.old_logprobs=trainer"], 1, 0),     # an old-policy pass
    (["grpo.beta=0.05"], 1, 1),                                  # reference model and its pass
])
def test_grpo_runs_only_needed_passes(overrides, per_step, frozen):
    argv = ["--steps", "2", "--seq-length", "16", "model.num_layers=2", "model.hidden_size=32",
            "data.prompt_length=8", "rollout.num_prompts=2"] + overrides
    for calls in run_workers(example_worker, 2, "grpo", argv, timeout=120):
        assert calls == {"compute_logprobs": 2 * per_step, "build_frozen_copy": frozen}


def test_grpo_report_ratio(capfd):
    """`--report-ratio` at TP=2 x PP=2 on the real rollouts (logits gathered over TP, tokens sent
    to the first stage): the trainer's log-probs of the sampler's distribution reproduce the
    recorded ones (r = 1 to fp32 precision) under every setting; plain-softmax log-probs give
    r = the kept mass (< 1) under a filter, exactly 1 without one."""
    argv = ["--tp", "2", "--pp", "2", "--steps", "1", "--seq-length", "16", "model.num_layers=2",
            "model.hidden_size=32", "data.prompt_length=8", "rollout.num_prompts=2",
            "rollout.samples_per_prompt=4", "--report-ratio"]
    run_workers(example_worker, 4, "grpo", argv, timeout=120)
    out = capfd.readouterr()
    rows = {}
    for line in (out.out + out.err).splitlines():
        if line.startswith("| T=1"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(cells[0], cells[1])] = dict(tokens=int(cells[2]), mean=float(cells[3]),
                                              max_abs_log=float(cells[7]))
    assert len(rows) == 10, rows
    for (sampler, trainer), row in rows.items():
        assert row["tokens"] == 2 * 4 * 9
        if trainer.startswith("sampler") or sampler == "T=1 (no filter)":
            assert row["max_abs_log"] < 1e-5 and abs(row["mean"] - 1) < 1e-5, (sampler, trainer, row)
        else:
            assert row["mean"] < 0.95, (sampler, trainer, row)
    assert rows[("T=1 top_k=50", "plain softmax")]["mean"] < rows[("T=1 top_p=0.9", "plain softmax")]["mean"]


def _log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _mean(values):
    values = list(values)
    return sum(values) / len(values)


def test_rl_chain_sft_then_grpo_raises_the_reward(tmp_path):
    """The chain users run (examples/rl_chain.py), shorter: SFT with the default configs on 2 ranks
    (DP = 2) stops partial and saves a Megatron distributed checkpoint; GRPO loads it and its
    mean reward over its last 5 rollout steps beats its first 3 by a clear margin (the full
    60-step run gains about 0.4, docs/rl.md); DPO trains on pairs of the same policy's answers.
    Every stage logs `step`, and `reward` / `accuracy` where it sampled answers."""
    checkpoint = str(tmp_path / "ckpt")
    run_workers(example_worker, 2, "sft", ["--task", "count", "--save", checkpoint,
                                           "--log-jsonl", str(tmp_path / "sft.jsonl")], timeout=120)
    sft = _log(tmp_path / "sft.jsonl")
    assert [r["step"] for r in sft] == list(range(len(sft))) and "loss" in sft[0]
    final = [r for r in sft if "reward" in r][-1]
    assert 0.3 <= final["reward"] <= 0.7 and len(sft) < 100  # stopped partial (stop_at_reward)
    info = json.loads((tmp_path / "ckpt" / "model_config.json").read_text())
    assert info["model"]["model.vocab_size"] == 128 and info["saved_by"] == "examples/sft.py"
    assert os.path.exists(tmp_path / "ckpt" / "metadata.json")  # dist_checkpointing's

    run_workers(example_worker, 2, "grpo", ["--load", checkpoint, "--steps", "25",
                                            "--log-jsonl", str(tmp_path / "grpo.jsonl")], timeout=180)
    grpo = _log(tmp_path / "grpo.jsonl")
    assert [r["step"] for r in grpo] == list(range(25))
    first, last = _mean(r["reward"] for r in grpo[:3]), _mean(r["reward"] for r in grpo[-5:])
    assert abs(first - final["reward"]) < 0.15  # GRPO starts where SFT stopped
    assert last - first >= 0.1, (first, last)
    assert all(0 <= r["accuracy"] <= r["reward"] + 1e-6 <= 1 + 1e-6 for r in grpo)

    run_workers(example_worker, 2, "dpo", ["--load", checkpoint, "--steps", "3", "eval.every=2",
                                           "--log-jsonl", str(tmp_path / "dpo.jsonl")], timeout=120)
    dpo = _log(tmp_path / "dpo.jsonl")
    assert [r["step"] for r in dpo] == [0, 1, 2]
    assert all("preference_accuracy" in r and "loss" in r for r in dpo)
    assert [r["step"] for r in dpo if "reward" in r] == [0, 2]
    assert abs(dpo[0]["reward"] - final["reward"]) < 0.15  # (after one step from the checkpoint)


def logprobs_worker(rank, world, argv):
    """The log-probs of fixed token rows, on the last stage of DP rank 0, under the policy that
    `--load` reads in the layout `argv` asks for, or under a perturbed initial one that `--save`
    writes."""
    import torch
    from megatron.core import parallel_state

    from megatron_fused_ce.megatron import compute_logprobs

    module = EXAMPLES["grpo"]
    sys.argv = ["grpo.py"] + argv
    args = module.parse_args("grpo", "doc")
    cfg = args.cfg
    state = module.init_distributed(cfg, cfg["train"]["seed"])
    model, _, fused = module.build_model(cfg, state)
    if args.load:
        module.load(model, args.load)
    elif args.save:  # weights no layout would initialize to (the same noise on both DP replicas)
        noise = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * 0.2)
    tokens = torch.randint(0, 11, (4, cfg["data"]["seq_length"] + 1), generator=torch.Generator().manual_seed(3))
    batches = module.micro_batches({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, 4)
    post = module.LogprobsPostProcessorFor(cfg, fused)
    (out,) = compute_logprobs(model, batches, module.forward_fn, post,
                              seq_length=cfg["data"]["seq_length"], micro_batch_size=4)
    if args.save:  # as where psutil is missing (megatron-core's writer would raise for want of it)
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        sys.modules["psutil"] = None
        filesystem_async.HAVE_PSUTIL = False
        module.save(model, cfg, args.save, "grpo", 0)
    keep = parallel_state.get_data_parallel_rank() == 0 and parallel_state.is_pipeline_last_stage()
    result = out.logprobs.cpu() if keep else None
    module.shutdown()
    return result


def test_checkpoint_loads_in_another_layout(tmp_path):
    """A checkpoint saved at TP = 1 x DP = 2 (vocab 128, padded to 128) loads at TP = 2 x PP = 2
    (the vocab padded to 256: megatron's make_vocab_size_divisible_by x TP; the tied output weight
    on the last stage): the same log-probs on the same tokens. The save runs as without psutil."""
    layout = ["--tp", "2", "--pp", "2"]
    checkpoint = str(tmp_path / "ckpt")
    small = ["model.num_layers=2", "model.hidden_size=32"]
    saved = [r for r in run_workers(logprobs_worker, 2, small + ["--save", checkpoint], timeout=120)
             if r is not None]
    loaded = [r for r in run_workers(logprobs_worker, 4, small + layout + ["--load", checkpoint],
                                     timeout=120) if r is not None]
    assert saved and loaded
    assert float((saved[0] - loaded[0]).abs().max()) < 1e-5
    assert float(saved[0].mean()) < -1.0  # (a real distribution over 128 tokens, not zeros)
    fresh = [r for r in run_workers(logprobs_worker, 4, small + layout, timeout=120) if r is not None]
    assert float((saved[0] - fresh[0]).abs().max()) > 0.1  # what the load changed


def test_torchrun_run_is_one_clean_screen():
    """`torchrun ... examples/pretrain_gpt.py --compare-unfused` as the README runs it: exit 0; no
    warning from megatron-core or torchrun (OMP banner); one header line; the parity line with
    the memory of the output layer + loss, fused below unfused; the progress bar to its end."""
    root = os.path.dirname(EXAMPLES_DIR)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # the repository first, and whatever the environment already had (packages installed with --target)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    import torch
    on_gpus = torch.cuda.device_count() >= 2  # a GPU a process: CUDA/NCCL, as example_common picks
    if not on_gpus:  # one GPU or none: on the CPU, as the README says (NCCL needs a GPU a process)
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "examples/pretrain_gpt.py", "--tp", "2", "--steps", "2", "--seq-length", "32",
            "model.num_layers=2", "model.hidden_size=32", "--compare-unfused",
            "megatron_cfg.linear_ce_fusion_chunk_size=16"]
    proc = subprocess.run(argv, cwd=root, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=240)
    assert proc.returncode == 0, proc.stdout
    # Python's compile-time SyntaxWarnings about an installed dependency's own source (printed with
    # the offending line when its bytecode was not written at install, e.g. pip --no-compile) are
    # not the example's output; any other warning is
    text = without_dependency_syntax_warnings(proc.stdout, root)
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    noise = [line for line in lines if not (line.startswith("pretrain:") or line.startswith("first batch"))]
    assert noise == [], noise  # nothing but the header, the parity line and the progress bar
    assert not re.search(r"warn|OMP_NUM_THREADS|Traceback", text, re.IGNORECASE), text
    headers = [line for line in lines if "fused linear CE:" in line]
    backend = "CUDA/NCCL" if on_gpus else "CPU/gloo"
    assert headers == [f"pretrain: world 2 = TP 2 x PP 1 x DP 1 on {backend}; model 2 layers, hidden 32, "
                       "vocab 1000; fused linear CE: on (chunk 16)"]
    (parity,) = [line for line in lines if line.startswith("first batch")]
    fused, unfused = map(float, re.search(r"memory: fused ([\d.]+) MiB vs unfused ([\d.]+) MiB",
                                          parity).groups())
    assert 0 < fused < unfused / 2, parity
    assert float(parity.split("|difference| ")[1].split()[0]) <= 1e-4
    assert any("2/2" in line and "lm loss=" in line and "loss_mem=" in line for line in lines)
