"""Bad input raises a clear ValueError naming the argument, on every TP rank, before any collective.

Each case runs at TP=2 under a timeout: a check that fails on one rank while the other waits in an
all-reduce would hang (WorkerTimeout) or crash the peer instead of raising the same error on both.
"""

import pytest
import torch
import torch.distributed as dist

from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs


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
    return fn, h, w, y, kw


CASES = {
    "label_too_large": "labels", "label_in_padded_tail": "labels", "negative_label": "labels",
    "label_bad_on_rank1_only": "labels", "labels_differ_across_ranks": "labels", "float_labels": "labels", "labels_shape": "labels",
    "hidden_size": "weight", "dtype": "weight", "temperature": "temperature",
    "chunk_size": "chunk_size", "unequal_shards": "weight", "vocab_size": "vocab_size",
    "reduction": "reduction", "label_smoothing": "label_smoothing",
}


def _bad_worker(rank, world, name):
    fn, h, w, y, kw = _case(name, rank)
    try:
        fn(h.requires_grad_(), w.requires_grad_(), y, tp_group=dist.group.WORLD, **kw)
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
