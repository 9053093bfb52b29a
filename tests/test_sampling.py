"""Sampler fidelity: linear_logprobs(top_k=, top_p=, min_p=, return_topk=) against a float64 dense
reference of the same semantics (sampling_reference.py), at TP 1/2/4 over gloo.

Every case: padded vocab (the last shard holds padding columns), temperature 0.7, chunks of 7 rows
(dividing neither the token count nor the labelled count), ignored tokens, labels both inside and
outside the kept set, values and dX / dW under non-uniform upstream gradients. "ints" inputs are
small integers whose logits are exact in every dtype: many exactly tied logits (the bf16 case of
real models), so the reference decides on exactly the values the op sees.

Tolerances as tests/test_ops.py (relative norm vs float64): fp32 2e-5, bf16 2e-2. The kept set and
the top-k ids must match exactly.
"""

import math
import pickle
import zlib

import pytest
import torch
import torch.distributed as dist

import reference
from dist import run_workers
from megatron_fused_ce import LogprobsOutput, linear_logprobs
from megatron_fused_ce.ops import sampling
from megatron_fused_ce.ops.backends import sampling_torch
from sampling_cases import PARAMS, check, dense_z, make_case, run_case, world_group


def _params_worker(rank, world, case, param_list, impl="torch"):
    return [run_case(rank, world, case, params, impl) for params in param_list]


def _seed(*key):
    return zlib.crc32(repr(key).encode()) % 10_000


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype,ints", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
                         ids=["fp32", "fp32-ties", "bf16-ties"])
def test_matches_dense_reference(tp, dtype, ints):
    case = make_case(_seed(tp, str(dtype), ints), tp, dtype=dtype, ints=ints)
    for params, results in zip(PARAMS, zip(*run_workers(_params_worker, tp, case, PARAMS))):
        check(case, params, results)


# vLLM's SamplingParams spellings: top_k 0 / -1 = off, min_p = 1 keeps the tokens tied with the max
ENGINE_PARAMS = [
    dict(min_p=1.0),
    dict(top_k=-1, top_p=0.8),
    dict(top_k=0, min_p=0.1, return_topk=3),
    dict(top_k=-1, top_p=0.9, min_p=1.0),
]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype,ints", [(torch.float32, False), (torch.float32, True)], ids=["fp32", "fp32-ties"])
def test_engine_settings_match_dense_reference(tp, dtype, ints):
    """The settings as vLLM reads them, against the float64 reference: "ties" rows hold several
    tokens tied with the max, all of which min_p=1 keeps."""
    case = make_case(_seed("engine", tp, ints), tp, dtype=dtype, ints=ints)
    if ints:  # the case exercises ties with the max
        z = dense_z(case["hidden"], case["weight"], case["vocab"], case["T"])
        assert ((z == z.max(dim=1, keepdim=True).values).sum(dim=1) > 1).any()
    for params, results in zip(ENGINE_PARAMS, zip(*run_workers(_params_worker, tp, case, ENGINE_PARAMS))):
        check(case, params, results, what="sampled (engine settings)")


def test_sequence_parallel_and_all_ignored_chunks():
    case = make_case(3, 2, sp=True, ignored=0.6)
    params = [dict(top_p=0.85, return_topk=3), dict(top_k=3, min_p=0.2)]
    for p, results in zip(params, zip(*run_workers(_params_worker, 2, case, params))):
        check(case, p, results)


# ---------------------------------------------------------------- exact searches (forced)
def _counting_worker(rank, world, case, param_list, candidates, max_top_k):
    """Run with tiny candidate counts and count searches and collectives on this rank."""
    sampling.CANDIDATES, sampling.MAX_TOP_K_CANDIDATES = candidates, max_top_k
    sampling_torch.TIE_ROWS = 2  # tie resolution in several row blocks
    counts = {"nucleus": 0, "kth": 0, "collectives": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    sampling._nucleus_cut = counted("nucleus", sampling._nucleus_cut)
    sampling._kth_largest = counted("kth", sampling._kth_largest)
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        setattr(dist, name, counted("collectives", getattr(dist, name)))
    results = [run_case(rank, world, case, params) for params in param_list]
    return results, counts


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_exact_searches_when_candidates_do_not_settle(tp):
    """CANDIDATES=2 and MAX_TOP_K_CANDIDATES=2: every top_p row with a nucleus of 3+ tokens and
    every top_k >= 3 takes the exact search; ties (ints) land at the cuts."""
    params = [dict(top_p=0.95), dict(top_k=9), dict(top_k=30, top_p=0.97, min_p=0.01, return_topk=2)]
    for ints in (False, True):
        case = make_case(_seed("search", tp, ints), tp, ints=ints, temperature=1.3)
        out = run_workers(_counting_worker, tp, case, params, 2, 2)
        for i, p in enumerate(params):
            check(case, p, [results[i] for results, _ in out], what="searched")
        counts = [c for _, c in out]
        assert counts[0]["nucleus"] > 0 and counts[0]["kth"] > 0, counts
        assert all(c == counts[0] for c in counts), f"collective counts differ across ranks: {counts}"


# ---------------------------------------------------------------- no filter = today, bit for bit
def _identity_worker(rank, world, case):
    plain = run_case(rank, world, case, {})
    noop = run_case(rank, world, case, dict(top_k=case["vocab"], top_p=1.0, min_p=0.0))
    noop_none = run_case(rank, world, case, dict(top_k=None, top_p=None, min_p=None, return_topk=0))
    noop_engine = run_case(rank, world, case, dict(top_k=0, top_p=1.0, min_p=0.0))  # vLLM's defaults
    noop_minus_one = run_case(rank, world, case, dict(top_k=-1))
    topk_only = run_case(rank, world, case, dict(return_topk=5))
    return plain, noop, noop_none, noop_engine, noop_minus_one, topk_only


@pytest.mark.parametrize("tp", [1, 4])
def test_no_filter_is_todays_result_bit_for_bit(tp):
    case = make_case(_seed("identity", tp), tp, dtype=torch.bfloat16, ints=True)
    results = run_workers(_identity_worker, tp, case)
    for plain, *others in results:
        for other in others:
            for key in ("lp", "ent", "dx", "dw"):
                assert torch.equal(plain[key], other[key]), key
    check(case, dict(return_topk=5), [r[-1] for r in results], what="topk-only")


def test_no_grad_matches_grad_path():
    case = make_case(8, 1)
    h, w = case["hidden"], case["weight"][:case["v_local"]]
    for params in PARAMS:
        kw = dict(vocab_size=case["vocab"], temperature=case["T"], chunk_size=5, return_entropy=True, **params)
        with torch.no_grad():
            a = linear_logprobs(h, w, case["labels"], **kw)
        b = linear_logprobs(h.clone().requires_grad_(), w, case["labels"], **kw)
        assert torch.equal(a.logprobs, b.logprobs.detach()) and torch.equal(a.entropy, b.entropy.detach())
        assert (a.topk_ids is None) == (b.topk_ids is None)
        if a.topk_ids is not None:
            assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)


@pytest.mark.parametrize("params", [dict(top_p=0.8, top_k=9), dict(return_topk=4)], ids=["filters", "topk-only"])
def test_sampler_runs_on_the_shared_chunk_loop(params, monkeypatch):
    """The sampler is a tiling of the one chunk loop: its forward and its recompute backward walk
    the rows with fast.py's loops (one chunk of logits at a time, the last chunk's dW written in
    the weight dtype) under the same autograd Function as the plain statistics. A copy of the loop
    in sampling.py would drift from those guarantees without a test of its own noticing."""
    from megatron_fused_ce.ops import fast
    walks = []
    real_row_chunks = fast.row_chunks

    def counted(num_rows, chunk_size):
        spans = list(real_row_chunks(num_rows, chunk_size))
        walks.append(len(spans))
        return iter(spans)

    monkeypatch.setattr(fast, "row_chunks", counted)
    case = make_case(_seed("loop", str(params)), 1)
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"][:case["v_local"]].clone().requires_grad_()
    out = linear_logprobs(h, w, case["labels"], vocab_size=case["vocab"], temperature=case["T"], chunk_size=7,
                          return_entropy=True, **params)
    rows = case["labels"].numel()  # ignored rows go through the loop too, with a zero gradient
    assert walks == [math.ceil(rows / 7)]  # the forward: one walk over the rows
    nodes, seen, stack = set(), set(), [out.logprobs.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes.add(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
    assert "LinearSoftmaxStatsBackward" in nodes, nodes
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert walks == [math.ceil(rows / 7)] * 2  # the backward: the same loop once more
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_topk_up_to_64_and_whole_vocab():
    case = make_case(9, 4, vocab=70, extra_pad=2)  # 4 shards of 20 columns, the last 10 padding
    params = [dict(return_topk=64), dict(return_topk=70, top_p=0.5)]
    for p, results in zip(params, zip(*run_workers(_params_worker, 4, case, params))):
        check(case, p, results)


# ---------------------------------------------------------------- output type
def test_logprobs_output_still_unpacks_as_a_pair():
    h, w = torch.randn(5, 8), torch.randn(12, 8)
    y = torch.tensor([0, 3, -100, 7, 11])
    out = linear_logprobs(h, w, y, return_entropy=True, return_topk=3, top_p=0.9)
    lp, ent = out  # existing callers unpack two fields
    assert isinstance(out, tuple) and len(out) == 2 and lp is out.logprobs and ent is out.entropy
    assert out.topk_ids.shape == (5, 3) and out.topk_logprobs.shape == (5, 3)
    again = pickle.loads(pickle.dumps(out))
    assert torch.equal(again.topk_ids, out.topk_ids) and torch.equal(again.logprobs, out.logprobs)
    moved = out._replace(entropy=None)
    assert moved.entropy is None and moved.topk_ids is out.topk_ids
    plain = LogprobsOutput(lp, None)
    assert plain.topk_ids is None and plain.topk_logprobs is None
    doubled = out.map(lambda t: t * 2)  # every field, top-k included; None stays None
    assert torch.equal(doubled.topk_ids, out.topk_ids * 2) and torch.equal(doubled.entropy, ent * 2)
    assert plain.map(lambda t: t * 2).entropy is None and plain.map(lambda t: t).topk_ids is None
    assert "topk_ids" in repr(out) and "topk_ids" not in repr(plain)


# ---------------------------------------------------------------- memory
@pytest.mark.parametrize("forced_search", [False, True])
def test_largest_intermediate_is_one_chunk(forced_search, monkeypatch):
    if forced_search:
        monkeypatch.setattr(sampling, "CANDIDATES", 2)
        monkeypatch.setattr(sampling, "MAX_TOP_K_CANDIDATES", 2)
    n, hidden, v_local, chunk = (512 if forced_search else 1024), 32, 512, 128
    torch.manual_seed(1)
    h = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(v_local, hidden).requires_grad_()  # peaked rows: nuclei within the candidates
    y = torch.randint(0, v_local, (n,))
    y[::5] = -100
    with reference.LargestTensor() as mode:
        out = linear_logprobs(h, w, y, chunk_size=chunk, return_entropy=True, top_k=40, top_p=0.9,
                              min_p=0.001, return_topk=20)
        (torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0).sum() + out.entropy.sum()).backward()
    reference.record_memory(f"linear_logprobs top_k/top_p/min_p/return_topk"
                            f"{', exact searches' if forced_search else ''} (chunk {chunk} of {n} rows): "
                            f"largest tensor / dense [N, V] logits", mode.largest / (n * v_local))
    assert mode.largest <= chunk * v_local, (mode.largest, chunk * v_local)


# ---------------------------------------------------------------- bad input
BAD = {  # values no engine accepts (vLLM: top_k >= -1, top_p in (0, 1], min_p in [0, 1])
    "top_k_minus_two": (dict(top_k=-2), "top_k"),
    "top_k_float": (dict(top_k=2.0), "top_k"),
    "top_k_bool": (dict(top_k=True), "top_k"),
    "top_p_zero": (dict(top_p=0.0), "top_p"),
    "top_p_above_one": (dict(top_p=1.5), "top_p"),
    "top_p_nan": (dict(top_p=float("nan")), "top_p"),
    "min_p_above_one": (dict(min_p=1.5), "min_p"),
    "min_p_negative": (dict(min_p=-0.1), "min_p"),
    "min_p_nan": (dict(min_p=float("nan")), "min_p"),
    "min_p_inf": (dict(min_p=float("inf")), "min_p"),
    "return_topk_larger_than_vocab": (dict(return_topk=21), "return_topk"),
    "return_topk_negative": (dict(return_topk=-1), "return_topk"),
    "top_p_on_rank1_only": ("rank1", "top_p"),
    "top_k_differs_across_ranks": ("differs", "top_k"),
}


def _bad_worker(rank, world, name):
    torch.manual_seed(0)
    h, w, y = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 20, (6,))
    kwargs, _ = BAD[name]
    if kwargs == "rank1":
        kwargs = dict(top_p=1.5) if rank == 1 else {}
    elif kwargs == "differs":
        kwargs = dict(top_k=3 + rank)
    try:
        linear_logprobs(h.requires_grad_(), w.requires_grad_(), y, tp_group=dist.group.WORLD, **kwargs)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_sampler_arguments_raise_on_every_rank(name):
    for rank, msg in enumerate(run_workers(_bad_worker, 2, name, timeout=20)):
        assert msg is not None, f"rank {rank} did not raise for {name}"
        assert BAD[name][1] in msg, f"rank {rank}: {msg!r} does not name {BAD[name][1]}"


def _off_spelled_differently_worker(rank, world, spellings):
    torch.manual_seed(0)
    h, w, y = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 20, (6,))
    got = linear_logprobs(h, w, y, tp_group=dist.group.WORLD, **spellings[rank]).logprobs
    return torch.equal(got, linear_logprobs(h, w, y, tp_group=dist.group.WORLD).logprobs)


@pytest.mark.parametrize("spellings", [
    (dict(top_p=None, min_p=0.0), dict(top_p=1.0, min_p=None)),
    (dict(top_k=0), dict(top_k=None)),
    (dict(top_k=-1), dict(top_k=0)),
    (dict(top_k=20, top_p=1), dict(top_k=-1)),  # top_k >= the vocab (20) keeps everything too
], ids=["top_p_min_p", "top_k_0_none", "top_k_-1_0", "top_k_vocab_-1"])
def test_filters_that_are_off_agree_however_spelled(spellings):
    """top_p=None and top_p=1.0, min_p=None and 0.0, top_k None / 0 / -1 / >= vocab are the same
    setting: no rank raises, and the result is the unfiltered one."""
    assert run_workers(_off_spelled_differently_worker, 2, spellings, timeout=20) == [True, True]


def _filter_on_one_rank_worker(rank, world, spellings):
    torch.manual_seed(0)
    h, w, y = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 20, (6,))
    try:
        linear_logprobs(h, w, y, tp_group=dist.group.WORLD, **spellings[rank])
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("spellings,name", [
    ((dict(top_k=0), dict(top_k=1)), "top_k"),
    ((dict(min_p=1.0), dict(min_p=None)), "min_p"),
], ids=["top_k_off_vs_1", "min_p_1_vs_off"])
def test_a_filter_on_one_rank_only_raises_on_every_rank(spellings, name):
    """Compared by effect, not leniently: top_k=0 (off) and top_k=1 differ, min_p=1 is a filter."""
    for rank, msg in enumerate(run_workers(_filter_on_one_rank_worker, 2, spellings, timeout=20)):
        assert msg is not None and name in msg, (rank, msg)


# ---------------------------------------------------------------- exact semantics, by hand
LN2 = 0.6931471805599453
_F32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
_BELOW_3 = torch.nextafter(_F32(3.0), _F32(float("-inf"))).item()  # fp32 neighbours
_BELOW_M15 = torch.nextafter(_F32(-1.5), _F32(float("-inf"))).item()
_ABOVE_M15 = torch.nextafter(_F32(-1.5), _F32(float("inf"))).item()
_LSE_M15 = math.log(math.exp(0.5) + math.exp(-1.5) + math.exp(_ABOVE_M15))
_LSE_1220 = math.log(math.e + 2 * math.e**2 + 1.0)
_LSE_122 = math.log(math.e + 2 * math.e**2)
# (logits of one row, settings, {label: expected log-prob}); every probability is exact in fp32
EXACT = [
    ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.5), {0: -LN2, 1: -LN2, 2: None}),  # mass before id 2 = 0.5: out
    ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.6), {2: -math.log(3), 3: None}),  # a tie cut across ranks
    ([1.0, 2.0, 2.0, 0.0], dict(top_k=2), {1: -LN2, 2: -LN2, 0: None}),
    ([2.0, 1.0, 1.0, 0.0], dict(top_k=2), {0: 2.0 - math.log(math.e**2 + 2 * math.e),  # ties at the
                                           2: 1.0 - math.log(math.e**2 + 2 * math.e), 3: None}),  # k-th kept
    ([2 * LN2, LN2, 0.0, 0.0], dict(min_p=0.5), {0: math.log(4 / 6), 1: math.log(2 / 6), 2: None}),
    ([3.0, 3.0, 2.0, 1.0], dict(min_p=math.exp(-1.5), top_k=3, top_p=0.7), {1: -LN2, 2: None, 3: None}),
    # min_p = 1: the tokens tied with the max (here on both ranks at TP=2), not one an ulp below it
    ([3.0, _BELOW_3, 3.0, 1.0], dict(min_p=1.0), {0: -LN2, 2: -LN2, 1: None, 3: None}),
    ([_BELOW_3, 3.0, 1.0, 1.0], dict(min_p=1.0, top_k=-1, top_p=0.5), {1: 0.0, 0: None, 2: None}),
    # the min_p boundary, decided on fp32 logits: keep z >= M + fl32(log(min_p)) = 0.5 - 2 = -1.5
    # exactly (log(exp(-2)) rounds to -2 in fp32): the token at -1.5 is kept, one an ulp below not
    ([0.5, -1.5, _BELOW_M15, _ABOVE_M15], dict(min_p=math.exp(-2.0)),
     {0: 0.5 - _LSE_M15, 1: -1.5 - _LSE_M15, 3: _ABOVE_M15 - _LSE_M15, 2: None}),
    # top_k 0 and -1: off (vLLM's spellings), with and without another filter
    ([1.0, 2.0, 2.0, 0.0], dict(top_k=0), {0: 1.0 - _LSE_1220, 3: -_LSE_1220}),
    ([1.0, 2.0, 2.0, 0.0], dict(top_k=-1, min_p=math.exp(-1.5)), {0: 1.0 - _LSE_122, 1: 2.0 - _LSE_122, 3: None}),
]


def _exact_worker(rank, world, candidates):
    sampling.CANDIDATES, sampling.MAX_TOP_K_CANDIDATES = candidates, candidates
    v_local = 4 // world
    weight = torch.eye(4)[rank * v_local:(rank + 1) * v_local]
    out = []
    for row, params, expected in EXACT:
        labels = torch.tensor(list(expected))
        hidden = torch.tensor([row] * len(labels))
        out.append(linear_logprobs(hidden, weight, labels, tp_group=world_group(world), chunk_size=2, **params).logprobs)
    return out


@pytest.mark.parametrize("tp,candidates", [(1, 128), (2, 128), (2, 1)], ids=["tp1", "tp2", "tp2-searched"])
def test_exact_semantics_by_hand(tp, candidates):
    """vLLM's rules at their boundaries: a token whose preceding mass equals top_p is dropped,
    every token tied with the k-th is kept, p == min_p * p_max is kept, ties cut by lower id;
    min_p's boundary is decided on fp32 logits (z >= M + log(min_p), both rounded to fp32):
    min_p = 1 keeps exactly the ties with the max; top_k 0 / -1 are off."""
    for results in run_workers(_exact_worker, tp, candidates):
        for (row, params, expected), lp in zip(EXACT, results):
            for (label, want), got in zip(expected.items(), lp.tolist()):
                if want is None:
                    assert got == float("-inf"), (row, params, label, got)
                else:
                    assert got == pytest.approx(want, abs=1e-6), (row, params, label, got)


# ---------------------------------------------------------------- the op's other options
def test_logits_dtype_main_grad_autocast_and_first_order_only():
    case = make_case(12, 1, dtype=torch.bfloat16, ints=True)
    params = dict(top_k=12, top_p=0.9, min_p=0.02, return_topk=6)
    plain = run_case(0, 1, case, params)
    check(case, params, [run_case(0, 1, dict(case, chunk_size=5), params)], what="options")
    h, w = case["hidden"], case["weight"]
    kw = dict(vocab_size=case["vocab"], temperature=case["T"], chunk_size=7, return_entropy=True, **params)
    # fp32 logits: the integer logits are exact either way
    out = linear_logprobs(h, w, case["labels"], logits_dtype=torch.float32, **kw)
    assert torch.equal(torch.isfinite(out.logprobs), torch.isfinite(plain["lp"]))
    assert torch.equal(out.topk_ids, plain["topk_ids"])
    # Megatron's main_grad: the same dW lands there
    wp = w.clone().requires_grad_()
    wp.main_grad, wp.grad_added_to_main_grad = torch.zeros(w.shape), False
    out = linear_logprobs(h.clone().requires_grad_(), wp, case["labels"], accumulate_into_main_grad=True, **kw)
    finite = torch.isfinite(out.logprobs)
    ((torch.where(finite, out.logprobs, 0.0) * case["grad_lp"]).sum() + (out.entropy * case["grad_ent"]).sum()).backward()
    assert wp.grad_added_to_main_grad and reference.rel_err(wp.main_grad, plain["dw"].float()) < 1e-2
    # autocast: fp32 inputs computed in bf16, as F.linear would
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_logprobs(h.float(), w.float(), case["labels"], **kw)
    assert torch.equal(torch.isfinite(out.logprobs), torch.isfinite(plain["lp"]))
    # a gradient penalty through the op raises instead of dropping the second-order term
    hg = h.float().clone().requires_grad_()
    lp = linear_logprobs(hg, w.float(), case["labels"], **kw).logprobs
    (grad,) = torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum(), hg, create_graph=True)
    with pytest.raises(RuntimeError, match="second-order"):
        grad.square().sum().backward()
