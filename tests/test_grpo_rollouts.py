"""The GRPO example's rollout sampler (examples/rollout.py): its kept set and log-probs against the
float64 reference of the sampler semantics (tests/sampling_reference.py), its draws against the
distribution it reports, the log-probs it records against `linear_logprobs(..., top_k, top_p,
min_p)` on the same weights, the digit task's targets and reward, and generation from the prefix
against generation from the whole sequence (TP, PP, CP over gloo)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dist import run_workers
from megatron_fused_ce import linear_logprobs
from sampling_reference import kept_set, processed_stats

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.append(EXAMPLES)

import rollout  # noqa: E402
from rollout import Sampler, sample, sampler_logprobs  # noqa: E402

SETTINGS = [
    Sampler(1.0),
    Sampler(1.0, top_p=0.8),
    Sampler(0.7, top_p=0.9),
    Sampler(1.0, top_k=5),
    Sampler(1.3, top_k=50),
    Sampler(1.0, min_p=0.1),
    Sampler(0.8, top_k=20, top_p=0.9, min_p=0.02),
    Sampler(1.0, top_k=1),
]


def _logits(rows=48, vocab=200, seed=0):
    """Rows of several shapes: peaked, flat, and with exact ties (at the top and in the middle)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * torch.linspace(0.3, 4.0, rows).unsqueeze(1)
    z[0] = 0.0                                   # all tied
    z[1, :10] = z[1].max() + 1.0                 # ten tied at the top
    z[2] = torch.round(z[2] * 2) / 2             # many ties everywhere
    return z


@pytest.mark.parametrize("sampler", SETTINGS, ids=lambda s: s.describe())
def test_kept_set_and_logprobs_match_reference(sampler):
    logits = _logits()
    logq = sampler_logprobs(logits, sampler)
    z = logits.double() / sampler.temperature
    keep = kept_set(z, top_k=sampler.top_k, top_p=sampler.top_p, min_p=sampler.min_p)
    assert torch.equal(logq.isfinite(), keep)
    labels = torch.arange(logits.shape[1]).expand_as(logits)
    ref = torch.stack([processed_stats(z, labels[:, j], keep)[0] for j in range(logits.shape[1])], 1)
    assert torch.allclose(logq.double()[keep], ref[keep], atol=1e-5, rtol=0)


def test_filters_really_drop_tokens():
    """The settings above are not all no-ops: each filter drops tokens on these logits."""
    logits = _logits()
    full = sampler_logprobs(logits, Sampler(1.0)).isfinite().sum()
    for sampler in SETTINGS[1:]:
        assert sampler_logprobs(logits, sampler).isfinite().sum() < full, sampler


@pytest.mark.parametrize("sampler", [Sampler(1.0, top_p=0.8), Sampler(1.0, top_k=3, min_p=0.05)],
                         ids=lambda s: s.describe())
def test_draws_follow_the_reported_distribution(sampler):
    """20000 draws of one row: only kept tokens, each recorded log-prob is log q of its token, and
    the frequencies match q (total variation < 0.02; sampling error ~0.005)."""
    logits = torch.tensor([[3.0, 2.5, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -3.0, -5.0]])
    logq = sampler_logprobs(logits, sampler)[0]
    draws = 20000
    tokens, recorded = sample(logits.expand(draws, -1), sampler, torch.Generator().manual_seed(3))
    assert logq[tokens].isfinite().all()
    assert torch.equal(recorded, logq[tokens])
    frequency = torch.bincount(tokens, minlength=logits.shape[1]).double() / draws
    assert 0.5 * (frequency - logq.double().exp()).abs().sum() < 0.02


def test_same_generator_same_draws():
    logits = _logits()
    a = sample(logits, Sampler(1.0, top_p=0.9), torch.Generator().manual_seed(5))
    b = sample(logits, Sampler(1.0, top_p=0.9), torch.Generator().manual_seed(5))
    c = sample(logits, Sampler(1.0, top_p=0.9), torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


@pytest.mark.parametrize("sampler", [Sampler(1.0, top_p=0.9), Sampler(0.7, top_k=50),
                                     Sampler(1.0, top_k=50, top_p=0.8, min_p=0.01), Sampler(1.2)],
                         ids=lambda s: s.describe())
def test_recorded_logprobs_equal_linear_logprobs(sampler):
    """What the sampler records for the tokens it drew equals the trainer's `linear_logprobs` with
    the same settings, on the same weights (fp32), to fp32 precision; the plain softmax (no
    filter) is lower by the log of the kept mass wherever a filter drops something."""
    g = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(64, 32, generator=g), torch.randn(300, 32, generator=g) * 0.5
    logits = hidden @ weight.t()
    tokens, recorded = sample(logits, sampler, torch.Generator().manual_seed(1))
    trainer = linear_logprobs(hidden, weight, tokens, temperature=sampler.temperature, top_k=sampler.top_k,
                              top_p=sampler.top_p, min_p=sampler.min_p, impl="torch").logprobs
    assert (trainer - recorded).abs().max() < 1e-5
    plain = linear_logprobs(hidden, weight, tokens, temperature=sampler.temperature, impl="torch").logprobs
    if sampler.top_k or (sampler.top_p or 1.0) < 1.0 or sampler.min_p:
        assert (plain - recorded).max() < -1e-5  # every row drops some mass
    else:
        assert (plain - recorded).abs().max() < 1e-5


def test_task_targets_and_reward():
    prompt = torch.tensor([[3, 1, 4, 10], [9, 2, 6, 10]])
    assert rollout.targets(prompt, 5, "count").tolist() == [[5, 6, 7, 8, 9], [7, 8, 9, 0, 1]]
    assert rollout.targets(prompt, 4, "copy").tolist() == [[3, 1, 4, 3], [9, 2, 6, 9]]
    assert rollout.targets(prompt, 4, "reverse").tolist() == [[4, 1, 3, 4], [6, 2, 9, 6]]
    target = rollout.targets(prompt, 4, "count")
    response = torch.tensor([[5, 6, 0, 50], [7, 8, 9, 0]])  # 2 right + a wrong digit + a non-digit
    assert rollout.rewards(response, target).tolist() == pytest.approx([(2 + 0.1) / 4, 1.0])
    # partial credit in the reward; the accuracy is the exact match of the whole response
    assert rollout.accuracy(response, target).tolist() == [0.0, 1.0]
    assert rollout.accuracy(target, target).tolist() == [1.0, 1.0]
    advantages = rollout.group_advantages(torch.tensor([0.0, 1.0, 0.5, 0.5]), 2)
    assert advantages[0] < 0 < advantages[1] and advantages[2:].abs().max() < 1e-5
    g = torch.Generator().manual_seed(0)
    p = rollout.prompts(5, 4, g)
    assert p.shape == (5, 4) and (p[:, -1] == rollout.SEPARATOR).all() and (p[:, :-1] < 10).all()


def test_step_log_is_written_by_the_reporter_only(tmp_path):
    path = tmp_path / "log.jsonl"
    silent = rollout.JsonlLog(str(tmp_path / "other.jsonl"), is_reporter=False)
    silent.write({"step": 0})
    silent.close()
    assert not (tmp_path / "other.jsonl").exists()
    log = rollout.JsonlLog(str(path), is_reporter=True)
    log.write({"step": 0, "loss": 1.5})
    assert path.read_text() == '{"step": 0, "loss": 1.5}\n'  # flushed at once
    log.write({"step": 1, "reward": 0.25, "accuracy": 0.0})
    log.close()
    assert [line for line in path.read_text().splitlines()][1] == '{"step": 1, "reward": 0.25, "accuracy": 0.0}'


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[plot\]"'):
        rollout.plot(str(tmp_path / "out.png"), [])


def test_fed_length():
    """The prefix that predicts token `position`, padded to the layout's multiple and to at least
    MIN_FED_LENGTH, never past the sequence."""
    assert rollout.MIN_FED_LENGTH == 16
    assert [rollout.fed_length(p, 128) for p in (1, 8, 16, 17, 100, 128)] == [16, 16, 16, 17, 100, 128]
    assert [rollout.fed_length(p, 128, 4) for p in (8, 17, 20, 125, 128)] == [16, 20, 20, 128, 128]
    assert rollout.fed_length(5, 12) == 12 and rollout.fed_length(13, 24, 8) == 16


# Generation on a tiny random policy: 32-token sequences, 7-token prompts (26 draws per row, from
# inputs of 16 to 32 positions), under a filter (kept sets to compare).
GENERATION = ["data.seq_length=32", "data.prompt_length=7", "model.num_layers=2", "model.hidden_size=32",
              "sampling.top_p=0.9", "rollout.temperature=0.3"]
LAYOUTS = {"tp1": (1, []),
           "tp2_pp2": (4, ["megatron_cfg.tensor_model_parallel_size=2",
                           "megatron_cfg.pipeline_model_parallel_size=2"]),
           "cp2": (2, ["megatron_cfg.context_parallel_size=2"])}


def generation_worker(rank, world, overrides):
    """(prefix generation, whole-sequence generation, the lengths the prefix one fed) of one policy,
    the same prompts and the same generator seed."""
    from example_common import build_model, init_distributed
    from example_config import load_config

    cfg = load_config("grpo", os.path.join(EXAMPLES, "configs", "grpo.yaml"), (), GENERATION + overrides)
    parallel_state = init_distributed(cfg, cfg["train"]["seed"])
    model, _, fused = build_model(cfg, parallel_state)
    seq, vocab = cfg["data"]["seq_length"], cfg["model"]["vocab_size"]
    prompt = rollout.prompts(8, cfg["data"]["prompt_length"], torch.Generator().manual_seed(3))
    prefix_length, fed = rollout.fed_length, []

    def recorded(position, seq_length, multiple=1):
        fed.append(prefix_length(position, seq_length, multiple))
        return fed[-1]

    outs = []
    for length in (recorded, lambda position, seq_length, multiple=1: seq_length):
        rollout.fed_length = length
        tokens, logq, kept = rollout.generate(model, fused, prompt, seq, vocab, rollout.sampler_of(cfg),
                                              torch.Generator().manual_seed(5), kept_sets=True)
        outs.append((tokens, logq, kept and [(k.token_ids, k.offsets) for k in kept]))
    rollout.fed_length = prefix_length
    return outs, fed


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefix_generation_equals_whole_sequence(layout):
    """Generating from the prefix (what `generate` feeds) draws the same tokens with the same
    sampler log-probs and kept sets as feeding the whole sequence at every step: to the bit under
    TP and PP; under CP the attention's sums follow the layout of the fed length, so the log-probs
    agree to rounding."""
    world, overrides = LAYOUTS[layout]
    results = run_workers(generation_worker, world, overrides, timeout=120)
    for (prefix, whole), fed in results:
        assert min(fed) == 16 and max(fed) == 32 and len(set(fed)) > 4  # really shorter inputs
        assert torch.equal(prefix[0], whole[0])
        if layout == "cp2":
            assert (prefix[1] - whole[1]).abs().max() < 1e-5
        else:
            assert torch.equal(prefix[1], whole[1]), (prefix[1] - whole[1]).abs().max()
        assert (prefix[2] is None) == (whole[2] is None)
        for a, b in zip(prefix[2] or [], whole[2] or []):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert any(kept is not None and sum(ids.numel() for ids, _ in kept) for (_, (_, _, kept)), _ in results)
