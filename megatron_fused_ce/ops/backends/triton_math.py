"""Triton device functions that more than one kernel module computes alike: log as torch's CUDA
log computes it, and the last step of the merged statistics (torch_backend.merged_tail's log S,
lse, entropy and labelled log-probs). triton_backend's tail launch and replay's statistics launch,
which finishes its rows itself where no merge follows (TP = 1), call the same definitions, so
both give the same bits."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def precise_log(x, PRECISE: tl.constexpr):
    """log as torch's CUDA log computes it (libdevice's logf), where PRECISE; else tl.log (the
    interpreter, which has no libdevice)."""
    if PRECISE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def store_labelled_logprob(rows, ok, target, row_max, log_sum_exp, labelled_ptr, kept_ptr, poison_ptr, out_ptr,
                           HAS_LABELLED: tl.constexpr, HAS_KEPT: tl.constexpr, HAS_POISON: tl.constexpr):
    """torch_backend.labelled_logprob of the rows' values: (z_y - M) - log S, 0 where not
    labelled, -inf where the label is not kept, plus the poison."""
    value = (target - row_max) - log_sum_exp
    if HAS_LABELLED:
        value = tl.where(tl.load(labelled_ptr + rows, mask=ok, other=0) != 0, value, 0.0)
    if HAS_KEPT:
        value = tl.where(tl.load(kept_ptr + rows, mask=ok, other=0) != 0, value, float("-inf"))
    if HAS_POISON:
        value = value + tl.load(poison_ptr)
    tl.store(out_ptr + rows, value, mask=ok)


@triton.jit
def store_merged_tail(rows, ok, row_max, s, shifted, target, log_sum_exp_ptr, lse_ptr, entropy_ptr, labelled_ptr,
                      kept_ptr, poison_ptr, logprob_ptr, WANT_ENTROPY: tl.constexpr, PRECISE: tl.constexpr,
                      LOGPROB: tl.constexpr, HAS_LABELLED: tl.constexpr, HAS_KEPT: tl.constexpr,
                      HAS_POISON: tl.constexpr):
    """torch_backend.merged_tail of rows whose max, sum exp(z - max) s, sum exp(z - max)(z - max)
    `shifted` and target z are known: log S, lse and (WANT_ENTROPY) the entropy stored, and
    (LOGPROB) the labelled log-probs."""
    log_s = precise_log(s, PRECISE)
    tl.store(log_sum_exp_ptr + rows, log_s, mask=ok)
    tl.store(lse_ptr + rows, row_max + log_s, mask=ok)
    if WANT_ENTROPY:
        # (div_rn: torch's division, rounded to nearest; `/` is the approximate division)
        tl.store(entropy_ptr + rows, log_s - tl.div_rn(shifted, s), mask=ok)
    if LOGPROB:
        store_labelled_logprob(rows, ok, target, row_max, log_s, labelled_ptr, kept_ptr, poison_ptr, logprob_ptr,
                               HAS_LABELLED, HAS_KEPT, HAS_POISON)
