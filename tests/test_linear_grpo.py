"""linear_grpo_loss (gradients in the forward pass) == grpo_loss(linear_logprobs(...)) (recompute),
for the loss, the metrics, dX and dW, over the GRPO options; at TP=1 and TP=2 with sequence
parallelism. fp32, tolerance 1e-5 relative (the two paths differ only in summation order)."""

import pytest
import torch
import torch.distributed as dist

import reference
from dist import run_workers
from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, grpo_loss
from megatron_fused_ce.losses.linear_grpo import gradients_in_forward_apply, linear_grpo_loss

B, T, H, V_LOCAL = 4, 6, 16, 23

CONFIGS = {
    "dapo_old": (dict(), ("old",)),
    "grpo_kl_k3": (dict(loss_type="grpo", beta=0.05), ("old", "ref")),
    "dr_grpo": (dict(loss_type="dr_grpo", max_completion_length=8), ("old",)),
    "bnpo_delta_dual": (dict(loss_type="bnpo", delta=1.5, dual_clip_c=3.0, epsilon_high=0.28), ("old",)),
    "cispo": (dict(loss_type="cispo", cispo_max_ratio=1.1), ("old",)),
    "sapo": (dict(loss_type="sapo"), ("old",)),
    "token_truncate": (dict(is_correction="token_truncate", is_clip_max=1.2), ("old", "sampling")),
    "sequence_mask_offpolicy": (dict(is_correction="sequence_mask", is_clip_min=0.5, is_clip_max=2.0),
                                ("old", "sampling")),
    "k2_bias_corrected": (dict(beta=0.1, kl_estimator="k2", use_bias_correction_kl=True), ("old", "ref")),
    "force_on_policy": (dict(force_on_policy_ratio=True, beta=0.1, kl_estimator="k1"), ("old", "ref")),
    "on_policy_normalizer": (dict(), ()),
    # not decomposable per token: must take the recompute path and still agree
    "gspo_sequence_ratio": (dict(importance_sampling_level="sequence"), ("old",)),
    "sequence_truncate_on_policy": (dict(is_correction="sequence_truncate", is_clip_max=1.5), ("sampling",)),
}


def _inputs(seed, tp, sequence_first):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V_LOCAL * tp, H, generator=g) / H**0.5 * 3
    labels = torch.randint(0, V_LOCAL * tp - 3, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[1] = 0.0  # an empty sequence
    adv = torch.randn(B, generator=g)
    noise = lambda: 0.3 * torch.randn(B, T, generator=g)  # noqa: E731
    extra = {"old": noise(), "ref": noise(), "sampling": noise()}
    if sequence_first:
        hidden, labels = hidden.transpose(0, 1).contiguous(), labels.t().contiguous()
    return hidden, weight, labels, mask, adv, extra


def _worker(rank, world, name, seed):
    cfg_kwargs, needs = CONFIGS[name]
    config = GRPOConfig(**cfg_kwargs)
    sp = world > 1
    hidden_full, weight_full, labels, mask, adv, extra = _inputs(seed, world, sp)
    group = dist.group.WORLD if world > 1 else None
    shard = weight_full[rank * V_LOCAL:(rank + 1) * V_LOCAL]
    if sp:
        s_local = hidden_full.shape[0] // world
        hidden_full = hidden_full[rank * s_local:(rank + 1) * s_local]
    # old log-probs near the policy's own, so the ratio crosses the clip boundaries
    with torch.no_grad():
        lp_now = linear_logprobs(hidden_full, shard, labels, tp_group=group, vocab_size=V_LOCAL * world - 3,
                                 sequence_parallel=sp).logprobs
        lp_now = lp_now.t() if sp else lp_now
    names = {"old": "old_logprobs", "ref": "reference_logprobs", "sampling": "sampling_logprobs"}
    tensors = {names[k]: lp_now + extra[k] for k in needs}
    normalizer = 37 if name == "on_policy_normalizer" else None
    common = dict(tp_group=group, vocab_size=V_LOCAL * world - 3, chunk_size=5, sequence_parallel=sp,
                  temperature=0.9, **tensors, normalizer=normalizer)
    results = []
    for fused in (True, False):
        h = hidden_full.clone().requires_grad_()
        w = shard.clone().requires_grad_()
        if fused:
            loss, metrics = linear_grpo_loss(h, w, labels, adv, mask, config, **common)
        else:
            op_kw = {k: common[k] for k in ("tp_group", "vocab_size", "chunk_size", "sequence_parallel", "temperature")}
            lp = linear_logprobs(h, w, labels, **op_kw).logprobs
            loss, metrics = grpo_loss(lp.t() if sp else lp, adv, mask, config, **tensors, normalizer=normalizer)
        (2.5 * loss).backward()
        results.append((loss.detach(), {k: v.detach() for k, v in metrics.items()}, h.grad, w.grad))
    return results


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_linear_grpo_matches_recompute_composition(name, tp):
    for fused, unfused in run_workers(_worker, tp, name, 40 + tp):
        (lf, mf, dxf, dwf), (lu, mu, dxu, dwu) = fused, unfused
        assert torch.allclose(lf, lu, rtol=1e-5, atol=1e-7), (lf, lu)
        assert mf.keys() == mu.keys()
        for key in mf:
            assert torch.allclose(mf[key], mu[key], rtol=1e-5, atol=1e-7), key
        assert dxu.abs().max() > 0 and dwu.abs().max() > 0
        for what, a, b in (("grpo dX vs recomp", dxf, dxu), ("grpo dW vs recomp", dwf, dwu)):
            err = reference.record(what, tp, torch.float32, reference.rel_err(a, b))
            assert err < 1e-5, (what, err)


def test_path_choice_and_gemm_count():
    from test_ops import _CountMatmuls

    hidden, weight, labels, mask, adv, extra = _inputs(0, 1, False)
    mask[1] = 1.0
    for name, expect_fused in (("dapo_old", True), ("gspo_sequence_ratio", False),
                               ("sequence_truncate_on_policy", False), ("sequence_mask_offpolicy", True)):
        cfg_kwargs, needs = CONFIGS[name]
        config = GRPOConfig(**cfg_kwargs)
        kw = {"old_logprobs": extra["old"] if "old" in needs else None,
              "sampling_logprobs": extra["sampling"] if "sampling" in needs else None}
        assert gradients_in_forward_apply(config, kw["old_logprobs"], kw["sampling_logprobs"]) == expect_fused
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with _CountMatmuls() as mode:
            loss, _ = linear_grpo_loss(h, w, labels, adv, mask, config, chunk_size=B * T, **kw)
            loss.backward()
        assert mode.count == (3 if expect_fused else 4), name
