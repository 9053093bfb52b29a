"""Context parallelism for the losses: the input agreement, and stacked sums / maxima over CP ranks.

With ``cp_group``, each context-parallel (CP) rank passes its slice of every sequence: ``[B, T_local]``
tensors holding any subset of each sequence's positions (Megatron's load-balanced layout keeps
chunks ``r`` and ``2·CP−1−r`` of ``2·CP``), the same positions in every per-token argument. A loss
adds up its sequence- and batch-level partial sums over the group (``sum_over_cp``: one all-reduce
per step, see ``ops/reductions.py`` for its backward), so that the loss and every metric are
the same on every CP rank and equal to the CP=1 values, and each rank's gradient w.r.t. its local
log-probs equals the CP=1 gradient at those positions.

Input rule under CP (checked by ``agree_on_inputs`` with one all-reduce, before any other
collective, so bad input raises the same ``ValueError`` on every rank instead of hanging):

* on each rank, every ``[B, T_local]`` argument has the shape of the log-probs (a full-length mask
  next to sliced log-probs is an error there);
* every rank passes the same number of sequences ``B``;
* every rank passes the same optional arguments (they decide which collectives run);
* any local argument error (bad shape, bad option, bad normalizer) raises on every rank.

The agreement is remembered per signature (the function, the groups, ``B`` and the flags): a
later call of it makes no collective for it, so a rank that alone passes bad input after its peers
agreed raises alone while they go on to the loss's sums (docs/reliability.md, "Not caught").

``T_local`` may differ between ranks. What cannot be seen is a rank passing whole sequences of the
same length as the other ranks' slices: slicing is the caller's contract.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..ops import reductions
from ..ops.agreement import MEMOS, REMEMBERED_SIGNATURES, value_code

__all__ = ["cp_size", "agree_on_inputs", "sum_over_cp", "max_over_cp"]


def cp_size(cp_group) -> int:
    return reductions.group_size(cp_group)


def agree_on_inputs(
    fn_name: str,
    check: Callable[[], None],
    *,
    cp_group=None,
    other_groups: Sequence = (),
    batch_size: Optional[int] = None,
    flags: Union[Sequence[Tuple[str, bool]], Callable[[], Sequence[Tuple[str, bool]]]] = (),
    device: Optional[torch.device] = None,
) -> None:
    """Run ``check()`` (which raises ``ValueError`` for bad local input) and raise its error on
    every rank of ``cp_group`` (and of ``other_groups``, e.g. the TP group of a fused loss).

    Without a group of more than one rank this is just ``check()``. Otherwise one int64 all-reduce
    MAX per group carries the local failure flag, ``±batch_size`` and ``±flags`` (named booleans
    that must agree, such as which optional inputs were given; or a function that gives them), so
    every rank sees the same verdict.
    """
    groups = [g for g in (*other_groups, cp_group) if reductions.group_size(g) > 1]
    if not groups:
        check()
        return
    if callable(flags):  # (only where there is a rank to agree with: a config's fingerprint is host time)
        flags = flags()
    problem = None
    try:
        check()
    except ValueError as error:
        problem = str(error)
    # A signature agreed before needs no collective (as the op's agreement, ops/agreement.py):
    # steady state makes none and reads nothing back.
    signature = (fn_name, tuple((id(g), reductions.group_size(g), reductions.group_rank(g)) for g in groups),
                 str(device), batch_size, tuple((name, value_code(flag)) for name, flag in flags))
    if problem is None and signature in _AGREED_INPUTS:
        _AGREED_INPUTS.move_to_end(signature)
        return
    batch = -1 if batch_size is None or problem is not None else int(batch_size)
    values = [int(problem is not None), batch, -batch]
    for _, flag in flags:
        values += [int(flag), -int(flag)]
    agreed = torch.tensor(values, dtype=torch.int64, device=device)
    for group in groups:
        agreed = reductions.max_over_ranks(agreed, group)
    agreed = agreed.tolist()

    if problem is not None:
        raise ValueError(problem)
    if agreed[0]:
        raise ValueError(f"{fn_name}: invalid input on another rank (it raised the error there)")
    batch_max, batch_min = agreed[1], -agreed[2]
    if batch_size is not None and batch_min >= 0 and batch_max != batch_min:
        raise ValueError(f"{fn_name}: the ranks of cp_group pass different numbers of sequences "
                         f"({batch_min} to {batch_max}); each context-parallel rank passes its slice "
                         "of the same B sequences")
    differing = [name for i, (name, _) in enumerate(flags) if agreed[3 + 2 * i] != -agreed[4 + 2 * i]]
    if differing:
        raise ValueError(f"{fn_name}: the ranks disagree on {', '.join(differing)}; every "
                         "context-parallel rank must pass the same options and optional arguments")
    _AGREED_INPUTS[signature] = None
    while len(_AGREED_INPUTS) > REMEMBERED_SIGNATURES:
        _AGREED_INPUTS.popitem(last=False)


_AGREED_INPUTS: "OrderedDict[tuple, None]" = OrderedDict()  # signatures agree_on_inputs agreed
MEMOS.append(_AGREED_INPUTS)


def sum_over_cp(parts: Dict[str, Tensor], cp_group, *, feeds_partials: bool = False) -> Dict[str, Tensor]:
    """Each partial sum added up over the CP group, with one all-reduce for all of them.

    Differentiable: the backward is the identity when the sums enter the loss the same way on
    every rank (each rank's gradient is then the CP=1 one at its positions); pass
    ``feeds_partials=True`` for sums that are inputs of per-rank partial sums reduced again later
    (``ops.reductions.sum_over_context_ranks``). The parts must share a dtype and device; counts
    are passed as floats. Without CP the parts are returned as they are.
    """
    if cp_size(cp_group) == 1:
        return parts
    names = list(parts)
    flat = torch.cat([parts[name].reshape(-1) for name in names])
    total = reductions.sum_over_context_ranks(flat, cp_group, feeds_partials=feeds_partials)
    sizes = [parts[name].numel() for name in names]
    return {name: piece.reshape(parts[name].shape)
            for name, piece in zip(names, total.split(sizes))}


@torch.no_grad()
def max_over_cp(parts: Dict[str, Tensor], cp_group) -> Dict[str, Tensor]:
    """Each (detached) value's maximum over the CP group, one all-reduce for all (metrics only)."""
    if cp_size(cp_group) == 1:
        return {name: value.detach() for name, value in parts.items()}
    names = list(parts)
    flat = torch.cat([parts[name].detach().reshape(-1) for name in names])
    total = reductions.max_over_context_ranks(flat, cp_group)
    sizes = [parts[name].numel() for name in names]
    return {name: piece.reshape(parts[name].shape)
            for name, piece in zip(names, total.split(sizes))}
