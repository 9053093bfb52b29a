"""Sampler fidelity: log-probs of the distribution the inference engine samples from, and the
top-k log-probs of every position, vocab-parallel and chunked like the rest of the op.

The distribution (vLLM V1's sampler: `Sampler.sample` in vllm/v1/sample/sampler.py applies the
temperature, then the argmax-invariant logits processors -- `MinPLogitsProcessor.apply` in
vllm/v1/sample/logits_processor/builtin.py -- then `apply_top_k_top_p` in
vllm/v1/sample/ops/topk_topp_sampler.py). Per token row, with z = logits / T over the unpadded
vocab:

1. min_p: drop tokens with softmax(z)_k < min_p * max_j softmax(z)_j, i.e. keep
   z_k >= max(z) + log(min_p). Decided on the fp32 logits, not on probabilities: keep
   z_k >= fl32(M + fl32(log(min_p))), M the row max (see `min_p_floor`). vLLM compares fp32
   probabilities (p_k >= min_p * p_max); the two rules agree except for tokens within a rounding
   of the boundary, where this rule decides. min_p = 1 keeps exactly the tokens whose z equals
   the max (vLLM's fp32 probabilities may also tie a token a few ulps below it).
2. top_k (0 and -1 are vLLM's "off"): keep the tokens whose z is >= the k-th largest remaining z
   (every token tied with the k-th is kept, as the `logits < kth_value` mask of vLLM's
   `apply_top_k_top_p_pytorch` does; the newer Triton kernel of
   vllm/v1/sample/ops/topk_topp_triton.py may trim such ties to k by position: the two differ
   only on exactly tied logits at the k-th value).
3. top_p: renormalize the remainder R (q = softmax over R) and keep, walking the total order
   "z descending, then global id ascending", every token whose mass ranked strictly before it is
   < top_p: the smallest prefix with mass >= top_p (vLLM drops a token when the ascending
   cumulative mass up to and including it is <= 1 - top_p; the first token is always kept).
   Among exactly tied z vLLM's order is whatever its sort returns; here it is the lower id first.
4. renormalize over the kept set K: log q_y = z_y - logsumexp_K(z) for y in K, -inf otherwise.

After all three filters K is a prefix of the total order, so one pair per row describes it:
kept(k) <=> z_k > z_cut or (z_k == z_cut and id_k <= id_cut) (see sampling_torch.py).

Per chunk (forward), with the chunk's logits in hand:

    candidates   each rank: its first M tokens in the total order (int64 keys);
                 one all-gather -> the global first M, identical on every rank
    cut          min_p / top_k / top_p thresholds from the candidates alone when they hold the
                 answer (the usual case); otherwise an exact search on the chunk (below)
    kept sums    each rank: sum over its kept columns of exp(z - max), (... * z), the target
                 logit; one all-reduce -> logsumexp_K, E_q[z], z_y

Exact searches (rows that the M candidates cannot settle; the rows and the number of steps are
decided on values identical on every rank, so every rank makes the same collectives):
- top_k > M: the k-th largest z by bisection on the order-preserving int32 image of fp32 values,
  one all-reduced count per step (at most 32 steps, every row of the chunk);
- a nucleus longer than the candidates (flat rows): the cut value by the same bisection on the
  mass strictly above a value (one all-reduce per step, those rows only); then the tokens tied at
  the cut, which all have the same probability, are resolved arithmetically (how many of them the
  nucleus needs), and the id of the last one is found on the rank that owns it (one all-gather of
  per-rank tie counts, one all-reduce MAX of the id).

Backward recomputes each chunk's logits and writes dlogits of the kept-set distribution:
d log q_y / dz_k = [k == y] - q_k on K, 0 outside (the set itself is piecewise constant).

`return_topk=k` without any filter keeps the plain statistics bit for bit (the candidates taken
from the same chunks on the way) and adds the top-k log-probs of the full softmax(z); with filters
they come from the same candidates.

All of it is `SamplerChunks`, a tiling of the chunk loop (chunked.py): fast.py's two loops with
this per-chunk math, behind the methods fast chunks and lean tiles have.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import reductions
from .backends import sampling_torch
from .agreement import finite_real, is_int
from .chunked import ChunkSpec
from .fast import (FAST_CHUNKS, backward_grads, chunk_logits, concat_partials, logits_partials, map_chunk_logits,
                   weight_grad_cast_target)
from .gemm import gemm_input
from .backends.sampling_torch import ID_ALL, ID_NONE, decode_keys, float_from_ordered, ordered_int32

# Candidates per row when top_p is set: nuclei longer than this take the exact search.
CANDIDATES = 128
# top_k up to this many is read off the candidates; larger top_k takes the exact count search.
MAX_TOP_K_CANDIDATES = 1024
# Rows seen / rows that took an exact search, since import (read by tools/benchmark.py).
SEARCH_COUNTS = Counter()


@dataclass(frozen=True)
class SamplingSpec:
    """Sampler settings of one call, normalized: a filter that keeps everything is None."""

    top_k: Optional[int]
    top_p: Optional[float]
    min_p: Optional[float]
    return_topk: int
    vocab_start: int  # global id of this shard's column 0
    true_vocab: int
    num_candidates: int  # M

    @property
    def filters(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None


def top_k_off(top_k, true_vocab: Optional[int] = None) -> bool:
    """Whether a (checked) top_k keeps every token: None, vLLM's 0 / -1, or >= the vocab."""
    return top_k is None or top_k < 1 or (true_vocab is not None and top_k >= true_vocab)


def sampling_spec(top_k, top_p, min_p, return_topk, *, true_vocab: int, vocab_start: int) -> Optional[SamplingSpec]:
    """None when the call is today's plain log-probs (no filter that drops anything, no top-k)."""
    top_k = None if top_k_off(top_k, true_vocab) else int(top_k)
    top_p = None if top_p is None or top_p >= 1.0 else float(top_p)
    min_p = None if min_p is None or min_p <= 0.0 else float(min_p)
    return_topk = int(return_topk or 0)
    if top_k is None and top_p is None and min_p is None and return_topk == 0:
        return None
    wanted = max(return_topk, 1)  # the first candidate is the row max
    if top_k is not None and top_k <= MAX_TOP_K_CANDIDATES:
        wanted = max(wanted, top_k)
    if top_p is not None:
        wanted = max(wanted, CANDIDATES)
    return SamplingSpec(top_k, top_p, min_p, return_topk, vocab_start, true_vocab,
                        min(wanted, true_vocab))


def sampler_problems(top_k, top_p, min_p, return_topk, true_vocab: int) -> dict:
    """The sampler settings' checks: {name: error message, or None when it passed} (for the
    agreement of api.py and the post-processor's unfused path)."""
    problems = dict.fromkeys(("top_k", "top_p", "min_p", "return_topk"))
    # the ranges vLLM's SamplingParams accepts, so that a trainer can pass the engine's settings
    # through unchanged: top_k 0 or -1 = off, min_p = 1 keeps the tokens tied with the max
    if top_k is not None and (not is_int(top_k) or top_k < -1):
        problems["top_k"] = f"top_k must be None, 0 or -1 (off), or an integer >= 1, got {top_k!r}"
    if top_p is not None and (not finite_real(top_p) or not 0.0 < top_p <= 1.0):
        problems["top_p"] = f"top_p must be None or a number in (0, 1], got {top_p!r}"
    if min_p is not None and (not finite_real(min_p) or not 0.0 <= min_p <= 1.0):
        problems["min_p"] = f"min_p must be None or a number in [0, 1], got {min_p!r}"
    if not is_int(return_topk) or return_topk < 0:
        problems["return_topk"] = f"return_topk must be an integer >= 0, got {return_topk!r}"
    elif return_topk > true_vocab:
        problems["return_topk"] = f"return_topk={return_topk} is larger than the vocab ({true_vocab} tokens)"
    return problems


def agreed_values(sampler: dict, problems: dict, true_vocab: Optional[int] = None) -> dict:
    """The settings as every rank must pass them (must_agree), by effect: top_p / min_p as floats
    (1 and 1.0 alike), a filter that is off (None, top_p=1, min_p=0, top_k 0 / -1 / >= the vocab
    when `true_vocab` is given) as None, None for a setting that failed its check (reported by
    the check)."""
    def effect(k, v):
        if problems[k] or v is None:
            return None
        if k == "top_p":
            return None if float(v) >= 1.0 else float(v)
        if k == "min_p":
            return None if float(v) <= 0.0 else float(v)
        if k == "top_k" and top_k_off(v, true_vocab):
            return None
        return int(v)
    return {k: effect(k, v) for k, v in sampler.items()}


def filters_on(top_k, top_p, min_p, true_vocab: Optional[int] = None) -> bool:
    """Whether (checked) settings may drop a token, i.e. a log-prob may be -inf."""
    agreed = agreed_values(dict(top_k=top_k, top_p=top_p, min_p=min_p),
                           dict.fromkeys(("top_k", "top_p", "min_p")), true_vocab)
    return any(v is not None for v in agreed.values())


def min_p_floor(row_max: Tensor, min_p: float) -> Tensor:
    """The min_p cut on fp32 logits: keep z >= row_max + log(min_p), with log(min_p) rounded to
    fp32 and the sum rounded to fp32 (row_max is fp32). One explicit rule, so that a token at the
    boundary is decided the same way by every backend, rank and chunk; min_p = 1 gives
    row_max itself: the tokens tied with the max."""
    # rounded to fp32 on the host (no device copy): the sum of two fp32 values is then rounded
    # once, to fp32, on every device
    log_min_p = torch.tensor(math.log(min_p), dtype=torch.float32).item()
    return row_max.float() + log_min_p


def merge_candidates(keys: Tensor, group) -> Tensor:
    """Each rank's [n, M] keys -> the global first M of every row, sorted, identical on all ranks."""
    gathered = reductions.gather_over_ranks(keys, group)
    if gathered.shape[0] == 1:
        return keys
    n, m = keys.shape
    return gathered.permute(1, 0, 2).reshape(n, -1).topk(m, dim=1).values


# --------------------------------------------------------------------------------------------
# The kept set of each row of one chunk
# --------------------------------------------------------------------------------------------
class _ChunkSearch:
    """Global sums over the chunk's logits for a subset of rows (one collective each)."""

    def __init__(self, logits: Tensor, spec: ChunkSpec, sp: SamplingSpec, kernels):
        self.logits, self.spec, self.sp, self.kernels = logits, spec, sp, kernels

    def _local(self, rows, row_max, z_cut, id_cut, **want):
        spec = self.spec
        return self.kernels.kept_sums(self.logits, None, spec.num_valid_cols, spec.inv_temperature,
                                      self.sp.vocab_start, row_max, z_cut, id_cut, rows=rows, **want)

    def mass(self, rows, row_max, z_cut, id_cut) -> Tensor:
        """fp64 sum of exp(z - row_max) over the (z_cut, id_cut) prefix, all ranks."""
        local = self._local(rows, row_max, z_cut, id_cut).sum_exp
        return reductions.sum_over_ranks(local, self.spec.tp_group).double()

    def count_at_least(self, rows, row_max, value) -> Tensor:
        """Number of tokens with z >= value, all ranks."""
        ids = torch.full_like(value, ID_ALL, dtype=torch.int64)
        local = self._local(rows, row_max, value, ids, want_count=True).count
        return reductions.sum_over_ranks(local, self.spec.tp_group)

    def ties(self, rows, row_max, value) -> tuple[Tensor, Tensor]:
        """(fp64 mass strictly above value, all ranks; [tp, rows] count of z == value per rank)."""
        strictly = self._local(rows, row_max, value, torch.full_like(value, ID_NONE, dtype=torch.int64),
                               want_count=True)
        at_least = self._local(rows, row_max, value, torch.full_like(value, ID_ALL, dtype=torch.int64),
                               want_count=True)
        local = torch.stack([strictly.sum_exp.double(), (at_least.count - strictly.count).double()])
        gathered = reductions.gather_over_ranks(local, self.spec.tp_group)  # [tp, 2, rows]
        return gathered[:, 0].sum(dim=0), gathered[:, 1].round().long()

    def tie_id(self, rows, value, position) -> Tensor:
        """Global id of the position-th token tied at value on the rank that holds it."""
        spec = self.spec
        local = sampling_torch.tie_id(self.logits, rows, spec.num_valid_cols, spec.inv_temperature,
                                      self.sp.vocab_start, value, position)
        return reductions.max_over_ranks(local, spec.tp_group)


def _steps(lo: Tensor, hi: Tensor) -> int:
    """Bisection steps that settle every row (host value, identical on every rank)."""
    if lo.numel() == 0:
        return 0
    return int((hi - lo).max().item()).bit_length()


def _kth_largest(search: _ChunkSearch, k: int, row_max: Tensor, floor: Tensor, ceiling: Tensor) -> Tensor:
    """The k-th largest z of every row (exact), or -inf where it is below `floor`."""
    lo, hi = ordered_int32(floor).long(), ordered_int32(ceiling).long()
    reachable = search.count_at_least(None, row_max, floor) >= k
    hi = torch.where(reachable, hi, lo)
    for _ in range(_steps(lo, hi)):  # invariant: count(z >= value(lo)) >= k
        mid = torch.div(lo + hi + 1, 2, rounding_mode="floor")
        ok = search.count_at_least(None, row_max, float_from_ordered(mid)) >= k
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid - 1)
    return torch.where(reachable, float_from_ordered(lo), float("-inf"))


def _nucleus_cut(search: _ChunkSearch, rows: Tensor, row_max: Tensor, floor: Tensor, ceiling: Tensor,
                 target: Tensor) -> tuple[Tensor, Tensor]:
    """(z_cut, id_cut) of rows whose nucleus is longer than the candidates: the smallest value
    whose mass strictly above is < target, then the ties at it resolved by count."""
    lo, hi = ordered_int32(floor).long(), ordered_int32(ceiling).long()
    for _ in range(_steps(lo, hi)):  # invariant: mass(z > value(hi)) < target
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        value = float_from_ordered(mid)
        ok = search.mass(rows, row_max, value, torch.full_like(mid, ID_NONE)) < target
        lo, hi = torch.where(ok, lo, mid + 1), torch.where(ok, mid, hi)
    z_cut = float_from_ordered(hi)
    above, ties = search.ties(rows, row_max, z_cut)
    # Tied tokens have the same probability: the j-th of them (id order, j = 0, 1, ...) has
    # mass `above + j * e` ranked before it, so the nucleus takes ceil((target - above) / e).
    e = torch.exp(z_cut - row_max).double()
    wanted = torch.ceil((target - above) / e).clamp(min=1).long()
    wanted = torch.minimum(wanted, ties.sum(dim=0))
    cumulative = ties.cumsum(dim=0)  # [tp, rows]
    owner = (cumulative < wanted.unsqueeze(0)).sum(dim=0)
    before = torch.where(owner > 0, cumulative.gather(0, (owner - 1).clamp(min=0).unsqueeze(0)).squeeze(0), 0)
    rank = reductions.group_rank(search.spec.tp_group)
    position = torch.where(owner == rank, wanted - before, 0)
    return z_cut, search.tie_id(rows, z_cut, position)


def kept_cut(cz: Tensor, cid: Tensor, cvalid: Tensor, search: _ChunkSearch, sp: SamplingSpec):
    """Per row (z_cut, id_cut) of the kept set (module doc), from the merged candidates."""
    n, num_cands = cz.shape
    SEARCH_COUNTS["rows"] += n
    row_max = cz[:, 0]
    floor = (min_p_floor(row_max, sp.min_p) if sp.min_p is not None
             else torch.full_like(row_max, float("-inf")))
    if sp.top_k is not None:
        if sp.top_k <= num_cands:
            kth = cz[:, sp.top_k - 1]
        else:
            SEARCH_COUNTS["top_k_search_rows"] += n
            kth = _kth_largest(search, sp.top_k, row_max, floor, cz[:, -1])
        floor = torch.maximum(floor, kth)
    if sp.top_p is None:
        return floor, torch.full((n,), ID_ALL, dtype=torch.int64, device=cz.device)

    # top_p over the remainder R = {z >= floor}
    in_rest = cvalid & (cz >= floor.unsqueeze(1))
    mass = torch.where(in_rest, torch.exp(cz - row_max.unsqueeze(1)).double(), 0.0)
    cumulative = mass.cumsum(dim=1)
    rest_mass = cumulative[:, -1].clone()
    # R is inside the candidates unless the last candidate is in R (and some token is not a candidate)
    spills = in_rest[:, -1] & (num_cands < sp.true_vocab)
    rows = spills.nonzero().squeeze(1)
    if rows.numel():  # a host sync; the same rows on every rank
        rest_mass[rows] = search.mass(rows, row_max[rows], floor[rows],
                                      torch.full_like(rows, ID_ALL))
    target = sp.top_p * rest_mass
    before = torch.cat([torch.zeros_like(mass[:, :1]), cumulative[:, :-1]], dim=1)
    last = (in_rest & (before < target.unsqueeze(1))).sum(dim=1) - 1  # >= 0: before[:, 0] = 0
    z_cut = cz.gather(1, last.unsqueeze(1)).squeeze(1)
    id_cut = cid.gather(1, last.unsqueeze(1)).squeeze(1)
    longer = spills & (cumulative[:, -1] < target)  # every candidate kept and the nucleus goes on
    rows = longer.nonzero().squeeze(1)
    SEARCH_COUNTS["top_p_search_rows"] += rows.numel()
    if rows.numel():
        z_cut[rows], id_cut[rows] = _nucleus_cut(search, rows, row_max[rows], floor[rows],
                                                 cz[rows, -1], target[rows])
    return z_cut, id_cut


# --------------------------------------------------------------------------------------------
# The sampler's tiling
# --------------------------------------------------------------------------------------------
@dataclass
class KeptStats(reductions.MergedStats):
    """MergedStats over each row's kept set K (the full vocab without filters), plus the set and
    the top-k. With M the row max (always in K): lse = M + log_sum_exp, log_sum_exp = log sum_K
    exp(z - M); entropy is that of the renormalized kept-set distribution q."""

    z_cut: Optional[Tensor] = None  # the kept set's (z_cut, id_cut) per row (None without filters)
    id_cut: Optional[Tensor] = None
    topk_logprobs: Optional[Tensor] = None  # [n, return_topk] under the full softmax(z)
    topk_ids: Optional[Tensor] = None  # [n, return_topk] int64 global ids

    def grad_offsets(self) -> tuple:
        """The kept set's dlogits need its cut besides the softmax's offsets."""
        if self.z_cut is None:
            return super().grad_offsets()
        return (self.max, self.log_sum_exp, self.z_cut, self.id_cut)

    def label_kept(self, labels: Tensor) -> Optional[Tensor]:
        """bool per row: the label (global id) is in the kept set (None without filters)."""
        if self.z_cut is None:
            return None
        target = self.target.detach()
        return (target > self.z_cut) | ((target == self.z_cut) & (labels <= self.id_cut))


def _topk(cands: Tensor, row_max: Tensor, log_sum_exp: Tensor, k: int):
    """Log-probs (z - M) - log S of the first k candidates, and their ids."""
    cz, cid, _ = decode_keys(cands[:, :k])
    return (cz - row_max.unsqueeze(1)) - log_sum_exp.unsqueeze(1), cid


def _kept_chunk(logits: Tensor, local_target: Tensor, spec: ChunkSpec, sp: SamplingSpec) -> KeptStats:
    """One chunk's statistics over the kept set, merged over TP ranks."""
    kernels = spec.backend
    keys = kernels.shard_candidates(logits, spec.num_valid_cols, spec.inv_temperature, sp.vocab_start,
                                    sp.num_candidates)
    cands = merge_candidates(keys, spec.tp_group)
    cz, cid, cvalid = decode_keys(cands)
    row_max = cz[:, 0]
    z_cut, id_cut = kept_cut(cz, cid, cvalid, _ChunkSearch(logits, spec, sp, kernels), sp)
    sums = kernels.kept_sums(logits, local_target, spec.num_valid_cols, spec.inv_temperature,
                             sp.vocab_start, row_max, z_cut, id_cut, want_entropy=spec.want_entropy,
                             want_total=sp.return_topk > 0)
    parts = [sums.sum_exp, sums.target]
    parts += [sums.sum_exp_shifted] if spec.want_entropy else []
    parts += [sums.total] if sp.return_topk else []
    merged = reductions.sum_over_ranks(torch.stack(parts), spec.tp_group)
    kept_sum, target = merged[0], merged[1]
    log_sum_exp = torch.log(kept_sum)
    topk_lp = topk_ids = None
    if sp.return_topk:
        topk_lp, topk_ids = _topk(cands, row_max, torch.log(merged[-1]), sp.return_topk)
    return KeptStats(target=target, lse=row_max + log_sum_exp,
                     # H = log S - E_q[z - M], relative to the max (as reductions.merge_shard_stats)
                     entropy=log_sum_exp - merged[2] / kept_sum if spec.want_entropy else None,
                     max=row_max, log_sum_exp=log_sum_exp, topk_logprobs=topk_lp, topk_ids=topk_ids,
                     z_cut=z_cut, id_cut=id_cut)


def _concat(parts: list, rows: Tensor, spec: ChunkSpec, sp: SamplingSpec) -> KeptStats:
    if not parts:  # no labelled row (on any rank: the count is agreed)
        empty = rows.new_zeros(0, dtype=torch.float32)
        k, ints = sp.return_topk, dict(dtype=torch.int64, device=empty.device)
        return KeptStats(target=empty, lse=empty, entropy=empty if spec.want_entropy else None, max=empty,
                         log_sum_exp=empty, z_cut=empty, id_cut=torch.zeros(0, **ints),
                         topk_logprobs=empty.new_zeros(0, k) if k else None,
                         topk_ids=torch.zeros(0, k, **ints) if k else None)
    return KeptStats(**{
        name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
        for name in KeptStats.__dataclass_fields__})


@dataclass(frozen=True)
class SamplerChunks:
    """`spec.tiling` when a sampler setting is on: fast.py's chunks of rows (each one GEMM over the
    whole vocab shard) and its two loops, with the kept-set math per chunk. A row's kept set needs
    the global candidates of its chunk, so with filters the statistics are merged over TP ranks
    chunk by chunk; `return_topk` alone keeps the plain statistics bit for bit (merged once after
    the loop, as fast.FastChunks) and takes the candidates from the same chunks of logits."""

    sp: SamplingSpec
    statistics_type = KeptStats

    def weight_grad_dtype(self, weight: Tensor, num_rows: int, spec) -> torch.dtype:
        return FAST_CHUNKS.weight_grad_dtype(weight, num_rows, spec)

    def merged_statistics(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> KeptStats:
        sp = self.sp
        if sp.filters:
            parts = map_chunk_logits(rows, weight, spec, lambda start, end, logits: _kept_chunk(
                logits, local_target[start:end], spec, sp))
            return _concat(parts, rows, spec, sp)
        kernels, keys = spec.backend, []

        def plain_stats_and_candidates(start, end, logits):
            keys.append(kernels.shard_candidates(logits, spec.num_valid_cols, spec.inv_temperature,
                                                 sp.vocab_start, sp.num_candidates))
            return logits_partials(logits, local_target[start:end], spec)

        partials = concat_partials(map_chunk_logits(rows, weight, spec, plain_stats_and_candidates), rows, spec)
        merged = reductions.merge_shard_stats(partials, spec.tp_group, spec.backend)
        local = torch.cat(keys) if keys else torch.zeros(0, sp.num_candidates, dtype=torch.int64, device=rows.device)
        topk_lp, topk_ids = _topk(merge_candidates(local, spec.tp_group), merged.max, merged.log_sum_exp,
                                  sp.return_topk)
        return KeptStats(**vars(merged), topk_logprobs=topk_lp, topk_ids=topk_ids)

    def recompute_grads(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
                        coefs: dict, dx_rows: Optional[Tensor], dw_out: Optional[Tensor],
                        accumulate: bool) -> Optional[Tensor]:
        """fast.py's backward loop; with filters each chunk's dlogits are those of the kept-set
        distribution: d log q_y / dz_k = [k == y] - q_k on K, 0 outside (kernels.kept_dlogits_)."""
        if not self.sp.filters:
            return FAST_CHUNKS.recompute_grads(rows, weight, local_target, spec, offsets, coefs, dx_rows, dw_out,
                                               accumulate)
        return backward_grads(rows, weight, local_target, spec, offsets, coefs, dx_rows, dw_out,
                              dw_accumulate=accumulate, cast_dw_to=weight_grad_cast_target(dw_out, weight, accumulate),
                              chunk_dlogits=self._kept_dlogits)

    def _kept_dlogits(self, h: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
                      coefs: dict) -> Tensor:
        row_max, log_sum_exp, z_cut, id_cut = offsets
        dlogits = spec.backend.kept_dlogits_(
            chunk_logits(h, weight, spec), local_target, spec.num_valid_cols, spec.inv_temperature,
            self.sp.vocab_start, row_max, log_sum_exp, z_cut, id_cut, coefs["p"], coefs["pz"], coefs["target"])
        return gemm_input(dlogits, h)


# --------------------------------------------------------------------------------------------
# Materialized logits (the Megatron post-processor's unfused path)
# --------------------------------------------------------------------------------------------
@dataclass
class LogitsSampler:
    """Sampler quantities of materialized vocab-parallel logits [N, V_local] (no gradient)."""

    z_cut: Optional[Tensor]  # [N] (None without filters)
    id_cut: Optional[Tensor]  # [N]
    topk_logprobs: Optional[Tensor]  # [N, return_topk] under the full softmax(z)
    topk_ids: Optional[Tensor]  # [N, return_topk]

    def kept_columns(self, logits: Tensor, num_valid_cols: int, inv_temperature: float,
                     vocab_start: int) -> Tensor:
        """[N, V_local] bool: the kept set on this shard (padding columns never)."""
        z = logits[:, :num_valid_cols].float() * inv_temperature  # the op's z, bit for bit
        ids = torch.arange(vocab_start, vocab_start + num_valid_cols, device=logits.device)
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        keep[:, :num_valid_cols] = sampling_torch.kept_mask(z, ids, self.z_cut, self.id_cut)
        return keep


@torch.no_grad()
def sample_logits(logits: Tensor, *, tp_group, num_valid_cols: int, inv_temperature: float,
                  sp: SamplingSpec) -> LogitsSampler:
    """The kept-set cut and top-k of every row of [N, V_local] logits, with the same candidates,
    searches and collectives as the fused op (all rows as one chunk, torch kernels)."""
    logits = logits.detach()
    spec = ChunkSpec(tp_group=tp_group, backend=None, num_valid_cols=num_valid_cols,
                     inv_temperature=inv_temperature, chunk_size=max(logits.shape[0], 1),
                     want_sum_logits=False, want_entropy=False, sequence_parallel=False)
    keys = sampling_torch.shard_candidates(logits, num_valid_cols, inv_temperature, sp.vocab_start,
                                           sp.num_candidates)
    cands = merge_candidates(keys, tp_group)
    cz, cid, cvalid = decode_keys(cands)
    z_cut = id_cut = topk_lp = topk_ids = None
    if sp.filters:
        z_cut, id_cut = kept_cut(cz, cid, cvalid, _ChunkSearch(logits, spec, sp, sampling_torch), sp)
    if sp.return_topk:
        row_max = cz[:, 0]
        local = sampling_torch.kept_sums(logits, None, num_valid_cols, inv_temperature, sp.vocab_start,
                                         row_max, row_max, torch.full_like(cid[:, 0], ID_ALL),
                                         want_total=True).total
        topk_lp, topk_ids = _topk(cands, row_max, torch.log(reductions.sum_over_ranks(local, tp_group)),
                                  sp.return_topk)
    return LogitsSampler(z_cut, id_cut, topk_lp, topk_ids)
