"""Context parallelism of the pure losses: with `cp_group`, each CP rank passes its slice of every
sequence, and then (float64, gloo)

* the loss and every metric are identical on every CP rank and equal to the CP=1 value, and
* each rank's gradient w.r.t. its local log-probs equals the CP=1 gradient at those positions,

at CP=2 and CP=4, for Megatron's load-balanced slicing (chunks r and 2·CP−1−r of 2·CP) and for an
arbitrary split of the positions into unequal parts (one of them empty). The CP=1 values are
computed in the parent by the same functions without `cp_group` (their correctness is
test_losses.py's job). Every case of one layout runs in a single launch of forked workers.

Also: bad input under CP raises the same ValueError on every rank instead of hanging, and
`linear_grpo_loss(cp_group=...)` equals `grpo_loss` at CP=1 for the loss, the metrics, dX and dW
(TP=1 x CP=2, and TP=2 x CP=2 on 4 ranks with subgroups, with and without sequence parallelism).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import reference
from dist import run_workers
from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, dpo_loss, grpo_loss, nll_loss
from megatron_fused_ce.losses.linear_grpo import linear_grpo_loss

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


def _run_case(name, data, cp_group=None):
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


def _slice(data, index):
    return {k: (v[:, index] if v.dim() == 2 else v) for k, v in data.items()}


def _cp_worker(rank, world, layout):
    data = _slice(make_data(), positions(layout, world, rank))
    return {name: _run_case(name, data, dist.group.WORLD) for name in CASES}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["balanced", "arbitrary"])
def test_losses_under_context_parallelism_equal_cp1(cp, layout):
    data = make_data()
    expected = {name: _run_case(name, data) for name in CASES}
    results = run_workers(_cp_worker, cp, layout)
    worst = 0.0
    for name, (loss, metrics, grad) in expected.items():
        assert torch.isfinite(grad).all() and grad.abs().max() > 0, name
        full_grad = torch.zeros_like(grad)
        for rank, result in enumerate(results):
            cp_loss, cp_metrics, cp_grad = result[name]
            torch.testing.assert_close(cp_loss, loss, rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")
            assert cp_metrics.keys() == metrics.keys(), name
            for key, value in metrics.items():
                torch.testing.assert_close(cp_metrics[key], value, rtol=1e-12, atol=1e-13,
                                           msg=lambda m, key=key: f"{name} metric {key}: {m}")
            index = positions(layout, cp, rank)
            torch.testing.assert_close(cp_grad, grad[:, index], rtol=1e-12, atol=1e-14,
                                       msg=lambda m: f"{name} rank {rank} grad: {m}")
            full_grad[:, index] = cp_grad
            worst = max(worst, abs(float(cp_loss) - float(loss)) / max(abs(float(loss)), 1e-30))
        worst = max(worst, reference.rel_err(full_grad, grad))
    reference.record_difference(f"losses CP={cp} vs CP=1", 1, F64, worst)
    excluded = {name: float(expected[name][1]["num_excluded_tokens"]) for name in CASES if "excluded" in name}
    assert excluded["excluded_grpo"] == 3 and excluded["excluded_dapo_gspo"] == 2, excluded
    assert excluded["excluded_nll"] == 1 and excluded["excluded_dpo"] == 1, excluded


# ---- bad input under CP: the same ValueError on every rank, never a hang --------------------------------

def _bad_input_worker(rank, world, problem, loss_name):
    data = _slice(make_data(), positions("balanced", world, rank))
    lp, mask, adv = data["lp"], data["mask"], data["adv"]
    kwargs, config = {}, GRPOConfig(loss_type="grpo")
    if rank == world - 1:
        if problem == "batch":
            lp, mask, adv = lp[:2], mask[:2], adv[:2]
            data["ref"] = data["ref"][:2]
        elif problem == "unsliced_mask":
            mask = make_data()["mask"]
        elif problem == "normalizer":
            kwargs["normalizer"] = 0
        elif problem == "optional_argument":
            kwargs["normalizer"] = 3
        elif problem == "config":
            config = GRPOConfig(loss_type="dapo")
    try:
        if loss_name == "nll":
            nll_loss(lp, mask, cp_group=dist.group.WORLD, **kwargs)
        elif loss_name == "dpo":
            dpo_loss(lp, data["ref"], mask, cp_group=dist.group.WORLD, **kwargs)
        else:
            grpo_loss(lp, adv, mask, config, old_logprobs=data["old"][:lp.shape[0]], cp_group=dist.group.WORLD,
                      **kwargs)
    except ValueError as error:
        return str(error)
    return None


BAD_INPUTS = {  # problem -> losses for which it is a problem
    "batch": ("dpo", "grpo"),
    "unsliced_mask": ("nll", "dpo", "grpo"),
    "normalizer": ("nll", "dpo", "grpo"),
    "optional_argument": ("nll", "dpo", "grpo"),
    "config": ("grpo",),
}


@pytest.mark.parametrize("problem,loss_name", [(p, n) for p, names in BAD_INPUTS.items() for n in names])
def test_bad_input_under_cp_raises_on_every_rank(problem, loss_name):
    messages = run_workers(_bad_input_worker, 2, problem, loss_name, timeout=30)
    assert all(m is not None for m in messages), messages
    expect = {"batch": "different numbers of sequences", "unsliced_mask": "mask shape",
              "normalizer": "normalizer", "optional_argument": "normalizer", "config": "config"}[problem]
    assert any(expect in m for m in messages), messages


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


def _fused_inputs(tp):
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


_NAMES = {"old": "old_logprobs", "ref": "reference_logprobs", "sampling": "sampling_logprobs"}


def _fused_reference(name, tp):
    """CP=1, TP=1: grpo_loss on linear_logprobs of the full sequences; loss, metrics, dX, dW."""
    hidden, weight, labels, mask, adv, others = _fused_inputs(tp)
    cfg_kwargs, needs = FUSED_CONFIGS[name]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = linear_logprobs(h, w, labels, vocab_size=V_LOCAL * tp - 3, temperature=0.9).logprobs
    normalizer = 29 if "normalizer" in name else None
    loss, metrics = grpo_loss(lp, adv, mask, GRPOConfig(**cfg_kwargs), normalizer=normalizer,
                              **{_NAMES[k]: others[k] for k in needs})
    (2.5 * loss).backward()
    return loss.detach(), metrics, h.grad, w.grad


def _fused_worker(rank, world, tp, sequence_parallel):
    cp = world // tp
    tp_rank, cp_rank = rank % tp, rank // tp
    groups = {}
    for c in range(cp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(c * tp, (c + 1) * tp)))
        if c == cp_rank:
            groups["tp"] = group
    for t in range(tp):
        group = dist.new_group(list(range(t, world, tp)))
        if t == tp_rank:
            groups["cp"] = group
    hidden, weight, labels, mask, adv, others = _fused_inputs(tp)
    index = positions("balanced", cp, cp_rank)
    hidden, labels, mask = hidden[:, index], labels[:, index], mask[:, index]
    others = {k: v[:, index] for k, v in others.items()}
    if sequence_parallel:  # sequence-first, this TP rank's part of the (local) sequence dim
        hidden, labels = hidden.transpose(0, 1).contiguous(), labels.t().contiguous()
        rows = hidden.shape[0] // tp
        hidden = hidden[tp_rank * rows:(tp_rank + 1) * rows]
    shard = weight[tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL]
    results = {}
    for name, (cfg_kwargs, needs) in FUSED_CONFIGS.items():
        h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        loss, metrics = linear_grpo_loss(
            h, w, labels, adv, mask, GRPOConfig(**cfg_kwargs), tp_group=groups["tp"] if tp > 1 else None,
            cp_group=groups["cp"], vocab_size=V_LOCAL * tp - 3, temperature=0.9, chunk_size=5,
            sequence_parallel=sequence_parallel, normalizer=29 if "normalizer" in name else None,
            **{_NAMES[k]: others[k] for k in needs})
        (2.5 * loss).backward()
        results[name] = (loss.detach(), {k: v.detach() for k, v in metrics.items()}, h.grad, w.grad)
    return results


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_linear_grpo_under_context_parallelism_equals_cp1(tp, sequence_parallel):
    cp = 2
    results = run_workers(_fused_worker, tp * cp, tp, sequence_parallel)
    for name in FUSED_CONFIGS:
        loss, metrics, dx, dw = _fused_reference(name, tp)
        assert dx.abs().max() > 0 and dw.abs().max() > 0, name
        dw_sum = [torch.zeros_like(dw[:V_LOCAL]) for _ in range(tp)]
        for rank, result in enumerate(results):
            tp_rank, cp_rank = rank % tp, rank // tp
            got_loss, got_metrics, got_dx, got_dw = result[name]
            torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-7)
            assert got_metrics.keys() == metrics.keys(), name
            for key, value in metrics.items():
                torch.testing.assert_close(got_metrics[key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, key=key: f"{name} metric {key}: {m}")
            want_dx = dx[:, positions("balanced", cp, cp_rank)]
            if sequence_parallel:
                want_dx = want_dx.transpose(0, 1)
                rows = want_dx.shape[0] // tp
                want_dx = want_dx[tp_rank * rows:(tp_rank + 1) * rows]
            err = reference.record_difference("linear_grpo_loss dX, CP=2 vs CP=1", tp, torch.float32,
                                              reference.rel_err(got_dx, want_dx))
            assert err < 1e-5, (name, rank, "dX", err)
            dw_sum[tp_rank] += got_dw  # Megatron sums parameter gradients over the CP group
        for tp_rank in range(tp):
            want_dw = dw[tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL]
            err = reference.record_difference("linear_grpo_loss dW, CP=2 vs CP=1", tp, torch.float32,
                                              reference.rel_err(dw_sum[tp_rank], want_dw))
            assert err < 1e-5, (name, tp_rank, "dW", err)
