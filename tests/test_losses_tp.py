"""End-to-end parity at TP=2 over gloo: the losses of megatron_fused_ce.losses applied to
`linear_logprobs(h, W_shard, y, tp_group=...)` equal the same losses on `log_softmax` of the dense
(float64, unsharded) logits, for the loss, the metrics, dX and dW.

The losses are pure functions of log-probs, so this checks that the op's log-probs and their
backward compose with every loss: the upstream gradient of the op is an arbitrary per-token
vector here (not the plain NLL one), including zeros on masked tokens.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import reference
from dist import run_workers
from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, dpo_loss, grpo_loss, nll_loss

TP = 2
B, T, H, V_LOCAL = 4, 6, 16, 19
VOCAB = V_LOCAL * TP - 3  # Megatron-style padded vocab: the last 3 columns take no part
IGNORE = -100
LOSS_SCALE = 3.0  # upstream gradient != 1, as with loss scaling


def _inputs(seed=0):
    """Hidden states, full weight, labels, mask, advantages and old/ref/sampling log-probs near the
    dense policy's own (so GRPO ratios cross the clip boundaries)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V_LOCAL * TP, H, generator=g) * (3.0 / H**0.5)
    labels = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[1] = 0.0  # an empty sequence (the rejected answer of pair 0)
    mask[0, 0] = 1.0
    labels = torch.where(mask > 0, labels, torch.full_like(labels, IGNORE))
    advantages = torch.randn(B, generator=g)
    lp_dense, _ = _dense_logprobs(hidden.double(), weight.double(), labels)
    lp_dense = lp_dense.float()
    noise = {name: 0.4 * torch.randn(B, T, generator=g) for name in ("old", "ref", "sampling")}
    others = {
        "old_logprobs": lp_dense + noise["old"],
        "reference_logprobs": lp_dense + noise["ref"],
        "sampling_logprobs": lp_dense + noise["old"] + noise["sampling"],
    }
    return hidden, weight, labels, mask, advantages, others


def _dense_logprobs(hidden, weight_full, labels):
    """log_softmax over the unpadded vocab of the materialized logits; 0 at ignored positions."""
    logits = (hidden @ weight_full.t())[..., :VOCAB]
    logp = F.log_softmax(logits, dim=-1)
    keep = labels != IGNORE
    lp = logp.gather(-1, labels.clamp(0, VOCAB - 1).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=lp.dtype)
    return torch.where(keep, lp, zero), torch.where(keep, entropy, zero)


# name -> loss(logprobs, entropy, mask, advantages, others) -> (loss, metrics)
CASES = {
    "nll": lambda lp, ent, m, a, o: nll_loss(lp, m),
    "nll_global_normalizer": lambda lp, ent, m, a, o: nll_loss(lp, m, normalizer=40),
    "dpo_sigmoid_sft": lambda lp, ent, m, a, o: dpo_loss(
        lp, o["reference_logprobs"], m, beta=0.5, label_smoothing=0.1, sft_weight=0.3),
    "dpo_ipo_average": lambda lp, ent, m, a, o: dpo_loss(
        lp, o["reference_logprobs"], m, loss_type="ipo", average_log_probs=True, preference_weight=0.7),
    "dpo_hinge": lambda lp, ent, m, a, o: dpo_loss(
        lp, o["reference_logprobs"], m, loss_type="hinge", beta=0.3),
    "grpo_dapo_kl_is_dual_clip": lambda lp, ent, m, a, o: grpo_loss(
        lp, a, m, GRPOConfig(beta=0.1, dual_clip_c=2.0, is_correction="token_truncate", is_clip_max=1.2),
        entropy=ent, **o),
    "grpo_gspo_bias_kl": lambda lp, ent, m, a, o: grpo_loss(
        lp, a, m, GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.05,
                             kl_estimator="k2", use_bias_correction_kl=True),
        old_logprobs=o["old_logprobs"], reference_logprobs=o["reference_logprobs"]),
    "grpo_cispo_sequence_mask": lambda lp, ent, m, a, o: grpo_loss(
        lp, a, m, GRPOConfig(loss_type="cispo", cispo_max_ratio=1.1, is_correction="sequence_mask",
                             is_clip_min=0.2, is_clip_max=5.0),
        old_logprobs=o["old_logprobs"], sampling_logprobs=o["sampling_logprobs"]),
    "grpo_dr_grpo_delta_on_policy": lambda lp, ent, m, a, o: grpo_loss(
        lp, a, m, GRPOConfig(loss_type="dr_grpo", max_completion_length=8, delta=1.5)),
    "grpo_sapo_token_advantages": lambda lp, ent, m, a, o: grpo_loss(
        lp, a[:, None] * torch.linspace(-1, 1, T), m,
        GRPOConfig(loss_type="sapo", beta=0.1, kl_estimator="k1"), normalizer=30, **o),
}


def _tp_worker(rank, world, name):
    hidden, weight_full, labels, mask, advantages, others = _inputs()
    h = hidden.clone().requires_grad_()
    w = weight_full[rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_()
    out = linear_logprobs(h, w, labels, tp_group=dist.group.WORLD, vocab_size=VOCAB, ignore_index=IGNORE,
                          return_entropy=True, chunk_size=7, impl="torch")
    loss, metrics = CASES[name](out.logprobs, out.entropy, mask, advantages, others)
    (LOSS_SCALE * loss).backward()
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, h.grad, w.grad


def _dense(name):
    hidden, weight_full, labels, mask, advantages, others = _inputs()
    h = hidden.double().requires_grad_()
    w = weight_full.double().requires_grad_()
    lp, entropy = _dense_logprobs(h, w, labels)
    others = {k: v.double() for k, v in others.items()}
    loss, metrics = CASES[name](lp, entropy.detach(), mask.double(), advantages.double(), others)
    (LOSS_SCALE * loss).backward()
    return loss.detach(), metrics, h.grad, w.grad


@pytest.mark.parametrize("name", list(CASES))
def test_losses_on_linear_logprobs_match_dense_logits_tp2(name):
    ref_loss, ref_metrics, ref_dx, ref_dw = _dense(name)
    assert ref_dx.abs().max() > 0 and ref_dw.abs().max() > 0
    for rank, (loss, metrics, dx, dw) in enumerate(run_workers(_tp_worker, TP, name)):
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
        assert metrics.keys() == ref_metrics.keys()
        for key, value in metrics.items():
            torch.testing.assert_close(value.double(), ref_metrics[key].double(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, key=key: f"metric {key}: {m}")
        ref_dw_shard = ref_dw[rank * V_LOCAL:(rank + 1) * V_LOCAL]
        for what, got, want in (("losses dX", dx, ref_dx), ("losses dW", dw, ref_dw_shard)):
            err = reference.record(what, TP, torch.float32, reference.rel_err(got, want))
            assert err < 1e-5, (name, rank, what, err)
        if rank == TP - 1:  # Megatron's padding columns receive exactly zero gradient
            assert (dw[VOCAB - rank * V_LOCAL:] == 0).all()
