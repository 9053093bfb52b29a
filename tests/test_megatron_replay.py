"""Sampling-distribution replay through the Megatron integration (CPU, gloo, fp32 GPTModel): the
engine's kept sets (`sampling_mask`, the `[b, s]` layout of `build_sampling_mask`) given to
`LogprobsPostProcessor`, `compute_logprobs`, `grpo_loss_func` and `FusedOutputProcessor`.

* TP = 2 (tied), TP = 2 + SP: fused (the op on hidden states, the mask reordered to its `[s, b]`
  labels under SP) == unfused (the logits, `kept_columns`) == the op in one process on the same
  hidden states and mask == the float64 dense reference; positions without a set == the plain
  softmax.
* CP = 2 (megatron's load-balanced slices, and a packed THD row cut by `cu_seqlens_padded`): each
  rank cuts its positions out of the whole-sequence mask; log-probs (gathered), GRPO metrics and
  every gradient equal CP = 1's, fused and unfused.
* grpo_loss_func with a mask through Megatron's schedule at DP = 2, fused (linear_grpo_loss'
  recompute path) and unfused: the loss equals float64 `grpo_loss` on the float64 replayed
  log-probs of all rows in one process, the gradients the one-process fp32 ones; tokens outside
  their set are excluded and left out of Megatron's count.
* Bad masks raise the same ValueError on every rank (TP = 2 + SP, fused and unfused; CP = 2).
* The example: `examples/grpo.py sampling.replay=true` at TP = 2 x PP = 2 (fused vs unfused on the
  first rollout) and CP = 2; the rollout sampler's kept sets; the config switch (refused without
  fidelity or without a filter that cuts a token).
* megatron-core >= 0.18: `FusedOutputProcessor(returns="logprobs")` with
  `output_processor_context={"sampling_mask": ...}` and the processor as the loss funcs' post-
  processor (skipped on 0.16).

Tolerances as in test_megatron_sampling / test_megatron_cp: 1e-5 (fp32 against float64, or two
summation orders).
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

import megatron_harness as common
from dist import run_workers
from megatron_harness import MBS, SEQ, TRUE_VOCAB, Setup

from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, grpo_loss
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    compat,
    compute_logprobs,
    context_parallel_group,
    grpo_loss_func,
    install_fused_output_layer,
    local_sampling_mask,
    output_weight,
    uninstall_fused_output_layer,
)
from megatron_fused_ce.ops.replay import SamplingMask, build_sampling_mask

ATOL = 1e-5
RTOL = 1e-5
GRAD_RTOL = 1e-4
FUSED = FusedCEConfig(enabled=True, chunk_size=8)
START = 3  # the "prompt": labels before it carry no set (the engine generated the rest)
CONFIG = GRPOConfig(loss_type="dapo", beta=0.1, is_correction="token_truncate", is_clip_max=1.1)


# ------------------------------------------------------------------------------------------------
# Engine-like masks
# ------------------------------------------------------------------------------------------------
class EngineMask:
    """vLLM's per-request SamplingMask: lists, attributes `token_ids` / `offsets`."""

    def __init__(self, token_ids, offsets):
        self.token_ids, self.offsets = token_ids, offsets


def request_mask(labels_row: torch.Tensor, seed: int, start: int = START):
    """One request's kept sets over its generated tokens (labels_row[start:]): a quarter empty (no
    truncation), the others 1-12 ids of the true vocab holding the label three times in four.
    Returns (EngineMask, dense keep [len(labels_row), TRUE_VOCAB], all True where empty)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.ones(labels_row.numel(), TRUE_VOCAB, dtype=torch.bool)
    ids, offsets = [], [0]
    for t in range(start, labels_row.numel()):
        if torch.rand((), generator=g) < 0.25:
            offsets.append(offsets[-1])
            continue
        size = int(torch.randint(1, 13, (), generator=g))
        chosen = torch.randperm(TRUE_VOCAB, generator=g)[:size]
        label = int(labels_row[t])
        if 0 <= label < TRUE_VOCAB and torch.rand((), generator=g) < 0.75 and label not in chosen.tolist():
            chosen[0] = label
        keep[t] = False
        keep[t, chosen] = True
        ids += chosen.tolist()
        offsets.append(len(ids))
    return EngineMask(ids, offsets), keep


def batch_mask(labels: torch.Tensor, seed: int, start: int = START):
    """The mask of `labels` [b, s] from per-request masks (build_sampling_mask) and the dense keep
    [b * s, TRUE_VOCAB]; request i of the batch is seeded seed * 1000 + i."""
    requests, keeps = [], []
    for row in range(labels.shape[0]):
        mask, keep = request_mask(labels[row], seed * 1000 + row, start)
        requests.append((row, start, mask))
        keeps.append(keep)
    return build_sampling_mask(requests, tuple(labels.shape)), torch.cat(keeps)


def replayed_reference(z: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor):
    """float64 log q(label) and entropy of q per row of z [N, V] over each row's kept ids (-inf
    where the label is not kept; 0 at ignored labels)."""
    z = z.double().masked_fill(~keep, float("-inf"))
    logq = torch.log_softmax(z, dim=-1)
    scored = labels != -100
    lp = logq.gather(1, labels.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    q = logq.exp()
    entropy = -(q * logq.masked_fill(~keep, 0.0)).sum(-1)
    return torch.where(scored, lp, 0.0), torch.where(scored, entropy, 0.0)


def _gather(tensor, dim, group):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# ------------------------------------------------------------------------------------------------
# The post-processor at TP = 2 (+ SP): fused == unfused == float64
# ------------------------------------------------------------------------------------------------
def postprocess_worker(rank, world, setup: Setup, temperature: float):
    from megatron.core import parallel_state

    (model,) = common.build(setup)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    batch = common.make_batches("sft", 1, seed=7)[0]
    labels = batch["labels"].clone()
    labels[0, 5] = -100  # an ignored position with a set: log-prob and entropy 0
    mask, keep = batch_mask(labels, seed=3)
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB, temperature=temperature, return_entropy=True)
    out = {}
    with torch.no_grad():
        for mode in ("unfused", "fused"):
            if mode == "fused":
                install_fused_output_layer(model, FUSED)
            output = common.forward_fn(model, batch)
            out[mode] = post(output, model, labels, sampling_mask=mask)
            out[mode + "_plain"] = post(output, model, labels)
        hidden = _gather(output, 1, tp_group) if setup.sp else output
        weight = _gather(output_weight(model), 0, tp_group)
    z = (hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().t())[:, :TRUE_VOCAB] / temperature
    lp, ent = (t.reshape(labels.shape) for t in replayed_reference(z, labels.reshape(-1), keep))
    finite = torch.isfinite(lp)
    report = {"excluded": int((~finite).sum()), "logprobs": out["fused"].logprobs}
    has_set = ~keep.all(-1).reshape(labels.shape)
    for mode in ("unfused", "fused"):
        got = out[mode]
        report[mode] = dict(
            finite_ok=torch.equal(torch.isfinite(got.logprobs), finite),
            lp_err=(got.logprobs[finite].double() - lp[finite]).abs().max().item(),
            ent_err=(got.entropy.double() - ent).abs().max().item(),
            # positions without a set: the plain softmax (fused: other chunks, the same sums)
            plain_equal=(got.logprobs[~has_set] - out[mode + "_plain"].logprobs[~has_set]).abs().max() <= 1e-6,
            changed=bool((got.logprobs[has_set] != out[mode + "_plain"].logprobs[has_set]).any()))
    report["fused_vs_unfused"] = (out["fused"].logprobs[finite] - out["unfused"].logprobs[finite]).abs().max().item()
    # the op itself on the whole hidden states and weight, one process, the batch's mask as given
    with torch.no_grad():
        op = linear_logprobs(hidden, weight, labels, vocab_size=TRUE_VOCAB, temperature=temperature,
                             return_entropy=True, sampling_mask=mask, impl="torch")
    report["op_finite_ok"] = torch.equal(torch.isfinite(op.logprobs), finite)
    report["op_err"] = max((out[mode].logprobs[finite] - op.logprobs[finite]).abs().max().item()
                           for mode in ("unfused", "fused"))
    return report


@pytest.mark.parametrize("setup,temperature", [(Setup(tp=2, tied=True), 0.7), (Setup(tp=2, sp=True), 1.3)],
                         ids=["tp2-tied", "tp2-sp"])
def test_post_processor_replays_the_mask(setup, temperature):
    results = run_workers(postprocess_worker, setup.world, setup, temperature)
    for report in results:
        assert report["excluded"] > 0  # some labels are outside their sets
        for mode in ("unfused", "fused"):
            entry = report[mode]
            assert entry["finite_ok"], (mode, entry)
            assert entry["lp_err"] <= ATOL and entry["ent_err"] <= ATOL, (mode, entry)
            assert entry["plain_equal"] and entry["changed"], (mode, entry)
        assert report["fused_vs_unfused"] <= ATOL
        assert report["op_finite_ok"] and report["op_err"] <= ATOL, report["op_err"]
    assert torch.equal(results[0]["logprobs"], results[1]["logprobs"])  # the same on both TP ranks


def test_local_sampling_mask_orders_and_slices():
    """The SP order ([s, b]) of a batch's mask, against the dense keep matrix; the length the
    labels ask for in the error."""
    labels = torch.randint(0, TRUE_VOCAB, (2, 8))
    mask, keep = batch_mask(labels, seed=1, start=0)
    dense = keep.view(2, 8, TRUE_VOCAB)

    def as_dense(local, rows):
        out = torch.ones(rows, TRUE_VOCAB, dtype=torch.bool)
        for i in range(rows):
            ids = local.token_ids[local.offsets[i]:local.offsets[i + 1]]
            if ids.numel():
                out[i] = False
                out[i, ids] = True
        return out

    sp = local_sampling_mask(mask, (2, 8), sequence_first=True)
    assert torch.equal(as_dense(sp, 16), dense.transpose(0, 1).reshape(16, TRUE_VOCAB))
    with pytest.raises(ValueError, match="offsets has 17 entries, but the labels have 2 rows x 16"):
        local_sampling_mask(mask, (2, 16))


# ------------------------------------------------------------------------------------------------
# CP = 2: each rank cuts its positions out of the whole-sequence mask
# ------------------------------------------------------------------------------------------------
def cp_worker(rank, world, setup: Setup):
    from megatron.core import parallel_state as ps

    from megatron_cp_workers import packed_batch, packed_forward, reduce_metrics

    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
    whole = common.make_batches("grpo", 2, seed=100)
    masks = [batch_mask(b["labels"], seed=i)[0] for i, b in enumerate(whole)]
    batches = common.cp_batches(whole)
    packed = [packed_batch(seed) for seed in range(2)] if not setup.sp else []  # (THD: without SP)
    packed_masks = [batch_mask(b["labels"], seed=10 + i, start=0)[0] for i, b in enumerate(packed)]
    packed = common.cp_batches(packed)
    report = {"coords": (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                         ps.get_data_parallel_rank()), "cp_rank": ps.get_context_parallel_rank(),
              "last": ps.is_pipeline_last_stage()}
    kw = dict(seq_length=SEQ, micro_batch_size=MBS)
    for mode in ("unfused", "fused"):
        (install_fused_output_layer if mode == "fused" else uninstall_fused_output_layer)(
            chunks, *((fused,) if mode == "fused" else ()))
        replayed = [o.logprobs for o in compute_logprobs(chunks, batches, common.forward_fn, post,
                                                          sampling_mask=masks, **kw)]
        plain = [o.logprobs for o in compute_logprobs(chunks, batches, common.forward_fn, post, **kw)]
        gathered = [o.logprobs for o in compute_logprobs(chunks, batches, common.forward_fn, post,
                                                          sampling_mask=masks, layout="gathered", **kw)]
        packed_gathered = [o.logprobs for o in compute_logprobs(
            chunks, packed, packed_forward, post, sampling_mask=packed_masks, layout="gathered",
            seq_length=SEQ, micro_batch_size=1)] if packed else []

        def make(chunk, batch, index):
            noise = batch["noise"] * (batch["loss_mask"] != 0)
            return grpo_loss_func(post, chunk, batch["labels"], batch["loss_mask"], batch["advantages"], CONFIG,
                                  old_logprobs=replayed[index] + noise, reference_logprobs=plain[index] - noise,
                                  sampling_logprobs=replayed[index] + 0.5 * noise, sampling_mask=masks[index])

        metrics = common.run_step(chunks, batches, make)
        report[mode] = {"gathered": gathered, "packed": packed_gathered, "grads": common.grads(chunks),
                        "metrics": reduce_metrics(metrics) if report["last"] else None}
    assert (1 if context_parallel_group() is None else dist.get_world_size(context_parallel_group())) == setup.cp
    return report


def _finite_close(a, b, tol):
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite)
    return (a[finite] - b[finite]).abs().max().item() <= tol * max(1.0, b[finite].abs().max().item())


@pytest.mark.parametrize("setup", [Setup(cp=2), Setup(tp=2, cp=2, sp=True, tied=True)], ids=str)
def test_context_parallel_replay_equals_cp1(setup):
    reference_setup = Setup(tp=setup.tp, sp=setup.sp, tied=setup.tied, gathered_attention=True)
    reference = {r["coords"]: r for r in run_workers(cp_worker, reference_setup.world, reference_setup,
                                                      timeout=240)}
    results = run_workers(cp_worker, setup.world, setup, timeout=240)
    ref_last = [r for r in reference.values() if r["last"]]
    assert all(r["unfused"]["metrics"]["num_excluded_tokens"] > 0 for r in ref_last)
    assert setup.sp or any(bool(torch.isinf(lp).any()) for r in ref_last for lp in r["unfused"]["packed"])
    for result in results:
        want = reference[result["coords"]]["unfused"]
        for mode in ("unfused", "fused"):
            got = result[mode]
            for a, b in zip(got["gathered"] + got["packed"], want["gathered"] + want["packed"]):
                assert _finite_close(a, b, RTOL), (mode, result["cp_rank"])
            for name, grad in want["grads"].items():
                assert common.max_rel_diff(got["grads"][name], grad) <= GRAD_RTOL, (mode, name)
            if result["last"]:
                for name, value in want["metrics"].items():
                    assert abs(got["metrics"][name] - value) <= RTOL * max(abs(value), 1.0), (mode, name)


# ------------------------------------------------------------------------------------------------
# grpo_loss_func with a mask: Megatron's schedule at DP = 2 == one process == float64
# ------------------------------------------------------------------------------------------------
DP, MICRO = 2, 2


def _grpo_batches():
    """[(dp_rank, [(micro-batch, its mask)])], every mask from its rows' own requests."""
    out = []
    for r in range(DP):
        batches = common.make_batches("grpo", MICRO, seed=100 + r)
        out.append((r, [(b, batch_mask(b["labels"], seed=10 * r + i)) for i, b in enumerate(batches)]))
    return out


def _extras(batch):
    noise = batch["noise"] * (batch["loss_mask"] != 0)
    base = torch.full_like(noise, -4.6) * (batch["loss_mask"] != 0)
    return {"old": base + noise, "reference": base - noise, "sampling": base + 0.5 * noise}


def grpo_megatron_worker(rank, world, fused):
    from megatron.core import parallel_state

    chunks = common.build(Setup(dp=2))
    if fused:
        install_fused_output_layer(chunks, FUSED)
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    pairs = dict(_grpo_batches())[parallel_state.get_data_parallel_rank()]
    batches = [b for b, _ in pairs]
    calls = {"linear_grpo_loss": 0}
    if fused:  # the fused path is linear_grpo_loss with the mask (counted)
        import megatron_fused_ce.megatron.loss_funcs as loss_funcs

        original = loss_funcs.linear_grpo_loss

        def counted(*args, **kwargs):
            calls["linear_grpo_loss"] += kwargs.get("sampling_mask") is not None
            return original(*args, **kwargs)

        loss_funcs.linear_grpo_loss = counted

    def make(chunk, batch, index):
        extra = _extras(batch)
        return grpo_loss_func(post, chunk, batch["labels"], batch["loss_mask"], batch["advantages"], CONFIG,
                              old_logprobs=extra["old"], reference_logprobs=extra["reference"],
                              sampling_logprobs=extra["sampling"], sampling_mask=pairs[index][1][0])

    metrics = common.run_step(chunks, batches, make)
    total = torch.stack([torch.stack([m["loss"], m["num_excluded_tokens"]]) for m in metrics]).sum(0)
    dist.all_reduce(total)
    return {"loss": float(total[0, 0] / total[0, 1]), "count": float(total[0, 1]),
            "excluded": float(total[1, 0]), "grads": common.grads(chunks), "calls": calls}


def grpo_direct_worker(rank, world):
    (model,) = common.build(Setup())
    install_fused_output_layer(model, FUSED)
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    pairs = [p for _, ps in _grpo_batches() for p in ps]
    rows = [b for b, _ in pairs]
    cat = {k: torch.cat([b[k] for b in rows]) for k in ("tokens", "labels", "loss_mask", "position_ids",
                                                        "advantages")}
    cat["attention_mask"] = common.causal_mask()
    # the mask of all rows: the micro-batches' requests, one after the other
    requests = []
    for index, (batch, _) in enumerate(pairs):
        dp_rank, micro = divmod(index, MICRO)
        for row in range(MBS):
            mask, _ = request_mask(batch["labels"][row], (10 * dp_rank + micro) * 1000 + row)
            requests.append((index * MBS + row, START, mask))
    mask = build_sampling_mask(requests, tuple(cat["labels"].shape))
    keep = torch.cat([k for _, (_, k) in pairs])
    extras = [_extras(b) for b in rows]
    extra = {k: torch.cat([e[k] for e in extras]) for k in extras[0]}
    model.zero_grad_buffer()
    hidden = common.forward_fn(model, cat)
    lp = post(hidden, model, cat["labels"], sampling_mask=mask).logprobs
    loss, metrics = grpo_loss(lp, cat["advantages"], cat["loss_mask"], CONFIG, old_logprobs=extra["old"],
                              reference_logprobs=extra["reference"], sampling_logprobs=extra["sampling"])
    loss.backward()
    # float64: the replayed log-probs of the model's hidden states and the loss on them
    z = hidden.detach().double().reshape(-1, hidden.shape[-1]) @ output_weight(model).detach().double().t()
    lp64, _ = replayed_reference(z[:, :TRUE_VOCAB], cat["labels"].reshape(-1), keep)
    loss64, metrics64 = grpo_loss(lp64.view(cat["labels"].shape), cat["advantages"].double(),
                                  cat["loss_mask"].double(), CONFIG,
                                  **{f"{k}_logprobs": v.double() for k, v in extra.items()})
    return {"loss": float(loss), "loss64": float(loss64), "excluded": float(metrics["num_excluded_tokens"]),
            "excluded64": float(metrics64["num_excluded_tokens"]), "grads": common.grads([model])}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_grpo_loss_func_with_a_mask(fused):
    via_megatron = run_workers(grpo_megatron_worker, 2, fused)
    (direct,) = run_workers(grpo_direct_worker, 1)
    assert direct["excluded"] > 0 and direct["excluded"] == direct["excluded64"]
    assert direct["loss"] == pytest.approx(direct["loss64"], rel=RTOL)
    loss_tokens = sum(float((b["loss_mask"] != 0).sum()) for _, ps in _grpo_batches() for b, _ in ps)
    for result in via_megatron:
        assert result["calls"]["linear_grpo_loss"] == (MICRO if fused else 0)
        assert result["excluded"] == direct["excluded"]
        assert result["count"] == loss_tokens - direct["excluded"]  # excluded: not counted
        assert result["loss"] == pytest.approx(direct["loss64"], rel=RTOL)
        for name, grad in direct["grads"].items():
            assert common.max_rel_diff(result["grads"][name], grad) <= RTOL, name


# ------------------------------------------------------------------------------------------------
# Bad masks raise the same ValueError on every rank
# ------------------------------------------------------------------------------------------------
TP_BAD = {
    # name: (which ranks pass it wrong, expected message on the culprit)
    "wrong_length": ("all", "offsets has"),
    "decreasing_offsets": ("all", "never decrease"),
    "id_out_of_range": ("all", "outside [0, vocab_size"),
    "rank1_only": ("rank1", "differs across tensor-parallel ranks"),
    "rank1_decreasing": ("rank1", "never decrease"),
    "with_filters": ("all", "cannot be combined"),
}


def _bad(name, mask, labels):
    ids, offsets = mask.token_ids.clone(), mask.offsets.clone()
    if name == "wrong_length":  # three positions short, otherwise well formed
        offsets = offsets[:-3].clone()
        offsets[-1] = ids.numel()
        return SamplingMask(ids, offsets)
    if name in ("decreasing_offsets", "rank1_decreasing"):
        offsets[10] = int(offsets[11]) + 1  # above the next offset
        return SamplingMask(ids, offsets)
    if name == "id_out_of_range":
        ids[-1] = TRUE_VOCAB + 3
        return SamplingMask(ids, offsets)
    return mask


def bad_tp_worker(rank, world):
    (model,) = common.build(Setup(tp=2, sp=True))
    batch = common.make_batches("grpo", 1, seed=9)[0]
    labels = batch["labels"]
    mask, _ = batch_mask(labels, seed=4)
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    filtered = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB, top_p=0.9)
    messages = {}
    for mode in ("unfused", "fused"):
        if mode == "fused":
            install_fused_output_layer(model, FUSED)
        output = common.forward_fn(model, batch)
        for name, (who, _) in TP_BAD.items():
            culprit = who == "all" or rank == 1
            given = _bad(name, mask, labels) if culprit else mask
            if name == "rank1_only" and not culprit:
                given = None
            try:
                (filtered if name == "with_filters" else post)(output, model, labels, sampling_mask=given)
                messages[mode, name] = None
            except ValueError as error:
                messages[mode, name] = str(error)
        try:  # the GRPO loss func takes the same checks (fused: linear_grpo_loss)
            extra = _extras(batch)
            grpo_loss_func(post, model, labels, batch["loss_mask"], batch["advantages"], CONFIG,
                           old_logprobs=extra["old"], reference_logprobs=extra["reference"],
                           sampling_mask=_bad("decreasing_offsets", mask, labels) if rank == 1 else mask)(output)
            messages[mode, "grpo_rank1_decreasing"] = None
        except ValueError as error:
            messages[mode, "grpo_rank1_decreasing"] = str(error)
        # still in step: a good call runs its collectives on both ranks
        post(output, model, labels, sampling_mask=mask)
    return rank, messages


def test_bad_masks_raise_on_every_tensor_parallel_rank():
    results = dict(run_workers(bad_tp_worker, 2, timeout=120))
    cases = dict(TP_BAD, grpo_rank1_decreasing=("rank1", "never decrease"))
    for mode in ("unfused", "fused"):
        for name, (who, expected) in cases.items():
            messages = {rank: results[rank][mode, name] for rank in (0, 1)}
            assert all(m is not None for m in messages.values()), (mode, name, messages)
            culprit = messages[1]
            assert expected in culprit, (mode, name, culprit)


def bad_cp_worker(rank, world):
    from megatron.core import parallel_state as ps

    (model,) = common.build(Setup(cp=2))
    install_fused_output_layer(model, FUSED)
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    whole = common.make_batches("grpo", 1, seed=9)[0]
    mask, _ = batch_mask(whole["labels"], seed=4)
    (batch,) = common.cp_batches([whole])
    output = common.forward_fn(model, batch)
    # a bad id in the last set of row 0: at a position of CP rank 0 only (chunks 0 and 3 of 4)
    bad = SamplingMask(mask.token_ids.clone(), mask.offsets)
    last = int(mask.offsets[SEQ]) - 1
    assert int(torch.searchsorted(mask.offsets, torch.tensor(last), right=True)) - 1 >= 3 * SEQ // 4
    bad.token_ids[last] = TRUE_VOCAB + 1
    sliced = local_sampling_mask(mask, tuple(batch["labels"].shape), cp_group=ps.get_context_parallel_group())
    extra = _extras(batch)
    cases = {
        "bad_id_on_rank0_positions": lambda: post(output, model, batch["labels"], sampling_mask=bad),
        "sliced_not_whole": lambda: post(output, model, batch["labels"], sampling_mask=sliced),
        "grpo_bad_id": lambda: grpo_loss_func(post, model, batch["labels"], batch["loss_mask"],
                                              batch["advantages"], CONFIG, old_logprobs=extra["old"],
                                              reference_logprobs=extra["reference"], sampling_mask=bad)(output),
        "grpo_rank1_only": lambda: grpo_loss_func(post, model, batch["labels"], batch["loss_mask"],
                                                  batch["advantages"], CONFIG, old_logprobs=extra["old"],
                                                  reference_logprobs=extra["reference"],
                                                  sampling_mask=mask if rank == 1 else None)(output),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    uninstall_fused_output_layer(model)  # the unfused path: only the loss func's own agreement
    logits = common.forward_fn(model, batch)
    try:
        grpo_loss_func(post, model, batch["labels"], batch["loss_mask"], batch["advantages"], CONFIG,
                       old_logprobs=extra["old"], reference_logprobs=extra["reference"],
                       sampling_mask=mask if rank == 1 else None)(logits)
        messages["grpo_rank1_only_unfused"] = None
    except ValueError as error:
        messages["grpo_rank1_only_unfused"] = str(error)
    return messages


def test_bad_masks_raise_on_every_context_parallel_rank():
    results = run_workers(bad_cp_worker, 2, timeout=90)
    expected = {"bad_id_on_rank0_positions": "outside [0, vocab_size=100)",
                "sliced_not_whole": "whole sequences (2 context-parallel ranks x 8)",
                "grpo_bad_id": "outside [0, vocab_size=100)", "grpo_rank1_only": "disagree on sampling_mask given",
                "grpo_rank1_only_unfused": "disagree on sampling_mask given"}
    for name, text in expected.items():
        messages = [r[name] for r in results]
        assert all(m is not None and text in m for m in messages), (name, messages)


# ------------------------------------------------------------------------------------------------
# The example: sampler kept sets, the config switch, GRPO with replay
# ------------------------------------------------------------------------------------------------
EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES_DIR not in sys.path:
    sys.path.append(EXAMPLES_DIR)


def test_sampler_reports_kept_sets_per_request():
    """The rollout sampler's kept sets: those of its own log q (finite entries), empty where a row
    kept the whole vocab; regrouped per request over its generated tokens (vLLM's layout)."""
    from rollout import KeptSets, Sampler, kept_columns, sample, sampler_logprobs

    g = torch.Generator().manual_seed(0)
    kept, logqs = KeptSets(block_bytes=2 * 5 * 40), []  # (read back every two positions)
    for t in range(4):
        logits = 3 * torch.randn(5, 40, generator=g)
        logits[0] = 0.0  # a flat row: min_p keeps all 40 of them
        sampler = Sampler(1.0, min_p=0.2)
        tokens, recorded = sample(logits, sampler, torch.Generator().manual_seed(t))
        logq = sampler_logprobs(logits, sampler)
        assert torch.equal(recorded, logq.gather(1, tokens.unsqueeze(1)).squeeze(1))
        kept.add(kept_columns(logq))
        logqs.append(logq)
    requests = kept.per_request()
    assert len(requests) == 5
    for row, mask in enumerate(requests):
        assert mask.offsets.numel() == 5
        for t in range(4):
            ids = mask.token_ids[mask.offsets[t]:mask.offsets[t + 1]]
            finite = torch.isfinite(logqs[t][row]).nonzero().squeeze(1)
            assert torch.equal(ids, finite if row else ids.new_zeros(0)), (row, t)
    assert not Sampler(1.0).filters and Sampler(1.0, top_k=5).filters and Sampler(1.0, min_p=0.1).filters


def test_example_config_replay_switch():
    from example_common import build_parser
    from example_config import load_config

    path = os.path.join(EXAMPLES_DIR, "configs", "grpo.yaml")
    cfg = load_config("grpo", path)
    assert cfg["sampling"]["replay"] is False and cfg["sampling"]["fidelity"] is True  # the default
    for sampler in ("sampling.top_p=0.9", "sampling.top_k=5", "sampling.min_p=0.1"):
        cfg = load_config("grpo", path, overrides=[sampler, "sampling.replay=true"])
        assert cfg["sampling"]["replay"] is True, sampler
    with pytest.raises(ValueError, match="sampling.replay=true needs sampling.fidelity=true"):
        load_config("grpo", path, overrides=["sampling.top_p=0.9", "sampling.fidelity=false", "sampling.replay=true"])
    # no filter that cuts anything (the defaults, or vLLM's "off" spellings): nothing to replay
    for off in ([], ["sampling.top_k=-1"], ["sampling.top_k=0", "sampling.top_p=1.0", "sampling.min_p=0.0"],
                [f"sampling.top_k={10 ** 6}"]):
        with pytest.raises(ValueError, match="sampling.replay=true needs a sampler filter to replay"):
            load_config("grpo", path, overrides=off + ["sampling.replay=true"])
    with pytest.raises(ValueError, match="top_p"):  # out of range: the range's error, not replay's
        load_config("grpo", path, overrides=["sampling.top_p=1.5", "sampling.replay=true"])
    with pytest.raises(ValueError, match="unknown key 'sampling.replay'"):  # SFT / DPO sample, never train on it
        load_config("sft", os.path.join(EXAMPLES_DIR, "configs", "sft.yaml"), overrides=["sampling.replay=true"])
    assert "replay" in build_parser("grpo", "").format_help()


REPLAY_RUN = ["--steps", "2", "--seq-length", "32", "model.num_layers=2", "model.hidden_size=32",
              "data.prompt_length=24", "rollout.num_prompts=2", "rollout.samples_per_prompt=4",
              "sampling.top_p=0.8", "sampling.replay=true", "rollout.old_logprobs=trainer", "--compare-unfused"]


@pytest.mark.parametrize("layout", [["--tp", "2", "--pp", "2"], ["--tp", "2", "--cp", "2"]], ids=["tp2-pp2", "tp2-cp2"])
def test_grpo_example_with_replay(layout, capfd):
    """examples/grpo.py sampling.replay=true (top_p 0.8, an old-policy pass of the same masks):
    the policy's log-probs of the sampled tokens, fused and unfused, agree and none is excluded
    (every sampled token is in the set it was drawn from)."""
    from example_runner import example_worker

    run_workers(example_worker, 4, "grpo", layout + REPLAY_RUN, timeout=180)
    out = capfd.readouterr()
    text = out.out + out.err
    assert "trainer log-probs of the sampler's reported kept sets (replay)" in text
    line = next(line for line in text.splitlines() if line.startswith("first rollout"))
    assert "kept by one only" not in line, line
    difference = float(line.split("|difference| ")[1].split()[0])
    assert difference <= 1e-4, line
    excluded = [float(v) for v in re.findall(r"excluded=([0-9.e+-]+)", text)]
    assert excluded and not any(excluded), excluded  # every sampled token is in its own set


def test_rl_chain_with_replay_raises_the_reward(tmp_path):
    """SFT with the default configs (2 ranks, DP = 2), then 25 GRPO steps from its checkpoint
    sampling at top_p 0.9 with `sampling.replay=true`: no token is ever excluded, and the mean
    reward over the last 5 steps beats the first 3 by a clear margin (docs/rl.md: 60 steps, one
    seed, replay against recomputed filters)."""
    import json

    from example_runner import example_worker

    checkpoint = str(tmp_path / "ckpt")
    run_workers(example_worker, 2, "sft", ["--task", "count", "--save", checkpoint], timeout=120)
    log = tmp_path / "grpo.jsonl"
    run_workers(example_worker, 2, "grpo", ["--load", checkpoint, "--steps", "25", "--log-jsonl", str(log),
                                            "sampling.top_p=0.9", "sampling.replay=true"], timeout=180)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(25)) and records[0]["label"].endswith("replayed")
    assert all(r["excluded"] == 0.0 for r in records)
    first = sum(r["reward"] for r in records[:3]) / 3
    last = sum(r["reward"] for r in records[-5:]) / 5
    assert last - first >= 0.1, (first, last)


# ------------------------------------------------------------------------------------------------
# megatron-core >= 0.18: FusedOutputProcessor with a mask
# ------------------------------------------------------------------------------------------------
HAS_HOOK = compat.has_output_processor()
needs_hook = pytest.mark.skipif(
    not HAS_HOOK, reason=f"megatron-core {compat.megatron_core_version_string()} has no GPTModel "
                         f"output_processor (>= 0.18)")


def processor_worker(rank, world, setup: Setup):
    from megatron_fused_ce.megatron import FusedOutputProcessor

    chunks = common.build(setup)
    (model,) = chunks
    whole = common.make_batches("grpo", 1, seed=11)[0]
    mask, _ = batch_mask(whole["labels"], seed=6)
    (batch,) = common.cp_batches([whole])
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    out = {}
    with torch.no_grad():
        post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB, return_entropy=True)
        out["unfused"] = post(model(*args), model, batch["labels"], sampling_mask=mask)
        for name, config in (("processor", FUSED), ("processor_off", FusedCEConfig(enabled=False))):
            proc = FusedOutputProcessor(config, returns="logprobs", vocab_size=TRUE_VOCAB, return_entropy=True)
            out[name] = model(*args, labels=batch["labels"], output_processor=proc,
                              output_processor_context={"sampling_mask": mask})
        try:
            model(*args, output_processor=FusedOutputProcessor(FUSED, vocab_size=TRUE_VOCAB),
                  output_processor_context={"sampling_mask": mask})
            out["hidden_states_error"] = None
        except ValueError as error:
            out["hidden_states_error"] = str(error)
    # the loss func with the processor as post-processor (hidden states) vs the unfused model
    proc = FusedOutputProcessor(FUSED, vocab_size=TRUE_VOCAB)
    plain = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)  # (the processor's settings)
    extra = _extras(batch)
    grads, metrics = {}, {}
    for route in ("unfused", "processor"):
        def forward(chunk, b, route=route):
            return chunk(*args, output_processor=proc) if route == "processor" else chunk(*args)

        def make(chunk, b, index):
            return grpo_loss_func(proc if route == "processor" else plain, chunk, b["labels"], b["loss_mask"],
                                  b["advantages"], CONFIG, old_logprobs=extra["old"],
                                  reference_logprobs=extra["reference"], sampling_mask=mask)

        metrics[route] = common.run_step(chunks, [batch], make, forward=forward)[0]
        grads[route] = common.grads(chunks)
    return out, metrics, grads


@needs_hook
@pytest.mark.parametrize("setup", [Setup(tp=2, sp=True), Setup(cp=2)], ids=str)
def test_output_processor_replays_the_mask(setup):
    for out, metrics, grads in run_workers(processor_worker, setup.world, setup, timeout=120):
        want = out["unfused"]
        assert bool(torch.isinf(want.logprobs).any())
        for name in ("processor", "processor_off"):
            assert _finite_close(out[name].logprobs, want.logprobs, RTOL), name
            assert (out[name].entropy - want.entropy).abs().max() <= ATOL, name
        assert "returns='logprobs' only" in out["hidden_states_error"]
        for key, value in metrics["unfused"].items():
            assert torch.allclose(metrics["processor"][key], value, rtol=RTOL, atol=1e-6), key
        for name, grad in grads["unfused"].items():
            assert common.max_rel_diff(grads["processor"][name], grad) <= GRAD_RTOL, name
