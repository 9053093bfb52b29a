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
from losses_cp_cases import (
    CASES,
    F64,
    FUSED_CONFIGS,
    LOGPROB_ARGS,
    V_LOCAL,
    fused_inputs,
    fused_reference,
    make_data,
    positions,
    run_case,
    slice_positions,
)
from megatron_fused_ce.losses import GRPOConfig, dpo_loss, grpo_loss, nll_loss
from megatron_fused_ce.losses.linear_grpo import linear_grpo_loss


def _cp_worker(rank, world, layout):
    data = slice_positions(make_data(), positions(layout, world, rank))
    return {name: run_case(name, data, dist.group.WORLD) for name in CASES}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["balanced", "arbitrary"])
def test_losses_under_context_parallelism_equal_cp1(cp, layout):
    data = make_data()
    expected = {name: run_case(name, data) for name in CASES}
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
    data = slice_positions(make_data(), positions("balanced", world, rank))
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
    hidden, weight, labels, mask, adv, others = fused_inputs(tp)
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
            **{LOGPROB_ARGS[k]: others[k] for k in needs})
        (2.5 * loss).backward()
        results[name] = (loss.detach(), {k: v.detach() for k, v in metrics.items()}, h.grad, w.grad)
    return results


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_linear_grpo_under_context_parallelism_equals_cp1(tp, sequence_parallel):
    cp = 2
    results = run_workers(_fused_worker, tp * cp, tp, sequence_parallel)
    for name in FUSED_CONFIGS:
        loss, metrics, dx, dw = fused_reference(name, tp)
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
