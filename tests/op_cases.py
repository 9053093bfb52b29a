"""Op-level cases, float64 references and workers shared by several test files.

* linear_logprobs / linear_cross_entropy cases at TP 1/2/4 and their float64 checks (tests/test_ops.py);
* autocast and large-|z| entropy cases (tests/test_reliability.py);
* the forward/backward pairings that a training step may make of one loss (tests/test_forward_backward_pairing.py).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import reference
from megatron_fused_ce import LogprobsOutput, linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, grpo_loss, linear_grpo_loss


# ------------------------------------------------------------------ linear_logprobs / linear_cross_entropy
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def make_case(seed, tp, *, dtype=torch.float32, seq=20, batch=3, hidden=24, vocab=101,
              ignored=0.3, temperature=0.7, chunk_size=7, sp=False, extra_pad=3):
    """Global inputs, identical on every rank (drawn from `seed`)."""
    g = torch.Generator().manual_seed(seed)
    v_local = -(-vocab // tp) + extra_pad  # padded like Megatron: equal shards, padding at the end
    hidden_full = torch.randn(seq, batch, hidden, generator=g).to(dtype)
    weight_full = (torch.randn(v_local * tp, hidden, generator=g) * 2.0 / hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, (seq, batch), generator=g)
    labels[torch.rand(seq, batch, generator=g) < ignored] = -100
    grad_lp = torch.randn(seq, batch, generator=g)
    grad_ent = torch.randn(seq, batch, generator=g)
    return dict(seed=seed, tp=tp, dtype=dtype, hidden=hidden_full, weight=weight_full, labels=labels,
                grad_lp=grad_lp, grad_ent=grad_ent, vocab=vocab, v_local=v_local, T=temperature,
                chunk_size=chunk_size, sp=sp)


def local_inputs(rank, case):
    tp, v_local = case["tp"], case["v_local"]
    weight = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    hidden = case["hidden"]
    if case["sp"]:
        s_local = hidden.shape[0] // tp
        hidden = hidden[rank * s_local:(rank + 1) * s_local]
    return hidden.clone().requires_grad_(), weight


def world_group(world):
    return dist.group.WORLD if world > 1 else None


def logprobs_worker(rank, world, case, impl="torch"):
    hidden, weight = local_inputs(rank, case)
    out = linear_logprobs(hidden, weight, case["labels"], tp_group=world_group(world), vocab_size=case["vocab"],
                          temperature=case["T"], return_entropy=True, chunk_size=case["chunk_size"],
                          sequence_parallel=case["sp"], impl=impl)
    assert isinstance(out, LogprobsOutput) and out.logprobs.dtype == torch.float32
    ((out.logprobs * case["grad_lp"]).sum() + (out.entropy * case["grad_ent"]).sum()).backward()
    return out.logprobs.detach(), out.entropy.detach(), hidden.grad, weight.grad


def reference_logprobs(case):
    h = case["hidden"].double().requires_grad_()
    w = case["weight"].double().requires_grad_()
    lp, ent, _ = reference.dense_stats(h, w, case["labels"], vocab_size=case["vocab"], temperature=case["T"])
    ((lp * case["grad_lp"].double()).sum() + (ent * case["grad_ent"].double()).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def check_against_reference(case, results, what_prefix=""):
    ref_lp, ref_ent, ref_dx, ref_dw = reference_logprobs(case)
    tp, dtype, v_local, tol = case["tp"], case["dtype"], case["v_local"], TOL[case["dtype"]]
    for rank, (lp, ent, dx, dw) in enumerate(results):
        if case["sp"]:
            s_local = ref_dx.shape[0] // tp
            ref_dx_rank = ref_dx[rank * s_local:(rank + 1) * s_local]
        else:
            ref_dx_rank = ref_dx
        ref_dw_rank = ref_dw[rank * v_local:(rank + 1) * v_local]
        assert torch.all(lp[case["labels"] == -100] == 0.0)
        assert torch.isfinite(lp).all() and torch.isfinite(dx.float()).all() and torch.isfinite(dw.float()).all()
        for name, out, ref in (("logprobs", lp, ref_lp), ("entropy", ent, ref_ent),
                               ("dX", dx, ref_dx_rank), ("dW", dw, ref_dw_rank)):
            err = reference.record(what_prefix + name, tp, dtype, reference.rel_err(out, ref))
            assert err <= tol, f"rank {rank} {name}: rel err {err:.2e} > {tol:.0e}"
        # the padded vocab rows take no part: exactly zero gradient
        padded_from = max(case["vocab"] - rank * v_local, 0)
        assert torch.all(dw[padded_from:] == 0)
    # identical on every rank
    for lp, ent, _, _ in results[1:]:
        assert torch.equal(lp, results[0][0]) and torch.equal(ent, results[0][1])


def reference_ce(case, reduction, smoothing, z_loss, upstream):
    h = case["hidden"].double().requires_grad_()
    w = case["weight"].double().requires_grad_()
    _, _, z = reference.dense_stats(h, w, case["labels"], vocab_size=case["vocab"], temperature=case["T"])
    y = case["labels"].reshape(-1)
    loss = F.cross_entropy(z, y, reduction=reduction, label_smoothing=smoothing)
    zl = z_loss * torch.logsumexp(z, -1).square() * (y != -100)
    if reduction == "mean":
        loss = loss + zl.sum() / max(int((y != -100).sum()), 1)
    elif reduction == "sum":
        loss = loss + zl.sum()
    else:
        loss = (loss + zl).reshape(case["labels"].shape)
    (loss * upstream.double()).sum().backward()
    return loss.detach(), h.grad, w.grad


def autograd_nodes(tensor) -> list:
    """Every autograd node behind `tensor` (its grad_fn and what that reaches), each once."""
    seen, todo = [], [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.append(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return seen


def autograd_node_names(tensor) -> set:
    return {type(node).__name__ for node in autograd_nodes(tensor)}


class CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
                    torch.ops.aten.addmm_.default, torch.ops.aten.addmm.out):
            self.count += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------ autocast, entropy at large |z|
BF16_TOL = 2e-2  # the stated bf16 tolerance (relative norm), TOL[torch.bfloat16]


def grpo_advantages(y):
    # not symmetric around 0: with advantages summing to 0 the GRPO loss at ratio 1 is exactly 0
    # and a relative error against it is 0/0 (the CUDA test read "loss: nan")
    return torch.linspace(-1, 1, y.shape[0], device=y.device) + 0.25


def autocast_loss(fn, h, w, y, **kw):
    if fn == "logprobs":
        out = linear_logprobs(h, w, y, return_entropy=True, chunk_size=37, **kw)
        return (out.logprobs * 0.5).sum() + (out.entropy * 0.25).sum()
    if fn == "ce_mean":
        return linear_cross_entropy(h, w, y, chunk_size=37, label_smoothing=0.1, **kw)
    if fn == "ce_none":
        return (linear_cross_entropy(h, w, y, reduction="none", chunk_size=37, **kw) * 0.1).sum()
    mask = (y != -100).float()
    return linear_grpo_loss(h, w, y, grpo_advantages(y), mask, GRPOConfig(), chunk_size=37, **kw)[0]


def autocast_reference_loss(fn, h, w, y):
    """The same losses from float64 logits (ignored labels: no term)."""
    z, flat = h.reshape(-1, h.shape[-1]) @ w.t(), y.reshape(-1)
    keep = flat != -100
    logp = F.log_softmax(z, -1)
    lp = torch.where(keep, logp.gather(1, flat.clamp(min=0)[:, None]).squeeze(1), 0.0)
    if fn == "logprobs":
        return (lp * 0.5).sum() - torch.where(keep, (logp.exp() * logp).sum(-1), 0.0).sum() * 0.25
    if fn == "ce_mean":
        return F.cross_entropy(z, flat, label_smoothing=0.1)
    if fn == "ce_none":
        return (F.cross_entropy(z, flat, reduction="none") * 0.1).sum()
    mask = keep.reshape(y.shape).to(z.dtype)
    return grpo_loss(lp.reshape(y.shape), grpo_advantages(y).to(z.dtype), mask, GRPOConfig())[0]


def entropy_case(seed, spread, temperature, tp, n=48):
    """Logits z = h @ W.T / T with a spread of about `spread` (|z| ~ 50 and up), vocab padded."""
    g = torch.Generator().manual_seed(seed)
    hidden, vocab, v_local = 32, 250, 128 if tp == 2 else 256
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(v_local * tp, hidden, generator=g) / hidden**0.5 * spread * temperature
    y = torch.randint(0, vocab, (n,), generator=g)
    return dict(h=h, w=w, y=y, vocab=vocab, v_local=v_local, T=temperature,
                g_lp=torch.randn(n, generator=g), g_ent=torch.randn(n, generator=g))


def _entropy_outputs(case, h, w, y, lp, ent):
    ((lp * case["g_lp"].to(lp.dtype)).sum() + (ent * case["g_ent"].to(ent.dtype)).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _dense_entropy(case, dtype):
    h, w = case["h"].to(dtype).requires_grad_(), case["w"].to(dtype).requires_grad_()
    z = (h @ w.t())[:, :case["vocab"]] / case["T"]
    logp = F.log_softmax(z, -1)
    return _entropy_outputs(case, h, w, case["y"], logp.gather(1, case["y"][:, None]).squeeze(1),
                            -(logp.exp() * logp).sum(-1))


def entropy_worker(rank, world, case, impl="torch"):
    v = case["v_local"]
    h = case["h"].clone().requires_grad_()
    w = case["w"][rank * v:(rank + 1) * v].clone().requires_grad_()
    out = linear_logprobs(h, w, case["y"], tp_group=dist.group.WORLD if world > 1 else None,
                          vocab_size=case["vocab"], temperature=case["T"], return_entropy=True,
                          chunk_size=20, impl=impl)
    return _entropy_outputs(case, h, w, case["y"], out.logprobs, out.entropy)


def check_entropy_precision(case, results, what):
    """Every quantity within 2x (+ a floor at fp32 rounding) of a plain fp32 dense computation's
    error, both against float64."""
    ref = _dense_entropy(case, torch.float64)
    plain = _dense_entropy(case, torch.float32)
    v = case["v_local"]
    for rank, ours in enumerate(results):
        for i, name in enumerate(("logprobs", "entropy", "dX", "dW")):
            sl = slice(rank * v, (rank + 1) * v) if name == "dW" else slice(None)
            err, plain_err = reference.rel_err(ours[i], ref[i][sl]), reference.rel_err(plain[i][sl], ref[i][sl])
            reference.record_error_ratio(f"{what} {name}", len(results), torch.float32, err / plain_err)
            assert err <= 2 * plain_err + 1e-7, f"rank {rank} {name}: {err:.2e} vs plain fp32 {plain_err:.2e}"


# ------------------------------------------------------------------ forward/backward pairings
# Each scenario runs forwards and backwards and returns (loss value, multiple of the reference
# gradient that dX and dW must equal). `loss_fn(h, w, g)`: g is the upstream gradient the first
# backward through that loss will bring.
def plain(loss_fn, h, w):
    loss = loss_fn(h, w, 1.0)
    loss.backward()
    return loss.detach(), 1.0


def checkpoint_non_reentrant(loss_fn, h, w):
    """The forward runs twice (again during backward), the backward once."""
    loss = checkpoint(lambda x: loss_fn(x, w, 1.0), h, use_reentrant=False)
    loss.backward()
    return loss.detach(), 1.0


def checkpoint_reentrant(loss_fn, h, w):
    """The first forward runs under no_grad, the second during backward, right before its backward."""
    loss = checkpoint(lambda x: loss_fn(x, w, 1.0), h, use_reentrant=True)
    loss.backward()
    return loss.detach(), 1.0


def second_backward(loss_fn, h, w):
    loss = loss_fn(h, w, 1.0)
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    return loss.detach(), 1.5


def loss_used_twice(loss_fn, h, w):
    loss = loss_fn(h, w, 3.0)  # autograd sums both uses' gradients before the op's backward
    (loss + 2.0 * loss).backward()
    return loss.detach(), 3.0


def changing_loss_scale(loss_fn, h, w):
    """Two accumulated micro-batches under a loss scale that changes in between."""
    (loss_fn(h, w, 4.0) * 4.0).backward()
    loss = loss_fn(h, w, 0.25)
    (loss * 0.25).backward()
    return loss.detach(), 4.25


def megatron_loss_scaling(loss_fn, h, w):
    """Megatron's default (calculate_per_token_loss=False): each micro-batch's loss divided by its
    token count and the number of micro-batches, g ~ 1e-5 at real sizes; tiny and different per
    micro-batch, negative too (a loss that is maximized)."""
    total = 0.0
    for g in (1e-5, 3e-8, -2e-3):
        loss = loss_fn(h, w, g)
        (loss * g).backward()
        total += g
    return loss.detach(), total


SCENARIOS = [plain, checkpoint_non_reentrant, checkpoint_reentrant, second_backward, loss_used_twice,
             changing_loss_scale, megatron_loss_scaling]
