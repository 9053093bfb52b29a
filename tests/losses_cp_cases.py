"""The cases of tests/test_losses_cp.py (also run over NCCL by tests/test_multigpu_losses_cp.py): float64
inputs of the pure losses, the CP layouts of their positions, and `linear_grpo_loss`'s inputs and CP=1
reference.
"""

from __future__ import annotations

import torch

from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, dpo_loss, grpo_loss, nll_loss

F64 = torch.float64


B, S = 4, 16  # S divisible by 2·CP for CP = 2, 4


L = 20  # max_completion_length for dr_grpo


def make_data(seed=0):
    """float64 [B, S] inputs with an empty sequence, a one-token sequence, garbage at masked
    positions and -inf (excluded) tokens in the policy, old and sampling log-probs."""
    g = torch.Generator().manual_seed(seed)
    lp = -(torch.rand(B, S, generator=g, dtype=F64) * 2.0 + 0.05)
    valid = torch.rand(B, S, generator=g) < 0.7
    valid[1] = False  # empty sequence
    valid[2] = False
    valid[2, 9] = True  # a single token
    mask = valid.to(F64) * (0.5 + torch.rand(B, S, generator=g, dtype=F64))
    old = lp + 0.5 * torch.randn(B, S, generator=g, dtype=F64)
    data = dict(
        lp=lp, mask=mask, old=old,
        ref=lp + 0.5 * torch.randn(B, S, generator=g, dtype=F64),
        sampling=old + 0.3 * torch.randn(B, S, generator=g, dtype=F64),
        entropy=torch.rand(B, S, generator=g, dtype=F64) * 3,
        adv=torch.randn(B, generator=g, dtype=F64),
        token_adv=torch.randn(B, S, generator=g, dtype=F64),
    )
    data["lp"] = data["lp"].masked_fill(~valid, float("-inf"))
    for key in ("old", "ref", "sampling", "entropy"):
        data[key] = data[key].masked_fill(~valid, float("nan"))
    # excluded tokens (valid positions with a -inf log-prob), on both halves of the sequences
    first, last = valid[0].nonzero().squeeze(1), valid[3].nonzero().squeeze(1)
    data["lp_excluded"] = data["lp"].clone()
    data["lp_excluded"][0, first[-1]] = float("-inf")
    data["old_excluded"] = data["old"].clone()
    data["old_excluded"][3, last[0]] = float("-inf")
    data["sampling_excluded"] = data["sampling"].clone()
    data["sampling_excluded"][3, last[-1]] = float("-inf")
    return data


# ---- the cases: name -> f(lp, d, cp_group) -> (loss, metrics); d holds the other [B, T] inputs ----


def _grpo(config_kwargs, inputs=("old",), adv="adv", normalizer=None):
    names = {"old": "old_logprobs", "ref": "reference_logprobs", "sampling": "sampling_logprobs",
             "old_excluded": "old_logprobs", "sampling_excluded": "sampling_logprobs", "entropy": "entropy"}

    def case(lp, d, cp_group):
        config = GRPOConfig(**config_kwargs)
        kwargs = {names[k]: d[k] for k in inputs}
        return grpo_loss(lp, d[adv], d["mask"], config, normalizer=normalizer, cp_group=cp_group, **kwargs)
    return case


def _dpo(**kwargs):
    def case(lp, d, cp_group):
        return dpo_loss(lp, d["ref"], d["mask"], cp_group=cp_group, **kwargs)
    return case


def _nll(**kwargs):
    def case(lp, d, cp_group):
        return nll_loss(lp, d["mask"], cp_group=cp_group, **kwargs)
    return case


def _excluded(case):
    """The case on policy log-probs with a -inf at a valid token."""
    case.lp_key = "lp_excluded"
    return case


IS = dict(is_clip_min=0.5, is_clip_max=1.5)


CASES = {
    "nll": _nll(),
    "nll_normalizer": _nll(normalizer=40),
    "dpo_sigmoid": _dpo(beta=0.5, label_smoothing=0.1),
    "dpo_sigmoid_average_sft": _dpo(average_log_probs=True, sft_weight=0.3, beta=2.0),
    "dpo_ipo_average": _dpo(loss_type="ipo", average_log_probs=True, preference_weight=0.7),
    "dpo_hinge_sft": _dpo(loss_type="hinge", beta=0.3, sft_weight=1.0),
    "dpo_normalizers": _dpo(normalizer=5, sft_normalizer=11.0, sft_weight=0.5),
    **{f"grpo_{lt}": _grpo(dict(loss_type=lt, max_completion_length=L), ("old", "entropy"))
       for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")},
    "gspo_grpo": _grpo(dict(loss_type="grpo", importance_sampling_level="sequence")),
    "gspo_dapo_kl_bias": _grpo(dict(importance_sampling_level="sequence", beta=0.1,
                                    use_bias_correction_kl=True), ("old", "ref")),
    "gspo_on_policy": _grpo(dict(importance_sampling_level="sequence", loss_type="sapo"), ()),
    "is_token_truncate": _grpo(dict(is_correction="token_truncate", **IS), ("old", "sampling")),
    "is_token_mask": _grpo(dict(is_correction="token_mask", **IS), ("old", "sampling")),
    "is_sequence_truncate": _grpo(dict(is_correction="sequence_truncate", is_clip_max=3.0),
                                  ("old", "sampling")),
    "is_sequence_mask_grpo": _grpo(dict(loss_type="grpo", is_correction="sequence_mask", is_clip_min=0.2,
                                        is_clip_max=5.0), ("old", "sampling")),
    "is_sequence_truncate_on_policy": _grpo(dict(is_correction="sequence_truncate", is_clip_max=2.0),
                                            ("sampling",)),
    "kl_k1": _grpo(dict(beta=0.1, kl_estimator="k1"), ("old", "ref")),
    "kl_k2_grpo": _grpo(dict(loss_type="grpo", beta=0.2, kl_estimator="k2"), ("old", "ref")),
    "kl_k3_bias_sapo": _grpo(dict(loss_type="sapo", beta=0.1, use_bias_correction_kl=True), ("old", "ref")),
    "dual_clip_delta": _grpo(dict(dual_clip_c=1.3, delta=1.6, epsilon_high=0.28), ("old",)),
    "token_advantages": _grpo(dict(loss_type="grpo"), ("old",), adv="token_adv"),
    "force_on_policy": _grpo(dict(force_on_policy_ratio=True, beta=0.1), ("old", "ref")),
    "normalizer_tokens": _grpo(dict(loss_type="cispo"), ("old",), normalizer=37.0),
    "normalizer_sequences": _grpo(dict(loss_type="grpo"), ("old",), normalizer=7),
    # the convention options
    "sapo_token_reduction": _grpo(dict(loss_type="sapo", sapo_reduction="token"), ("old",)),
    "sapo_without_empty": _grpo(dict(loss_type="sapo", count_empty_sequences=False), ("old",)),
    "grpo_without_empty": _grpo(dict(loss_type="grpo", count_empty_sequences=False, beta=0.1),
                                ("old", "ref")),
    "cispo_two_sided": _grpo(dict(loss_type="cispo", cispo_min_ratio=0.8, cispo_max_ratio=1.2), ("old",)),
    # -inf (excluded) tokens, counted over all CP ranks
    "excluded_grpo": _excluded(_grpo(dict(loss_type="grpo", is_correction="sequence_mask", **IS),
                                     ("old_excluded", "sampling_excluded"))),
    "excluded_dapo_gspo": _excluded(_grpo(dict(importance_sampling_level="sequence", beta=0.1),
                                          ("old_excluded", "ref"))),
    "excluded_nll": _excluded(_nll()),
    "excluded_dpo": _excluded(_dpo(average_log_probs=True, sft_weight=0.3)),
}


def run_case(name, data, cp_group=None):
    """(loss, metrics, grad w.r.t. lp) of one case on (a slice of) the data."""
    case = CASES[name]
    lp = data[getattr(case, "lp_key", "lp")].clone().requires_grad_()
    loss, metrics = case(lp, data, cp_group)
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    grad = torch.zeros_like(lp) if grad is None else grad
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grad


def positions(layout, cp, rank):
    """The sequence positions that CP rank `rank` holds."""
    if layout == "balanced":  # Megatron: chunks r and 2·CP−1−r of 2·CP
        chunk = S // (2 * cp)
        return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                          torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])
    sizes = {2: [5, 11], 4: [0, 4, 5, 7]}[cp]  # unequal, one rank without positions
    order = torch.randperm(S, generator=torch.Generator().manual_seed(cp))
    start = sum(sizes[:rank])
    return order[start:start + sizes[rank]].sort().values


def slice_positions(data, index):
    return {k: (v[:, index] if v.dim() == 2 else v) for k, v in data.items()}


# ---- linear_grpo_loss with cp_group ---------------------------------------------------------------------

H, V_LOCAL = 16, 23


FUSED_CONFIGS = {
    # gradients in the forward pass (totals precomputed before the chunk loop)
    "dapo": (dict(), ("old",)),
    "grpo_kl": (dict(loss_type="grpo", beta=0.05), ("old", "ref")),
    "sapo": (dict(loss_type="sapo"), ("old",)),
    "grpo_without_empty": (dict(loss_type="grpo", count_empty_sequences=False), ("old",)),
    "sequence_mask_off_policy": (dict(loss_type="bnpo", is_correction="sequence_mask", is_clip_min=0.5,
                                      is_clip_max=2.0), ("old", "sampling")),
    "cispo_on_policy_normalizer": (dict(loss_type="cispo"), ()),
    # recompute path
    "gspo": (dict(importance_sampling_level="sequence"), ("old",)),
    "sequence_truncate_on_policy": (dict(is_correction="sequence_truncate", is_clip_max=1.5), ("sampling",)),
}


def fused_inputs(tp):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V_LOCAL * tp, H, generator=g) / H**0.5 * 3
    labels = torch.randint(0, V_LOCAL * tp - 3, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    mask[1] = 0.0
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        lp = linear_logprobs(hidden, weight, labels, vocab_size=V_LOCAL * tp - 3).logprobs
    others = {"old": lp + 0.3 * torch.randn(B, S, generator=g), "ref": lp + 0.3 * torch.randn(B, S, generator=g)}
    others["sampling"] = others["old"] + 0.2 * torch.randn(B, S, generator=g)
    return hidden, weight, labels, mask, adv, others


LOGPROB_ARGS = {"old": "old_logprobs", "ref": "reference_logprobs", "sampling": "sampling_logprobs"}


def fused_reference(name, tp):
    """CP=1, TP=1: grpo_loss on linear_logprobs of the full sequences; loss, metrics, dX, dW."""
    hidden, weight, labels, mask, adv, others = fused_inputs(tp)
    cfg_kwargs, needs = FUSED_CONFIGS[name]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = linear_logprobs(h, w, labels, vocab_size=V_LOCAL * tp - 3, temperature=0.9).logprobs
    normalizer = 29 if "normalizer" in name else None
    loss, metrics = grpo_loss(lp, adv, mask, GRPOConfig(**cfg_kwargs), normalizer=normalizer,
                              **{LOGPROB_ARGS[k]: others[k] for k in needs})
    (2.5 * loss).backward()
    return loss.detach(), metrics, h.grad, w.grad
