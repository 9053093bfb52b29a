"""Bad input raises a clear ValueError naming the argument, on every TP rank, before any collective.

Each case runs at TP=2 under a timeout: a check that fails on one rank while the other waits in an
all-reduce would hang (WorkerTimeout) or crash the peer instead of raising the same error on both.
Arguments that differ across ranks (labels with the same labelled count, temperature, options,
dtypes, the sequence-parallel flag ...) must raise too: otherwise they desynchronize the collectives
or return the same wrong values on every rank.
"""

import pytest
import torch
import torch.distributed as dist

from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss


def _inputs(rank):
    torch.manual_seed(0)
    h = torch.randn(6, 8)
    w = torch.randn(10, 8)
    y = torch.randint(0, 20, (6,))
    return h, w, y


# name -> (function that breaks the inputs on `rank`, argument the error must name)
def _case(name, rank):
    h, w, y = _inputs(rank)
    kw = {}
    fn = linear_logprobs
    if name == "label_too_large":
        y[2] = 20  # vocab is 2 * 10
    elif name == "label_in_padded_tail":
        kw["vocab_size"] = 17
        y[1] = 18  # a padded column: not a real token
    elif name == "negative_label":
        y[0] = -5
    elif name == "label_bad_on_rank1_only":
        if rank == 1:
            y[3] = 99
    elif name == "labels_differ_across_ranks":
        if rank == 1:
            y[0] = -100  # a different number of labelled tokens: would desynchronize the merge
    elif name == "float_labels":
        y = y.float()
    elif name == "labels_shape":
        y = y[:5]
    elif name == "hidden_size":
        w = torch.randn(10, 7)
    elif name == "dtype":
        w = w.double()
    elif name == "temperature":
        kw["temperature"] = 0.0
    elif name == "chunk_size":
        kw["chunk_size"] = 0
    elif name == "unequal_shards":
        if rank == 1:
            w = torch.randn(9, 8)
    elif name == "vocab_size":
        kw["vocab_size"] = 21
    elif name == "reduction":
        fn, kw["reduction"] = linear_cross_entropy, "avg"
    elif name == "label_smoothing":
        fn, kw["label_smoothing"] = linear_cross_entropy, 1.5
    # -- values that differ across ranks (only rank 1 changes) ------------------------------------
    elif name == "labels_swapped_on_rank1":  # same labelled count: the count check alone passes
        y[:2] = torch.tensor([3, 11])
        if rank == 1:
            y[:2] = torch.tensor([11, 3])
    elif name == "label_changed_on_rank1":
        if rank == 1:
            y[2] = (y[2] + 1) % 20
    elif name == "temperature_differs":
        kw["temperature"] = 0.9 if rank == 1 else 1.0
    elif name == "vocab_size_differs":
        kw["vocab_size"] = 19 if rank == 1 else 20
        y[y >= 19] = 0
    elif name == "chunk_size_differs":
        kw["chunk_size"] = 2 if rank == 1 else 3
    elif name == "return_entropy_differs":
        kw["return_entropy"] = rank == 1
    elif name == "ignore_index_differs":
        kw["ignore_index"] = -1 if rank == 1 else -100
    elif name == "impl_differs":
        kw["impl"] = "triton" if rank == 1 else "torch"
    elif name == "logits_dtype_differs":
        kw["logits_dtype"] = torch.float32 if rank == 1 else None
        h, w = h.bfloat16(), w.bfloat16()
    elif name == "dtype_differs":
        if rank == 1:
            h, w = h.bfloat16(), w.bfloat16()
    elif name == "sequence_parallel_differs":  # both shapes valid for their own flag
        h = torch.randn(12, 8)
        y = torch.randint(0, 20, (12,))
        if rank == 1:
            h, kw["sequence_parallel"] = h[6:].clone(), True
    elif name == "requires_grad_differs":
        kw["_hidden_requires_grad"] = rank == 0
    elif name in ("reduction_differs", "label_smoothing_differs", "z_loss_weight_differs"):
        fn = linear_cross_entropy
        kw.update({"reduction_differs": {"reduction": "sum" if rank == 1 else "mean"},
                   "label_smoothing_differs": {"label_smoothing": 0.1 * rank},
                   "z_loss_weight_differs": {"z_loss_weight": 1e-3 * rank}}[name])
    elif name == "advantages_differ":
        fn, h, y = _grpo, h.reshape(2, 3, 8), y.reshape(2, 3)
        kw["advantages"] = torch.tensor([1.0, -1.0 + rank])
    elif name == "normalizer_differs":  # a number: compared across ranks, not part of the signature
        fn, h, y = _grpo, h.reshape(2, 3, 8), y.reshape(2, 3)
        kw["advantages"], kw["normalizer"] = torch.tensor([1.0, -1.0]), 6.0 + rank
    # -- values that would crash one rank before the agreement -----------------------------------
    elif name == "ignore_index_none_on_rank1":
        kw["ignore_index"] = None if rank == 1 else -100
    elif name == "ignore_index_str_on_rank1":
        kw["ignore_index"] = "-100" if rank == 1 else -100
    elif name == "ignore_index_too_large":
        kw["ignore_index"] = 2**70
    elif name in ("int8_labels", "int16_labels", "uint8_labels"):
        y = y.to({"int8_labels": torch.int8, "int16_labels": torch.int16, "uint8_labels": torch.uint8}[name])
    elif name == "temperature_inf":
        kw["temperature"] = float("inf")
    elif name == "temperature_nan_on_rank1":
        kw["temperature"] = float("nan") if rank == 1 else 1.0
    elif name == "z_loss_weight_inf":
        fn, kw["z_loss_weight"] = linear_cross_entropy, float("inf")
    elif name == "logits_dtype":
        kw["logits_dtype"] = torch.float16
    # -- flags given as strings: a truthy 'no' / 'False' must not switch them on ------------------
    elif name == "return_entropy_str":
        kw["return_entropy"] = "no"
    elif name == "accumulate_into_main_grad_str":
        fn, kw["accumulate_into_main_grad"] = linear_cross_entropy, "False"
    return fn, h, w, y, kw


def _grpo(h, w, y, *, advantages, **kw):
    """linear_grpo_loss with [B=2, T=3] inputs: the per-token gradients depend on the advantages."""
    return linear_grpo_loss(h, w, y, advantages, torch.ones(2, 3), GRPOConfig(), **kw)


CASES = {
    "label_too_large": "labels", "label_in_padded_tail": "labels", "negative_label": "labels",
    "label_bad_on_rank1_only": "labels", "labels_differ_across_ranks": "labels", "float_labels": "labels", "labels_shape": "labels",
    "hidden_size": "weight", "dtype": "weight", "temperature": "temperature",
    "chunk_size": "chunk_size", "unequal_shards": "weight", "vocab_size": "vocab_size",
    "reduction": "reduction", "label_smoothing": "label_smoothing",
    "labels_swapped_on_rank1": "labels", "label_changed_on_rank1": "labels",
    "temperature_differs": "temperature", "vocab_size_differs": "vocab_size",
    "chunk_size_differs": "chunk_size", "return_entropy_differs": "return_entropy",
    "ignore_index_differs": "ignore_index", "impl_differs": "impl",
    "logits_dtype_differs": "logits_dtype", "dtype_differs": "hidden",
    "sequence_parallel_differs": "sequence_parallel", "requires_grad_differs": "requires_grad",
    "reduction_differs": "reduction", "label_smoothing_differs": "label_smoothing",
    "z_loss_weight_differs": "z_loss_weight", "advantages_differ": "advantages", "normalizer_differs": "normalizer",
    "ignore_index_none_on_rank1": "ignore_index", "ignore_index_str_on_rank1": "ignore_index",
    "ignore_index_too_large": "ignore_index", "int8_labels": "labels", "int16_labels": "labels",
    "uint8_labels": "labels", "temperature_inf": "temperature", "temperature_nan_on_rank1": "temperature",
    "z_loss_weight_inf": "z_loss_weight", "logits_dtype": "logits_dtype",
    "return_entropy_str": "return_entropy must be True or False",
    "accumulate_into_main_grad_str": "accumulate_into_main_grad must be True or False",
}


def _bad_worker(rank, world, name):
    fn, h, w, y, kw = _case(name, rank)
    h.requires_grad_(kw.pop("_hidden_requires_grad", True))
    try:
        fn(h, w.requires_grad_(), y, tp_group=dist.group.WORLD, **kw)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rank_raises_naming_the_argument(name):
    messages = run_workers(_bad_worker, 2, name, timeout=20)
    for rank, msg in enumerate(messages):
        assert msg is not None, f"rank {rank} did not raise for {name}"
        assert CASES[name] in msg, f"rank {rank}: {msg!r} does not name {CASES[name]}"


def test_single_rank_errors_without_group():
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 1, 10, -100])
    with pytest.raises(ValueError, match="labels"):
        linear_logprobs(h, w, y)
    with pytest.raises(ValueError, match="impl"):
        linear_logprobs(h, w, torch.zeros(4, dtype=torch.long), impl="cuda")
    with pytest.raises(ValueError, match="device|weight"):
        linear_logprobs(h, w.to("meta"), torch.zeros(4, dtype=torch.long))


# ---------------------------------------------------------------- the unfused post-processor path
UNFUSED_CASES = {
    "label_bad_on_rank1_only": "labels", "labels_swapped_on_rank1": "labels",
    "vocab_size_zero": "vocab_size", "temperature_inf": "temperature",
    "temperature_nan_on_rank1": "temperature", "ignore_index_none_on_rank1": "ignore_index",
    "vocab_size_differs": "vocab_size",
}


def _unfused_worker(rank, world, name):
    from megatron_fused_ce.megatron.unfused_logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 10, requires_grad=True)  # this rank's shard of a vocab of 20
    y = torch.randint(0, 19, (2, 3))
    kw = {}
    if name == "label_bad_on_rank1_only" and rank == 1:
        y[0, 0] = 25
    elif name == "labels_swapped_on_rank1":
        y[0, :2] = torch.tensor([3, 11]) if rank == 0 else torch.tensor([11, 3])
    elif name == "vocab_size_zero":
        kw["vocab_size"] = 0  # was taken as "the padded vocab"
    elif name == "temperature_inf":
        kw["temperature"] = float("inf")
    elif name == "temperature_nan_on_rank1":
        kw["temperature"] = float("nan") if rank == 1 else 1.0
    elif name == "ignore_index_none_on_rank1":
        kw["ignore_index"] = None if rank == 1 else -100
    elif name == "vocab_size_differs":
        kw["vocab_size"] = 19 + rank
    try:
        vocab_parallel_logprobs(logits, y, tp_group=dist.group.WORLD, tp_rank=rank, tp_size=world, **kw)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("name", sorted(UNFUSED_CASES))
def test_unfused_logprobs_raise_on_every_rank(name):
    """vocab_parallel_logprobs (fusion off) agrees on its errors before its first all-reduce."""
    messages = run_workers(_unfused_worker, 2, name, timeout=20)
    for rank, msg in enumerate(messages):
        assert msg is not None, f"rank {rank} did not raise for {name}"
        assert UNFUSED_CASES[name] in msg, f"rank {rank}: {msg!r}"


@pytest.mark.parametrize("cu_seqlens, match", [
    (torch.tensor([1, 4, 8]), "start at 0"),
    (torch.tensor([0, 5, 3, 8]), "non-decreasing"),
    (torch.tensor([0, 4, 13]), "past the 12 tokens"),
    (torch.tensor([0.0, 4.0, 8.0]), "integer"),
    (torch.tensor([[0, 4, 8]]), "1-D"),
    (torch.tensor([], dtype=torch.long), "non-empty"),
])
def test_packed_sequence_labels_rejects_bad_cu_seqlens(cu_seqlens, match):
    from megatron_fused_ce.megatron.postprocess import packed_sequence_labels

    with pytest.raises(ValueError, match=match):
        packed_sequence_labels(torch.arange(12).reshape(1, 12), cu_seqlens)


def test_post_processor_rejects_bad_settings():
    from megatron_fused_ce.megatron import FusedCEConfig, LogprobsPostProcessor

    for kwargs, name in (({"temperature": float("inf")}, "temperature"),
                         ({"temperature": float("nan")}, "temperature"),
                         ({"vocab_size": 0}, "vocab_size"), ({"ignore_index": None}, "ignore_index")):
        with pytest.raises(ValueError, match=name):
            LogprobsPostProcessor(FusedCEConfig(enabled=True), **kwargs)
