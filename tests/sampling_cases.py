"""Sampler cases (top_k / top_p / min_p / return_topk) and their float64 check, shared by
tests/test_sampling.py, the backend suites and the NCCL suite.

Tolerances as tests/test_ops.py (relative norm vs float64): fp32 2e-5, bf16 2e-2. The kept set and
the top-k ids must match exactly.
"""

import torch
import torch.distributed as dist

import reference
import sampling_reference as sref
from megatron_fused_ce import linear_logprobs

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


PARAMS = [
    dict(top_k=5),
    dict(top_p=0.8),
    dict(min_p=0.1),
    dict(top_k=12, top_p=0.9, min_p=0.02, return_topk=6),
]


def random_inputs(g, tp, dtype, ints, seq, batch, hidden, vocab, extra_pad):
    """(columns per shard, hidden [seq, batch, hidden], the padded full weight) drawn from `g`."""
    v_local = -(-vocab // tp) + extra_pad
    if ints:  # integer logits: exact in bf16, many ties
        hidden_full = torch.randint(-2, 3, (seq, batch, hidden), generator=g).to(dtype)
        weight_full = (torch.randint(-2, 3, (v_local * tp, hidden), generator=g) * 0.25).to(dtype)
    else:
        hidden_full = torch.randn(seq, batch, hidden, generator=g).to(dtype)
        weight_full = (torch.randn(v_local * tp, hidden, generator=g) * 2.0 / hidden**0.5).to(dtype)
    return v_local, hidden_full, weight_full


def make_case(seed, tp, *, dtype=torch.float32, ints=False, seq=10, batch=3, hidden=16, vocab=101,
              extra_pad=3, temperature=0.7, chunk_size=7, ignored=0.25, sp=False):
    g = torch.Generator().manual_seed(seed)
    v_local, hidden_full, weight_full = random_inputs(g, tp, dtype, ints, seq, batch, hidden, vocab, extra_pad)
    z = dense_z(hidden_full, weight_full, vocab, temperature)
    # labels: a third random, a third the argmax, a third among the 4 most likely
    labels = torch.randint(0, vocab, (seq * batch,), generator=g)
    top4 = z.topk(4, dim=1).indices
    pick = torch.randint(0, 4, (seq * batch,), generator=g)
    which = torch.arange(seq * batch) % 3
    labels = torch.where(which == 1, top4[:, 0], torch.where(which == 2, top4.gather(1, pick[:, None]).squeeze(1), labels))
    labels = labels.reshape(seq, batch)
    labels[torch.rand(seq, batch, generator=g) < ignored] = -100
    return dict(seed=seed, tp=tp, dtype=dtype, hidden=hidden_full, weight=weight_full, labels=labels,
                grad_lp=torch.randn(seq, batch, generator=g), grad_ent=torch.randn(seq, batch, generator=g),
                vocab=vocab, v_local=v_local, T=temperature, chunk_size=chunk_size, sp=sp)


def dense_z(hidden, weight, vocab, temperature):
    return (hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().t())[:, :vocab] / temperature


def local_inputs(rank, case):
    v_local = case["v_local"]
    weight = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    hidden = case["hidden"]
    if case["sp"]:
        s_local = hidden.shape[0] // case["tp"]
        hidden = hidden[rank * s_local:(rank + 1) * s_local]
    return hidden.clone().requires_grad_(), weight


def world_group(world):
    return dist.group.WORLD if world > 1 else None


def run_case(rank, world, case, params, impl="torch", backward=True):
    hidden, weight = local_inputs(rank, case)
    out = linear_logprobs(hidden, weight, case["labels"], tp_group=world_group(world), vocab_size=case["vocab"],
                          temperature=case["T"], return_entropy=True, chunk_size=case["chunk_size"],
                          sequence_parallel=case["sp"], impl=impl, **params)
    if backward:
        finite = torch.isfinite(out.logprobs)
        loss = (torch.where(finite, out.logprobs, 0.0) * case["grad_lp"]).sum() + (out.entropy * case["grad_ent"]).sum()
        loss.backward()
    return dict(lp=out.logprobs.detach(), ent=out.entropy.detach(), dx=hidden.grad, dw=weight.grad,
                topk_lp=out.topk_logprobs, topk_ids=out.topk_ids)


def sampled_reference(case, params):
    h = case["hidden"].double().requires_grad_()
    w = case["weight"].double().requires_grad_()
    z = (h.reshape(-1, h.shape[-1]) @ w.t())[:, :case["vocab"]] / case["T"]
    filters = {k: v for k, v in params.items() if k != "return_topk"}
    keep = sref.kept_set(z, **filters)
    lp, ent = sref.processed_stats(z, case["labels"].reshape(-1), keep)
    finite = torch.isfinite(lp)
    g_lp, g_ent = case["grad_lp"].reshape(-1).double(), case["grad_ent"].reshape(-1).double()
    ((torch.where(finite, lp, 0.0) * g_lp).sum() + (ent * g_ent).sum()).backward()
    shape = case["labels"].shape
    out = dict(lp=lp.detach().reshape(shape), ent=ent.detach().reshape(shape), dx=h.grad, dw=w.grad)
    if params.get("return_topk"):
        k = params["return_topk"]
        tlp, tid = sref.topk_reference(z, k)
        out["topk_lp"], out["topk_ids"] = tlp.reshape(shape + (k,)), tid.reshape(shape + (k,))
    return out


def compare_ranks(case, results, ref, tol, recorded, what):
    """Every rank's log-probs, entropy, dX (its sequence-parallel slice) and dW (its vocab shard)
    against the float64 reference `ref`: the same -inf positions, 0 at ignored labels, each
    relative error (passed through `recorded(name, err)`) within `tol`."""
    tp, v_local = case["tp"], case["v_local"]
    labelled = case["labels"] != -100
    ref_finite = torch.isfinite(ref["lp"])
    for rank, got in enumerate(results):
        assert torch.equal(torch.isfinite(got["lp"]), ref_finite), f"{what} rank {rank}: kept sets differ"
        assert torch.all(got["lp"][~labelled] == 0) and torch.all(got["ent"][~labelled] == 0)
        dx_ref = ref["dx"]
        if case["sp"]:
            s_local = dx_ref.shape[0] // tp
            dx_ref = dx_ref[rank * s_local:(rank + 1) * s_local]
        dw_ref = ref["dw"][rank * v_local:(rank + 1) * v_local]
        for name, out, want in (("lp", got["lp"][ref_finite], ref["lp"][ref_finite]),
                                ("entropy", got["ent"], ref["ent"]), ("dX", got["dx"], dx_ref),
                                ("dW", got["dw"], dw_ref)):
            err = recorded(name, reference.rel_err(out, want))
            assert err <= tol, f"{what} rank {rank} {name}: rel err {err:.2e} > {tol:.0e}"


def check(case, params, results, what="sampled", record=True):
    """The results of every rank against the float64 reference; `record`: add the errors to the
    summary table under `what` (not for runs through a stand-in of a backend)."""
    def recorded(name, err):
        return reference.record(f"{what} {name}", tp, dtype, err) if record else err

    ref = sampled_reference(case, params)
    tp, dtype, v_local, tol = case["tp"], case["dtype"], case["v_local"], TOL[case["dtype"]]
    labelled = case["labels"] != -100
    ref_finite = torch.isfinite(ref["lp"])
    if any(k in params for k in ("top_k", "top_p", "min_p")):
        # the case exercises labels inside and outside the kept set
        assert ref_finite[labelled].any() and not ref_finite[labelled].all(), params
    compare_ranks(case, results, ref, tol, recorded, what=str(params))
    for rank, got in enumerate(results):
        assert torch.all(got["dw"][max(case["vocab"] - rank * v_local, 0):] == 0)  # padding rows
        if params.get("return_topk"):
            k = params["return_topk"]
            assert got["topk_lp"].shape == case["labels"].shape + (k,)
            assert torch.equal(got["topk_ids"][labelled], ref["topk_ids"][labelled])
            assert torch.all(got["topk_ids"][~labelled] == -1) and torch.all(got["topk_lp"][~labelled] == 0)
            err = reference.rel_err(got["topk_lp"][labelled], ref["topk_lp"][labelled])
            assert recorded("topk_lp", err) <= tol
        else:
            assert got["topk_lp"] is None and got["topk_ids"] is None
    for got in results[1:]:  # identical on every rank
        for key in ("lp", "ent", "topk_lp", "topk_ids"):
            assert (got[key] is None and results[0][key] is None) or torch.equal(got[key], results[0][key]), key
