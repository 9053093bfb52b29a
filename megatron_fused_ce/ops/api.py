"""Public entry points: `linear_logprobs` and `linear_cross_entropy`.

One token's path: its hidden row (all-gathered first under sequence parallelism) -> if its label is
not `ignore_index`, it joins a chunk of labelled rows -> chunk logits on this rank's vocab shard ->
backend softmax partials -> merged over TP ranks (reductions.py) -> per-token target logit, lse,
(sum of logits, expected logit) -> log-prob / entropy / loss here. Ignored rows are dropped before
the first GEMM: they cost no flops and get exactly zero output and zero gradient.
With sampler settings (top_k / top_p / min_p / return_topk) the chunk loop is sampling.py's.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import reductions, sampling, torch_backend
from .chunked import (
    ChunkSpec,
    LinearLossGradInForward,
    LinearSoftmaxStats,
    adds_into_main_grad,
    forward_stats,
)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The automatic chunk size bounds one chunk of logits, whatever the number of tokens. CPU (torch
# backend, which also holds fp32 copies of the chunk): 64 Mi elements. CUDA: GEMMs of >= 4096 rows
# run near the cuBLAS peak while 256-500 rows cost 1.8-2.9x the GEMM floor (docs/benchmarks.md),
# so at least 4096 rows, and more while the bf16 chunk stays under 512 Mi elements (1 GiB).
_AUTO_CHUNK_ELEMENTS = 64 * 1024 * 1024
_AUTO_CHUNK_ELEMENTS_CUDA = 512 * 1024 * 1024
_AUTO_CHUNK_MIN_ROWS_CUDA = 4096


class _LogprobsPair(NamedTuple):
    logprobs: Tensor  # fp32, labels.shape; 0.0 at ignored positions
    entropy: Optional[Tensor]  # fp32, labels.shape (0.0 at ignored positions) or None


class LogprobsOutput(_LogprobsPair):
    """`(logprobs, entropy)`: a NamedTuple of two fields, so `lp, ent = out` keeps working.

    `topk_logprobs` / `topk_ids` (`return_topk=k`: `labels.shape + (k,)`, else None) are
    attributes outside the tuple for the same reason."""

    topk_logprobs: Optional[Tensor] = None  # class defaults: also what _make / pytrees rebuild
    topk_ids: Optional[Tensor] = None

    def __new__(cls, logprobs, entropy=None, topk_logprobs=None, topk_ids=None):
        self = super().__new__(cls, logprobs, entropy)
        if topk_logprobs is not None or topk_ids is not None:
            self.topk_logprobs, self.topk_ids = topk_logprobs, topk_ids
        return self

    def _replace(self, **changes):
        fields = dict(logprobs=self.logprobs, entropy=self.entropy, topk_logprobs=self.topk_logprobs,
                      topk_ids=self.topk_ids)
        fields.update(changes)
        return type(self)(**fields)

    def __repr__(self):
        extra = "" if self.topk_ids is None else (f", topk_logprobs={self.topk_logprobs!r}, "
                                                  f"topk_ids={self.topk_ids!r}")
        return f"LogprobsOutput(logprobs={self.logprobs!r}, entropy={self.entropy!r}{extra})"


def _triton_backend_or_none():
    try:
        from . import triton_backend
    except ImportError:
        return None
    return triton_backend


def select_backend(impl: str, device: torch.device):
    if impl == "torch":
        return torch_backend
    if impl == "triton":
        backend = _triton_backend_or_none()
        if backend is None:
            raise ValueError("impl: 'triton' was requested but triton cannot be imported")
        return backend
    # "auto": Triton where it compiles for the device, the torch reference elsewhere.
    if device.type == "cuda":
        backend = _triton_backend_or_none()
        if backend is not None:
            return backend
    return torch_backend


# --------------------------------------------------------------------------------------------
# Argument checks. Each rank collects its own problems without raising, then all ranks agree on
# the union with one tiny all-reduce, so that every rank raises the same error before any real
# collective (a check failing on one rank while the others wait in an all-reduce is a hang).
# --------------------------------------------------------------------------------------------
_CHECKS = ("hidden", "weight", "labels", "temperature", "chunk_size", "vocab_size", "impl",
           "reduction", "label_smoothing", "z_loss_weight", "ignore_index",
           "top_k", "top_p", "min_p", "return_topk")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _local_problems(fn_name, hidden, weight, labels, tp_size, vocab_size, temperature, chunk_size,
                    sequence_parallel, impl, ignore_index, extra_checks) -> dict:
    problems = {}
    if not isinstance(hidden, Tensor) or hidden.dim() < 1 or hidden.dtype not in _FLOAT_DTYPES:
        problems["hidden"] = "hidden must be a float32/bfloat16/float16 tensor of shape [..., H]"
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        problems["weight"] = "weight must be a 2-D tensor [V_local, H]"
    if "hidden" not in problems and "weight" not in problems:
        if hidden.shape[-1] != weight.shape[1]:
            problems["weight"] = (f"weight has hidden size {weight.shape[1]} but hidden has "
                                  f"{hidden.shape[-1]} (H mismatch)")
        elif weight.dtype != hidden.dtype:
            problems["weight"] = f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}"
        elif weight.device != hidden.device:
            problems["weight"] = f"weight is on {weight.device} but hidden is on {hidden.device}"
    if not isinstance(labels, Tensor):
        problems["labels"] = "labels must be an integer tensor"
    elif labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        problems["labels"] = f"labels must hold integer class ids, got dtype {labels.dtype}"
    elif "hidden" not in problems:
        expected = tuple(hidden.shape[:-1])
        if sequence_parallel:
            if hidden.dim() < 2:
                problems["hidden"] = "sequence_parallel needs hidden of shape [S/TP, ..., H]"
            else:
                expected = (hidden.shape[0] * tp_size,) + expected[1:]
        if "hidden" not in problems and tuple(labels.shape) != expected:
            problems["labels"] = (f"labels shape {tuple(labels.shape)} does not match "
                                  f"{'gathered ' if sequence_parallel and tp_size > 1 else ''}"
                                  f"hidden.shape[:-1] = {expected}")
        elif labels.device != hidden.device:
            problems["labels"] = f"labels are on {labels.device} but hidden is on {hidden.device}"
    if not isinstance(temperature, numbers.Real) or not (temperature > 0) or not math.isfinite(temperature):
        problems["temperature"] = f"temperature must be a finite number > 0, got {temperature!r}"
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size <= 0):
        problems["chunk_size"] = f"chunk_size must be a positive integer or None, got {chunk_size!r}"
    if not _is_int(ignore_index):
        problems["ignore_index"] = f"ignore_index must be an integer, got {ignore_index!r}"
    if "weight" not in problems:
        padded_vocab = weight.shape[0] * tp_size
        if vocab_size is not None and (not _is_int(vocab_size) or not 0 < vocab_size <= padded_vocab):
            problems["vocab_size"] = (f"vocab_size must be an integer in [1, V_local * tp_size = "
                                      f"{padded_vocab}], got {vocab_size!r}")
    if impl not in ("auto", "torch", "triton"):
        problems["impl"] = f"impl must be 'auto', 'torch' or 'triton', got {impl!r}"
    elif impl == "triton" and _triton_backend_or_none() is None:
        problems["impl"] = "impl='triton' was requested but triton cannot be imported"
    problems.update(extra_checks)
    return problems


def _check_arguments(fn_name, hidden, weight, labels, tp_group, vocab_size, temperature, chunk_size,
                     sequence_parallel, impl, ignore_index, extra_checks=None, must_agree=None) -> int:
    """Raise the same ValueError on every TP rank for bad input.

    `must_agree`: {argument name: int64 code} of settings that decide the collectives made (the
    sampler settings); a difference across ranks is an error naming the argument.
    Returns (true vocab size, number of labelled tokens), both agreed by all ranks."""
    tp_size = reductions.group_size(tp_group)
    problems = _local_problems(fn_name, hidden, weight, labels, tp_size, vocab_size, temperature,
                               chunk_size, sequence_parallel, impl, ignore_index, extra_checks or {})
    v_local = weight.shape[0] if "weight" not in problems else -1
    true_vocab = (vocab_size if "vocab_size" not in problems and vocab_size is not None
                  else max(v_local, 0) * tp_size)
    bad_labels, outside = 0, None
    device = hidden.device if isinstance(hidden, Tensor) else torch.device("cpu")
    if "labels" not in problems and "hidden" not in problems and labels.numel() > 0:
        outside = ((labels < 0) | (labels >= true_vocab)) & (labels != ignore_index)
        bad_labels = outside.sum()
    # One vector, one all-reduce MAX: the failed checks, the bad label count, and +-(V_local,
    # H, tokens) so that unequal shapes across ranks show as max != -min.
    h = hidden.shape[-1] if "hidden" not in problems else -1
    n = labels.numel() if "labels" not in problems else -1
    header = torch.tensor([int(k in problems) for k in _CHECKS]
                          + [v_local, -v_local, h, -h, n, -n], dtype=torch.int64)
    # Labels must be the same on every TP rank; the cheap, sufficient check that keeps the chunk
    # collectives in step is the number of labelled tokens.
    labelled = torch.zeros((), dtype=torch.int64, device=device)
    if "labels" not in problems and "hidden" not in problems and labels.numel() > 0:
        labelled = (labels != ignore_index).sum()
    codes = list((must_agree or {}).values())
    agreed = torch.cat([header.to(device), torch.stack([labelled, -labelled]),
                        torch.tensor([c for code in codes for c in (code, -code)], dtype=torch.int64,
                                     device=device),
                        torch.as_tensor(bad_labels, device=device).reshape(1)])
    agreed = reductions.max_over_ranks(agreed, tp_group).tolist()
    agreed, agreed_codes = agreed[:-1 - 2 * len(codes)] + agreed[-1:], agreed[-1 - 2 * len(codes):-1]

    messages = []
    for key, failed in zip(_CHECKS, agreed):
        if failed:
            messages.append(problems.get(key, f"{key}: invalid on another tensor-parallel rank"))
    (v_max, v_min, h_max, h_min, n_max, n_min, l_max, l_min), bad = agreed[len(_CHECKS):-1], agreed[-1]
    if v_max != -v_min and v_max >= 0 and -v_min >= 0:
        messages.append(f"weight: vocab shards differ in size across tensor-parallel ranks "
                        f"({-v_min} to {v_max} rows); Megatron pads the vocab so they are equal")
    if h_max != -h_min and not messages:
        messages.append(f"hidden: hidden size differs across tensor-parallel ranks ({-h_min} to {h_max})")
    if n_max != -n_min and not messages:
        messages.append(f"labels: number of tokens differs across tensor-parallel ranks ({-n_min} to {n_max})")
    if l_max != -l_min and not messages:
        messages.append(f"labels: differ across tensor-parallel ranks ({-l_min} to {l_max} labelled "
                        f"tokens); every rank of tp_group must pass the same labels")
    for name, high, low in zip(must_agree or {}, agreed_codes[0::2], agreed_codes[1::2]):
        if high != -low and not messages:
            messages.append(f"{name}: differs across tensor-parallel ranks; every rank of tp_group "
                            f"must pass the same {name}")
    if bad:
        if outside is not None and int(bad_labels) > 0:
            example = int(labels[outside][0])
            messages.append(f"labels: {int(bad_labels)} label(s) outside [0, vocab_size={true_vocab}) "
                            f"that are not ignore_index={ignore_index} (e.g. {example})")
        else:
            messages.append(f"labels: labels outside [0, vocab_size={true_vocab}) on another "
                            f"tensor-parallel rank")
    if messages:
        raise ValueError(f"{fn_name}: " + "; ".join(messages))
    return true_vocab, l_max


def _sampler_problems(top_k, top_p, min_p, return_topk, true_vocab) -> dict:
    problems = {}
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        problems["top_k"] = f"top_k must be None or an integer >= 1, got {top_k!r}"
    if top_p is not None and (not isinstance(top_p, numbers.Real) or isinstance(top_p, bool)
                              or not 0.0 < top_p <= 1.0):
        problems["top_p"] = f"top_p must be None or a number in (0, 1], got {top_p!r}"
    if min_p is not None and (not isinstance(min_p, numbers.Real) or isinstance(min_p, bool)
                              or not 0.0 <= min_p < 1.0):
        problems["min_p"] = f"min_p must be None or a number in [0, 1), got {min_p!r}"
    if not _is_int(return_topk) or return_topk < 0:
        problems["return_topk"] = f"return_topk must be an integer >= 0, got {return_topk!r}"
    elif return_topk > true_vocab:
        problems["return_topk"] = f"return_topk={return_topk} is larger than the vocab ({true_vocab} tokens)"
    return problems


def _agreement_code(name: str, value) -> int:
    """An int64 that differs when the (validated) setting differs: top_p / min_p by the bits of
    their float value, top_k / return_topk as is, None as -1."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        return -2  # invalid: reported by its own check
    if name in ("top_p", "min_p"):
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return int(value) if _is_int(value) and value < 2**62 else -2


# --------------------------------------------------------------------------------------------
# The shared pipeline: flatten, drop ignored rows, run the chunked statistics.
# --------------------------------------------------------------------------------------------
@dataclass
class TokenStats:
    """Differentiable per-token statistics on the labelled rows, plus how to scatter them back."""

    target: Tensor
    lse: Tensor
    sum_logits: Optional[Tensor]
    expected_logit: Optional[Tensor]
    row_index: Optional[Tensor]  # labelled rows among all (gathered) rows; None = all rows
    out_shape: tuple
    num_rows: int
    anchor: Optional[Tensor] = None  # grad-in-forward: zero scalar carrying dX, dW (add to the loss)
    # sampler fidelity (sampling.py), on the labelled rows
    kept: Optional[Tensor] = None  # bool: the label is in the kept set (None: no filter)
    topk_logprobs: Optional[Tensor] = None  # [rows, k]
    topk_ids: Optional[Tensor] = None  # [rows, k]

    def to_full(self, values: Tensor, fill=0) -> Tensor:
        """[num labelled rows, ...] -> labels.shape + (...) with `fill` at ignored positions
        (differentiable)."""
        shape = self.out_shape + tuple(values.shape[1:])
        if self.row_index is None:
            return values.reshape(shape)
        full = values.new_full((self.num_rows,) + tuple(values.shape[1:]), fill)
        return full.index_put((self.row_index,), values).reshape(shape)


def auto_chunk_size(num_rows: int, v_local: int, device: torch.device, *, hidden_size: int = 0,
                    element_size: int = 2, fp32_weight_grad_buffer: bool = False) -> int:
    """Rows per chunk when the caller gives none: bounded chunks of logits (see the caps above).

    `fp32_weight_grad_buffer`: the weight gradient will be computed here and, once the rows span
    several chunks, summed over them in an fp32 [V_local, H] buffer (i.e. not into Megatron's
    main_grad). One chunk of all rows then needs no such buffer: its single GEMM writes dW in the
    weight's dtype. That is taken whenever its peak memory, all logits + dW, is no larger than the
    chunked peak, one chunk + the fp32 buffer (or the buffer + the cast dW): faster (no fp32
    read-modify-write of dW per chunk, no final cast pass) at no memory cost. CUDA only: the peaks
    assume the Triton backend, which works on the chunk in place (the torch backend on the CPU
    also makes fp32 copies of it).
    """
    v_local = max(v_local, 1)
    if device.type == "cuda":
        rows = max(_AUTO_CHUNK_MIN_ROWS_CUDA, _AUTO_CHUNK_ELEMENTS_CUDA // v_local)
    else:
        rows = max(64, _AUTO_CHUNK_ELEMENTS // v_local)
    num_rows = max(num_rows, 1)
    if fp32_weight_grad_buffer and device.type == "cuda" and num_rows > rows:
        weight_elems = v_local * hidden_size
        chunked_peak = max(rows * v_local * element_size + 4 * weight_elems,
                           (4 + element_size) * weight_elems)
        one_chunk_peak = (num_rows * v_local + weight_elems) * element_size
        if one_chunk_peak <= chunked_peak:
            return num_rows
    return min(num_rows, rows)


def token_statistics(fn_name, hidden, weight, labels, *, tp_group, vocab_size, temperature, ignore_index,
                 chunk_size, sequence_parallel, impl, accumulate_into_main_grad, want_sum_logits,
                 want_entropy, extra_checks=None, token_grads=None, sampler=None) -> TokenStats:
    """Checks, flattening and the chunked statistics shared by every entry point.

    `token_grads`, when given, switches to gradients-in-forward (see LinearLossGradInForward): the
    returned statistics are then plain values and `anchor` carries the gradient.
    `sampler`: {top_k, top_p, min_p, return_topk} of linear_logprobs (sampling.py)."""
    must_agree = None if sampler is None else {name: _agreement_code(name, value) for name, value in sampler.items()}
    true_vocab, num_labelled = _check_arguments(fn_name, hidden, weight, labels, tp_group, vocab_size,
                                                temperature, chunk_size, sequence_parallel, impl,
                                                ignore_index, extra_checks, must_agree)
    tp_size, tp_rank = reductions.group_size(tp_group), reductions.group_rank(tp_group)
    sequence_parallel = bool(sequence_parallel) and tp_size > 1
    v_local, hidden_size = weight.shape
    hidden2d = hidden.reshape(-1, hidden_size)
    flat_labels = labels.reshape(-1)
    num_rows = flat_labels.numel()

    row_index = None if num_labelled == num_rows else (flat_labels != ignore_index).nonzero().squeeze(1)
    row_labels = flat_labels if row_index is None else flat_labels.index_select(0, row_index)
    vocab_start = tp_rank * v_local
    local_target = row_labels - vocab_start
    local_target = torch.where((local_target >= 0) & (local_target < v_local), local_target, -1)

    if not chunk_size:
        chunk_size = auto_chunk_size(
            row_labels.numel(), v_local, hidden.device, hidden_size=hidden_size,
            element_size=weight.element_size(),
            fp32_weight_grad_buffer=(torch.is_grad_enabled() and weight.requires_grad
                                     and not adds_into_main_grad(weight, accumulate_into_main_grad)))
    spec = ChunkSpec(
        tp_group=tp_group,
        backend=select_backend(impl, hidden.device),
        num_valid_cols=min(max(true_vocab - vocab_start, 0), v_local),
        inv_temperature=1.0 / float(temperature),
        chunk_size=chunk_size,
        want_sum_logits=want_sum_logits,
        want_entropy=want_entropy,
        sequence_parallel=sequence_parallel,
        accumulate_into_main_grad=accumulate_into_main_grad,
    )
    anchor = None
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    sampling_spec = None if sampler is None else sampling.sampling_spec(
        **sampler, true_vocab=true_vocab, vocab_start=vocab_start)
    if sampling_spec is not None:  # sampler fidelity: its own chunk loop (sampling.py)
        out = sampling.sampled_statistics(hidden2d, weight, row_index, local_target, row_labels, spec,
                                          sampling_spec, needs_grad)
        return TokenStats(out.target, out.lse, None, out.expected_logit, row_index, tuple(labels.shape),
                          num_rows, kept=out.kept, topk_logprobs=out.topk_logprobs, topk_ids=out.topk_ids)
    if needs_grad and token_grads is not None:
        anchor, target, lse, sum_logits, expected = LinearLossGradInForward.apply(
            hidden2d, weight, row_index, local_target, spec, token_grads)
    elif needs_grad:
        target, lse, sum_logits, expected = LinearSoftmaxStats.apply(
            hidden2d, weight, row_index, local_target, spec)
    else:  # reference / old log-prob passes: no autograd Function, nothing saved
        full_hidden = reductions.gather_sequence(hidden2d, tp_group) if sequence_parallel else hidden2d
        rows = full_hidden if row_index is None else full_hidden.index_select(0, row_index)
        merged = forward_stats(rows, weight, local_target, spec)
        target, lse, sum_logits, expected = merged.target, merged.lse, merged.sum_logits, merged.expected_logit
    return TokenStats(target, lse, sum_logits, expected, row_index, tuple(labels.shape), num_rows, anchor)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    tp_group=None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
    sequence_parallel: bool = False,
    impl: str = "auto",
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    return_topk: int = 0,
    accumulate_into_main_grad: bool = False,
) -> LogprobsOutput:
    """Per-token log p(label) (and entropy) of softmax(hidden @ W_full.T / temperature), or of the
    distribution an inference engine's sampler draws from (`top_k` / `top_p` / `min_p`).

    Never materializes the [tokens, V_local] logits: see the module docs of api.py and chunked.py.
    `weight` is this rank's contiguous vocab shard (rank r owns ids [r*V_local, (r+1)*V_local));
    results are identical on every rank of `tp_group`. dX is the full input gradient (summed over
    TP ranks; reduce-scattered under `sequence_parallel`), dW this shard's gradient.
    `accumulate_into_main_grad=True` (Megatron's gradient_accumulation_fusion): when the weight has
    a `main_grad` buffer the fp32 weight gradient is added into it directly and autograd receives a
    dummy zero gradient (as Megatron's own linear layers do).

    Sampler fidelity (vLLM V1's sampler; sampling.py cites the functions). With z = logits / T over
    the unpadded vocab, per token row:
      1. `min_p` in [0, 1): drop tokens with p_k < min_p * max_j p_j (p = softmax(z)), i.e. keep
         z_k >= max(z) + log(min_p);
      2. `top_k` >= 1: keep tokens with z_k >= the k-th largest remaining z (every token tied
         with the k-th is kept);
      3. `top_p` in (0, 1]: renormalize what is left and keep the smallest prefix of it, in the
         order z descending then global id ascending, whose mass is >= top_p: a token is kept iff
         the renormalized mass ranked strictly before it is < top_p (the first token always is);
      4. renormalize over the kept set K: logprobs = z_y - logsumexp_K(z) if y is in K, else
         -inf with no gradient. Gradients are exact on K (K itself is piecewise constant).
         `return_entropy` then gives the entropy of this renormalized distribution.
    None (or top_p=1, min_p=0, top_k >= vocab) skips a filter; with none left the result is
    today's, bit for bit. vLLM orders exactly tied z arbitrarily at the top_p cut; here the
    lower id comes first.
    `return_topk=k` (0 = off): `LogprobsOutput.topk_logprobs` / `.topk_ids`, labels.shape + (k,):
    log-probs under the full softmax(z) (not the filtered one) of the k most likely global ids,
    descending, ties by lower id, never a padded column; identical on every TP rank; no gradient.
    Ignored positions get logprob 0.0 and id -1. The log-probs and entropy are today's when no
    filter is set.
    Cost: per chunk, every rank's M first tokens are all-gathered (M = max(return_topk, top_k,
    128 with top_p)); rows whose nucleus is longer, or top_k > 1024, take an exact search of up to
    ~32 extra passes over the chunk (those rows) with one small all-reduce each.
    """
    true_vocab = vocab_size if _is_int(vocab_size) and vocab_size > 0 else (
        weight.shape[0] * reductions.group_size(tp_group)
        if isinstance(weight, Tensor) and weight.dim() == 2 else 1)
    sampler = dict(top_k=top_k, top_p=top_p, min_p=min_p, return_topk=return_topk)
    stats = token_statistics(
        "linear_logprobs", hidden, weight, labels, tp_group=tp_group, vocab_size=vocab_size,
        temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size,
        sequence_parallel=sequence_parallel, impl=impl,
        accumulate_into_main_grad=accumulate_into_main_grad,
        want_sum_logits=False, want_entropy=return_entropy,
        extra_checks=_sampler_problems(top_k, top_p, min_p, return_topk, true_vocab), sampler=sampler)
    logprobs = stats.target - stats.lse
    if stats.kept is not None:  # a label outside the kept set: -inf, and no gradient
        logprobs = torch.where(stats.kept, logprobs, float("-inf"))
    logprobs = stats.to_full(logprobs)
    entropy = stats.to_full(stats.lse - stats.expected_logit) if return_entropy else None
    if stats.topk_ids is None:
        return LogprobsOutput(logprobs, entropy)
    return LogprobsOutput(logprobs, entropy, stats.to_full(stats.topk_logprobs),
                          stats.to_full(stats.topk_ids, fill=-1))


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    tp_group=None,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    sequence_parallel: bool = False,
    impl: str = "auto",
    accumulate_into_main_grad: bool = False,
) -> Tensor:
    """F.cross_entropy(full_logits[..., :vocab_size] / T, labels, ...) + z-loss, without the logits.

    Per labelled token: (1 - eps) * (lse - z_y) + eps * (lse - sum_k z_k / vocab_size)
    + z_loss_weight * lse**2, with eps = label_smoothing over the global unpadded vocab.
    "mean" divides by the number of labelled tokens (0.0 with zero gradients when there are none),
    "sum" adds, "none" returns fp32 per-token losses of labels.shape (0 at ignored positions).
    """
    extra = {}
    if reduction not in ("mean", "sum", "none"):
        extra["reduction"] = f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
    if not isinstance(label_smoothing, numbers.Real) or not 0.0 <= label_smoothing < 1.0:
        extra["label_smoothing"] = f"label_smoothing must be in [0, 1), got {label_smoothing!r}"
    if not isinstance(z_loss_weight, numbers.Real) or not z_loss_weight >= 0.0:
        extra["z_loss_weight"] = f"z_loss_weight must be >= 0, got {z_loss_weight!r}"
    smoothing = float(label_smoothing) if "label_smoothing" not in extra else 0.0
    z_weight = float(z_loss_weight) if "z_loss_weight" not in extra else 0.0
    true_vocab = vocab_size or (weight.shape[0] * reductions.group_size(tp_group)
                                if isinstance(weight, Tensor) and weight.dim() == 2 else 1)
    token_grads = None
    if reduction in ("mean", "sum") and isinstance(labels, Tensor):
        # The loss is a scalar whose per-token gradient is known once a chunk is merged: produce
        # dX, dW in the forward pass (3 GEMMs instead of 4). reduction="none" has arbitrary
        # per-token upstream gradients, so it keeps the recompute path.
        def token_grads(merged, positions, num_labelled):
            scale = 1.0 / max(num_labelled, 1) if reduction == "mean" else 1.0
            g_lse = merged.lse * (2.0 * z_weight * scale) + scale if z_weight else torch.full_like(merged.lse, scale)
            g_target = torch.full_like(merged.lse, -(1.0 - smoothing) * scale)
            g_sum = torch.full_like(merged.lse, -smoothing * scale / true_vocab) if smoothing > 0 else None
            return g_target, g_lse, g_sum, None

    stats = token_statistics(
        "linear_cross_entropy", hidden, weight, labels, tp_group=tp_group, vocab_size=vocab_size,
        temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size,
        sequence_parallel=sequence_parallel, impl=impl,
        accumulate_into_main_grad=accumulate_into_main_grad,
        want_sum_logits=smoothing > 0.0, want_entropy=False, extra_checks=extra, token_grads=token_grads)

    per_token = stats.lse - stats.target
    if smoothing > 0.0:
        per_token = (1.0 - smoothing) * per_token + smoothing * (stats.lse - stats.sum_logits / true_vocab)
    if z_weight:
        per_token = per_token + z_weight * stats.lse.square()
    if reduction == "none":
        return stats.to_full(per_token)
    total = per_token.sum()
    if reduction == "mean":
        total = total / max(per_token.numel(), 1)
    return total if stats.anchor is None else total + stats.anchor
