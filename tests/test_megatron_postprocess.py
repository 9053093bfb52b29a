"""LogprobsPostProcessor on a real GPTModel (CPU, gloo): against a float64 dense reference, with
hidden states (fused) and logits (unfused) as input, temperature, entropy, padded vocab, ignored
labels, sequence parallelism, packed sequences; and the pipeline broadcast helper.

Tolerances (fp32 model, float64 reference): log-probs and entropy to 1e-5 absolute.
"""

from __future__ import annotations

import pytest
import torch

import reference
import megatron_harness as common
from dist import init_megatron_parallel, run_workers
from megatron_harness import HIDDEN, PADDED_VOCAB, SEQ, TRUE_VOCAB, Setup, all_gather_cat

from megatron_fused_ce import LogprobsOutput
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    broadcast_from_last_stage,
    enable_cpu_mode,
    install_fused_output_layer,
    output_weight,
    packed_sequence_labels,
    sft_loss_func,
)

ATOL = 1e-5
FUSED = FusedCEConfig(enabled=True, chunk_size=8)


def dense_reference_worker(rank, world, setup: Setup, temperature: float):
    from megatron.core import parallel_state

    (model,) = common.build(setup)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    batch = common.make_batches("sft", 1, seed=7)[0]
    labels = batch["labels"].clone()
    labels[0, 5] = labels[1, 0] = -100  # ignored positions: log-prob and entropy exactly 0
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB, temperature=temperature,
                                 return_entropy=True)
    out, shapes = {}, {}
    with torch.no_grad():
        for mode in ("unfused", "fused"):
            if mode == "fused":
                install_fused_output_layer(model, FUSED)
            output = common.forward_fn(model, batch)
            shapes[mode] = tuple(output.shape)
            out[mode] = post(output, model, labels)
            if mode == "fused":
                hidden = all_gather_cat(output, 1, tp_group) if setup.sp else output
                # FusedCEConfig.logits_dtype reaches the op (a no-op on this fp32 model)
                post32 = LogprobsPostProcessor(FusedCEConfig(enabled=True, chunk_size=8, logits_dtype="float32"),
                                               vocab_size=TRUE_VOCAB, temperature=temperature,
                                               return_entropy=True)
                fp32_inputs = post32.fused_inputs(output, model, labels)["logits_dtype"] is torch.float32
                fp32_same = torch.equal(post32(output, model, labels).logprobs, out[mode].logprobs)
        weight = all_gather_cat(output_weight(model), 0, tp_group)
    lp_ref, ent_ref, _ = reference.dense_stats(hidden, weight, labels, vocab_size=TRUE_VOCAB,
                                               temperature=temperature)
    return {
        "shapes": shapes,
        "lp_err": {m: (o.logprobs.double() - lp_ref).abs().max().item() for m, o in out.items()},
        "ent_err": {m: (o.entropy.double() - ent_ref).abs().max().item() for m, o in out.items()},
        "lp_rel": {m: reference.rel_err(o.logprobs, lp_ref) for m, o in out.items()},
        "ignored_zero": all(float(o.logprobs[0, 5]) == 0.0 == float(o.entropy[1, 0])
                            for o in out.values()),
        "dtype": {m: (o.logprobs.dtype, o.entropy.dtype) for m, o in out.items()},
        "logprobs": out["fused"].logprobs,
        "fp32_logits": (fp32_inputs, fp32_same),
    }


@pytest.mark.parametrize("setup,temperature", [
    (Setup(tp=1), 1.0),
    (Setup(tp=2, tied=True), 0.7),
    (Setup(tp=2, sp=True), 1.3),
], ids=["tp1-T1.0", "tp2-tied-T0.7", "tp2-sp-T1.3"])
def test_matches_dense_reference(setup, temperature):
    results = run_workers(dense_reference_worker, setup.world, setup, temperature)
    tp = setup.tp
    for r in results:
        # Fusion on: the model returns hidden states ([b, s/TP, h] under SP), never logits.
        assert r["shapes"]["fused"] == (common.MBS, SEQ // (tp if setup.sp else 1), HIDDEN)
        assert r["shapes"]["unfused"] == (common.MBS, SEQ, PADDED_VOCAB // tp)
        for mode in ("fused", "unfused"):
            assert r["dtype"][mode] == (torch.float32, torch.float32)
            assert r["lp_err"][mode] <= ATOL, (mode, r["lp_err"])
            assert r["ent_err"][mode] <= ATOL, (mode, r["ent_err"])
            reference.record(f"mcore lp {mode}", tp, torch.float32, r["lp_rel"][mode])
        assert r["ignored_zero"]
        assert r["fp32_logits"] == (True, True)
    for r in results[1:]:  # identical on all TP ranks
        assert torch.equal(r["logprobs"], results[0]["logprobs"])


# ------------------------------------------------------------------------------------------------
# Packed sequences
# ------------------------------------------------------------------------------------------------
SEGMENTS = [[5, 7, 4], [9, 3, 2, 2]]  # per row; each row sums to SEQ


def _packed_batch(g):
    tokens = torch.randint(0, TRUE_VOCAB, (len(SEGMENTS), SEQ + 1), generator=g)
    position_ids = torch.zeros(len(SEGMENTS), SEQ, dtype=torch.long)
    allowed = torch.zeros(len(SEGMENTS), 1, SEQ, SEQ, dtype=torch.bool)
    cu = [0]
    for r, lengths in enumerate(SEGMENTS):
        start = 0
        for n in lengths:
            position_ids[r, start:start + n] = torch.arange(n)
            allowed[r, 0, start:start + n, start:start + n] = True
            start += n
            cu.append(r * SEQ + start)
    attention_mask = ~(allowed & torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": position_ids,
            "attention_mask": attention_mask, "loss_mask": torch.ones(len(SEGMENTS), SEQ),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


def packed_worker(rank, world, setup: Setup):
    (model,) = common.build(setup)
    batch = _packed_batch(torch.Generator().manual_seed(3))
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    report = {}
    for mode in ("unfused", "fused"):
        if mode == "fused":
            install_fused_output_layer(model, FUSED)
        with torch.no_grad():
            packed = post(common.forward_fn(model, batch), model, batch["labels"],
                          cu_seqlens=batch["cu_seqlens"]).logprobs
            loss_sum, count, _ = sft_loss_func(post, model, batch["labels"], batch["loss_mask"],
                                               cu_seqlens=batch["cu_seqlens"])(
                common.forward_fn(model, batch))
        # Each sequence alone (its own row, positions from 0, padded to SEQ): the same log-probs,
        # except that the packed row scores nothing at its last position.
        worst, boundary_zero, expected_sum = 0.0, True, 0.0
        for r, lengths in enumerate(SEGMENTS):
            start = 0
            for n in lengths:
                alone_tokens = torch.zeros(1, SEQ + 1, dtype=torch.long)
                alone_tokens[0, :n + 1] = torch.cat([batch["tokens"][r, start:start + n],
                                                     batch["labels"][r, start + n - 1:start + n]])
                alone_labels = alone_tokens[:, 1:].clone()
                alone_labels[0, n - 1:] = -100  # the target of its last position is not its own
                alone = {"tokens": alone_tokens[:, :-1], "labels": alone_labels,
                         "position_ids": torch.arange(SEQ).unsqueeze(0),
                         "attention_mask": common.causal_mask()}
                with torch.no_grad():
                    lp = post(common.forward_fn(model, alone), model, alone_labels).logprobs
                worst = max(worst, (lp[0, :n] - packed[r, start:start + n]).abs().max().item())
                boundary_zero &= float(packed[r, start + n - 1]) == 0.0
                expected_sum -= lp[0, :n].sum().item()
                start += n
        report[mode] = {"err": worst, "boundary_zero": boundary_zero,
                        "count": int(count), "loss_sum": float(loss_sum),
                        "expected_sum": expected_sum}
    return report


def test_packed_sequences():
    setup = Setup(tp=2, sp=True)
    num_sequences = sum(len(s) for s in SEGMENTS)
    for r in run_workers(packed_worker, setup.world, setup):
        for mode, m in r.items():
            assert m["boundary_zero"], mode
            assert m["err"] <= ATOL, (mode, m["err"])
            assert m["count"] == len(SEGMENTS) * SEQ - num_sequences
            assert abs(m["loss_sum"] - m["expected_sum"]) <= 1e-4 * abs(m["expected_sum"])


def test_packed_sequence_labels():
    labels = torch.arange(10).reshape(2, 5)
    cu = torch.tensor([0, 3, 3, 7, 9])  # an empty sequence, a sequence crossing rows, padding
    out = packed_sequence_labels(labels, cu)
    assert out.tolist() == [[0, 1, -100, 3, 4], [5, -100, 7, -100, -100]]
    assert packed_sequence_labels(labels, None) is labels


# ------------------------------------------------------------------------------------------------
# Broadcast from the last pipeline stage
# ------------------------------------------------------------------------------------------------
def _values():
    g = torch.Generator().manual_seed(0)
    return {
        "tensor": torch.randint(-5, 5, (3, 5), generator=g),
        "bf16": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "logprobs": LogprobsOutput(torch.randn(2, 7, generator=g), None),
        "logprobs_entropy": LogprobsOutput(torch.randn(2, 7, generator=g),
                                           torch.rand(2, 7, generator=g)),
    }


def broadcast_worker(rank, world):
    from megatron.core import parallel_state

    enable_cpu_mode()
    init_megatron_parallel(1, world)
    last = parallel_state.is_pipeline_last_stage()
    return {name: broadcast_from_last_stage(value if last else None)
            for name, value in _values().items()}


def test_broadcast_from_last_stage():
    expected = _values()
    for received in run_workers(broadcast_worker, 4):
        for name, value in expected.items():
            got = received[name]
            if isinstance(value, LogprobsOutput):
                assert isinstance(got, LogprobsOutput)
                assert torch.equal(got.logprobs, value.logprobs)
                assert (got.entropy is None) == (value.entropy is None)
                if value.entropy is not None:
                    assert torch.equal(got.entropy, value.entropy)
            else:
                assert got.dtype == value.dtype and torch.equal(got, value)


def _unsendable_values():
    return {
        "none": None,
        "uint8": torch.zeros(2, 3, dtype=torch.uint8),
        "7 dims": torch.zeros((1,) * 7),
        "a list": [torch.zeros(2)],
        "bf16 entropy": LogprobsOutput(torch.zeros(2, 7), torch.zeros(2, 7, dtype=torch.bfloat16)),
    }


def broadcast_refusal_worker(rank, world):
    from megatron.core import parallel_state

    enable_cpu_mode()
    init_megatron_parallel(1, world)
    last = parallel_state.is_pipeline_last_stage()
    refused = {}
    for name, value in _unsendable_values().items():
        try:
            broadcast_from_last_stage(value if last else None)
        except ValueError as error:
            refused[name] = str(error)
    # the stages are still in step: the next broadcast arrives
    after = broadcast_from_last_stage(torch.arange(4) if last else None)
    return last, refused, after


def test_broadcast_from_last_stage_refuses_a_value_it_cannot_send_on_every_stage():
    """A value the last stage cannot send (None, a dtype or rank the header cannot describe, an
    entropy of another dtype than the log-probs' the other stages would make their buffer in)
    raises ValueError on every stage: before, the last stage raised before the header's broadcast
    and the others waited in it."""
    names = set(_unsendable_values())
    for last, refused, after in run_workers(broadcast_refusal_worker, 2):
        assert set(refused) == names and torch.equal(after, torch.arange(4))
        if last:
            assert "must pass a value" in refused["none"] and "torch.uint8" in refused["uint8"]
            assert "at most 6 dims" in refused["7 dims"] and "entropy" in refused["bf16 entropy"]
        else:
            assert all("cannot be sent" in message for message in refused.values())


# ------------------------------------------------------------------------------------------------
# The point of it all: with fusion on, no [tokens, V/TP] tensor is ever allocated.
# ------------------------------------------------------------------------------------------------
def largest_tensor_worker(rank, world):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    (model,) = common.build(Setup())
    rows = common.make_batches("sft", 2, seed=9)
    batch = {k: torch.cat([b[k] for b in rows]) for k in ("tokens", "labels", "position_ids")}
    batch["attention_mask"] = common.causal_mask()
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    largest = {}
    for mode in ("unfused", "fused"):
        if mode == "fused":
            install_fused_output_layer(model, FUSED)
        output = common.forward_fn(model, batch).detach().requires_grad_()
        with Largest() as tracker:
            post(output, model, batch["labels"]).logprobs.sum().backward()
        largest[mode] = tracker.numel
    return largest, batch["labels"].numel(), output_weight(model).numel()


def test_fused_never_allocates_logits():
    (largest, tokens, weight_numel), = run_workers(largest_tensor_worker, 1)
    logits_numel = tokens * PADDED_VOCAB
    assert logits_numel > weight_numel  # so that the check can tell them apart
    assert largest["unfused"] >= logits_numel  # the check sees the logits when they exist
    assert largest["fused"] < logits_numel
    assert largest["fused"] <= max(weight_numel, FUSED.chunk_size * PADDED_VOCAB, tokens * HIDDEN)
