"""Errors found on the device, by calls that make no host synchronization, raised at the next one.

The first call of a signature checks everything and reads the verdict back (agreement.py). Later
calls with the same signature skip that read-back, so what depends on the tensors' contents is
checked on the device instead:

- labels outside [0, vocab_size) that are not ignore_index (on every rank: the labels are the same);
- a sampling mask's offsets, ids and duplicates (replay.MaskCheck.deferred_poison; on every rank
  too: the mask is the same), and a labelled position without a kept set where the signature's
  first call had a set at every labelled position (its later calls skip the plain pass such a
  position needs: replay.ReplayChunks.missing_set_poison); on the Triton backend one kernel
  records both (backends/replay_triton.kept_layout);
- a loss's normalizer given as a GPU tensor (a global token count) that is not a finite count > 0
  (losses/nll.given_count: reading it on the host would synchronize every loss call);
- values that differ across tensor-parallel ranks (labels, a sampling mask, per-token inputs of the
  loss, the call's Python-level arguments), compared by fingerprints riding on the statistics'
  all-gather (reductions.RankCheck), so every rank computes the same verdict.

A call that finds one returns NaN (never a silently wrong value) and records it here, in one int64
word of flags per device. The flags are read, and a ValueError naming what was found raised on
every rank, by the next host synchronization of the package: the next call that runs the full
agreement (a new signature), the step pre-hook of every torch optimizer (step_checks.py), or
`check_deferred_errors()` (RL loops that run forward-only passes without a step).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import Tensor

LABELS_OUT_OF_RANGE = 1
RANKS_DIFFER = 2
SAMPLING_MASK_BAD = 4
SAMPLING_MASK_NEW_EMPTY_SET = 8
BAD_NORMALIZER = 16
MESSAGES = {
    LABELS_OUT_OF_RANGE: "labels outside [0, vocab_size) that are not ignore_index",
    RANKS_DIFFER: ("labels, sampling masks, per-token loss inputs or arguments that differ across "
                   "tensor-parallel ranks (every rank of tp_group must pass the same)"),
    SAMPLING_MASK_BAD: ("a bad sampling_mask: offsets that do not start at 0, decrease or do not end at "
                        "len(token_ids), token ids outside [0, vocab_size), or an id twice in one kept set"),
    SAMPLING_MASK_NEW_EMPTY_SET: (
        "a labelled position without a kept set (an empty set: the plain softmax) in a sampling_mask "
        "whose signature's first call had a kept set at every labelled position, so that its later "
        "calls skip the plain log-prob pass such a position needs; pass masks with such positions from "
        "a signature's first call on, or call megatron_fused_ce.ops.agreement.forget_signatures() "
        "before the call that has them"),
    BAD_NORMALIZER: "a loss normalizer (a count given as a GPU tensor) that is not a finite number > 0",
}

_FLAGS: Dict[torch.device, Tensor] = {}  # per device: the OR of the flags recorded since the last read


def flags(device: torch.device) -> Tensor:
    """The int64 [1] word of flags of `device`. Made by the first full agreement on the device
    (`take`), which precedes every call that records one (a later call of a signature): a word
    first made inside a CUDA graph capture would be memory no kernel has zeroed until the graph
    is replayed."""
    word = _FLAGS.get(device)
    if word is None:
        word = _FLAGS[device] = torch.zeros(1, dtype=torch.int64, device=device)
        from .step_checks import before_optimizer_steps

        before_optimizer_steps(check_deferred_errors)
    return word


def record(errors: Tensor) -> None:
    """OR a call's int64 0-d flags into its device's word (one kernel, no host read)."""
    flags(errors.device).bitwise_or_(errors.reshape(1))


def messages_of(value: int) -> List[str]:
    return [message for bit, message in MESSAGES.items() if value & bit]


def take(device: torch.device) -> Tensor:
    """The flags of `device` as a device tensor, the word cleared (for the full agreement, which
    reads it with everything else)."""
    word = flags(device)
    value = word.clone()
    word.zero_()
    return value


def check_deferred_errors() -> None:
    """Raise ValueError if a call since the last check found bad contents on the device (module
    doc); one small read per device the package ran a call on."""
    found = 0
    for device, word in _FLAGS.items():
        value = int(word.item())
        if value:
            word.zero_()
            found |= value
    if found:
        raise ValueError("megatron_fused_ce: a fused call after the first of its signature, or a loss, found "
                         + "; ".join(messages_of(found)) + " (its results were NaN)")
