"""The op's entry: `linear_logprobs`, and `token_statistics`, which every fused entry point runs
(linear_logprobs here; the gradients-in-forward losses in losses/, on ops/forward_grad.py).

One token's path: its hidden row (all-gathered first under sequence parallelism) -> a chunk of rows
-> chunk logits on this rank's vocab shard -> backend softmax partials -> merged over TP ranks
(reductions.py) -> per-token target logit, lse, (sum of logits, entropy) -> log-prob / entropy /
loss here. A row whose label is `ignore_index` has no target and gets exactly zero output and zero
gradient; it still goes through the GEMMs, since dropping it would need its count on the host (a
sampling mask's replay as well: its layout is sized from what the host knows, replay.py).

Arguments are checked by one agreement of the TP ranks on the first call of each signature and on
the device afterwards (agreement.py, deferred_errors.py): a later call makes no host sync.
With sampler settings (top_k / top_p / min_p / return_topk) the statistics are those of each row's
kept set (sampling.py's tiling, on the same chunk loop).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple, Optional
import weakref
import zlib

import torch
from torch import Tensor

from . import agreement as agreement_memo, backends, deferred_errors, lean, reductions, replay, sampling
from .agreement import (Agreement, finite_real, fingerprint_pieces, fits_int64, flag_argument, integer_argument,
                        is_int, value_code)
from .forward_grad import PER_ROW, ForwardGradLoss
from .chunked import ChunkSpec, LinearLogprobDlogitsInForward, LinearLossGradInForward, autocast_off, softmax_statistics
from .fast import FAST_CHUNKS, EarlyProduct, StatsWithDlogits, TermsInLaunch, chunk_logits, fused_statistics, last_chunk_start
from .main_grad import adds_into_main_grad, saved_tensors_hooks_active, unpaired_forward_error

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MEMORY_MODES = ("fast", "lean")
# memory_mode="fast": with no `chunk_size`, a chunk of logits holds at most `max_chunk_bytes`
# (default 1 GiB; the op's extra memory is then flat in the number of tokens: one chunk, plus the
# fp32 [V_local, H] weight-gradient accumulator when several chunks share it and dW does not go into
# Megatron's main_grad). The rows are split into chunks of equal size, rounded to the GEMM's 128-row
# tiles. On the CPU the torch backend also makes fp32 copies of a chunk: at most 64 Mi elements.
DEFAULT_MAX_CHUNK_BYTES = 1 << 30
_CHUNK_ROW_MULTIPLE = 128
_AUTO_CHUNK_ELEMENTS_CPU = 64 * 1024 * 1024
# memory_mode="lean": the working set of the tile sweeps (lean.py) on each rank, whatever the number
# of tokens: 400 bytes per row of the whole (padded) vocab (2.4 % of the bf16 logits of 8192 tokens,
# under the 3 % target), at least 32 MiB. Per row of the whole vocab, not of the shard: tiles keep
# their size as tensor parallelism shrinks the shard (half-size tiles made TP=2 launch-bound:
# docs/design.md §10.7).
LEAN_WORKSET_BYTES = 32 * 1024 * 1024
LEAN_WORKSET_PER_VOCAB_ROW = 400


def lean_workset_bytes(v_local: int, tp_size: int) -> int:
    """memory_mode="lean": the working set of the tile sweeps on each rank (see above)."""
    return max(LEAN_WORKSET_BYTES, LEAN_WORKSET_PER_VOCAB_ROW * v_local * tp_size)


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

    def map(self, fn) -> "LogprobsOutput":
        """`fn` applied to every tensor it holds, top-k fields included (None stays None): use this,
        not iteration, to rebuild one (iterating yields the two tuple fields only)."""
        return type(self)(*(None if t is None else fn(t)
                            for t in (self.logprobs, self.entropy, self.topk_logprobs, self.topk_ids)))

    def _replace(self, **changes):
        fields = dict(logprobs=self.logprobs, entropy=self.entropy, topk_logprobs=self.topk_logprobs,
                      topk_ids=self.topk_ids)
        fields.update(changes)
        return type(self)(**fields)

    def __repr__(self):
        extra = "" if self.topk_ids is None else (f", topk_logprobs={self.topk_logprobs!r}, "
                                                  f"topk_ids={self.topk_ids!r}")
        return f"LogprobsOutput(logprobs={self.logprobs!r}, entropy={self.entropy!r}{extra})"


# --------------------------------------------------------------------------------------------
# Argument checks. Each rank collects its own problems and every value that must be the same on
# all ranks (a fingerprint of the labels included) without raising; one small all-reduce then
# makes every rank raise the same error before any real collective (agreement.py).
# --------------------------------------------------------------------------------------------
_CHECKS = ("hidden", "weight", "labels", "temperature", "chunk_size", "max_chunk_bytes", "vocab_size",
           "impl", "ignore_index", "logits_dtype", "memory_mode")
_LABEL_DTYPES = (torch.int64, torch.int32)


@dataclass
class _Agreed:
    true_vocab: int  # the unpadded global vocab size
    # labelled tokens of the call (the same on every rank), read back by the full agreement; None
    # after a remembered signature (not read: the rows are then not dropped, see token_statistics)
    num_labelled: Optional[int]
    # a remembered signature: the code every TP rank must share (the rank check's first piece)
    signature_code: Optional[int] = None
    # a sampling mask's (labelled rows with a set, without one), read by the full agreement only
    mask_rows: Optional[tuple] = None
    # the signature's first call had a kept set at every labelled row (and one at least): every call
    # of it then replays without the plain pass, a later one checking on the device that this holds
    mask_sets_everywhere: bool = False
    # a remembered signature: the signature itself (agreement.still_remembered tells if it still is)
    signature: Optional[tuple] = None

    @property
    def remembered(self) -> bool:
        return self.num_labelled is None


def _local_checks(agreement: Agreement, hidden, weight, labels, tp_size, vocab_size, temperature,
                  chunk_size, sequence_parallel, impl, ignore_index, logits_dtype, memory_mode) -> None:
    """This rank's own checks (nothing raised here: each failure is recorded by argument name)."""
    fail = agreement.fail
    if not isinstance(hidden, Tensor) or hidden.dim() < 1 or hidden.dtype not in _FLOAT_DTYPES:
        fail("hidden", "hidden must be a float32/bfloat16/float16 tensor of shape [..., H]")
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        fail("weight", "weight must be a 2-D tensor [V_local, H]")
    if not agreement.failed("hidden", "weight"):
        if hidden.shape[-1] != weight.shape[1]:
            fail("weight", f"weight has hidden size {weight.shape[1]} but hidden has "
                           f"{hidden.shape[-1]} (H mismatch)")
        elif weight.dtype != hidden.dtype:
            fail("weight", f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
        elif weight.device != hidden.device:
            fail("weight", f"weight is on {weight.device} but hidden is on {hidden.device}")
    if not isinstance(labels, Tensor):
        fail("labels", "labels must be an integer tensor")
    elif labels.dtype not in _LABEL_DTYPES:
        fail("labels", f"labels must be int64 (or int32) class ids, got dtype {labels.dtype}")
    elif not agreement.failed("hidden"):
        expected = tuple(hidden.shape[:-1])
        if sequence_parallel:
            if hidden.dim() < 2:
                fail("hidden", "sequence_parallel needs hidden of shape [S/TP, ..., H]")
            else:
                expected = (hidden.shape[0] * tp_size,) + expected[1:]
        if not agreement.failed("hidden") and tuple(labels.shape) != expected:
            fail("labels", f"labels shape {tuple(labels.shape)} does not match "
                           f"{'gathered ' if sequence_parallel and tp_size > 1 else ''}"
                           f"hidden.shape[:-1] = {expected}")
        elif labels.device != hidden.device:
            fail("labels", f"labels are on {labels.device} but hidden is on {hidden.device}")
    if not finite_real(temperature) or not temperature > 0:
        fail("temperature", f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (not is_int(chunk_size) or chunk_size <= 0):
        fail("chunk_size", f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    if not fits_int64(ignore_index):
        fail("ignore_index", f"ignore_index must be an integer (int64), got {ignore_index!r}")
    if not agreement.failed("weight"):
        padded_vocab = weight.shape[0] * tp_size
        if vocab_size is not None and (not is_int(vocab_size) or not 0 < vocab_size <= padded_vocab):
            fail("vocab_size", f"vocab_size must be an integer in [1, V_local * tp_size = "
                               f"{padded_vocab}], got {vocab_size!r}")
    if impl not in backends.IMPLS:
        fail("impl", f"impl must be one of {', '.join(map(repr, backends.IMPLS))}, got {impl!r}")
    elif impl == "triton" and not backends.triton_available():
        fail("impl", "impl='triton' was requested but triton cannot be imported")
    if logits_dtype not in (None, torch.float32):
        fail("logits_dtype", f"logits_dtype must be None (the input dtype) or torch.float32, "
                             f"got {logits_dtype!r}")
    if memory_mode not in MEMORY_MODES:
        fail("memory_mode", f"memory_mode must be 'fast' or 'lean', got {memory_mode!r}")


# A call whose arguments repeat those of a remembered call (same types and values, same tensor
# layouts, the same checks passed) has the same signature and passes the same local checks: it
# skips building the agreement (~20 plain values registered and compared) and the checks, as long
# as the agreement still remembers that signature. Keyed by the raw arguments, so a call that
# differs in anything the checks read (chunk_size=True where 1 passed) misses and is checked.
_REMEMBERED_CALLS: "OrderedDict[tuple, tuple]" = OrderedDict()  # call key -> (signature, _Agreed)
agreement_memo.MEMOS.append(_REMEMBERED_CALLS)


def _call_key(fn_name, hidden, weight, labels, tp_group, plain: tuple, extra_checks: dict, must_agree: dict,
              mask_check) -> Optional[tuple]:
    """The raw arguments of a call as a dict key; None where the call cannot take the shortcut
    (a failed check, something that is not a tensor). The key may hold an unhashable value: the
    caller's lookup tells (hashing the key once, not twice, on every call)."""
    if not (isinstance(hidden, Tensor) and isinstance(weight, Tensor) and isinstance(labels, Tensor)):
        return None
    for message in extra_checks.values():
        if message is not None:
            return None
    agreed = tuple([(name, "tensor", tuple(value.shape), value.dtype) if isinstance(value, Tensor)
                    else (name, CallValue, type(value.value)) if isinstance(value, CallValue)
                    else (name, type(value), value) for name, value in must_agree.items()])
    options = agreement_memo.typed_options(plain)
    if options is None:
        return None
    return (fn_name, id(tp_group), hidden.shape, hidden.dtype, hidden.device, weight.shape, weight.dtype,
            weight.device, labels.shape, labels.dtype, labels.device, options,
            tuple(extra_checks), agreed, _mask_layout(mask_check))


def _mask_layout(mask_check) -> Optional[tuple]:
    """A sampling mask's part of a call key: its presence and layout, as in the signature (not its
    contents, nor how many ids it keeps: replay.layout_key)."""
    if mask_check is None:
        return None
    if not mask_check.usable:
        return (mask_check.present,)
    return (True,) + replay.layout_key(mask_check)


def masked_labels(labels, label_mask: Optional[Tensor], ignore_index):
    """`labels` with ignore_index where `label_mask` (the labels' shape) is 0: masked tokens have no
    label. (A bad ignore_index, which the agreement refuses on every rank, stands as -100 meanwhile.)"""
    if label_mask is None or not isinstance(labels, Tensor):
        return labels
    return labels.masked_fill(label_mask == 0, ignore_index if fits_int64(ignore_index) else -100)


def _check_arguments(fn_name, hidden, weight, labels, tp_group, *, vocab_size, temperature, chunk_size,
                     sequence_parallel, impl, ignore_index, logits_dtype, memory_mode, want_entropy,
                     grad_path, max_chunk_bytes, extra_checks, must_agree, mask_check=None,
                     may_remember=True, label_mask=None) -> _Agreed:
    """Raise the same ValueError on every TP rank for bad input or arguments that differ across
    ranks; else return what the ranks agreed on. One all-reduce of a small int64 vector and one
    read-back, on the first call of a signature (`Agreement.signature`: the Python-level
    arguments, shapes, dtypes, group). A later call of a remembered signature makes neither: what
    depends on the tensors' contents is then checked on the device (token_statistics).
    `may_remember`: False where a later call may not skip the agreement (sampler settings, whose
    collectives the checks guard). `label_mask`: positions to take as ignored (token_statistics)."""
    call_key = _call_key(fn_name, hidden, weight, labels, tp_group,
                         (vocab_size, temperature, chunk_size, sequence_parallel, impl, ignore_index, logits_dtype,
                          memory_mode, want_entropy, grad_path, max_chunk_bytes, label_mask is not None),
                         extra_checks, must_agree, mask_check) if may_remember else None
    if call_key is not None:
        try:
            hit = _REMEMBERED_CALLS.get(call_key)
        except TypeError:  # an unhashable value: no shortcut
            hit = call_key = None
        if hit is not None and agreement_memo.still_remembered(hit[0]):
            return hit[1]
    labels = masked_labels(labels, label_mask, ignore_index)  # (what the checks below see)
    tp_size = reductions.group_size(tp_group)
    device = hidden.device if isinstance(hidden, Tensor) else torch.device("cpu")
    agreement = Agreement(fn_name, tp_group, device, _CHECKS + tuple(k for k in extra_checks if k not in _CHECKS))
    _local_checks(agreement, hidden, weight, labels, tp_size, vocab_size, temperature, chunk_size,
                  sequence_parallel, impl, ignore_index, logits_dtype, memory_mode)
    if max_chunk_bytes is not None and not (is_int(max_chunk_bytes) and max_chunk_bytes > 0):
        agreement.fail("max_chunk_bytes", f"max_chunk_bytes must be a positive integer or None, got "
                                          f"{max_chunk_bytes!r}")
    for name, message in extra_checks.items():
        if message:
            agreement.fail(name, message)

    tensors_ok = not agreement.failed("hidden", "weight", "labels")
    v_local = weight.shape[0] if not agreement.failed("weight") else -1
    true_vocab = (vocab_size if vocab_size is not None and not agreement.failed("vocab_size")
                  else max(v_local, 0) * tp_size)
    # The signature first (plain values: shapes, dtypes, options), then what depends on contents.
    # Shapes and dtypes first: the more specific message wins for an argument.
    agreement.equal("weight", v_local, "weight: vocab shards differ in size across tensor-parallel "
                    "ranks; Megatron pads the vocab so that they are equal", show_range=True)
    agreement.equal("hidden", hidden.shape[-1] if not agreement.failed("hidden") else -1,
                    "hidden: hidden size differs across tensor-parallel ranks", show_range=True)
    agreement.equal("hidden", str(hidden.dtype) if not agreement.failed("hidden") else None,
                    "hidden: dtype differs across tensor-parallel ranks")
    agreement.equal("hidden", tuple(hidden.shape) if not agreement.failed("hidden") else None,
                    "hidden: shape differs across tensor-parallel ranks")
    agreement.equal("labels", labels.numel() if not agreement.failed("labels") else -1,
                    "labels: number of tokens differs across tensor-parallel ranks", show_range=True)
    labels_message = ("labels: differ across tensor-parallel ranks (ids or positions); every rank of "
                      "tp_group must pass the same labels")
    agreement.equal_layout("labels", labels if tensors_ok else None, labels_message)
    # Every option that changes the result or the sequence of collectives.
    agreement.equal("temperature", float(temperature) if not agreement.failed("temperature") else None)
    agreement.equal("vocab_size", true_vocab)
    agreement.equal("ignore_index", ignore_index if not agreement.failed("ignore_index") else None)
    agreement.equal("chunk_size", chunk_size if not agreement.failed("chunk_size") else -1)
    agreement.equal("max_chunk_bytes", max_chunk_bytes if not agreement.failed("max_chunk_bytes") else -1)
    # the backend that will run ("auto" and "torch" agree on a CPU)
    agreement.equal("impl", backends.select(impl, device).name if not agreement.failed("impl") else None)
    agreement.equal("logits_dtype", str(logits_dtype))
    agreement.equal("memory_mode", memory_mode if not agreement.failed("memory_mode") else None)
    agreement.equal("return_entropy", bool(want_entropy))
    agreement.equal("sequence_parallel", bool(sequence_parallel))
    agreement.equal("requires_grad", grad_path,
                    "requires_grad: torch.is_grad_enabled() or hidden/weight.requires_grad differ "
                    "across tensor-parallel ranks (their backward collectives would not match)")
    tensors_to_agree = {}
    for name, value in must_agree.items():
        if isinstance(value, Tensor):
            agreement.equal_layout(name, value)
            tensors_to_agree[name] = value
        elif isinstance(value, CallValue):
            agreement.equal_per_call(name, value.value)
        else:
            agreement.equal(name, value)
    if mask_check is not None:  # linear_logprobs: the sampling mask's sizes, on every rank
        mask_check.register_layout(agreement)
    if agreement.remembered() and may_remember:
        facts = agreement.remembered_facts() or {}
        signature = agreement.signature()
        agreed = _Agreed(true_vocab, None, signature_code=agreement.signature_code(),
                         mask_sets_everywhere=facts.get("mask_sets_everywhere", False), signature=signature)
        if call_key is not None:
            _REMEMBERED_CALLS[call_key] = (signature, agreed)
            while len(_REMEMBERED_CALLS) > agreement_memo.REMEMBERED_SIGNATURES:
                _REMEMBERED_CALLS.popitem(last=False)
        return agreed

    outside, labelled, bad_labels = None, 0, 0
    if tensors_ok and not agreement.failed("ignore_index") and labels.numel() > 0:
        # (few kernels: every launch before the first GEMM leaves the GPU idle)
        kept = labels != ignore_index
        outside = (labels.clamp(0, max(true_vocab - 1, 0)) != labels) & kept
        bad_labels = outside.sum()
        labelled = kept.sum()
    labelled_key = agreement.equal_count(
        "labels", labelled, "labels: number of labelled tokens differs across tensor-parallel ranks; "
        "every rank of tp_group must pass the same labels")
    # The labels themselves (ids and positions), by a fingerprint: equal counts are not enough.
    agreement.equal_values("labels", labels if tensors_ok else None, labels_message)
    bad_key = agreement.maximum_count("labels", bad_labels)
    for name, value in tensors_to_agree.items():
        agreement.equal_values(name, value)
    if mask_check is not None:  # the sampling mask's values and bad entries, on every rank
        mask_check.register_contents(agreement, device)
    # what calls of remembered signatures found on the device since the last read (deferred_errors.py)
    deferred_key = agreement.maximum_count("deferred errors", deferred_errors.take(device))

    def bad_label_message(agreed):
        if not agreed[bad_key]:
            return []
        if outside is not None and int(bad_labels) > 0:
            example = int(labels[outside][0])
            return [f"labels: {int(bad_labels)} label(s) outside [0, vocab_size={true_vocab}) "
                    f"that are not ignore_index={ignore_index} (e.g. {example})"]
        return [f"labels: labels outside [0, vocab_size={true_vocab}) on another tensor-parallel rank"]

    def messages(agreed):
        found = deferred_errors.messages_of(agreed[deferred_key])
        return (bad_label_message(agreed) + (mask_check.messages(agreed) if mask_check is not None else [])
                + ([f"an earlier call (after the first of its signature) found {'; '.join(found)}, and "
                    f"returned NaN"] if found else []))

    agreed = agreement.agree(messages)
    mask_rows = mask_check.row_counts(agreed) if mask_check is not None else None
    sets_everywhere = mask_rows is not None and mask_rows[0] > 0 and mask_rows[1] == 0
    if may_remember:
        agreement.remember({"mask_sets_everywhere": sets_everywhere})
        if call_key is not None:  # a shortcut kept from before the signature was evicted holds old facts
            _REMEMBERED_CALLS.pop(call_key, None)
    return _Agreed(true_vocab, agreed[labelled_key], mask_rows=mask_rows, mask_sets_everywhere=sets_everywhere)


def _autocast_inputs(hidden, weight):
    """Under torch.autocast for the inputs' device, the op computes in the autocast dtype: cast
    hidden and weight as F.linear would (differentiably: the casts' backward returns gradients in
    the original dtypes). The op itself then runs with autocast off (chunked.autocast_off)."""
    if not (isinstance(hidden, Tensor) and isinstance(weight, Tensor)):
        return hidden, weight
    try:
        if not torch.is_autocast_enabled(hidden.device.type):
            return hidden, weight
        dtype = torch.get_autocast_dtype(hidden.device.type)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        return hidden, weight

    def cast(t):
        return t.to(dtype) if t.dtype in _FLOAT_DTYPES and t.dtype != dtype else t

    return cast(hidden), cast(weight)


# --------------------------------------------------------------------------------------------
# The shared pipeline: flatten, drop ignored rows, run the chunked statistics.
# --------------------------------------------------------------------------------------------
class StraightFacts(NamedTuple):
    """What token_statistics decided for a call whose route a later call with the same arguments may
    run straight (remembered_routes.py): which route, the chunk spec (no first product, no rank
    check: a call makes its own), the remembered signature, the label kernel's arguments."""

    # "gradients in forward, one launch" (its statistics and dlogits from stats_dlogits), "gradients
    # in forward, terms in one launch" (the loss's per-token terms too: fast.TermsInLaunch), "gradients
    # in forward, row kernel" (the backend's one pass, a factor per row), "gradients in forward,
    # statistics then dlogits", "log-probs forward-only" (TP = 1: the stats launch finishes each
    # row), "log-probs forward-only, merged" (TP > 1), "log-probs dlogits in forward"
    route: str
    spec: Any
    signature: tuple
    ignore_index: int
    true_vocab: int
    vocab_start: int = 0  # this rank's first column
    # TP > 1: the signature's code, the rank check's first piece (the labels' and the must-agree
    # tensors' fingerprints follow, from the label kernel); None at TP = 1 (nothing to compare)
    signature_code: Optional[int] = None
    # TP > 1: the group, held weakly (a route must not keep a destroyed group alive until the
    # interpreter's teardown: gloo aborted there); `spec` holds none
    group: Optional[weakref.ref] = None


def _straight_facts(route: str, agreed: _Agreed, spec, ignore_index, *, tp_group, weight, weight_param,
                    accumulate_into_main_grad, applies: bool = True) -> Optional[StraightFacts]:
    """StraightFacts where a later call of this call's arguments may run its route straight: a
    remembered signature, no autocast cast of the weight, no main_grad (the spec names that call's
    weight; and whether a weight has one is not in the route's key)."""
    if not (applies and agreed.remembered and weight is weight_param and not accumulate_into_main_grad):
        return None
    several = reductions.group_size(tp_group) > 1
    return StraightFacts(route, replace(spec, first_product=None, rank_check=None, tp_group=None), agreed.signature,
                         ignore_index, agreed.true_vocab, reductions.group_rank(tp_group) * weight.shape[0],
                         agreed.signature_code if several else None, weakref.ref(tp_group) if several else None)


@dataclass
class TokenStats:
    """Differentiable per-token statistics on the labelled rows, plus how to scatter them back."""

    target: Tensor
    lse: Tensor
    sum_logits: Optional[Tensor]
    entropy: Optional[Tensor]
    row_index: Optional[Tensor]  # labelled rows among all (gathered) rows; None = all rows
    out_shape: tuple
    num_rows: int
    anchor: Optional[Tensor] = None  # with forward_grad: zero scalar carrying dX, dW (add to the loss)
    max: Optional[Tensor] = None  # lse = max + log_sum_exp (plain values, see MergedStats)
    log_sum_exp: Optional[Tensor] = None
    # sampler fidelity (sampling.py), on the labelled rows
    kept: Optional[Tensor] = None  # bool: the label is in the kept set (None: no filter)
    # kept is True at ignored rows (replay's): where(kept, logprob(), -inf) keeps logprob()'s zeros
    kept_at_ignored: bool = False
    topk_logprobs: Optional[Tensor] = None  # [rows, k]
    topk_ids: Optional[Tensor] = None  # [rows, k]
    num_labelled: Any = None  # labelled tokens: an int (the agreement's), or a LabelledCount on the device
    # where the rows were not dropped: which rows are labelled (bool [rows]), and fp32 [1] to add to
    # every result: NaN where the device checks found bad contents (deferred_errors.py), else 0
    labelled: Optional[Tensor] = None
    poison: Optional[Tensor] = None
    backend: Any = None  # the call's (backends.Backend): negative_logprob_total's kernel
    # the differentiable log-probs themselves where the statistics node made them
    # (chunked.LinearLogprobDlogitsInForward; target and lse are then plain values)
    logprob_value: Optional[Tensor] = None
    # where a later call with the same arguments may run this call's route straight (remembered_routes.py)
    straight: Optional["StraightFacts"] = None

    def logprob(self) -> Tensor:
        """log p_y of the labelled rows (0 in rows of ignored labels, with a zero gradient):
        differentiable as target - lse, valued as (target - max) - log_sum_exp (exact where
        target - lse would round at lse's scale)."""
        if self.logprob_value is not None:
            return self.logprob_value
        return _labelled_logprob(self.target, self.lse, self.max, self.log_sum_exp, self.labelled,
                                 backend=self.backend)

    def negative_logprob(self) -> Tensor:
        """-logprob(): the cross-entropy of each labelled row, (max - target) + log_sum_exp (the
        negated log-probs where the statistics node made them: the same bits)."""
        if self.logprob_value is not None:
            return -self.logprob_value
        return _labelled_logprob(self.target, self.lse, self.max, self.log_sum_exp, self.labelled, True)

    def negative_logprob_total(self, mean: bool) -> Optional[Tensor]:
        """poisoned(Σ negative_logprob()), divided by the labelled rows if `mean`, as a plain value
        (no gradient: the loss's gradient rides on the anchor) in one backend call; None where
        the statistics are differentiable or the count is not on the device."""
        if (self.backend is None or self.anchor is None or self.row_index is not None
                or not isinstance(self.num_labelled, LabelledCount)):
            return None
        return self.backend.labelled_loss_sum(self.target, self.max, self.log_sum_exp, self.labelled,
                                              self.num_labelled.inverse if mean else None, self.poison)

    def to_full(self, values: Tensor, fill=0, masked: bool = False) -> Tensor:
        """[num labelled rows, ...] -> labels.shape + (...) with `fill` at ignored positions
        (differentiable; `masked`: the values hold `fill` there already, as `logprob()`'s do); NaN
        everywhere if the device checks found bad contents."""
        shape = self.out_shape + tuple(values.shape[1:])
        if self.row_index is None:
            full = self.poisoned(values if masked else self.only_labelled(values, fill))
            return full if full.shape == shape else full.reshape(shape)  # (flat labels: no view, no node)
        full = values.new_full((self.num_rows,) + tuple(values.shape[1:]), fill)
        return full.index_put((self.row_index,), values).reshape(shape)

    def only_labelled(self, values: Tensor, fill=0) -> Tensor:
        """`fill` in the rows of ignored labels (rows that went through the chunk loop without a
        label); the gradient there is zero."""
        if self.labelled is None:
            return values
        keep = self.labelled.reshape((-1,) + (1,) * (values.dim() - 1))
        return torch.where(keep, values, fill)  # (a Python fill: no host-to-device copy)

    def poisoned(self, values: Tensor) -> Tensor:
        """NaN in place of every value (floating point) if the call's device checks found bad
        contents: never a silently wrong value (deferred_errors.py)."""
        if self.poison is None or not values.is_floating_point():
            return values
        return values + (self.poison if values.dim() else self.poison[0])  # NaN + x = NaN; 0 + x = x

    def mean_of_labelled(self, total: Tensor) -> Tensor:
        """total / max(labelled tokens, 1)."""
        if isinstance(self.num_labelled, LabelledCount):
            return total * self.num_labelled.inverse
        return total / max(int(self.num_labelled if self.num_labelled is not None else self.num_rows), 1)


def _labelled_logprob(target, lse, row_max, log_sum_exp, labelled, negative=False, backend=None) -> Tensor:
    """_LabelledLogprob's value, through its autograd Function only where a gradient can flow (an
    apply is host time of its own: forward-only passes, and the plain statistics of the losses
    whose gradients were made in the forward, need none). `backend`: the call's, whose
    `labelled_logprob` makes the log-probs (Triton: one launch, the same values bit for bit)."""
    if torch.is_grad_enabled() and (target.requires_grad or lse.requires_grad):
        return _LabelledLogprob.apply(target, lse, row_max, log_sum_exp, labelled, negative, backend)
    return _labelled_logprob_value(target, row_max, log_sum_exp, labelled, negative, backend)


def _labelled_logprob_value(target, row_max, log_sum_exp, labelled, negative, backend) -> Tensor:
    if backend is not None and not negative:
        return backend.labelled_logprob(target, row_max, log_sum_exp, labelled, None)
    return reductions.labelled_log_prob(target, row_max, log_sum_exp, labelled, negative)


class _LabelledLogprob(torch.autograd.Function):
    """log p_y = (target - max) - log_sum_exp (exact where target - lse would round at lse's
    scale), 0 in rows whose label is ignored (`labelled` False; None: every row); its gradient is
    that of target - lse: +g to target, -g to lse. Two kernels each way, where autograd through
    the same expression takes six."""

    @staticmethod
    def forward(ctx, target, lse, row_max, log_sum_exp, labelled, negative=False, backend=None):
        ctx.labelled, ctx.negative = labelled, negative
        return _labelled_logprob_value(target, row_max, log_sum_exp, labelled, negative, backend)

    @staticmethod
    def backward(ctx, grad):
        if ctx.labelled is not None:
            grad = torch.where(ctx.labelled, grad, 0.0)
        if ctx.negative:
            return -grad, grad, None, None, None, None, None
        return grad, -grad, None, None, None, None, None


def auto_chunk_size(num_rows: int, v_local: int, device: torch.device, *, logits_element_size: int = 2,
                    max_chunk_bytes: Optional[int] = None) -> int:
    """Rows per chunk when the caller gives none: chunks of equal size whose logits
    ([rows, v_local] of `logits_element_size` bytes) fit in `max_chunk_bytes` (None: 1 GiB), as
    many rows as fit rounded down to a multiple of 128 (at least 1 row)."""
    budget = DEFAULT_MAX_CHUNK_BYTES if max_chunk_bytes is None else int(max_chunk_bytes)
    v_local, num_rows = max(v_local, 1), max(num_rows, 1)
    max_rows = budget // (v_local * logits_element_size)
    if device.type != "cuda":
        max_rows = min(max_rows, _AUTO_CHUNK_ELEMENTS_CPU // v_local)
    if max_rows >= _CHUNK_ROW_MULTIPLE:
        max_rows -= max_rows % _CHUNK_ROW_MULTIPLE
    max_rows = max(max_rows, 1)
    if num_rows <= max_rows:
        return num_rows
    num_chunks = -(-num_rows // max_rows)
    rows = -(-num_rows // num_chunks)  # equal chunks: the last one is not a sliver
    if max_rows >= _CHUNK_ROW_MULTIPLE:
        rows = min(max_rows, -(-rows // _CHUNK_ROW_MULTIPLE) * _CHUNK_ROW_MULTIPLE)
    return rows


def expected_upstream_grad_problem(value) -> Optional[str]:
    """The check of `expected_upstream_grad` (None when it passes): None, or a finite number != 0.

    Where the loss's gradient is made in the forward pass and its weight gradient goes into
    Megatron's main_grad, the forward adds expected_upstream_grad x dW there (no buffer of the op's
    own), and the backward checks that the gradient it receives is that value (else main_grad is
    poisoned: main_grad.check_upstream_grad). Without it dW waits in an fp32 buffer for the backward.
    Elsewhere it changes nothing: every other path applies the upstream gradient in the backward."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        return ("expected_upstream_grad must be a Python number (the value is needed on the host "
                "before the first GEMM), got a tensor")
    if not finite_real(value) or value == 0:
        return f"expected_upstream_grad must be None or a finite number other than 0, got {value!r}"
    return None


def _anchor_from_token_grads(forward_grad: ForwardGradLoss, target, lse, sum_logits, entropy, row_max,
                             log_sum_exp, row_index, num_labelled, labelled) -> Tensor:
    """Recompute path for a loss with known per-token gradients (fp16): a zero scalar whose
    gradient w.r.t. the differentiable statistics is forward_grad's (so backward gets them already
    multiplied by the upstream gradient, in fp32, as the unfused path does)."""
    detached = [None if t is None else t.detach() for t in (target, lse, sum_logits, entropy)]
    merged = reductions.MergedStats(lse=detached[1], target=detached[0], sum_logits=detached[2],
                                    entropy=detached[3], max=row_max, log_sum_exp=log_sum_exp)
    positions = row_index if row_index is not None else slice(0, lse.shape[0])
    grads = forward_grad.token_grads(merged, positions, num_labelled).only_rows(labelled)
    terms = [(g * stat).sum() for g, stat in zip((grads.target, grads.lse, grads.sum_logits, grads.entropy),
                                                 (target, lse, sum_logits, entropy))
             if g is not None and stat is not None]
    if not terms:
        return lse.new_zeros(())
    carrier = torch.stack(terms).sum()
    return carrier - carrier.detach()


def token_statistics(fn_name, hidden, weight, labels, *, tp_group, vocab_size, temperature, ignore_index,
                     chunk_size, sequence_parallel, impl, accumulate_into_main_grad, want_sum_logits,
                     want_entropy, logits_dtype=None, memory_mode="fast", max_chunk_bytes=None,
                     extra_checks=None, must_agree=None, forward_grad: Optional[ForwardGradLoss] = None,
                     sampler=None,
                     expected_upstream_grad=None, mask_check=None, logprob_only: bool = False,
                     ahead: Optional[tuple] = None, label_mask: Optional[Tensor] = None) -> TokenStats:
    """Checks, flattening and the chunked statistics shared by every entry point.

    `extra_checks`: {argument name: error message, or None when it passed}, the entry point's own
    checks (the same names on every rank). `must_agree`: {name: value or tensor} that must be the
    same on every TP rank (a tensor is compared by fingerprint). Both join the one agreement.
    `forward_grad`, when given, switches to gradients-in-forward (forward_grad.py,
    chunked.LinearLossGradInForward): the returned statistics are then plain values and `anchor`
    carries the gradient. fp16 inputs keep that contract on the recompute path (see
    LinearLossGradInForward on why).
    `expected_upstream_grad`: the gradient the anchor will receive, when the caller knows it at
    forward time (see check_expected_upstream_grad).
    `logits_dtype`: None (the input dtype, like Megatron's output layer) or torch.float32.
    `memory_mode`: "fast" (chunks of logits, `chunk_size`) or "lean" (tiles, lean.py; `chunk_size`
    is not used).
    `sampler`: linear_logprobs' {top_k, top_p, min_p, return_topk} (sampling.py; they join
    `must_agree`: they decide the collectives made).
    `mask_check`: linear_logprobs' replay.MaskCheck (every rank passes one, with or without a
    mask: its sizes join the signature, its entries the agreement, or the device checks on a
    remembered signature); a mask with entries switches to replay.py's statistics.
    `logprob_only`: the caller differentiates `logprob()` alone (linear_logprobs without entropy,
    linear_cross_entropy's per-token losses without smoothing or z-loss):
    a call of fast chunks then makes the dlogits of its only or last chunk in the forward
    (chunked.LinearLogprobDlogitsInForward).
    `ahead`: first_product_ahead's (key, product), where the entry point launched it before its own
    argument handling (None: launched here).
    `label_mask` (the labels' shape; GRPO's mask): a position where it is 0 is ignored, as if its
    label were ignore_index; with gradients in the forward the label kernel reads it (no masked copy
    of the labels), elsewhere the labels are filled first (`masked_labels`)."""
    ahead_key, ahead_product = ahead if ahead is not None else first_product_ahead(
        fn_name, hidden, weight, impl, chunk_size, max_chunk_bytes, memory_mode, logits_dtype, sequence_parallel,
        want_entropy, want_sum_logits)
    vocab_size, ignore_index, chunk_size, max_chunk_bytes = map(
        integer_argument, (vocab_size, ignore_index, chunk_size, max_chunk_bytes))
    sequence_parallel, accumulate_into_main_grad = map(flag_argument, (sequence_parallel, accumulate_into_main_grad))
    weight_param = weight
    hidden, weight = _autocast_inputs(hidden, weight)
    if isinstance(labels, Tensor) and labels.dtype == torch.int32:
        labels = labels.long()
    tensors = isinstance(hidden, Tensor) and isinstance(weight, Tensor)
    needs_dx = tensors and torch.is_grad_enabled() and hidden.requires_grad
    needs_grad = tensors and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    # Gradients in the forward pass are a side effect of the forward: not where autograd may drop
    # saved tensors and run the forward again during backward (saved-tensor hooks: non-reentrant
    # checkpoint): the recompute path's forward has none.
    grad_in_forward = (needs_grad and forward_grad is not None and hidden.dtype != torch.float16
                       and not saved_tensors_hooks_active())
    if label_mask is not None and not grad_in_forward:  # (paths where more than the label kernel reads labels)
        labels, label_mask = masked_labels(labels, label_mask, ignore_index), None
    main_grad_param = (weight_param if isinstance(weight_param, Tensor)
                       and adds_into_main_grad(weight_param, accumulate_into_main_grad) else None)
    extra_checks = dict(extra_checks or {})
    # (a truthy string, 'no' included, must not switch an option on, as in the losses' options)
    extra_checks["flags"] = next((f"{name} must be True or False, got {value!r}" for name, value in (
        ("sequence_parallel", sequence_parallel), ("accumulate_into_main_grad", accumulate_into_main_grad),
        ("return_entropy", want_entropy)) if not isinstance(value, bool)), None)
    extra_checks["main_grad"] = unpaired_forward_error(main_grad_param) if needs_grad else None
    extra_checks["expected_upstream_grad"] = expected_upstream_grad_problem(expected_upstream_grad)
    if not extra_checks["expected_upstream_grad"] and expected_upstream_grad is not None:
        # (Megatron's g divides by the micro-batch's token count: a new value every call, compared
        # across ranks, not part of the signature)
        must_agree = {**(must_agree or {}), "expected_upstream_grad": CallValue(float(expected_upstream_grad))}
    # Sampler settings run the full agreement on every call (its checks guard their collectives);
    # every other call, a sampling mask's included, runs it on the first call of its signature only
    # and then checks the contents on the device. The rows of ignored labels go through the chunk
    # loop: no count to read back.
    may_remember = not any(v is not None and v != 0 for v in (sampler or {}).values())
    agreed = _check_arguments(
        fn_name, hidden, weight, labels, tp_group, vocab_size=vocab_size, temperature=temperature,
        chunk_size=chunk_size, sequence_parallel=sequence_parallel, impl=impl,
        ignore_index=ignore_index, logits_dtype=logits_dtype, memory_mode=memory_mode,
        want_entropy=want_entropy, grad_path=(needs_grad, needs_dx, grad_in_forward),
        max_chunk_bytes=max_chunk_bytes,
        extra_checks=extra_checks, must_agree={**(must_agree or {}), **(sampler or {})}, mask_check=mask_check,
        may_remember=may_remember, label_mask=label_mask)
    tp_size, tp_rank = reductions.group_size(tp_group), reductions.group_rank(tp_group)
    sequence_parallel = bool(sequence_parallel) and tp_size > 1
    v_local, hidden_size = weight.shape
    # (no reshape where the layout is already flat: a view is a dispatched op, and one of hidden an
    # autograd node whose backward is another)
    hidden2d = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden_size)
    flat_labels = labels if labels.dim() == 1 else labels.reshape(-1)
    num_rows = flat_labels.numel()
    if logits_dtype == hidden.dtype:
        logits_dtype = None
    vocab_start = tp_rank * v_local

    backend = backends.select(impl, hidden.device)
    num_valid_cols = min(max(agreed.true_vocab - vocab_start, 0), v_local)  # this shard's columns below the vocab
    lean_tiles = None
    if memory_mode == "lean":
        element_size = 4 if logits_dtype is not None else weight.element_size()
        lean_tiles = lean.tile_sizes(
            num_rows, v_local, hidden_size, weight.element_size(),
            lean_workset_bytes(v_local, tp_size),
            tile_bytes_per_element=element_size + backend.tile_scratch_bytes,
            weight_grad_accumulates=main_grad_param is not None)
    sampling_spec = None if sampler is None else sampling.sampling_spec(
        **sampler, true_vocab=agreed.true_vocab, vocab_start=vocab_start)
    if not chunk_size:
        chunk_size = auto_chunk_size(
            num_rows, v_local, hidden.device, max_chunk_bytes=max_chunk_bytes,
            logits_element_size=4 if logits_dtype is not None else weight.element_size())
    # a sampling mask with entries: replay (replay.py); one without entries, or (where the full
    # agreement counted them) without a set at a labelled position, is today's path
    mask_entries = (mask_check is not None and mask_check.usable and mask_check.ids.numel() > 0 and num_rows > 0)
    # how the rows and the vocab are walked: lean tiles, the sampler's chunks, or fast chunks
    tiling = (lean_tiles if lean_tiles is not None
              else sampling.SamplerChunks(sampling_spec) if sampling_spec is not None else FAST_CHUNKS)
    # (fp16 keeps the recompute path: g·h rounded to fp16 loses what a small upstream gradient
    # leaves of h; saved-tensor hooks: a checkpoint would run the forward's GEMMs again)
    dlogits_in_forward = (
        logprob_only and needs_grad and forward_grad is None and tiling is FAST_CHUNKS
        and not want_entropy and not want_sum_logits
        and logits_dtype is None and hidden.dtype != torch.float16 and num_rows > 0
        and (num_rows - last_chunk_start(num_rows, chunk_size)) * v_local * weight.element_size()
        <= DLOGITS_IN_FORWARD_MAX_BYTES
        and not saved_tensors_hooks_active())
    first_product = (EarlyProduct() if tiling is FAST_CHUNKS and not sequence_parallel and not mask_entries
                     and num_rows > 0 else None)
    spec = ChunkSpec(
        tp_group=tp_group,
        backend=backend,
        num_valid_cols=num_valid_cols,
        inv_temperature=1.0 / float(temperature),
        chunk_size=chunk_size,
        want_sum_logits=want_sum_logits,
        want_entropy=want_entropy,
        sequence_parallel=sequence_parallel,
        main_grad_param=main_grad_param,
        logits_dtype=logits_dtype,
        tiling=tiling,
        first_product=first_product,
    )
    if first_product is not None:  # the first GEMM now, the bookkeeping below while it runs
        # (as the chunk loop would: outside autograd's graph and autocast)
        with torch.no_grad(), autocast_off(hidden.device):
            first_product.launch(hidden2d, weight, flat_labels, spec,
                                 statistics=not (grad_in_forward or dlogits_in_forward),
                                 label_offset=vocab_start, ignore_index=ignore_index, ahead=ahead_product)
    # Every row goes through the chunk loop, an ignored one without a target and with a zero
    # gradient: no count sizes anything (nothing to read back, static shapes for CUDA graphs), and
    # the first call and the later ones of a signature compute alike, bit for bit. A later call
    # checks the contents on the device instead (deferred_errors.py).
    row_index, row_labels = None, flat_labels
    compare_ranks = tp_size > 1 and agreed.remembered
    # the tensors whose fingerprints join the rank check beside the labels' (GRPO's advantages, mask)
    agree_tensors = must_agree_tensors(must_agree) if compare_ranks else ()
    device_checks = _DeviceChecks(backend, flat_labels, ignore_index, agreed.true_vocab, vocab_start, v_local,
                                  check=agreed.remembered,
                                  signature_code=(call_code(agreed.signature_code, call_values(must_agree))
                                                  if compare_ranks else None),
                                  agree_tensors=agree_tensors, label_mask=label_mask)
    local_target, num_labelled = device_checks.local_target, device_checks.num_labelled
    replaying = mask_entries and (agreed.mask_rows is None or agreed.mask_rows[0] > 0)
    mask_poison = replay_chunks = None
    if replaying:  # sampling-mask replay (replay.py's tiling; before the rank check: it fingerprints the mask)
        # the plain pass only where the signature's first call had a labelled row without a set
        # (a remembered signature checks the mask on the device, and without the plain pass that
        # every labelled row still has a set: NaN and an error at the next host synchronization)
        replay_chunks = replay.replay_tiling(mask_check, flat_labels, device_checks.labelled, vocab_start,
                                             num_valid_cols, agreed.true_vocab,
                                             needs_grad, plain_pass=not agreed.mask_sets_everywhere, backend=backend,
                                             check=agreed.remembered, num_cols=v_local, fingerprint=compare_ranks,
                                             label_poison=device_checks.poison,
                                             max_elements=spec.chunk_size * v_local,
                                             weight_grad=weight.requires_grad)
        mask_poison = replay_chunks.poison
        if replay_chunks.route == "dense" and replay_chunks.by_rows and not sequence_parallel:
            # its first chunk is this call's first rows' logits, as the fast chunks' is: remembered,
            # a later call launches it before its argument handling and the mask's layout
            first_product = EarlyProduct()
            spec = replace(spec, first_product=first_product)
            with torch.no_grad(), autocast_off(hidden.device):
                first_product.launch(hidden2d, weight, flat_labels, spec, statistics=False, label_offset=vocab_start,
                                     ignore_index=ignore_index, ahead=ahead_product)
    _drop(ahead_product)
    if ahead_key is not None:
        EarlyProduct.remember(ahead_key, first_product)
    rank_check = None
    if compare_ranks:
        rank_check = reductions.RankCheck(
            _rank_check_values(device_checks.rank_pieces, replay_chunks.fingerprint if replaying else None),
            poison=device_checks.poison if mask_poison is None else mask_poison,
            flags=deferred_errors.flags(flat_labels.device))
        spec = replace(spec, rank_check=rank_check)

    shape = tuple(labels.shape)
    labelled = device_checks.labelled
    anchor = None
    # A forward-only log-prob call (the reference / old-policy passes) of one chunk on one rank:
    # nothing to merge, so the statistics kernel finishes each row itself (log S, lse and the
    # labelled log-prob with the device checks' poison in it: backend.shard_logprob), where the
    # general path adds a merge and half a dozen elementwise launches, host time at RL shapes.
    if (logprob_only and not needs_grad and tp_size == 1 and tiling is FAST_CHUNKS and not replaying
            and 0 < num_rows <= chunk_size and not fused_statistics(backend, hidden2d, weight)):
        with autocast_off(hidden.device):
            logprob, row_max, log_sum_exp, target, lse = backend.shard_logprob(
                chunk_logits(hidden2d, weight, spec), local_target, num_valid_cols, spec.inv_temperature,
                _device_poison(device_checks, rank_check))
        _drop(first_product)
        # (no `poison`: it is in the log-probs, the one result such a call returns)
        return TokenStats(target, lse, None, None, row_index, shape, num_rows, None, row_max, log_sum_exp,
                          num_labelled=num_labelled, labelled=labelled, backend=backend, logprob_value=logprob,
                          straight=_straight_facts(
                              "log-probs forward-only", agreed, spec, ignore_index, tp_group=tp_group, weight=weight,
                              weight_param=weight_param, accumulate_into_main_grad=accumulate_into_main_grad))
    if replaying:
        spec = replace(spec, tiling=replay_chunks)
        with autocast_off(hidden.device):
            out = softmax_statistics(hidden2d, weight, row_index, local_target, spec, differentiable=needs_grad)
        _drop(first_product)
        # a route a later call may run straight (remembered_routes.ReplayRoute): log-probs (with
        # entropy or not) without sequence parallelism (its spec without this call's layout: each
        # call makes its own)
        straight = _straight_facts(
            "log-probs replay" + (", plain pass" if replay_chunks.plain_pass else ""), agreed,
            replace(spec, tiling=FAST_CHUNKS), ignore_index, tp_group=tp_group, weight=weight,
            weight_param=weight_param, accumulate_into_main_grad=accumulate_into_main_grad,
            applies=not want_sum_logits and not sequence_parallel and main_grad_param is None)
        return TokenStats(out.target, out.lse, None, out.entropy, row_index, shape, num_rows,
                          None, out.max, out.log_sum_exp, kept=out.kept, kept_at_ignored=True,
                          num_labelled=num_labelled, labelled=labelled,
                          poison=_device_poison(device_checks, rank_check, mask_poison), backend=backend,
                          straight=straight)
    with autocast_off(hidden.device):
        if grad_in_forward:
            anchor, target, lse, sum_logits, entropy, row_max, log_sum_exp = LinearLossGradInForward.apply(
                hidden2d, weight, row_index, local_target, spec, forward_grad,
                None if expected_upstream_grad is None else float(expected_upstream_grad), labelled, num_labelled)
            _drop(first_product)
            # a route a later call may run straight (remembered_routes.py): one whole-vocab chunk
            # whose statistics and dlogits came from one launch, nothing beside the labels' checks
            # (a label mask is the loss's own per call: its route passes it to the label kernel)
            one_chunk = (agreed.remembered and main_grad_param is None
                         and expected_upstream_grad is None and logits_dtype is None and tiling is FAST_CHUNKS
                         and 0 < num_rows <= chunk_size)
            # (its plan: the one launch, the stats and dlogits kernels, or a one-pass row kernel with
            # a factor per row: the plan of a count on the device, a remembered signature's)
            plan = FAST_CHUNKS.forward_plan(hidden2d, weight, spec, forward_grad, needs_dx,
                                            num_labelled) if one_chunk else None
            straight = _straight_facts(
                "gradients in forward, one launch" if isinstance(plan, StatsWithDlogits)
                else "gradients in forward, terms in one launch" if isinstance(plan, TermsInLaunch)
                else "gradients in forward, row kernel" if plan is PER_ROW
                else "gradients in forward, statistics then dlogits", agreed, spec,
                ignore_index, tp_group=tp_group, weight=weight, weight_param=weight_param,
                accumulate_into_main_grad=accumulate_into_main_grad,
                applies=one_chunk and (plan is None or plan is PER_ROW
                                       or isinstance(plan, (StatsWithDlogits, TermsInLaunch))))
            return TokenStats(target, lse, sum_logits, entropy, row_index, shape, num_rows, anchor,
                              row_max, log_sum_exp, num_labelled=num_labelled, labelled=labelled,
                              poison=_device_poison(device_checks, rank_check), backend=backend,
                              straight=straight)
        if dlogits_in_forward:
            logprob, target, lse, row_max, log_sum_exp = LinearLogprobDlogitsInForward.apply(
                hidden2d, weight, local_target, labelled, spec, partial(_device_poison, device_checks, rank_check))
            _drop(first_product)
            # (no `poison`: it is in the log-probs, the one result such a call returns)
            return TokenStats(target, lse, None, None, row_index, shape, num_rows, None, row_max, log_sum_exp,
                              num_labelled=num_labelled, labelled=labelled, backend=backend,
                              logprob_value=logprob,
                              straight=_straight_facts(
                                  "log-probs dlogits in forward", agreed, spec, ignore_index, tp_group=tp_group,
                                  weight=weight, weight_param=weight_param,
                                  accumulate_into_main_grad=accumulate_into_main_grad,
                                  applies=num_rows <= chunk_size and not sequence_parallel))
        # differentiable when needed; else (reference / old log-prob passes) plain values, nothing saved
        merged = softmax_statistics(hidden2d, weight, row_index, local_target, spec, differentiable=needs_grad)
        _drop(first_product)
        if logprob_only and not needs_grad and type(merged) is reductions.MergedStats:
            # any other forward-only log-prob call (TP > 1, several chunks, the fused statistics
            # GEMM): the labelled log-probs with the device checks' poison in one launch
            logprob = backend.labelled_logprob(merged.target, merged.max, merged.log_sum_exp, labelled,
                                               _device_poison(device_checks, rank_check))
            # a route a later call may run straight (remembered_routes.py): one chunk at TP > 1, or
            # the fused statistics GEMM (without sequence parallelism) at any TP size
            fused = fused_statistics(backend, hidden2d, weight)
            applies = tiling is FAST_CHUNKS and (
                (fused and not sequence_parallel)
                or (not fused and tp_size > 1 and logits_dtype is None and 0 < num_rows <= chunk_size))
            return TokenStats(merged.target, merged.lse, None, None, row_index, shape, num_rows, None, merged.max,
                              merged.log_sum_exp, num_labelled=num_labelled, labelled=labelled, backend=backend,
                              logprob_value=logprob,
                              straight=_straight_facts(
                                  "log-probs forward-only, fused statistics" if fused
                                  else "log-probs forward-only, merged", agreed, spec, ignore_index, tp_group=tp_group,
                                  weight=weight, weight_param=weight_param,
                                  accumulate_into_main_grad=accumulate_into_main_grad, applies=applies))
    target, lse, sum_logits, entropy = merged.target, merged.lse, merged.sum_logits, merged.entropy
    if forward_grad is not None and needs_grad:  # fp16: the same contract, gradients on the recompute path
        anchor = _anchor_from_token_grads(forward_grad, target, lse, sum_logits, entropy, merged.max,
                                          merged.log_sum_exp, row_index, num_labelled, labelled)
        target, lse, sum_logits, entropy = (None if t is None else t.detach() for t in (target, lse, sum_logits, entropy))
    sampler_outputs = {}
    if isinstance(merged, sampling.KeptStats):  # sampler fidelity: the kept set and the top-k
        sampler_outputs = dict(kept=merged.label_kept(row_labels), topk_logprobs=merged.topk_logprobs,
                               topk_ids=merged.topk_ids)
    return TokenStats(target, lse, sum_logits, entropy, row_index, shape, num_rows, anchor,
                      merged.max, merged.log_sum_exp, **sampler_outputs, num_labelled=num_labelled,
                      labelled=labelled, poison=_device_poison(device_checks, rank_check), backend=backend)


# Log-probs make their dlogits in the forward (chunked.LinearLogprobDlogitsInForward) for the chunk
# they hold from forward to backward (a call's only chunk, or its last one) where that chunk is at
# most this large: as large as a default chunk (DEFAULT_MAX_CHUNK_BYTES), so that every call under
# the default budget takes it. What it wins is a GEMM (three for that chunk instead of the
# recompute path's four) and host time: on one H200, 2048x4096x19008 went 1.66 -> 1.28-1.36x the
# floor and 8192x4096x19008 1.49 -> 1.13-1.14x; the bound at 1 GiB instead of 512 MiB (calls of
# 0.5-1 GiB of logits) 16384x2048x19008 1.56-1.58 -> 1.13-1.14x, 16384x2048x32064 1.45-1.54 ->
# 1.13-1.23x, 8192x2048x64128 1.44-1.49 -> 1.12-1.16x, 16384x4096x19008 1.37-1.39 -> 1.04-1.08x.
# What it costs is memory: D (the chunk, which the recompute path's backward allocates too) is held
# from the forward to the backward with D·W ([rows, H] fp32, freed once dX is made): a peak of 1.43x
# the chunk's bf16 logits at H = 4096, V = 19008 (1.22x at H = 2048; 1.03-1.13x at 64k-128k-wide
# shards) where recompute's is 1.00x. Megatron runs a micro-batch's backward right after its
# forward on the stage with the output layer, so what is held is one micro-batch's. A call of
# several chunks holds its last one only (its backward frees it before it makes the others'
# dlogits again): one chunk at the peak, as the bounded chunks promise.
DLOGITS_IN_FORWARD_MAX_BYTES = DEFAULT_MAX_CHUNK_BYTES


def first_product_ahead(fn_name, hidden, weight, *options) -> tuple:
    """(key, product): the call's first GEMM launched before its argument handling, where the
    last call with the same key launched it first (fast.EarlyProduct.launch_remembered). The key:
    the entry point, hidden's and the weight's shapes, dtypes and devices, whether a gradient is
    needed, and the options that choose the first product (`impl`, the chunking ones, the entry
    point's own); (None, None) under autocast (the inputs are cast first) or with options that are
    not plain values. (On CPU too: the product is computed there and then, and taken over as on a
    GPU, so the CPU tests' calls run this path.)"""
    if not (isinstance(hidden, Tensor) and isinstance(weight, Tensor)):
        return None, None
    try:
        if torch.is_autocast_enabled(hidden.device.type):
            return None, None
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        return None, None
    options = agreement_memo.typed_options(options)
    if options is None:
        return None, None
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    key = (fn_name, hidden.shape, hidden.dtype, hidden.device, weight.shape, weight.dtype, weight.device,
           needs_grad, options)
    try:
        hash(key)
    except TypeError:
        return None, None
    return key, EarlyProduct.launch_remembered(key, hidden, weight)


def _drop(first_product: Optional[EarlyProduct]) -> None:
    """The forward is done: what its first step did not take is not held for the backward."""
    if first_product is not None:
        first_product.drop()


class LabelledCount:
    """The number of labelled rows of a call, on the device (`count`, int64 0-d), with `inverses`
    (fp32 [2]: 1 / max(count, 1) and its negative, a mean's coefficients without a kernel of their
    own) and which rows are labelled (`labelled`, bool [rows]). Views of the label kernel's outputs
    (`counts`, `scalars`: backend.label_targets), each taken where it is read: a view is a
    dispatched op, host time on every call that does not read it."""

    def __init__(self, counts: Tensor, scalars: Tensor, labelled: Tensor):
        self.counts, self.scalars, self.labelled = counts, scalars, labelled

    @property
    def count(self) -> Tensor:
        return self.counts[0]

    @property
    def inverses(self) -> Tensor:
        return self.scalars[1:3]

    @property
    def inverse(self) -> Tensor:
        return self.scalars[1]

    @property
    def negative_inverse(self) -> Tensor:
        return self.scalars[2]

    def per_row(self, positions) -> tuple:
        """(1 / count, -1 / count) at each of `positions` (indices or a slice of the rows) where
        its label is kept, 0 elsewhere: one kernel."""
        labelled = (backends.chunk_rows(self.labelled, positions.start, positions.stop) if isinstance(positions, slice)
                    else self.labelled[positions])
        # a product, not a select with a Python 0.0: the inverses are finite, and a select with
        # a scalar costs twice a product's host time
        return (self.scalars[1:3, None] * labelled).unbind(0)


class CallValue(NamedTuple):
    """A number in `must_agree` that every TP rank must share but that may change from call to
    call (GRPO's `normalizer`, a global token count): its type joins the call's signature, its value
    the signature's first agreement and, on later calls, the rank check's code (`call_code`). A new
    value is then no new signature: no agreement, no host synchronization."""

    value: Any


def call_values(must_agree: Optional[dict]) -> tuple:
    """The values of `must_agree`'s CallValues, in its order."""
    return tuple(v.value for v in (must_agree or {}).values() if isinstance(v, CallValue))


def call_code(signature_code: Optional[int], values: tuple) -> Optional[int]:
    """The code a call's rank check compares (TP > 1): its signature's, with `values` (call_values)
    mixed in, so that ranks passing different ones get the rank check's verdict."""
    if signature_code is None or not values:
        return signature_code
    return zlib.crc32(repr([value_code(v) for v in values]).encode(), signature_code)


def must_agree_tensors(must_agree: Optional[dict]) -> tuple:
    """The tensors among `must_agree`'s values, in its order: their fingerprints join the rank check
    after the labels' (a remembered route's too, remembered_routes.py)."""
    return tuple(v for v in (must_agree or {}).values() if isinstance(v, Tensor))


class _DeviceChecks:
    """Each row's target on this shard (-1 where the label is ignored, off this shard, or out of
    range), whether it is labelled, the number of labelled rows and, on a remembered signature
    (`check`), whether a label lies outside [0, true_vocab) (deferred_errors.py), all on the
    device: no count is read back. Positions where `label_mask` is 0 count as ignored."""

    def __init__(self, backend, flat_labels: Tensor, ignore_index: int, true_vocab: int, vocab_start: int,
                 v_local: int, check: bool, signature_code: Optional[int] = None, agree_tensors: tuple = (),
                 label_mask: Optional[Tensor] = None):
        # (the full agreement checked the first call of the signature: no flag to record then)
        flags = deferred_errors.flags(flat_labels.device) if check else None
        self.local_target, self.labelled, counts, scalars = backend.label_targets(
            flat_labels, ignore_index, true_vocab, vocab_start, v_local, flags, signature_code, agree_tensors,
            label_mask)
        # with a signature code: the rank check's pieces of it, of the labels' fingerprint and of
        # each tensor of `agree_tensors`', made beside the label launch
        self.rank_pieces = scalars[3:] if signature_code is not None else None
        self.num_labelled = LabelledCount(counts, scalars, self.labelled)
        # NaN where a label is out of range (recorded), else 0. On the first call of a signature too
        # (always 0 there: the full agreement refused bad labels): the first call and the later ones
        # run the same operations, so that what is compiled for the first (GRPO's per-token terms
        # and metrics) is not compiled again for the second, in the steady state
        self.poison = scalars[:1]


def _rank_check_values(label_pieces: Tensor, mask_fingerprint: Optional[Tensor] = None) -> Tensor:
    """fp32 pieces of what every TP rank must share on a remembered signature: the signature's
    code (its Python-level arguments), the labels' and each must-agree tensor's fingerprint
    (`label_pieces`, from the label launch), then the sampling mask's."""
    if mask_fingerprint is None:
        return label_pieces
    return torch.cat([label_pieces, fingerprint_pieces(mask_fingerprint.to(label_pieces.device))])


def _device_poison(device_checks: Optional[_DeviceChecks], rank_check,
                   mask_poison: Optional[Tensor] = None) -> Optional[Tensor]:
    """fp32 [1]: NaN if this call's device checks found bad contents (recorded for the next host
    synchronization: deferred_errors.py), else 0, for its results; None without device checks.
    `mask_poison`: the sampling mask's check with the labels' already in it (replay_tiling's)."""
    if device_checks is None:
        return None
    # (label_targets recorded what it found; the rank check's merge what it found, in its poison)
    if rank_check is not None:
        return rank_check.poison
    return device_checks.poison if mask_poison is None else mask_poison


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
    accumulate_into_main_grad: bool = False,
    logits_dtype: Optional[torch.dtype] = None,
    memory_mode: str = "fast",
    max_chunk_bytes: Optional[int] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    return_topk: int = 0,
    sampling_mask=None,
) -> LogprobsOutput:
    """Per-token log p(label) (and entropy) of softmax(hidden @ W_full.T / temperature), or of the
    distribution an inference engine's sampler draws from (`top_k` / `top_p` / `min_p`).

    Never materializes the [tokens, V_local] logits: see the module docs of api.py and chunked.py.
    `weight` is this rank's contiguous vocab shard (rank r owns ids [r*V_local, (r+1)*V_local));
    results are identical on every rank of `tp_group`. dX is the full input gradient (summed over
    TP ranks; reduce-scattered under `sequence_parallel`), dW this shard's gradient.
    `accumulate_into_main_grad=True` (Megatron's gradient_accumulation_fusion): when the weight has
    a `main_grad` buffer the fp32 weight gradient is added into it directly and autograd receives a
    dummy gradient, as from Megatron's own linear layers: zeros when the weight has
    `zero_out_wgrad` (Megatron's DDP then adds .grad to main_grad), else uninitialized (DDP
    ignores it). (linear_cross_entropy and linear_grpo_loss add it during the forward pass in fast
    mode: a forward freed without a backward fills main_grad with NaN and makes the next call on
    the weight raise, see main_grad.MainGradSideEffect.)
    `logits_dtype`: None (default) rounds each chunk of logits to the input dtype before the fp32
    softmax, as Megatron's unfused output layer does; torch.float32 keeps the GEMM's fp32 output
    (closer to float64 math for bf16/fp16 inputs, at the cost of a chunk twice as large).
    Under torch.autocast the inputs are cast to the autocast dtype first, as F.linear would.
    `memory_mode`: "fast" (default; the only mode for the sampler settings below) holds one chunk
    of logits (`chunk_size` rows when given, else equal chunks of at most `max_chunk_bytes` of
    logits, default 1 GiB) and, over several chunks, an fp32 [V_local, H] weight-gradient buffer
    (none when dW goes into Megatron's main_grad); "lean" works in tiles within a fixed working set on each rank (400 bytes per
    row of the whole vocab, at least 32 MiB: about 2.4 % of the logits of 8192 tokens, whatever the
    number of tokens or TP ranks; `chunk_size` is not used) with both gradients still
    accumulated in fp32, at the cost of more GEMMs (5 instead of 4 here, 4 instead of 3 for
    linear_cross_entropy). Forward-only calls (no_grad) of more than 256 MiB of logits need no
    chunk in either mode on CUDA: the statistics are taken inside the logits GEMM (bf16/fp16);
    smaller ones hold their one chunk (cuBLAS's GEMM was faster there, fast.FUSED_STATS_MIN_BYTES).

    Sampler fidelity (vLLM V1's sampler; sampling.py cites the functions). With z = logits / T over
    the unpadded vocab, per token row:
      1. `min_p` in [0, 1]: drop tokens with p_k < min_p * max_j p_j (p = softmax(z)), i.e. keep
         z_k >= max(z) + log(min_p). The logits decide, not probabilities: z_k >= M + log(min_p)
         in fp32 (M the row max, log(min_p) and the sum rounded to fp32), which differs from
         vLLM's fp32 comparison of probabilities only for tokens within a rounding of the
         boundary; min_p=1 keeps exactly the tokens whose z equals M;
      2. `top_k` >= 1: keep tokens with z_k >= the k-th largest remaining z (every token tied
         with the k-th is kept); 0 and -1 are off (vLLM's spellings);
      3. `top_p` in (0, 1]: renormalize what is left and keep the smallest prefix of it, in the
         order z descending then global id ascending, whose mass is >= top_p: a token is kept iff
         the renormalized mass ranked strictly before it is < top_p (the first token always is);
      4. renormalize over the kept set K: logprobs = z_y - logsumexp_K(z) if y is in K, else
         -inf with no gradient. Gradients are exact on K (K itself is piecewise constant).
         `return_entropy` then gives the entropy of this renormalized distribution.
    None (or top_p=1, min_p=0, top_k 0 / -1 / >= vocab) skips a filter; with none left the result is
    today's, bit for bit. vLLM orders exactly tied z arbitrarily at the top_p cut; here the
    lower id comes first. The settings must have the same effect on every TP rank (checked:
    top_k None / 0 / -1 agree, as do top_p None / 1 and min_p None / 0).
    `return_topk=k` (0 = off): `LogprobsOutput.topk_logprobs` / `.topk_ids`, labels.shape + (k,):
    log-probs under the full softmax(z) (not the filtered one) of the k most likely global ids,
    descending, ties by lower id, never a padded column; identical on every TP rank; no gradient.
    Ignored positions get logprob 0.0 and id -1. The log-probs and entropy are today's when no
    filter is set.
    Cost: per chunk, every rank's M first tokens are all-gathered (M = max(return_topk, top_k,
    128 with top_p)); rows whose nucleus is longer, or top_k > 1024, take an exact search of up to
    ~32 extra passes over the chunk (those rows) with one small all-reduce each.

    Sampling-distribution replay (`sampling_mask`; replay.py): the sets the engine's sampler
    kept, as `(token_ids, offsets)` or an object with `.token_ids` / `.offsets` (vLLM's
    `SamplingMask`), integer tensors or sequences, CSR: position i of `labels` in row-major order
    (ignored positions included; `len(offsets) == labels.numel() + 1`) keeps the global ids
    token_ids[offsets[i]:offsets[i + 1]] (each at most once, < vocab_size). Then
    logprobs = z_y - logsumexp over the kept ids of z (z = logits / T), -inf with no gradient
    where y is not kept, the plain log-prob where the set is empty (no truncation), 0.0 at
    ignored positions; `return_entropy` gives the entropy of that distribution. Bad masks, or
    masks that differ across TP ranks, raise the same ValueError on every rank: at once on the
    first call of a signature (the mask's sizes are part of it, its contents are not), at the
    next host synchronization on a later one, whose results are then NaN (deferred_errors.py). Not with
    top_k / top_p / min_p (the engine's filters already chose the sets), `return_topk` or
    memory_mode="lean". replay.build_sampling_mask makes a batch's mask from per-request masks,
    replay.slice_sampling_mask a context-parallel rank's part. Cost (chosen from sizes,
    replay.replay_route; V the rank's shard): on a GPU, sets of K <= V / 256 ids in tiles of 64
    rows, each tile's GEMMs over the ids its sets name (0.05-0.7 of plain log-probs at K = 50 on
    an H200); without those kernels (the torch backend), sets of K <= V / 640 on the W rows of
    their kept ids alone (O(rows x K x H)); larger sets on the whole shard with 3 GEMMs per chunk.
    """
    # a later call of a route the general path recorded: straight through (remembered_routes.py)
    # (with a sampling mask: the mask's tensors' layout joins the key, not how many ids it keeps)
    mask_key = None if sampling_mask is None else replay.route_key(sampling_mask)
    route_key = None if sampling_mask is not None and mask_key is None else remembered_routes.call_key(
        "linear_logprobs", hidden, weight, labels, tp_group,
        (vocab_size, temperature, ignore_index, return_entropy, chunk_size, sequence_parallel, impl,
         accumulate_into_main_grad, logits_dtype, memory_mode, max_chunk_bytes, top_k, top_p, min_p, return_topk,
         mask_key))
    route = remembered_routes.lookup(route_key)
    if route is not None:
        out = route(hidden, weight, labels) if mask_key is None else route(hidden, weight, labels,
                                                                          sampling_mask=sampling_mask)
        if out is not None:
            return out
    ahead = first_product_ahead("linear_logprobs", hidden, weight, impl, chunk_size, max_chunk_bytes, memory_mode,
                                logits_dtype, sequence_parallel, return_entropy, top_k, top_p, min_p, return_topk,
                                sampling_mask is not None)
    vocab_size, ignore_index, chunk_size, max_chunk_bytes, top_k, return_topk = map(
        integer_argument, (vocab_size, ignore_index, chunk_size, max_chunk_bytes, top_k, return_topk))
    return_entropy, sequence_parallel, accumulate_into_main_grad = map(
        flag_argument, (return_entropy, sequence_parallel, accumulate_into_main_grad))
    true_vocab = vocab_size if is_int(vocab_size) and vocab_size > 0 else (
        weight.shape[0] * reductions.group_size(tp_group)
        if isinstance(weight, Tensor) and weight.dim() == 2 else 1)
    sampler = dict(top_k=top_k, top_p=top_p, min_p=min_p, return_topk=return_topk)
    problems = sampling.sampler_problems(top_k, top_p, min_p, return_topk, true_vocab)
    active = sampling.agreed_values(sampler, problems, true_vocab)
    mask_check = replay.MaskCheck(sampling_mask, labels, ignore_index, true_vocab)
    problems["sampling_mask"] = mask_check.problem
    problems.update(replay.sampling_mask_problems(sampling_mask, active, memory_mode))
    # the sampler's tiling (sampling.SamplerChunks) needs each chunk's whole row of logits: no lean tiles
    problems["memory_mode_with_sampler"] = (
        "memory_mode='lean' cannot be combined with top_k / top_p / min_p / return_topk (the "
        "sampler's statistics run in chunks of logits): use memory_mode='fast'"
        if memory_mode == "lean" and sampling.sampling_spec(**active, true_vocab=true_vocab, vocab_start=0)
        is not None else None)
    stats = token_statistics(
        "linear_logprobs", hidden, weight, labels, tp_group=tp_group, vocab_size=vocab_size,
        temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size,
        sequence_parallel=sequence_parallel, impl=impl,
        accumulate_into_main_grad=accumulate_into_main_grad, logits_dtype=logits_dtype,
        memory_mode=memory_mode, max_chunk_bytes=max_chunk_bytes, want_sum_logits=False,
        want_entropy=return_entropy, extra_checks=problems,
        sampler=active, mask_check=mask_check, logprob_only=not return_entropy, ahead=ahead)
    if stats.straight is not None and route_key is not None:
        remembered_routes.remember(route_key, (remembered_routes.ReplayRoute if mask_key is not None
                                               else remembered_routes.LogprobRoute)(stats.straight, impl))
    logprobs = stats.logprob()
    if stats.kept is not None:  # a label outside the kept set: -inf, and no gradient
        logprobs = torch.where(stats.kept, logprobs, float("-inf"))
    logprobs = stats.to_full(logprobs, masked=stats.kept is None or stats.kept_at_ignored)
    entropy = stats.to_full(stats.entropy) if return_entropy else None
    if stats.topk_ids is None:
        return LogprobsOutput(logprobs, entropy)
    return LogprobsOutput(logprobs, entropy, stats.to_full(stats.topk_logprobs),
                          stats.to_full(stats.topk_ids, fill=-1))


from . import remembered_routes  # noqa: E402  (it imports this module's LabelledCount, StraightFacts)
