"""Tests of megatron_fused_ce.losses against independent float64 per-token reference loops.

The references below are written from the loss formulas token by token, with plain Python control
flow (if/else instead of clamp/max/where), so they share no code with the vectorized losses.
Values, gradients w.r.t. the log-probs and metrics are compared; gradcheck covers small cases.
GRPO's per-token terms and their closed-form derivatives (grpo.token_terms) are also compared with
torch.autograd of the same formulas on a traced graph, and the compiled evaluation with the eager one.
"""

from __future__ import annotations

import math
import re
import shutil
import warnings

import numpy as np
import pytest
import torch

from megatron_fused_ce.losses import (
    DPO_LOSS_TYPES,
    GRPO_LOSS_TYPES,
    GRPOConfig,
    dpo_loss,
    grpo,
    grpo_loss,
    nll_loss,
)
from megatron_fused_ce.losses.grpo import TokenInputs, token_terms
from megatron_fused_ce.losses.linear_grpo import GRPOGrads, linear_grpo_loss
from op_cases import autograd_nodes

F64 = torch.float64


def const(x) -> torch.Tensor:
    return torch.tensor(float(x), dtype=F64)


def zero() -> torch.Tensor:
    return torch.zeros((), dtype=F64)


# ---- test data ---------------------------------------------------------------------------------


def make_batch(batch=8, length=6, seed=0, float_mask=False, token_advantages=False, garbage=True):
    """Random log-probs with spread-out ratios (so every clip branch is hit), an empty sequence
    (row 2), and NaN/-inf garbage at masked positions (which must never leak into anything)."""
    gen = torch.Generator().manual_seed(seed)
    lp = -(torch.rand(batch, length, generator=gen, dtype=F64) * 2.0 + 0.05)
    valid = torch.rand(batch, length, generator=gen) < 0.75
    valid[2] = False
    valid[0, 0] = True
    mask = valid.to(F64)
    if float_mask:
        mask = mask * (0.5 + torch.rand(batch, length, generator=gen, dtype=F64))
    old = lp + 0.6 * torch.randn(batch, length, generator=gen, dtype=F64)
    ref = lp + 0.5 * torch.randn(batch, length, generator=gen, dtype=F64)
    sampling = old + 0.3 * torch.randn(batch, length, generator=gen, dtype=F64)
    entropy = torch.rand(batch, length, generator=gen, dtype=F64) * 3
    adv_shape = (batch, length) if token_advantages else (batch,)
    adv = torch.randn(*adv_shape, generator=gen, dtype=F64)
    if garbage:
        lp = lp.masked_fill(~valid, float("-inf"))
        for t in (old, ref, sampling, entropy):
            t.masked_fill_(~valid, float("nan"))
    return dict(lp=lp, mask=mask, old=old, ref=ref, sampling=sampling, entropy=entropy, adv=adv)


# ---- independent reference implementations ------------------------------------------------------


def impossible(*values):
    """A -inf log-prob (outside a sampler's kept set) excludes its token."""
    return any(v is not None and float(v.detach()) == -math.inf for v in values)


def ref_nll(lp, mask, normalizer=None):
    total, count = zero(), 0.0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            w = float(mask[i, t])
            if w != 0 and not impossible(lp[i, t]):
                total = total - w * lp[i, t]
                count += w
    n = count if normalizer is None else float(normalizer)
    return total / n if n != 0 else total * 0.0


def ref_log_sigmoid(x):
    # log σ(x) = -log(1 + e^{-x}), written differently from F.logsigmoid on purpose
    return -torch.log1p(torch.exp(-x)) if x.item() >= 0 else x - torch.log1p(torch.exp(x))


def ref_dpo(lp, ref, mask, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, average_log_probs=False,
            sft_weight=0.0, preference_weight=1.0, normalizer=None, sft_normalizer=None):
    def score(x, i):
        s, n = zero(), 0.0
        for t in range(x.shape[1]):
            w = float(mask[i, t])
            if w != 0 and not impossible(lp[i, t], ref[i, t]):
                s = s + w * x[i, t]
                n += w
        if average_log_probs:
            return s / n if n else s * 0.0
        return s

    pairs = lp.shape[0] // 2
    total, rc, rr = zero(), [], []
    for p in range(pairs):
        c, r = 2 * p, 2 * p + 1
        chosen = score(lp, c) - score(ref, c)
        rejected = score(lp, r) - score(ref, r)
        h = chosen - rejected
        if loss_type == "sigmoid":
            loss_p = (-(1 - label_smoothing) * ref_log_sigmoid(beta * h)
                      - label_smoothing * ref_log_sigmoid(-beta * h))
        elif loss_type == "ipo":
            loss_p = (h - 1.0 / (2 * beta)) ** 2
        else:
            loss_p = 1 - beta * h if (1 - beta * h).item() > 0 else zero()
        total = total + loss_p
        rc.append(beta * chosen.item())
        rr.append(beta * rejected.item())
    n_p = pairs if normalizer is None else normalizer
    preference = total / n_p
    chosen_mask = mask[0::2].clone()
    chosen_mask[(ref[0::2] == -math.inf) & (chosen_mask != 0)] = 0  # excluded from both terms
    sft = ref_nll(lp[0::2], chosen_mask, sft_normalizer)
    loss = preference_weight * preference + sft_weight * sft
    metrics = dict(preference_loss=preference.item(), sft_loss=sft.item(),
                   rewards_chosen=sum(rc) / pairs, rewards_rejected=sum(rr) / pairs,
                   reward_margin=sum(a - b for a, b in zip(rc, rr)) / pairs,
                   accuracy=sum(a > b for a, b in zip(rc, rr)) / pairs,
                   num_excluded_tokens=sum(impossible(lp[i, t], ref[i, t]) for i in range(lp.shape[0])
                                           for t in range(lp.shape[1]) if float(mask[i, t]) != 0))
    return loss, metrics


def ref_grpo(lp, adv, mask, cfg: GRPOConfig, old=None, ref=None, sampling=None, normalizer=None):
    """The formulas of grpo.py's module doc, one token at a time. Returns (loss, pg_loss, kl_loss, metrics)."""
    batch, length = lp.shape
    on_policy = old is None or cfg.force_on_policy_ratio
    lo_clip, hi_clip = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high
    use_is = sampling is not None and cfg.is_correction != "none"
    ppo = cfg.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")

    def old_at(i, t):
        return lp[i, t].detach() if on_policy else old[i, t]

    pg, kl = {}, {}
    stats = dict(w=[], r=[], low=[], high=[], dual=[], rho_raw=[], rho_changed=[], mult_err=[])
    num_excluded = 0
    for i in range(batch):
        toks = []
        for t in range(length):
            if float(mask[i, t]) == 0:
                continue
            if impossible(lp[i, t], None if on_policy else old[i, t],
                          None if sampling is None else sampling[i, t]):
                num_excluded += 1
            else:
                toks.append(t)
        w = {t: float(mask[i, t]) for t in toks}
        if toks and cfg.importance_sampling_level == "sequence":
            seq_ratio = torch.exp(sum(w[t] * (lp[i, t] - old_at(i, t)) for t in toks) / sum(w.values()))
        if use_is:
            seq_log_rho = sum(w[t] * (old_at(i, t).item() - sampling[i, t].item()) for t in toks)
        for t in toks:
            a = float(adv[i]) if adv.dim() == 1 else float(adv[i, t])
            if cfg.importance_sampling_level == "token":
                r = torch.exp(lp[i, t] - old_at(i, t))
            else:
                r = seq_ratio
            rv = r.item()
            dual = False
            if ppo:
                r_unclipped = const(cfg.delta) if cfg.delta is not None and rv > cfg.delta else r
                r_clipped = const(lo_clip) if rv < lo_clip else (const(hi_clip) if rv > hi_clip else r)
                b1, b2 = -a * r_unclipped, -a * r_clipped
                loss_t = b1 if b1.item() >= b2.item() else b2
                if cfg.dual_clip_c is not None and a < 0 and loss_t.item() > -a * cfg.dual_clip_c:
                    loss_t = const(-a * cfg.dual_clip_c)
                    dual = True
                low, high = rv < lo_clip and a < 0, rv > hi_clip and a > 0
            elif cfg.loss_type == "cispo":
                lower = 1.0 - cfg.epsilon_low if cfg.cispo_min_ratio is None else cfg.cispo_min_ratio
                weight = max(min(rv, cfg.cispo_max_ratio), lower)
                loss_t = -a * weight * lp[i, t]
                low = rv < lower
                high = rv > cfg.cispo_max_ratio
            else:  # sapo
                tau = cfg.sapo_temperature_pos if a > 0 else cfg.sapo_temperature_neg
                loss_t = -a * (1.0 / (1.0 + torch.exp(-tau * (r - 1.0)))) * 4.0 / tau
                low = high = False
            if use_is:
                log_rho = (seq_log_rho if cfg.is_correction.startswith("sequence")
                           else old_at(i, t).item() - sampling[i, t].item())
                rho_raw = math.exp(log_rho)
                lo, hi = cfg.is_clip_min, cfg.is_clip_max
                if cfg.is_correction.endswith("truncate"):
                    rho = min(rho_raw, hi)
                    if lo is not None:
                        rho = max(rho, lo)
                else:
                    inside = (lo is None or rho_raw >= lo) and (hi is None or rho_raw <= hi)
                    rho = rho_raw if inside else 0.0
                loss_t = loss_t * rho
                stats["rho_raw"].append(rho_raw)
                stats["rho_changed"].append(rho != rho_raw)
            if sampling is not None:
                stats["mult_err"].append(math.exp(abs(sampling[i, t].item() - old_at(i, t).item())))
            pg[i, t] = loss_t
            if cfg.beta > 0:
                d = ref[i, t] - lp[i, t]
                c_in = cfg.kl_input_clamp
                if c_in is not None and d.item() > c_in:
                    d = const(c_in)
                elif c_in is not None and d.item() < -c_in:
                    d = const(-c_in)
                if cfg.kl_estimator == "k1":
                    k = -d
                elif cfg.kl_estimator == "k2":
                    k = d * d / 2
                else:
                    k = torch.exp(d) - 1 - d
                c_out = cfg.kl_output_clamp
                if c_out is not None and k.item() > c_out:
                    k = const(c_out)
                elif c_out is not None and k.item() < -c_out:
                    k = const(-c_out)
                if cfg.use_bias_correction_kl:
                    k = k * r
                kl[i, t] = k
            for key, val in (("w", w[t]), ("r", rv), ("low", low), ("high", high), ("dual", dual)):
                stats[key].append(val)

    def reduce(values):
        if cfg.loss_type == "grpo" or (cfg.loss_type == "sapo" and cfg.sapo_reduction == "sequence"):
            total, nonempty = zero(), 0
            for i in range(batch):
                toks = [t for t in range(length) if (i, t) in values]
                if toks:
                    nonempty += 1
                    wsum = sum(float(mask[i, t]) for t in toks)
                    total = total + sum(float(mask[i, t]) * values[i, t] for t in toks) / wsum
            if normalizer is None:
                n = batch if cfg.count_empty_sequences else nonempty
                return total / n if n else total * 0.0
            return total / normalizer
        total = sum((float(mask[i, t]) * v for (i, t), v in values.items()), zero())
        if cfg.loss_type == "dr_grpo":
            return total / ((batch if normalizer is None else normalizer) * cfg.max_completion_length)
        n = sum(stats["w"]) if normalizer is None else normalizer
        return total / n if n else total * 0.0

    pg_loss = reduce(pg)
    kl_loss = reduce(kl) if cfg.beta > 0 else zero()
    loss = pg_loss + cfg.beta * kl_loss

    wsum = sum(stats["w"])

    def wmean(vals):
        return sum(w * float(v) for w, v in zip(stats["w"], vals)) / wsum if wsum else 0.0

    metrics = dict(loss=loss.item(), pg_loss=pg_loss.item(), kl=kl_loss.item(),
                   ratio_mean=wmean(stats["r"]), ratio_min=min(stats["r"], default=0.0),
                   ratio_max=max(stats["r"], default=0.0), clip_ratio_low=wmean(stats["low"]),
                   clip_ratio_high=wmean(stats["high"]),
                   clip_ratio=wmean([a or b for a, b in zip(stats["low"], stats["high"])]))
    if cfg.dual_clip_c is not None:
        metrics["dual_clip_ratio"] = wmean(stats["dual"])
    if use_is:
        rho_raw = stats["rho_raw"]
        metrics.update(is_ratio_mean=wmean(rho_raw), is_ratio_min=min(rho_raw, default=0.0),
                       is_ratio_max=max(rho_raw, default=0.0), is_clip_ratio=wmean(stats["rho_changed"]))
    if sampling is not None:
        metrics["token_mult_prob_error"] = wmean(stats["mult_err"])
    metrics["num_excluded_tokens"] = num_excluded
    return loss, pg_loss, kl_loss, metrics


# ---- helpers -------------------------------------------------------------------------------------


def grad_of(fn, lp):
    x = lp.detach().clone().requires_grad_(True)
    loss = fn(x)
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return loss.detach(), (torch.zeros_like(x) if g is None else g)


def assert_close(actual, expected, what=""):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64),
                               rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")


def grpo_inputs(data, inputs):
    """Keyword tensors for grpo_loss from a case's input flags."""
    kwargs = {}
    if inputs.get("old", True):
        kwargs["old_logprobs"] = data["old"]
    if inputs.get("ref", False):
        kwargs["reference_logprobs"] = data["ref"]
    if inputs.get("sampling", False):
        kwargs["sampling_logprobs"] = data["sampling"]
    if "normalizer" in inputs:
        kwargs["normalizer"] = inputs["normalizer"]
    return kwargs


def call_ref_grpo(x, data, cfg, kwargs):
    return ref_grpo(x, data["adv"], data["mask"], cfg, old=kwargs.get("old_logprobs"),
                    ref=kwargs.get("reference_logprobs"), sampling=kwargs.get("sampling_logprobs"),
                    normalizer=kwargs.get("normalizer"))


# ---- NLL -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("normalizer", [None, 1, 23.0])
def test_nll_matches_reference(float_mask, normalizer):
    data = make_batch(float_mask=float_mask)
    loss, grad = grad_of(lambda x: nll_loss(x, data["mask"], normalizer=normalizer)[0], data["lp"])
    ref_loss, ref_grad = grad_of(lambda x: ref_nll(x, data["mask"], normalizer), data["lp"])
    assert_close(loss, ref_loss, "loss")
    assert_close(grad, ref_grad, "grad")
    _, metrics = nll_loss(data["lp"], data["mask"] > 0)  # bool mask
    assert_close(metrics["num_tokens"], (data["mask"] > 0).sum(), "num_tokens")


# ---- DPO -----------------------------------------------------------------------------------------

DPO_CASES = {
    "sigmoid": dict(),
    "sigmoid_label_smoothing": dict(label_smoothing=0.2),
    "sigmoid_beta": dict(beta=0.5),
    "ipo": dict(loss_type="ipo"),
    "ipo_average": dict(loss_type="ipo", average_log_probs=True, beta=0.3),
    "hinge": dict(loss_type="hinge", beta=0.5),
    "sigmoid_average": dict(average_log_probs=True, beta=2.0),
    "sft_and_weights": dict(sft_weight=0.5, preference_weight=0.7),
    "normalizers": dict(normalizer=7, sft_normalizer=31.0, sft_weight=0.3),
}


@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_matches_reference(case, float_mask):
    kwargs = DPO_CASES[case]
    data = make_batch(batch=8, float_mask=float_mask, seed=3)
    ref_lp = data["ref"]
    loss, grad = grad_of(lambda x: dpo_loss(x, ref_lp, data["mask"], **kwargs)[0], data["lp"])
    ref_loss, ref_grad = grad_of(lambda x: ref_dpo(x, ref_lp, data["mask"], **kwargs)[0], data["lp"])
    assert_close(loss, ref_loss, "loss")
    assert_close(grad, ref_grad, "grad")
    _, metrics = dpo_loss(data["lp"], ref_lp, data["mask"], **kwargs)
    _, ref_metrics = ref_dpo(data["lp"], ref_lp, data["mask"], **kwargs)
    for name, value in ref_metrics.items():
        assert_close(metrics[name], value, name)
    assert_close(metrics["loss"], ref_loss, "metrics.loss")


def test_dpo_hinge_is_active_and_inactive():
    """The fixture puts hinge pairs on both sides of the kink (so both branches are tested)."""
    data = make_batch(batch=8, seed=3)
    scores = ((data["lp"] - data["ref"]).nan_to_num(0, 0, 0) * data["mask"]).sum(-1)
    margins = torch.stack([scores[2 * p] - scores[2 * p + 1] for p in range(4)])
    beta = DPO_CASES["hinge"]["beta"]
    assert (1 - beta * margins > 0).any() and (1 - beta * margins < 0).any()


# ---- GRPO: every loss type and option against the reference loops -------------------------------

L = 9  # max_completion_length for dr_grpo (> T)
GRPO_CASES = {
    # every loss type with its defaults
    **{lt: (dict(loss_type=lt, max_completion_length=L), dict()) for lt in GRPO_LOSS_TYPES},
    # PPO-clip options
    "dapo_asymmetric_clip": (dict(epsilon_low=0.1, epsilon_high=0.28), dict()),
    "dapo_delta": (dict(delta=1.5), dict()),
    "dapo_dual_clip": (dict(dual_clip_c=1.3), dict()),
    "grpo_delta_dual_clip": (dict(loss_type="grpo", delta=1.6, dual_clip_c=1.4), dict()),
    "dr_grpo_dual_clip": (dict(loss_type="dr_grpo", max_completion_length=L, dual_clip_c=2.0), dict()),
    "cispo_low_max_ratio": (dict(loss_type="cispo", cispo_max_ratio=1.2), dict()),
    "sapo_temperatures": (dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0), dict()),
    # conventions where peers differ
    "sapo_token_reduction": (dict(loss_type="sapo", sapo_reduction="token"), dict()),
    "sapo_without_empty_sequences": (dict(loss_type="sapo", count_empty_sequences=False), dict()),
    "grpo_without_empty_sequences": (dict(loss_type="grpo", count_empty_sequences=False), dict()),
    "cispo_two_sided": (dict(loss_type="cispo", cispo_min_ratio=0.8, cispo_max_ratio=1.2), dict()),
    # KL estimators and clamps
    "kl_k1": (dict(beta=0.1, kl_estimator="k1"), dict(ref=True)),
    "kl_k2": (dict(beta=0.1, kl_estimator="k2"), dict(ref=True)),
    "kl_k3": (dict(beta=0.1, kl_estimator="k3"), dict(ref=True)),
    "kl_input_clamp": (dict(beta=0.2, kl_estimator="k1", kl_input_clamp=0.3), dict(ref=True)),
    "kl_output_clamp": (dict(beta=0.2, kl_estimator="k3", kl_output_clamp=0.05), dict(ref=True)),
    "kl_no_clamps": (dict(beta=0.2, kl_estimator="k2", kl_input_clamp=None, kl_output_clamp=None),
                     dict(ref=True)),
    "kl_bias_correction": (dict(beta=0.3, use_bias_correction_kl=True), dict(ref=True)),
    "grpo_kl_bias_correction": (dict(loss_type="grpo", beta=0.3, kl_estimator="k2",
                                     use_bias_correction_kl=True), dict(ref=True)),
    "sapo_kl": (dict(loss_type="sapo", beta=0.1), dict(ref=True)),
    "cispo_kl": (dict(loss_type="cispo", beta=0.1, kl_estimator="k1"), dict(ref=True)),
    # train/inference importance-sampling correction
    "is_token_truncate": (dict(is_correction="token_truncate", is_clip_max=1.2), dict(sampling=True)),
    "is_token_truncate_min": (dict(is_correction="token_truncate", is_clip_min=0.8, is_clip_max=1.2),
                              dict(sampling=True)),
    "is_token_mask": (dict(is_correction="token_mask", is_clip_min=0.7, is_clip_max=1.4),
                      dict(sampling=True)),
    "is_token_mask_max_only": (dict(is_correction="token_mask", is_clip_max=1.3), dict(sampling=True)),
    "is_sequence_truncate": (dict(is_correction="sequence_truncate", is_clip_min=0.5, is_clip_max=1.5),
                             dict(sampling=True)),
    "is_sequence_mask": (dict(is_correction="sequence_mask", is_clip_min=0.5, is_clip_max=2.0),
                         dict(sampling=True)),
    "is_with_kl": (dict(beta=0.2, is_correction="token_truncate", is_clip_max=1.1),
                   dict(ref=True, sampling=True)),
    "is_cispo": (dict(loss_type="cispo", is_correction="token_mask", is_clip_min=0.8, is_clip_max=1.25),
                 dict(sampling=True)),
    "is_none_with_sampling": (dict(), dict(sampling=True)),
    # old log-probs
    "on_policy_no_old": (dict(), dict(old=False)),
    "force_on_policy_ratio": (dict(force_on_policy_ratio=True), dict()),
    "force_on_policy_is": (dict(force_on_policy_ratio=True, is_correction="token_truncate", is_clip_max=1.2),
                           dict(sampling=True)),
    # normalizers
    "dapo_normalizer": (dict(), dict(normalizer=57.0)),
    "bnpo_normalizer_tensor": (dict(loss_type="bnpo"), dict(normalizer=torch.tensor(41))),
    "grpo_normalizer": (dict(loss_type="grpo"), dict(normalizer=13)),
    "dr_grpo_normalizer": (dict(loss_type="dr_grpo", max_completion_length=L), dict(normalizer=11)),
    # everything at once
    "everything": (dict(loss_type="grpo", delta=1.7, dual_clip_c=1.5, beta=0.05, kl_estimator="k3",
                        use_bias_correction_kl=True, is_correction="sequence_mask", is_clip_min=0.3,
                        is_clip_max=3.0, epsilon_high=0.28),
                   dict(ref=True, sampling=True, normalizer=10)),
}


@pytest.mark.parametrize("advantages", ["seq", "token"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_matches_reference(case, level, advantages):
    cfg_kwargs, inputs = GRPO_CASES[case]
    cfg = GRPOConfig(importance_sampling_level=level, **cfg_kwargs)
    data = make_batch(seed=7, token_advantages=advantages == "token", float_mask=advantages == "token")
    kwargs = grpo_inputs(data, inputs)

    loss, grad = grad_of(lambda x: grpo_loss(x, data["adv"], data["mask"], cfg, **kwargs)[0], data["lp"])
    ref_loss, ref_grad = grad_of(lambda x: call_ref_grpo(x, data, cfg, kwargs)[0], data["lp"])
    assert_close(loss, ref_loss, "loss")
    assert_close(grad, ref_grad, "grad")
    assert torch.isfinite(grad).all() and (grad[data["mask"] == 0] == 0).all()

    _, metrics = grpo_loss(data["lp"], data["adv"], data["mask"], cfg, entropy=data["entropy"], **kwargs)
    _, _, _, ref_metrics = call_ref_grpo(data["lp"], data, cfg, kwargs)
    assert set(ref_metrics) | {"entropy"} == set(metrics), "metric names"
    for name, value in ref_metrics.items():
        assert_close(metrics[name], value, name)
    w = data["mask"]
    assert_close(metrics["entropy"], (data["entropy"].nan_to_num(0) * w).sum() / w.sum(), "entropy")
    assert_close(metrics["loss"], metrics["pg_loss"] + cfg.beta * metrics["kl"], "loss = pg + beta*kl")
    for name, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad and torch.isfinite(value), name


def test_fixture_exercises_every_branch():
    """Guard against a vacuous parity test: on the fixture every clip / clamp / mask is active
    for some tokens and inactive for others."""
    data = make_batch(seed=7)
    kw = dict(old_logprobs=data["old"], sampling_logprobs=data["sampling"], reference_logprobs=data["ref"])

    def metric(name, **cfg):
        return float(grpo_loss(data["lp"], data["adv"], data["mask"], GRPOConfig(**cfg), **kw)[1][name])

    for name in ("clip_ratio_low", "clip_ratio_high"):
        assert 0 < metric(name) < 1, name
    assert 0 < metric("dual_clip_ratio", dual_clip_c=1.3) < 1
    assert 0 < metric("clip_ratio_high", loss_type="cispo", cispo_max_ratio=1.2) < 1
    for mode, lo, hi in [("token_truncate", 0.8, 1.2), ("token_mask", 0.7, 1.4),
                         ("sequence_truncate", 0.5, 1.5), ("sequence_mask", 0.5, 2.0)]:
        assert 0 < metric("is_clip_ratio", is_correction=mode, is_clip_min=lo, is_clip_max=hi) < 1, mode
    # delta binds where A < 0 and r > delta; input / output KL clamps bind on some tokens
    valid = data["mask"] > 0
    ratio = torch.exp(data["lp"] - data["old"])[valid]
    adv = data["adv"][:, None].expand_as(data["lp"])[valid]
    assert ((ratio > 1.5) & (adv < 0)).any() and ((ratio < 1.5) & (adv < 0)).any()
    d = (data["ref"] - data["lp"])[valid]
    assert (d.abs() > 0.3).any() and (d.abs() < 0.3).any()
    k3 = torch.exp(d) - 1 - d
    assert (k3 > 0.05).any() and (k3 < 0.05).any()


def test_grpo_zero_length_sequence_gets_ratio_one():
    data = make_batch(seed=7)
    mask = data["mask"].clone()
    mask[:, :] = 0
    mask[0, 0] = 1  # only one token in the batch
    cfg = GRPOConfig(importance_sampling_level="sequence")
    _, metrics = grpo_loss(data["lp"], data["adv"], mask, cfg, old_logprobs=data["old"])
    expected = torch.exp(data["lp"][0, 0] - data["old"][0, 0])
    assert_close(metrics["ratio_mean"], expected, "ratio of the only token")


# ---- gradcheck -------------------------------------------------------------------------------------

GRADCHECK_GRPO = [
    dict(loss_type="dapo", beta=0.1, is_correction="token_truncate", is_clip_max=1.2),
    dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5, dual_clip_c=1.3),
    dict(loss_type="dr_grpo", max_completion_length=5, beta=0.2, kl_estimator="k2"),
    dict(loss_type="bnpo", is_correction="sequence_mask", is_clip_max=3.0, beta=0.1, kl_estimator="k1"),
    dict(loss_type="sapo", beta=0.1, use_bias_correction_kl=True),
    dict(loss_type="sapo", importance_sampling_level="sequence"),
]


def _small(seed):
    data = make_batch(batch=4, length=3, seed=seed, float_mask=True, garbage=False)
    data["mask"][2] = 0.0
    data["mask"][0, 0] = 1.0
    return data


@pytest.mark.parametrize("cfg_kwargs", GRADCHECK_GRPO, ids=lambda c: c["loss_type"])
def test_grpo_gradcheck(cfg_kwargs):
    # cispo is left out on purpose: its stop-gradient makes the analytic gradient differ from the
    # finite differences by design (its gradient is checked against the reference loops above).
    # old_logprobs are always passed: with old = lp.detach() the finite differences would move old.
    data = _small(seed=1)
    cfg = GRPOConfig(**cfg_kwargs)
    kw = dict(old_logprobs=data["old"], reference_logprobs=data["ref"], sampling_logprobs=data["sampling"])
    x = data["lp"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: grpo_loss(lp, data["adv"], data["mask"], cfg, **kw)[0], (x,))


@pytest.mark.parametrize("kwargs", [dict(), dict(loss_type="ipo", average_log_probs=True),
                                    dict(loss_type="hinge", beta=0.5),
                                    dict(label_smoothing=0.1, sft_weight=0.5)], ids=str)
def test_dpo_gradcheck(kwargs):
    data = _small(seed=2)
    x = data["lp"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: dpo_loss(lp, data["ref"], data["mask"], **kwargs)[0], (x,))


def test_nll_gradcheck():
    data = _small(seed=3)
    x = data["lp"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: nll_loss(lp, data["mask"])[0], (x,))


# ---- normalizer semantics across simulated data-parallel ranks -------------------------------------

RANK_ROWS = [slice(0, 2), slice(2, 8)]  # unequal numbers of sequences and tokens per rank


def _split_grads(fn, lp):
    """Sum of per-rank losses and the concatenated per-rank gradients."""
    total, grads = 0.0, []
    for rows in RANK_ROWS:
        loss, grad = grad_of(lambda x: fn(x, rows), lp[rows])
        total += float(loss)
        grads.append(grad)
    return total, torch.cat(grads)


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_grpo_global_normalizer_matches_whole_batch(loss_type):
    data = make_batch(seed=11)
    mask = data["mask"]
    assert mask[RANK_ROWS[0]].sum() != mask[RANK_ROWS[1]].sum()
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=L, beta=0.1,
                     is_correction="token_truncate", is_clip_max=1.3)
    normalizer = mask.shape[0] if cfg.normalizer_unit == "sequences" else mask.sum()

    def loss_fn(x, rows, norm):
        return grpo_loss(x, data["adv"][rows], mask[rows], cfg, old_logprobs=data["old"][rows],
                         reference_logprobs=data["ref"][rows], sampling_logprobs=data["sampling"][rows],
                         normalizer=norm)[0]

    whole_loss, whole_grad = grad_of(lambda x: loss_fn(x, slice(None), None), data["lp"])
    split_loss, split_grad = _split_grads(lambda x, rows: loss_fn(x, rows, normalizer), data["lp"])
    assert_close(split_loss, whole_loss, "summed loss")
    assert_close(split_grad, whole_grad, "gradients")
    if loss_type in ("dapo", "grpo"):  # the local default normalizer would not add up
        local_loss, _ = _split_grads(lambda x, rows: loss_fn(x, rows, None), data["lp"])
        assert abs(local_loss - float(whole_loss)) > 1e-3


def test_nll_and_dpo_global_normalizer_match_whole_batch():
    data = make_batch(seed=12)
    mask, lp, ref = data["mask"], data["lp"], data["ref"]
    whole, whole_grad = grad_of(lambda x: nll_loss(x, mask)[0], lp)
    split, split_grad = _split_grads(lambda x, rows: nll_loss(x, mask[rows], normalizer=mask.sum())[0], lp)
    assert_close(split, whole, "nll loss")
    assert_close(split_grad, whole_grad, "nll grad")

    kw = dict(sft_weight=0.4, beta=0.2)
    whole, whole_grad = grad_of(lambda x: dpo_loss(x, ref, mask, **kw)[0], lp)
    split, split_grad = _split_grads(
        lambda x, rows: dpo_loss(x, ref[rows], mask[rows], normalizer=4, sft_normalizer=mask[0::2].sum(),
                                 **kw)[0], lp)
    assert_close(split, whole, "dpo loss")
    assert_close(split_grad, whole_grad, "dpo grad")


# ---- edge cases ------------------------------------------------------------------------------------


EMPTY_GRPO = [dict(loss_type=lt, max_completion_length=L) for lt in GRPO_LOSS_TYPES] + [
    dict(importance_sampling_level="sequence", beta=0.1, use_bias_correction_kl=True,
         is_correction="sequence_mask", is_clip_min=0.5, is_clip_max=2.0),
    dict(loss_type="grpo", dual_clip_c=2.0, is_correction="token_truncate", is_clip_max=2.0),
]


@pytest.mark.parametrize("cfg_kwargs", EMPTY_GRPO, ids=str)
def test_zero_valid_tokens_give_zero_loss_and_grads(cfg_kwargs):
    data = make_batch(seed=5)
    mask = torch.zeros_like(data["mask"])
    lp = data["lp"].nan_to_num(neginf=-1.0)
    cfg = GRPOConfig(**cfg_kwargs)
    kw = dict(old_logprobs=data["old"], reference_logprobs=data["ref"], sampling_logprobs=data["sampling"],
              entropy=data["entropy"])
    loss, grad = grad_of(lambda x: grpo_loss(x, data["adv"], mask, cfg, **kw)[0], lp)
    assert float(loss) == 0.0 and (grad == 0).all()
    _, metrics = grpo_loss(lp, data["adv"], mask, cfg, **kw)
    for name, value in metrics.items():
        assert float(value) == 0.0, name


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_zero_valid_tokens_nll_dpo(mask_dtype):
    data = make_batch(seed=5)
    mask = torch.zeros(data["lp"].shape, dtype=mask_dtype)
    for fn in (lambda x: nll_loss(x, mask)[0],
               lambda x: dpo_loss(x, data["ref"], mask, sft_weight=1.0, average_log_probs=True)[0]):
        loss, grad = grad_of(fn, data["lp"])
        assert torch.isfinite(loss) and (grad == 0).all()


def test_empty_batch():
    lp = torch.zeros(0, 4, dtype=F64, requires_grad=True)
    loss, metrics = grpo_loss(lp, torch.zeros(0, dtype=F64), torch.zeros(0, 4), GRPOConfig(loss_type="grpo"))
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    loss, _ = dpo_loss(lp, lp.detach(), torch.zeros(0, 4))
    assert float(loss.detach()) == 0.0


def test_float32_and_bool_mask():
    data = make_batch(seed=9, garbage=False)
    lp32 = data["lp"].float()
    cfg = GRPOConfig(beta=0.1)
    loss32, m32 = grpo_loss(lp32, data["adv"].float(), data["mask"] > 0, cfg,
                            old_logprobs=data["old"].float(), reference_logprobs=data["ref"].float())
    loss64, _ = grpo_loss(data["lp"], data["adv"], data["mask"], cfg, old_logprobs=data["old"],
                          reference_logprobs=data["ref"])
    assert loss32.dtype == torch.float32 and m32["ratio_mean"].dtype == torch.float32
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-5, atol=1e-6)


# ---- which passes can be skipped; config validation ------------------------------------------------


def test_reference_logprobs_only_needed_with_kl():
    data = make_batch(seed=4)
    cfg = GRPOConfig(beta=0.0)
    assert not cfg.needs_reference_logprobs
    assert GRPOConfig(beta=0.01).needs_reference_logprobs
    # beta == 0: reference log-probs are never read, even when they are garbage
    kw = dict(old_logprobs=data["old"])
    plain, _ = grpo_loss(data["lp"], data["adv"], data["mask"], cfg, **kw)
    poisoned = torch.full_like(data["lp"], float("nan"))
    with_ref, metrics = grpo_loss(data["lp"], data["adv"], data["mask"], cfg, reference_logprobs=poisoned,
                                  **kw)
    assert_close(with_ref, plain, "beta=0 ignores reference")
    assert float(metrics["kl"]) == 0.0
    with pytest.raises(ValueError, match="reference_logprobs"):
        grpo_loss(data["lp"], data["adv"], data["mask"], GRPOConfig(beta=0.1), **kw)


def test_force_on_policy_ratio_skips_old_logprobs():
    data = make_batch(seed=4)
    cfg = GRPOConfig(force_on_policy_ratio=True)
    assert not cfg.needs_old_logprobs
    assert GRPOConfig().needs_old_logprobs
    with_old = grad_of(lambda x: grpo_loss(x, data["adv"], data["mask"], cfg, old_logprobs=data["old"])[0],
                       data["lp"])
    without = grad_of(lambda x: grpo_loss(x, data["adv"], data["mask"], cfg)[0], data["lp"])
    assert_close(with_old[0], without[0], "loss")
    assert_close(with_old[1], without[1], "grad")
    _, metrics = grpo_loss(data["lp"], data["adv"], data["mask"], cfg, old_logprobs=data["old"])
    assert float(metrics["ratio_min"]) == float(metrics["ratio_max"]) == 1.0


def test_is_correction_needs_sampling_logprobs_to_apply():
    """Per §3 the correction applies only when sampling log-probs are passed."""
    data = make_batch(seed=4)
    cfg = GRPOConfig(is_correction="token_mask", is_clip_max=1.1)
    assert cfg.needs_sampling_logprobs and not GRPOConfig().needs_sampling_logprobs
    loss, metrics = grpo_loss(data["lp"], data["adv"], data["mask"], cfg, old_logprobs=data["old"])
    plain, _ = grpo_loss(data["lp"], data["adv"], data["mask"], GRPOConfig(), old_logprobs=data["old"])
    assert_close(loss, plain, "no sampling log-probs: no correction")
    assert "is_ratio_mean" not in metrics and "token_mult_prob_error" not in metrics


def test_normalizer_unit():
    assert GRPOConfig(loss_type="grpo").normalizer_unit == "sequences"
    assert GRPOConfig(loss_type="dr_grpo", max_completion_length=4).normalizer_unit == "sequences"
    assert GRPOConfig(loss_type="sapo").normalizer_unit == "sequences"  # per sequence by default
    for lt in ("dapo", "bnpo", "cispo"):
        assert GRPOConfig(loss_type=lt).normalizer_unit == "tokens"
    assert GRPOConfig(loss_type="sapo", sapo_reduction="token").normalizer_unit == "tokens"


@pytest.mark.parametrize("kwargs, field", [
    (dict(loss_type="ppo"), "loss_type"),
    (dict(dual_clip_c=1.0), "dual_clip_c"),
    (dict(dual_clip_c=0.5), "dual_clip_c"),
    (dict(loss_type="cispo", dual_clip_c=3.0), "dual_clip_c"),
    (dict(delta=1.0), "delta"),
    (dict(loss_type="sapo", delta=2.0), "delta"),
    (dict(loss_type="dr_grpo"), "max_completion_length"),
    (dict(loss_type="dr_grpo", max_completion_length=0), "max_completion_length"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level"),
    (dict(is_correction="truncate"), "is_correction"),
    (dict(is_correction="token_truncate"), "is_clip_max"),
    (dict(is_correction="sequence_mask"), "is_clip_min"),
    (dict(is_clip_min=2.0, is_clip_max=1.0), "is_clip_min"),
    (dict(is_clip_max=-1.0), "is_clip_max"),
    (dict(beta=-0.1), "beta"),
    (dict(epsilon_low=1.0), "epsilon_low"),
    (dict(epsilon_high=-0.1), "epsilon_high"),
    (dict(cispo_max_ratio=0.0), "cispo_max_ratio"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"),
    (dict(kl_input_clamp=0.0), "kl_input_clamp"),
    (dict(kl_output_clamp=-1.0), "kl_output_clamp"),
    # types: a truthy string must not switch an option on; infinities are typos
    (dict(use_bias_correction_kl="no"), "use_bias_correction_kl"),
    (dict(force_on_policy_ratio=1), "force_on_policy_ratio"),
    (dict(count_empty_sequences="yes"), "count_empty_sequences"),
    (dict(beta=math.inf), "beta"),
    (dict(beta=math.nan), "beta"),
    (dict(beta="0.1"), "beta"),
    (dict(beta=True), "beta"),
    (dict(epsilon_high=math.inf), "epsilon_high"),
    (dict(epsilon_low=math.nan), "epsilon_low"),
    (dict(delta=math.inf), "delta"),
    (dict(dual_clip_c=math.inf), "dual_clip_c"),
    (dict(loss_type="cispo", cispo_max_ratio=math.inf), "cispo_max_ratio"),
    (dict(loss_type="sapo", sapo_temperature_pos=math.inf), "sapo_temperature_pos"),
    (dict(beta=0.1, kl_input_clamp=math.inf), "kl_input_clamp"),
    (dict(kl_output_clamp=math.inf), "kl_output_clamp"),
    (dict(is_correction="token_truncate", is_clip_max=math.inf), "is_clip_max"),
    (dict(is_correction="token_mask", is_clip_min=math.nan), "is_clip_min"),
    (dict(max_completion_length=2.5), "max_completion_length"),
    (dict(loss_type="dr_grpo", max_completion_length=True), "max_completion_length"),
    (dict(loss_type=["dapo"]), "loss_type"),
    (dict(sapo_reduction="mean"), "sapo_reduction"),
    (dict(loss_type="cispo", cispo_min_ratio=6.0), "cispo_min_ratio"),
    (dict(loss_type="cispo", cispo_min_ratio=-0.1), "cispo_min_ratio"),
])
def test_grpo_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**kwargs)


def test_grpo_validates_at_call_time():
    data = make_batch(seed=4)
    cfg = GRPOConfig()
    cfg.loss_type = "dr_grpo"  # mutated after construction
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(data["lp"], data["adv"], data["mask"], cfg)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(data["lp"], data["adv"][:3], data["mask"], GRPOConfig())
    with pytest.raises(ValueError, match="old_logprobs"):
        grpo_loss(data["lp"], data["adv"], data["mask"], GRPOConfig(), old_logprobs=data["old"][:, :2])


@pytest.mark.parametrize("field, bad", [("epsilon_low", 1.5), ("loss_type", "dr_grpo"), ("beta", math.nan),
                                        ("is_clip_max", -1.0), ("force_on_policy_ratio", 1),
                                        ("delta", np.float64(0.5))])
def test_grpo_config_mutated_between_calls_is_checked_again(field, bad):
    """validate() remembers configs that passed: a field mutated after a call that passed must
    raise as a fresh config with that value does, on either loss, and pass again once restored."""
    data = make_batch(seed=4)
    h = torch.randn(8, 6, 5, requires_grad=True)
    w = torch.randn(11, 5, requires_grad=True)
    labels = torch.randint(0, 11, (8, 6))
    cfg = GRPOConfig()
    calls = (lambda: grpo_loss(data["lp"], data["adv"], data["mask"], cfg),
             lambda: linear_grpo_loss(h, w, labels, data["adv"], data["mask"], cfg))
    first = [call()[0] for call in calls]
    with pytest.raises(ValueError) as fresh:
        GRPOConfig(**{field: bad})
    good = getattr(cfg, field)
    setattr(cfg, field, bad)
    for call in calls:
        with pytest.raises(ValueError) as later:
            call()
        assert str(later.value) == str(fresh.value)
    setattr(cfg, field, good)
    assert all(torch.equal(call()[0], value) for call, value in zip(calls, first))
    # a NumPy number equal to a remembered value is still made a Python float
    cfg.epsilon_high = np.float64(0.2)
    grpo_loss(data["lp"], data["adv"], data["mask"], cfg)
    assert type(cfg.epsilon_high) is float and cfg.fingerprint() == GRPOConfig().fingerprint()


@pytest.mark.parametrize("kwargs, field", [
    (dict(loss_type="kto"), "loss_type"),
    (dict(beta=0.0), "beta"),
    (dict(label_smoothing=0.7), "label_smoothing"),
    (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing"),
    (dict(beta=math.inf), "beta"),
    (dict(beta=math.nan), "beta"),
    (dict(label_smoothing=math.nan), "label_smoothing"),
    (dict(average_log_probs="no"), "average_log_probs"),
    (dict(sft_weight=math.nan), "sft_weight"),
    (dict(sft_weight=-0.5), "sft_weight"),
    (dict(preference_weight=math.inf), "preference_weight"),
    (dict(normalizer=0), "normalizer"),
    (dict(sft_normalizer=-3.0), "sft_normalizer"),
])
def test_dpo_validation(kwargs, field):
    data = make_batch(seed=4)
    with pytest.raises(ValueError, match=field):
        dpo_loss(data["lp"], data["ref"], data["mask"], **kwargs)
    assert set(DPO_LOSS_TYPES) == {"sigmoid", "ipo", "hinge"}


def test_dpo_needs_pairs():
    data = make_batch(batch=5, seed=4)
    with pytest.raises(ValueError, match="even"):
        dpo_loss(data["lp"], data["ref"], data["mask"])


def test_grpo_config_defaults():
    cfg = GRPOConfig()
    expected = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, delta=None, dual_clip_c=None,
                    cispo_max_ratio=5.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, beta=0.0,
                    kl_estimator="k3", kl_input_clamp=20.0, kl_output_clamp=10.0,
                    use_bias_correction_kl=False, importance_sampling_level="token", is_correction="none",
                    is_clip_min=None, is_clip_max=None,
                    force_on_policy_ratio=False, max_completion_length=None,
                    cispo_min_ratio=None, sapo_reduction="sequence", count_empty_sequences=True)
    assert {k: getattr(cfg, k) for k in expected} == expected


# ---- normalizers must be > 0 ----------------------------------------------------------------------

BAD_NORMALIZERS = [0, 0.0, -1, -2.5, math.inf, math.nan, True, "4", torch.tensor(0), torch.tensor(-1.0),
                   torch.tensor([1.0, 2.0]), torch.tensor(True), torch.tensor(math.inf)]


@pytest.mark.parametrize("normalizer", BAD_NORMALIZERS, ids=repr)
def test_bad_normalizer_raises(normalizer):
    """0 used to be replaced by 1 and a negative value flipped the sign of the loss."""
    data = make_batch(seed=4)
    calls = {
        "nll": lambda: nll_loss(data["lp"], data["mask"], normalizer=normalizer),
        "dpo": lambda: dpo_loss(data["lp"], data["ref"], data["mask"], normalizer=normalizer),
        "dpo_sft": lambda: dpo_loss(data["lp"], data["ref"], data["mask"], sft_normalizer=normalizer),
        **{lt: lambda lt=lt: grpo_loss(data["lp"], data["adv"], data["mask"],
                                       GRPOConfig(loss_type=lt, max_completion_length=L), normalizer=normalizer)
           for lt in GRPO_LOSS_TYPES},
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="normalizer"):
            call()


def test_good_normalizers_are_accepted():
    data = make_batch(seed=4)
    for normalizer in (1, 2.5, torch.tensor(3), torch.tensor([7.0]), torch.tensor(0.5, dtype=F64)):
        loss, _ = nll_loss(data["lp"], data["mask"], normalizer=normalizer)
        assert_close(loss, ref_nll(data["lp"], data["mask"], float(normalizer)), "nll")


@pytest.fixture
def counts_checked_on_the_device(monkeypatch):
    """Normalizer tensors checked as a GPU tensor is, on its device (nll.given_count), on the CPU."""
    from megatron_fused_ce import check_deferred_errors
    from megatron_fused_ce.losses import nll

    monkeypatch.setattr(nll, "read_on_host", lambda count: False)
    yield check_deferred_errors
    try:  # nothing left pending for the next test, whatever this one found
        check_deferred_errors()
    except ValueError:
        pass


def _normalizer_calls(data, normalizer):
    return {
        "nll": lambda: nll_loss(data["lp"], data["mask"], normalizer=normalizer),
        "dpo": lambda: dpo_loss(data["lp"], data["ref"], data["mask"], normalizer=normalizer),
        "dpo_sft": lambda: dpo_loss(data["lp"], data["ref"], data["mask"], sft_weight=1.0, sft_normalizer=normalizer),
        **{lt: lambda lt=lt: grpo_loss(data["lp"], data["adv"], data["mask"],
                                       GRPOConfig(loss_type=lt, max_completion_length=L), normalizer=normalizer)
           for lt in GRPO_LOSS_TYPES},
    }


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan], ids=repr)
def test_a_bad_gpu_normalizer_gives_nan_and_raises_at_the_next_check(counts_checked_on_the_device, value):
    """A normalizer tensor on a GPU (a global token count, given every micro-batch) is not read on
    the host, which would synchronize every loss call: a bad value gives a NaN loss and the error
    at the package's next host synchronization, never a loss silently scaled by it."""
    check = counts_checked_on_the_device
    data = make_batch(seed=4)
    for name, call in _normalizer_calls(data, torch.tensor(value)).items():
        loss, _ = call()
        assert torch.isnan(loss), name
        with pytest.raises(ValueError, match="normalizer"):
            check()


def test_a_good_gpu_normalizer_gives_the_host_checked_values(counts_checked_on_the_device, monkeypatch):
    check = counts_checked_on_the_device
    data = make_batch(seed=4)
    on_device = {name: call()[0] for name, call in _normalizer_calls(data, torch.tensor(3.0)).items()}
    check()  # nothing found
    monkeypatch.undo()
    on_host = {name: call()[0] for name, call in _normalizer_calls(data, torch.tensor(3.0)).items()}
    for name in on_host:
        assert torch.equal(on_device[name], on_host[name]), name


# ---- conventions where peers differ (GRPOConfig) -------------------------------------------------------


def _peer_inputs():
    data = make_batch(seed=21, garbage=False)
    data["mask"][5] = 0.0  # a second empty sequence
    return data


def test_sapo_default_reduction_is_per_sequence_like_trl_liger_verl():
    """TRL / Liger: ((x·m).sum(-1) / m.sum(-1).clamp(min=1)).mean() over all rows; verl's
    "seq-mean-token-mean" leaves fully masked rows out (count_empty_sequences=False)."""
    data = _peer_inputs()
    lp, old, mask, adv = data["lp"], data["old"], data["mask"], data["adv"][:, None]
    ratio = torch.exp(lp - old)
    tau = torch.where(adv > 0, const(1.0), const(1.05))
    per_token = -adv * torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    nonempty = (mask.sum(-1) > 0).to(F64)
    expected = {
        "default (TRL, Liger)": (dict(), per_sequence.mean()),
        "verl": (dict(count_empty_sequences=False), (per_sequence * nonempty).sum() / nonempty.sum()),
        "per token": (dict(sapo_reduction="token"), (per_token * mask).sum() / mask.sum()),
    }
    for what, (options, value) in expected.items():
        loss, _ = grpo_loss(lp, data["adv"], mask, GRPOConfig(loss_type="sapo", **options), old_logprobs=old)
        assert_close(loss, value, what)


def test_cispo_lower_bound_matches_verl_and_nemo_rl():
    """Default (verl / NeMo-RL): -A · sg(clamp(r, 1 - eps_low, cispo_max_ratio)) · lp;
    cispo_min_ratio=0 (TRL / Liger): no lower bound."""
    data = _peer_inputs()
    lp, old, mask, adv = data["lp"], data["old"], data["mask"], data["adv"][:, None]
    ratio = torch.exp(lp - old)
    assert (ratio < 0.8).any() and (ratio > 1.2).any()
    default = GRPOConfig(loss_type="cispo", cispo_max_ratio=1.2)  # epsilon_low = 0.2
    explicit = GRPOConfig(loss_type="cispo", cispo_min_ratio=0.8, cispo_max_ratio=1.2)
    one_sided = GRPOConfig(loss_type="cispo", cispo_min_ratio=0.0, cispo_max_ratio=1.2)
    for config, weight in ((default, ratio.clamp(0.8, 1.2)), (explicit, ratio.clamp(0.8, 1.2)),
                           (one_sided, ratio.clamp(max=1.2))):
        loss, grad = grad_of(lambda x: grpo_loss(x, data["adv"], mask, config, old_logprobs=old)[0], lp)
        expected, expected_grad = grad_of(lambda x: (-adv * weight * x * mask).sum() / mask.sum(), lp)
        assert_close(loss, expected, "cispo loss")
        assert_close(grad, expected_grad, "cispo grad")
    _, metrics = grpo_loss(lp, data["adv"], mask, default, old_logprobs=old)
    low = ((ratio < 0.8) * mask).sum() / mask.sum()
    assert_close(metrics["clip_ratio_low"], low, "clip_ratio_low")
    assert float(metrics["clip_ratio_low"]) > 0
    _, metrics = grpo_loss(lp, data["adv"], mask, one_sided, old_logprobs=old)
    assert float(metrics["clip_ratio_low"]) == 0


def test_grpo_without_empty_sequences_like_verl():
    data = _peer_inputs()
    config = GRPOConfig(loss_type="grpo", count_empty_sequences=False)
    loss, _ = grpo_loss(data["lp"], data["adv"], data["mask"], config, old_logprobs=data["old"])
    counted, _ = grpo_loss(data["lp"], data["adv"], data["mask"], GRPOConfig(loss_type="grpo"),
                           old_logprobs=data["old"])
    nonempty = int((data["mask"].sum(-1) > 0).sum())
    assert nonempty < data["mask"].shape[0]
    assert_close(loss, counted * data["mask"].shape[0] / nonempty, "rescaled by B / non-empty rows")


# ---- excluded tokens: a -inf log-prob masks its token ------------------------------------------------


def _with_impossible_tokens(seed=13):
    """A batch without garbage and the positions (all valid) where -inf will be written."""
    data = make_batch(seed=seed, garbage=False)
    valid = data["mask"] != 0
    picks = valid.nonzero()[torch.randperm(int(valid.sum()), generator=torch.Generator().manual_seed(seed))]
    return data, {"lp": picks[:3], "old": picks[3:5], "sampling": picks[5:7], "ref": picks[7:9]}


def _poison(tensor, positions):
    out = tensor.clone()
    out[positions[:, 0], positions[:, 1]] = -math.inf
    return out


def _masked_out(mask, *position_sets):
    out = mask.clone()
    for positions in position_sets:
        out[positions[:, 0], positions[:, 1]] = 0.0
    return out


EXCLUSION_GRPO = [
    dict(),
    dict(loss_type="grpo", beta=0.1, kl_estimator="k2"),
    dict(loss_type="sapo", is_correction="sequence_mask", is_clip_min=0.3, is_clip_max=3.0),
    dict(loss_type="cispo", is_correction="token_truncate", is_clip_max=1.2, beta=0.05),
    dict(loss_type="dr_grpo", max_completion_length=L, importance_sampling_level="sequence"),
    dict(loss_type="bnpo", importance_sampling_level="sequence", is_correction="sequence_truncate",
         is_clip_max=2.0, use_bias_correction_kl=True, beta=0.1),
]


@pytest.mark.parametrize("normalizer", [None, 30.0])
@pytest.mark.parametrize("cfg_kwargs", EXCLUSION_GRPO, ids=str)
def test_grpo_minus_inf_tokens_are_masked(cfg_kwargs, normalizer):
    """-inf policy / old / sampling log-probs: loss and gradient equal to the same batch with those
    tokens masked out; no NaN anywhere; the count is reported. (Reference -inf is kept: the KL
    clamps bound it.)"""
    data, at = _with_impossible_tokens()
    config = GRPOConfig(**cfg_kwargs)
    poisoned = dict(old_logprobs=_poison(data["old"], at["old"]),
                    sampling_logprobs=_poison(data["sampling"], at["sampling"]),
                    reference_logprobs=data["ref"], normalizer=normalizer)
    clean = dict(poisoned, old_logprobs=data["old"], sampling_logprobs=data["sampling"])
    lp_poisoned = _poison(data["lp"], at["lp"])
    mask_out = _masked_out(data["mask"], at["lp"], at["old"], at["sampling"])

    loss, grad = grad_of(lambda x: grpo_loss(x, data["adv"], data["mask"], config, **poisoned)[0], lp_poisoned)
    want, want_grad = grad_of(lambda x: grpo_loss(x, data["adv"], mask_out, config, **clean)[0], data["lp"])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert_close(loss, want, "loss")
    assert_close(grad, want_grad, "grad")
    _, metrics = grpo_loss(lp_poisoned, data["adv"], data["mask"], config, entropy=data["entropy"], **poisoned)
    _, want_metrics = grpo_loss(data["lp"], data["adv"], mask_out, config, entropy=data["entropy"], **clean)
    assert float(metrics.pop("num_excluded_tokens")) == 7 and float(want_metrics.pop("num_excluded_tokens")) == 0
    for name, value in want_metrics.items():
        assert torch.isfinite(metrics[name]), name
        assert_close(metrics[name], value, name)

    # old log-probs are ignored on-policy: their -inf excludes nothing then
    on_policy = dict(poisoned, old_logprobs=None)
    _, metrics = grpo_loss(lp_poisoned, data["adv"], data["mask"], config, **on_policy)
    assert float(metrics["num_excluded_tokens"]) == 5


def test_grpo_minus_inf_reference_is_not_excluded():
    """A -inf reference log-prob keeps its token: it acts like any very unlikely reference token,
    whose KL the default clamps bound (d -> -kl_input_clamp, k3 -> kl_output_clamp)."""
    data, at = _with_impossible_tokens()
    ref = _poison(data["ref"], at["ref"])
    very_unlikely = data["ref"].clone()
    very_unlikely[at["ref"][:, 0], at["ref"][:, 1]] = -1000.0
    config = GRPOConfig(beta=0.1, kl_estimator="k3")
    kw = dict(old_logprobs=data["old"])
    loss, grad = grad_of(lambda x: grpo_loss(x, data["adv"], data["mask"], config, reference_logprobs=ref,
                                             **kw)[0], data["lp"])
    want, want_grad = grad_of(lambda x: grpo_loss(x, data["adv"], data["mask"], config,
                                                  reference_logprobs=very_unlikely, **kw)[0], data["lp"])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert_close(loss, want, "loss")
    assert_close(grad, want_grad, "grad")
    _, metrics = grpo_loss(data["lp"], data["adv"], data["mask"], config, reference_logprobs=ref, **kw)
    assert float(metrics["num_excluded_tokens"]) == 0


@pytest.mark.parametrize("normalizer", [None, 17.0])
def test_nll_minus_inf_tokens_are_masked(normalizer):
    data, at = _with_impossible_tokens()
    lp = _poison(data["lp"], at["lp"])
    mask_out = _masked_out(data["mask"], at["lp"])
    loss, grad = grad_of(lambda x: nll_loss(x, data["mask"], normalizer=normalizer)[0], lp)
    want, want_grad = grad_of(lambda x: nll_loss(x, mask_out, normalizer=normalizer)[0], data["lp"])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert_close(loss, want, "loss")
    assert_close(grad, want_grad, "grad")
    _, metrics = nll_loss(lp, data["mask"], normalizer=normalizer)
    assert float(metrics["num_excluded_tokens"]) == 3
    assert_close(metrics["num_tokens"], mask_out.sum(), "num_tokens")


@pytest.mark.parametrize("kwargs", [dict(sft_weight=0.4), dict(average_log_probs=True, loss_type="ipo"),
                                    dict(loss_type="hinge", sft_weight=1.0, sft_normalizer=9.0)], ids=str)
def test_dpo_minus_inf_tokens_are_masked(kwargs):
    """A -inf policy or reference log-prob drops the token from both scores and the SFT term."""
    data, at = _with_impossible_tokens()
    lp, ref = _poison(data["lp"], at["lp"]), _poison(data["ref"], at["ref"])
    mask_out = _masked_out(data["mask"], at["lp"], at["ref"])
    loss, grad = grad_of(lambda x: dpo_loss(x, ref, data["mask"], **kwargs)[0], lp)
    want, want_grad = grad_of(lambda x: dpo_loss(x, data["ref"], mask_out, **kwargs)[0], data["lp"])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert_close(loss, want, "loss")
    assert_close(grad, want_grad, "grad")
    _, metrics = dpo_loss(lp, ref, data["mask"], **kwargs)
    _, want_metrics = dpo_loss(data["lp"], data["ref"], mask_out, **kwargs)
    assert float(metrics.pop("num_excluded_tokens")) == 5
    want_metrics.pop("num_excluded_tokens")
    for name, value in want_metrics.items():
        assert_close(metrics[name], value, name)


# ---- GRPO per-token terms (grpo.token_terms): the formulas on a traced graph -------------------------
#
# token_terms, the one definition of the GRPO per-token math with closed-form derivatives, against
# torch.autograd of the per-token formulas written with clamp / maximum / where (as grpo.py computed
# the loss before it had closed-form derivatives), with the policy log-prob and the ratio as
# independent leaves: their gradients are d/d lp at fixed r and d/d r. Every GRPO_CASES option at
# token and sequence level, on data with NaN / -inf garbage at masked positions; then bounds hit
# exactly and r == 1 on-policy, where torch's gradient conventions decide (clamp passes the gradient
# at its bounds, maximum splits it on ties).


def close_all(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14, msg=lambda m: f"{what}: {m}")


def traced_terms(cfg: GRPOConfig, lp, ratio, inputs: TokenInputs):
    """Per-token ``s·m·ℓ·ρ`` and ``s·m·kl`` as autograd sees the formulas, metric flags and the
    correction. ``lp`` and ``ratio`` are leaves; garbage at masked positions is cut off by where()
    before any arithmetic, as the loss did."""
    weights, scale, adv = inputs.weights, inputs.scale, inputs.advantages
    valid = weights != 0
    zero = torch.zeros_like(lp)
    safe_lp = torch.where(valid, lp, zero)
    flags = {}
    if cfg.loss_type == "cispo":
        low = cfg.cispo_lower_bound
        objective = -adv * ratio.clamp(min=low, max=cfg.cispo_max_ratio).detach() * safe_lp
        flags = {"clip_low": ratio < low, "clip_high": ratio > cfg.cispo_max_ratio}
    elif cfg.loss_type == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_temperature_pos),
                          torch.full_like(adv, cfg.sapo_temperature_neg))
        objective = -adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    else:
        low, high = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high
        unclipped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
        objective = torch.maximum(-adv * unclipped, -adv * ratio.clamp(low, high))
        flags = {"clip_low": (ratio < low) & (adv < 0), "clip_high": (ratio > high) & (adv > 0)}
        if cfg.dual_clip_c is not None:
            bound = -adv * cfg.dual_clip_c
            flags["dual_clip"] = (adv < 0) & (objective > bound)
            objective = torch.where(flags["dual_clip"], bound, objective)
    correction = None
    if inputs.sampling is not None and cfg.is_correction != "none":
        with torch.no_grad():
            old = lp.detach() if inputs.old is None else inputs.old
            if cfg.is_correction.startswith("sequence"):
                log_rho = inputs.sequence_log_rho.expand_as(lp)
            else:
                log_rho = torch.where(valid, old - inputs.sampling, zero)
            rho_raw = torch.exp(log_rho)
            lo, hi = cfg.is_clip_min, cfg.is_clip_max
            if cfg.is_correction.endswith("truncate"):
                rho = rho_raw.clamp(min=lo, max=hi)
            else:
                inside = torch.ones_like(valid)
                if lo is not None:
                    inside &= rho_raw >= lo
                if hi is not None:
                    inside &= rho_raw <= hi
                rho = torch.where(inside, rho_raw, zero)
        objective = objective * rho
        correction = (rho_raw, rho)
    pg = torch.where(valid, objective, zero) * weights * scale
    kl = None
    if cfg.beta > 0:
        d = torch.where(valid, inputs.reference - lp, zero)
        if cfg.kl_input_clamp is not None:
            d = d.clamp(-cfg.kl_input_clamp, cfg.kl_input_clamp)
        k = {"k1": lambda: -d, "k2": lambda: 0.5 * d * d, "k3": lambda: torch.exp(d) - 1.0 - d}[cfg.kl_estimator]()
        if cfg.kl_output_clamp is not None:
            k = k.clamp(-cfg.kl_output_clamp, cfg.kl_output_clamp)
        if cfg.use_bias_correction_kl:
            k = k * ratio
        kl = torch.where(valid, k, zero) * weights * scale
    return pg, kl, flags, correction


def check_against_traced(cfg: GRPOConfig, lp, inputs: TokenInputs, sequence_log_ratio=None):
    """token_terms vs the traced formulas: values, d/d lp, d/d r, the full token-level gradient,
    metric numerators and extremes, and exact zeros at masked positions."""
    valid = inputs.weights != 0
    with torch.no_grad():
        old = torch.where(valid, lp if inputs.old is None else inputs.old, torch.zeros_like(lp))
        if sequence_log_ratio is None:
            ratio = torch.exp(torch.where(valid, lp - old, torch.zeros_like(lp)))
        else:
            ratio = torch.exp(sequence_log_ratio).expand_as(lp).clone()
    lp_leaf, ratio_leaf = lp.clone().requires_grad_(), ratio.clone().requires_grad_()
    pg, kl, flags, correction = traced_terms(cfg, lp_leaf, ratio_leaf, inputs)
    total = pg if kl is None else pg + cfg.beta * kl
    d_lp, d_ratio = torch.autograd.grad(total.sum(), (lp_leaf, ratio_leaf), allow_unused=True)
    d_lp = torch.zeros_like(lp) if d_lp is None else d_lp
    d_ratio = torch.zeros_like(lp) if d_ratio is None else d_ratio

    terms = token_terms(cfg, lp, inputs.advantages, inputs.weights, inputs.scale, old=inputs.old,
                        reference=inputs.reference, sampling=inputs.sampling,
                        sequence_log_rho=inputs.sequence_log_rho, sequence_log_ratio=sequence_log_ratio)
    close_all(terms.ratio.expand_as(lp)[valid], ratio[valid], "ratio")
    close_all(terms.pg, pg.detach(), "pg")
    if cfg.beta > 0:
        close_all(terms.kl, kl.detach(), "kl")
    # (the traced graph's own gradients at masked positions may be NaN: 0·NaN garbage, cut off
    # further down by the where() on lp - old)
    close_all(terms.grad_logprob[valid], d_lp[valid], "d/d lp at fixed r")
    close_all(terms.grad_ratio[valid], d_ratio[valid], "d/d r")
    if sequence_log_ratio is None:  # r = exp(lp - old): the gradient of the loss on lp
        lp_leaf = lp.clone().requires_grad_()
        traced_ratio = torch.exp(torch.where(valid, lp_leaf - (lp_leaf.detach() if inputs.old is None else old),
                                             torch.zeros_like(lp)))
        pg, kl, _, _ = traced_terms(cfg, lp_leaf, traced_ratio, inputs)
        total = pg if kl is None else pg + cfg.beta * kl
        (full,) = torch.autograd.grad(total.sum(), lp_leaf)
        close_all(terms.grad_logprob + terms.grad_ratio * terms.ratio, full, "d/d lp through r")

    weights = inputs.weights
    expected = {"ratio_mean": weights * ratio}
    for name, flag in (("clip_ratio_low", "clip_low"), ("clip_ratio_high", "clip_high")):
        expected[name] = torch.where(flags[flag], weights, 0.0) if flag in flags else torch.zeros_like(lp)
    expected["clip_ratio"] = expected["clip_ratio_low"] + expected["clip_ratio_high"]
    if "dual_clip" in flags:
        expected["dual_clip_ratio"] = torch.where(flags["dual_clip"], weights, 0.0)
    if correction is not None:
        rho_raw, rho = correction
        expected["is_ratio_mean"] = weights * rho_raw
        expected["is_clip_ratio"] = torch.where(rho != rho_raw, weights, 0.0)
    if inputs.sampling is not None:
        old_value = lp if inputs.old is None else inputs.old
        expected["token_mult_prob_error"] = weights * torch.exp(
            torch.where(valid, inputs.sampling - old_value, torch.zeros_like(lp)).abs())
    assert list(terms.numerators) == list(grpo.metric_sum_names(cfg, inputs.sampling is not None))[
        1 + (cfg.beta > 0):]
    assert set(terms.numerators) == set(expected)
    for name, value in expected.items():
        close_all(terms.numerators[name].expand_as(lp)[valid], value[valid], name)
    ratio_values = {"ratio": ratio}
    if correction is not None:
        ratio_values["is_ratio"] = correction[0]
    assert list(terms.extremes) == list(grpo.extreme_names(cfg, inputs.sampling is not None))
    for name, value in ratio_values.items():
        close_all(terms.extremes[f"{name}_max"][valid], value[valid], f"{name}_max")
        close_all(terms.extremes[f"{name}_min"][valid], -value[valid], f"{name}_min")

    # masked and excluded tokens: exactly zero, whatever garbage they hold; finite everywhere
    per_token = [terms.pg, terms.grad_logprob, terms.grad_ratio, *terms.numerators.values()]
    per_token += [terms.kl] if terms.kl is not None else []
    for value in per_token:
        value = value.expand_as(lp)
        assert torch.isfinite(value).all() and (value[~valid] == 0).all()
    for name, value in terms.extremes.items():
        masked = value.expand_as(lp)[~valid]
        assert (masked == (0 if name == "any" else -math.inf)).all(), name
    return terms


# ---- GRPO per-token terms: every option, on garbage-laden data -------------------------------------


def token_inputs_of(data, cfg: GRPOConfig, flags, seed=0) -> TokenInputs:
    """TokenInputs of a test_losses case: its optional inputs, a positive normalization weight per
    sequence, a sequence correction; NaN wherever a token is masked (or its sequence empty)."""
    gen = torch.Generator().manual_seed(seed)
    lp, mask = data["lp"], data["mask"]
    valid = mask != 0
    weights = torch.where((lp == -math.inf) & valid, torch.zeros_like(mask), mask)  # excluded tokens
    adv = data["adv"] if data["adv"].dim() == 2 else data["adv"][:, None].expand_as(lp).clone()
    adv = adv.masked_fill(~valid, math.nan)
    sequence_log_rho = 0.3 * torch.randn(lp.shape[0], 1, generator=gen, dtype=F64)
    sequence_log_rho[~valid.any(-1)] = math.nan
    on_policy = not flags.get("old", True) or cfg.force_on_policy_ratio
    return TokenInputs(
        advantages=adv, weights=weights, scale=0.5 + torch.rand(lp.shape[0], 1, generator=gen, dtype=F64),
        old=None if on_policy else data["old"], reference=data["ref"] if cfg.beta > 0 else None,
        sampling=data["sampling"] if flags.get("sampling") else None,
        sequence_log_rho=sequence_log_rho if cfg.is_correction.startswith("sequence") else None)


@pytest.mark.parametrize("advantages", ["seq", "token"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_token_terms_match_traced_formulas(case, level, advantages):
    cfg_kwargs, flags = GRPO_CASES[case]
    cfg = GRPOConfig(importance_sampling_level=level, **cfg_kwargs)
    data = make_batch(seed=7, token_advantages=advantages == "token", float_mask=advantages == "token")
    lp = data["lp"]
    lp[0, 0] = -math.inf  # an excluded token (a -inf policy log-prob under a mask)
    inputs = token_inputs_of(data, cfg, flags)
    sequence_log_ratio = None
    if level == "sequence":
        sequence_log_ratio = 0.4 * torch.randn(lp.shape[0], 1, generator=torch.Generator().manual_seed(3), dtype=F64)
    check_against_traced(cfg, lp, inputs, sequence_log_ratio)


# ---- GRPO per-token terms: bounds hit exactly ---------------------------------------------------------


def _boundary_data():
    data = make_batch(seed=23)
    data["adv"][1] = 0.0  # a sequence without advantage: every PPO branch ties
    valid = data["mask"] != 0
    zero = torch.zeros_like(data["lp"])
    ratio = torch.exp(torch.where(valid, data["lp"] - data["old"], zero))
    rho = torch.exp(torch.where(valid, data["old"] - data["sampling"], zero))
    d = torch.where(valid, data["ref"] - data["lp"], zero)
    adv = data["adv"][:, None].expand_as(ratio)
    return data, valid, ratio, rho, d, adv


def _pick(values, where, largest=False):
    """A value of `values` at a position where `where` holds: the boundary some token hits."""
    chosen = values[where]
    assert chosen.numel() > 0
    return float(chosen.max() if largest else chosen.min())


def boundary_configs():
    """Configs whose bounds are values the fixture's tokens take exactly (1 + (r - 1) == r in
    float64 for r in [1, 2], 1 - (1 - r) == r for r in [1/2, 1])."""
    data, valid, ratio, rho, d, adv = _boundary_data()
    above = valid & (ratio > 1.05) & (ratio < 1.6)
    below = valid & (ratio < 0.95) & (ratio > 0.55)
    high, low = _pick(ratio, above), _pick(ratio, below, largest=True)
    eps = dict(epsilon_high=high - 1.0, epsilon_low=1.0 - low)
    dual = _pick(ratio, valid & (adv < 0) & (ratio > 1.0) & (ratio <= high))
    return {
        "clip_bounds": dict(**eps),
        "delta_at_a_ratio": dict(epsilon_high=0.02, delta=_pick(ratio, valid & (ratio > 1.1), largest=True)),
        "dual_clip_at_the_objective": dict(**eps, dual_clip_c=dual),
        "cispo_bounds": dict(loss_type="cispo", cispo_min_ratio=low, cispo_max_ratio=high),
        "is_truncate_bounds": dict(is_correction="token_truncate", is_clip_min=_pick(rho, valid & (rho < 0.95), True),
                                   is_clip_max=_pick(rho, valid & (rho > 1.05))),
        "is_mask_bounds": dict(is_correction="token_mask", is_clip_min=_pick(rho, valid & (rho < 0.95), True),
                               is_clip_max=_pick(rho, valid & (rho > 1.05))),
        "kl_input_clamp_at_d": dict(beta=0.3, kl_estimator="k3",
                                    kl_input_clamp=_pick(d.abs(), valid & (d.abs() > 0.2))),
        "kl_output_clamp_at_k1": dict(beta=0.3, kl_estimator="k1", kl_input_clamp=None,
                                      kl_output_clamp=_pick(d.abs(), valid & (d.abs() > 0.2))),
        "kl_bias_corrected_clamps": dict(beta=0.3, kl_estimator="k2", use_bias_correction_kl=True,
                                         kl_input_clamp=_pick(d.abs(), valid & (d.abs() > 0.3)), kl_output_clamp=0.02),
    }


BOUNDARY = boundary_configs()


@pytest.mark.parametrize("on_policy", [False, True], ids=["off_policy", "on_policy_r_is_1"])
@pytest.mark.parametrize("case", list(BOUNDARY))
def test_token_terms_at_exact_boundaries(case, on_policy):
    data, valid, ratio, rho, d, adv = _boundary_data()
    cfg = GRPOConfig(**BOUNDARY[case])
    flags = dict(old=not on_policy, sampling=cfg.is_correction != "none")
    inputs = token_inputs_of(data, cfg, flags)
    if not on_policy:  # the fixture does hit the bound
        hits = {"clip_bounds": [ratio == 1 + cfg.epsilon_high, ratio == 1 - cfg.epsilon_low],
                "delta_at_a_ratio": [ratio == (cfg.delta or 0)], "dual_clip_at_the_objective": [
                    (ratio == (cfg.dual_clip_c or 0)) & (adv < 0)],
                "cispo_bounds": [ratio == cfg.cispo_max_ratio, ratio == cfg.cispo_lower_bound],
                "is_truncate_bounds": [rho == cfg.is_clip_max, rho == cfg.is_clip_min],
                "is_mask_bounds": [rho == cfg.is_clip_max, rho == cfg.is_clip_min],
                "kl_input_clamp_at_d": [d.abs() == cfg.kl_input_clamp],
                "kl_output_clamp_at_k1": [d.abs() == cfg.kl_output_clamp],
                "kl_bias_corrected_clamps": [d.abs() == cfg.kl_input_clamp]}[case]
        for hit in hits:
            assert (hit & valid).any()
    terms = check_against_traced(cfg, data["lp"], inputs)
    if on_policy:
        assert (terms.ratio[valid] == 1).all()


def test_on_policy_ties_split_the_gradient_like_torch_maximum():
    """At r == 1 both PPO branches are -A: torch.maximum gives each half the gradient and the
    clamp passes its half (1 - eps_low <= 1 <= 1 + eps_high), so d/dr = -A, as without clipping."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    adv = torch.tensor([[0.7, -1.3, 0.0]], dtype=F64)
    weights, scale = torch.ones_like(lp), torch.full((), 0.25, dtype=F64)
    for delta in (None, 1.3):
        terms = token_terms(GRPOConfig(delta=delta, epsilon_high=0.0, epsilon_low=0.0), lp, adv, weights, scale)
        close_all(terms.grad_ratio, -adv * scale, f"d/dr on-policy, delta={delta}")
        close_all(terms.pg, -adv * scale, "value")


# ---- GRPO: the loss without a traced graph -------------------------------------------------------


@pytest.mark.parametrize("cfg_kwargs", [dict(), dict(loss_type="grpo", beta=0.1, delta=1.5, dual_clip_c=2.0,
                                                     is_correction="token_truncate", is_clip_max=1.2)], ids=str)
def test_grpo_loss_backward_is_one_node(cfg_kwargs):
    """The backward multiplies closed-form per-token derivatives: the loss hangs off the log-probs
    through one node, not a graph of the elementwise ops (before: 12 nodes for dapo, 32 with KL,
    delta, dual clip and a correction)."""
    data = make_batch(seed=7)
    lp = data["lp"].clone().requires_grad_()
    loss, _ = grpo_loss(lp, data["adv"], data["mask"], GRPOConfig(**cfg_kwargs), old_logprobs=data["old"],
                        reference_logprobs=data["ref"], sampling_logprobs=data["sampling"])
    assert len(autograd_nodes(loss)) <= 3


# ---- GRPO: the compiled evaluation (CUDA; here on CPU through inductor's C++ backend) ------------------


EVERY_OPTION = dict(loss_type="dapo", delta=1.5, dual_clip_c=3.0, beta=0.1, kl_estimator="k3",
                    use_bias_correction_kl=True, is_correction="token_truncate", is_clip_max=1.2)


def _fused_and_log_prob_losses(data, cfg_kwargs=EVERY_OPTION, chunk_size=7):
    """(grpo_loss, linear_grpo_loss) values, gradients and metrics of one config (chunk_size None:
    one chunk, linear_grpo_loss's whole-call function)."""
    cfg = GRPOConfig(**cfg_kwargs)
    kw = dict(old_logprobs=data["old"], reference_logprobs=data["ref"], sampling_logprobs=data["sampling"])
    lp = data["lp"].clone().requires_grad_()
    loss, metrics = grpo_loss(lp, data["adv"], data["mask"], cfg, **kw)
    loss.backward()
    gen = torch.Generator().manual_seed(1)
    batch, length = data["mask"].shape
    device = data["mask"].device
    hidden = torch.randn(batch, length, 8, generator=gen).to(device).requires_grad_()
    weight = torch.randn(19, 8, generator=gen).to(device)
    labels = torch.randint(0, 19, (batch, length), generator=gen).to(device)
    kw32 = {k: v.float() for k, v in kw.items()}  # NaN at masked positions
    fused, fused_metrics = linear_grpo_loss(hidden, weight, labels, data["adv"].float(), data["mask"].float(), cfg,
                                            chunk_size=chunk_size, **kw32)
    fused.backward()
    return [loss.detach(), lp.grad, *metrics.values(), fused.detach(), hidden.grad, *fused_metrics.values()]


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("chunk_size", [7, None], ids=["chunks", "one_chunk"])
def test_compiled_evaluation_equals_eager(monkeypatch, chunk_size):
    """One kernel per config: two configs that differ only in their numbers must not share one
    (torch leaves Python floats symbolic by default, and its graph cache then did). Several
    chunks: the table, each chunk's terms and the metrics compiled apart; one chunk: as one
    function (the whole call's)."""
    data = make_batch(seed=7)
    configs = [EVERY_OPTION, dict(EVERY_OPTION, epsilon_low=0.1, epsilon_high=0.28, delta=1.25, beta=0.3)]
    monkeypatch.setattr(grpo, "FUSE_ON_CPU", False)
    eager = [_fused_and_log_prob_losses(data, cfg_kwargs, chunk_size) for cfg_kwargs in configs]
    monkeypatch.setattr(grpo, "FUSE_ON_CPU", True)
    monkeypatch.setattr(grpo, "_compiled_functions", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compilation failure would warn
        compiled = [_fused_and_log_prob_losses(data, cfg_kwargs, chunk_size) for cfg_kwargs in configs]
    compiled_terms = {k: v for k, v in grpo._compiled_functions.items() if k[0] == "reduce_token_terms"}
    assert len(compiled_terms) == 2 and all(grpo._compiled_functions.values())
    linear_functions = {k[0] for k in grpo._compiled_functions if k[0] != "reduce_token_terms"}
    assert linear_functions == ({"_whole_call_terms"} if chunk_size is None
                                else {"_token_table", "_chunk_terms", "_metrics"}), linear_functions
    assert not torch.equal(eager[0][0], eager[1][0])
    for compiled_values, eager_values in zip(compiled, eager):
        for a, b in zip(compiled_values, eager_values):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_failed_compilation_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    data = make_batch(seed=7)
    monkeypatch.setattr(grpo, "FUSE_ON_CPU", False)
    eager = _fused_and_log_prob_losses(data)
    monkeypatch.setattr(grpo, "FUSE_ON_CPU", True)
    monkeypatch.setattr(grpo, "_compiled_functions", {})
    monkeypatch.setattr(grpo, "_warned_compile_failure", False)
    monkeypatch.setattr(grpo.torch, "compile", broken_compile)
    with pytest.warns(RuntimeWarning, match="no compiler here") as caught:
        fallback = _fused_and_log_prob_losses(data)
        fallback_again = _fused_and_log_prob_losses(data)
    assert len([w for w in caught if "grpo: compiling" in str(w.message)]) == 1
    for a, b, c in zip(fallback, fallback_again, eager):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, c, rtol=0, atol=0)


@pytest.mark.parametrize("error, capturing", [
    (torch.OutOfMemoryError("CUDA out of memory"), False),
    (RuntimeError("called a synchronizing CUDA operation"), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (RuntimeError("an error of any kind"), True),
], ids=["out of memory", "sync debug mode", "CUDA error", "while capturing"])
def test_compiled_terms_failing_outside_the_compiler_raise_and_keep_compiling(monkeypatch, error, capturing):
    """A compiled evaluation running out of memory, meeting a CUDA error or a synchronizing call
    under the sync debug mode's "error", or failing while a CUDA graph is captured raises to the
    caller: none is a compiler failure (grpo.compiler_failure), so its key is not sent to the eager
    definition for the rest of the process."""
    def failing(*args):
        raise error

    data = make_batch(seed=7)
    monkeypatch.setattr(grpo, "FUSE_ON_CPU", True)
    monkeypatch.setattr(grpo, "_compiled_functions", {})
    monkeypatch.setattr(grpo.torch, "compile", lambda fn, **kwargs: failing)
    if capturing:
        for name in ("is_available", "is_initialized", "is_current_stream_capturing"):
            monkeypatch.setattr(torch.cuda, name, lambda: True)
    with pytest.raises(type(error), match=re.escape(str(error))):
        _fused_and_log_prob_losses(data)
    assert grpo._compiled_functions and None not in grpo._compiled_functions.values()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk_size", [7, None], ids=["chunks", "one_chunk"])
def test_cuda_compiled_terms_equal_eager_and_make_no_host_sync(monkeypatch, chunk_size):
    data = {name: value.cuda() for name, value in make_batch(seed=7).items()}
    monkeypatch.setattr(grpo, "FUSE_ON_CUDA", False)
    eager = _fused_and_log_prob_losses(data, chunk_size=chunk_size)
    monkeypatch.setattr(grpo, "FUSE_ON_CUDA", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compilation failure would warn
        _fused_and_log_prob_losses(data, chunk_size=chunk_size)  # compiles
        token_grads, finish = GRPOGrads.token_grads, GRPOGrads.metrics

        def strict(method):
            def run(*args, **kwargs):
                torch.cuda.set_sync_debug_mode("error")  # a host sync raises
                try:
                    return method(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            return run

        monkeypatch.setattr(GRPOGrads, "token_grads", strict(token_grads))
        monkeypatch.setattr(GRPOGrads, "metrics", strict(finish))
        compiled = _fused_and_log_prob_losses(data, chunk_size=chunk_size)
    assert grpo._compiled_functions and all(grpo._compiled_functions.values())
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(GRPO_CASES))
def test_token_table_names_known_before_the_inputs(name):
    """linear_grpo_loss's compiled table returns tensors only: the names of its rows are derived
    from the arguments beforehand, and must be what token_inputs fills."""
    from megatron_fused_ce.losses import linear_grpo
    from megatron_fused_ce.losses.grpo import token_inputs

    cfg = GRPOConfig(**GRPO_CASES[name][0])
    like = torch.zeros(2, 3)
    for old, reference, sampling in ((like - 1, like - 2, like - 0.5), (None, like - 2, None), (like - 1, None, like)):
        if cfg.beta > 0 and reference is None:
            continue
        inputs, _ = token_inputs(torch.ones(2), torch.ones(2, 3), cfg, like=like, old_logprobs=old,
                                 reference_logprobs=reference, sampling_logprobs=sampling)
        assert linear_grpo._input_names(cfg, old, reference, sampling) == inputs.present(), (name, old is None)


# ---- half-precision log-probs: the losses' sums in fp32 ----------------------------------------------


def test_half_precision_logprobs_are_summed_in_fp32():
    """bf16 log-probs (a log_softmax of materialized bf16 logits) give the losses of their values
    summed in float64, to fp32 accuracy: summed in bf16, a sequence's score near -1000 moved in
    steps of 4, and DPO's margin (two such sums' difference) came out 0 for -0.022 (the loss at
    log 2, no preference signal); their gradients come back in bf16."""
    g = torch.Generator().manual_seed(3)
    batch, length = 4, 1024
    lp = (-torch.rand(batch, length, generator=g, dtype=F64) * 2).bfloat16()
    reference = (lp.double() + torch.randn(batch, length, generator=g, dtype=F64) * 0.01).float()
    mask = torch.ones(batch, length)
    scores, reference_scores = lp.double().sum(-1), reference.double().sum(-1)
    margin = (scores[0::2] - reference_scores[0::2]) - (scores[1::2] - reference_scores[1::2])
    expected = {
        "dpo": (-torch.nn.functional.logsigmoid(0.1 * margin)).mean(),
        "nll": -lp.double().sum() / mask.sum(),
        "grpo": -(torch.exp(lp.double() - reference.double()) * 0.5).mean(),  # dapo, A = 0.5, old = reference
    }
    calls = {
        "dpo": lambda x: dpo_loss(x, reference, mask, beta=0.1),
        "nll": lambda x: nll_loss(x, mask),
        "grpo": lambda x: grpo_loss(x, torch.full((batch,), 0.5), mask, GRPOConfig(loss_type="dapo"),
                                    old_logprobs=reference),
    }
    for name, call in calls.items():
        x = lp.clone().requires_grad_()
        loss, metrics = call(x)
        loss.backward()
        assert x.grad.dtype == torch.bfloat16, name
        torch.testing.assert_close(loss.double(), expected[name], rtol=2e-6, atol=0, msg=name)
        if name == "dpo":
            torch.testing.assert_close(metrics["reward_margin"].double(), 0.1 * margin.mean(), rtol=1e-4, atol=0)
