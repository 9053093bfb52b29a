"""Remembered routes at TP > 1 (ops/remembered_routes.py), over gloo: a later call of a remembered
signature runs its route straight and gives the general path's values, dX and dW bit for bit —
with the rank check's fingerprints riding on the statistics' all-gather as the general path's do,
so that labels or per-token inputs that differ across ranks still poison every rank's results and
raise at the next check, and a rank whose call takes the general path meets its peers' routed
calls in the same collectives. The torch backend, and Triton's (its interpreter on a CPU machine:
GRPO's per-token kernel adding the rank check's poison)."""

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from dist import run_workers  # noqa: E402
from megatron_fused_ce import check_deferred_errors, linear_cross_entropy, linear_logprobs  # noqa: E402
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss  # noqa: E402
from megatron_fused_ce.ops import agreement, api, remembered_routes  # noqa: E402

BATCH, LENGTH, HDIM, VOCAB = 2, 12, 16, 70  # 24 rows; the vocab padded to 72 = 2 x 36 = 4 x 18


def _inputs(world, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = BATCH * LENGTH
    hidden = torch.randn(rows, HDIM, generator=g)
    weight = torch.randn(72, HDIM, generator=g) / math.sqrt(HDIM) * 3
    labels = torch.randint(0, VOCAB, (rows,), generator=g)
    labels[::5] = -100
    rollout = dict(mask=(torch.rand(BATCH, LENGTH, generator=g) > 0.2).float(), adv=torch.randn(BATCH, generator=g),
                   old=-torch.rand(BATCH, LENGTH, generator=g) * 4, upstream=torch.linspace(-1.0, 2.0, rows))
    return hidden, weight, labels, rollout


def _shard(rank, world, hidden, weight, sequence_parallel):
    v_local = weight.shape[0] // world
    w = weight[rank * v_local:(rank + 1) * v_local].clone()
    if sequence_parallel:  # this rank's slice of the sequence-first rows
        s_local = hidden.shape[0] // world
        hidden = hidden[rank * s_local:(rank + 1) * s_local]
    return hidden.clone(), w


def _calls(rank, world, labels_of_rank=None, impl="torch"):
    """name -> call(): each returns the values, dX and dW of one call (a fresh leaf each time)."""
    group = dist.group.WORLD
    hidden, weight, labels, rollout = _inputs(world)
    if labels_of_rank is not None:
        labels = labels_of_rank(rank, labels)

    def ce(sp, reduction="mean", scales=(3.0,)):
        def call():
            h, w = (t.requires_grad_() for t in _shard(rank, world, hidden, weight, sp))
            # sequence-first [T, B] rows under sequence parallelism (B = 1 here)
            loss = linear_cross_entropy(h, w, labels, tp_group=group, vocab_size=VOCAB, temperature=0.7,
                                        reduction=reduction, sequence_parallel=sp, impl=impl)
            for i, scale in enumerate(scales):
                (loss * scale).backward(retain_graph=i + 1 < len(scales))
            return loss.detach(), h.grad, w.grad
        return call

    def ce_per_token(grad):  # reduction="none" (Megatron's output layer): log-probs' route, negated
        def call():
            h, w = _shard(rank, world, hidden, weight, False)
            h, w = h.requires_grad_(grad), w.requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                losses = linear_cross_entropy(h, w, labels, tp_group=group, vocab_size=VOCAB, temperature=0.7,
                                              reduction="none", impl=impl)
            if grad:
                (losses * rollout["upstream"]).sum().backward()
            return losses.detach(), h.grad, w.grad
        return call

    def grpo(sp):
        config = GRPOConfig(loss_type="dapo", beta=0.05)
        mask, adv, old = rollout["mask"], rollout["adv"], rollout["old"]

        def call():
            h, w = _shard(rank, world, hidden, weight, False)
            y = labels.reshape(BATCH, LENGTH)
            h = h.reshape(BATCH, LENGTH, HDIM)
            if sp:  # Megatron's sequence-first [T, B] layout, this rank's T / TP slice of the hidden states
                full = h.transpose(0, 1).contiguous()
                s_local = LENGTH // world
                h, y = full[rank * s_local:(rank + 1) * s_local].clone(), y.t().contiguous()
            h, w = h.requires_grad_(), w.requires_grad_()
            loss, metrics = linear_grpo_loss(h, w, y, adv, mask, config, tp_group=group, vocab_size=VOCAB,
                                             temperature=0.7, sequence_parallel=sp, impl=impl, old_logprobs=old,
                                             reference_logprobs=old - 0.2)
            (loss * 3.0).backward()
            return (loss.detach(), h.grad, w.grad) + tuple(m.detach() for m in metrics.values())
        return call

    def logprobs(sp, grad):
        def call():
            h, w = _shard(rank, world, hidden, weight, sp)
            h, w = h.requires_grad_(grad), w.requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                out = linear_logprobs(h, w, labels, tp_group=group, vocab_size=VOCAB, temperature=0.7,
                                      sequence_parallel=sp, impl=impl)
            if grad:
                (out.logprobs * rollout["upstream"]).sum().backward()
            return out.logprobs.detach(), h.grad, w.grad
        return call

    def replay(grad, entropy=False):
        # kept sets of 3-8 ids, the label in two of every three labelled rows' (the others' log-probs -inf)
        original = _inputs(world)[2]
        sets = []
        for i in range(original.numel()):
            ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(100 + i))[:3 + i % 6]
            if original[i] >= 0 and i % 3:
                ids[0] = original[i] if not bool((ids == original[i]).any()) else ids[0]
            sets.append(ids)
        mask = (torch.cat(sets), torch.tensor([0] + [s.numel() for s in sets]).cumsum(0))

        def call():
            h, w = _shard(rank, world, hidden, weight, False)
            h, w = h.requires_grad_(grad), w.requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                out = linear_logprobs(h, w, labels, tp_group=group, vocab_size=VOCAB, temperature=0.7, impl=impl,
                                      sampling_mask=mask, return_entropy=entropy)
            if grad:
                loss = (torch.where(out.logprobs.isfinite(), out.logprobs, 0.0) * rollout["upstream"]).sum()
                (loss + (out.entropy.sum() if entropy else 0.0)).backward()
            return out.logprobs.detach(), h.grad, w.grad, None if out.entropy is None else out.entropy.detach()
        return call

    def fused_logprobs():  # forward-only, the statistics from the fused statistics GEMM (bf16 inputs)
        from megatron_fused_ce.ops import fast
        from megatron_fused_ce.ops.backends import triton_gemm_stats

        def call():
            settings = fast.FUSED_STATS_MIN_BYTES, triton_gemm_stats.TILE, triton_gemm_stats.MERGE_BLOCK_T
            # (the fused GEMM at this small shape, in tiles that fit it)
            fast.FUSED_STATS_MIN_BYTES, triton_gemm_stats.TILE, triton_gemm_stats.MERGE_BLOCK_T = 0, (16, 32, 16, 4, 1), 4
            try:
                h, w = (t.bfloat16() for t in _shard(rank, world, hidden, weight, False))
                with torch.no_grad():
                    out = linear_logprobs(h, w, labels, tp_group=group, vocab_size=VOCAB, temperature=0.7, impl=impl)
            finally:
                fast.FUSED_STATS_MIN_BYTES, triton_gemm_stats.TILE, triton_gemm_stats.MERGE_BLOCK_T = settings
            return out.logprobs, None, None
        return call

    fused = {"log-probs forward-only, fused statistics GEMM": fused_logprobs()} if impl == "triton" else {}
    return {**fused, "cross-entropy": ce(False), "cross-entropy, sum, sequence parallel": ce(True, "sum"),
            "cross-entropy, second backward at 1e-5": ce(False, scales=(1e-5, 3.0)),
            "cross-entropy per token": ce_per_token(True), "cross-entropy per token, forward-only": ce_per_token(False),
            "grpo": grpo(False), "grpo, sequence parallel": grpo(True),
            "log-probs forward-only": logprobs(False, False),
            "log-probs forward-only, sequence parallel": logprobs(True, False),
            "log-probs, dlogits in the forward": logprobs(False, True),
            "log-probs, sampling mask replay": replay(True), "log-probs forward-only, sampling mask replay": replay(False),
            "log-probs and entropy, sampling mask replay": replay(True, True)}


class _GeneralCalls:
    """Counts the calls through the general path (token_statistics, as each entry point calls it)."""

    def __init__(self):
        self.count = 0
        self.modules = [api, sys.modules["megatron_fused_ce.losses.linear_cross_entropy"],
                        sys.modules["megatron_fused_ce.losses.linear_grpo"]]
        self.original = api.token_statistics

        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        for module in self.modules:
            module.token_statistics = counted

    def restore(self):
        for module in self.modules:
            module.token_statistics = self.original


def _routes_worker(rank, world, impl="torch", only=None):
    """Per case: three calls of one signature through the general path, then three with routes on
    (the third runs the route the second recorded) -> (general calls of the routed run, whether the
    third calls agree bit for bit, the routed outputs)."""
    general = _GeneralCalls()
    results = {}
    try:
        for name, call in _calls(rank, world, impl=impl).items():
            if only is not None and name not in only:
                continue
            remembered_routes.ENABLED = False
            agreement.forget_signatures()
            want = [call() for _ in range(3)][2]
            remembered_routes.ENABLED = True
            agreement.forget_signatures()
            general.count = 0
            got = [call() for _ in range(3)][2]
            same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                       for a, b in zip(got, want))
            facts = next(reversed(remembered_routes._ROUTES.values())).facts
            results[name] = (general.count, same, got, facts.spec.backend.name, facts.route)
        check_deferred_errors()
    finally:
        general.restore()
        remembered_routes.ENABLED = True
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_routes_at_tp_equal_the_general_path(world):
    results = run_workers(_routes_worker, world, timeout=240)
    _check_routed(results)
    # against float64: the cross-entropy's loss, dX (summed over ranks) and dW (each rank's shard)
    hidden, weight, labels, rollout = _inputs(world)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy((h64 @ w64.T)[:, :VOCAB] / 0.7, labels, ignore_index=-100)
    (ref * 3.0).backward()
    v_local = weight.shape[0] // world
    for rank, per_rank in enumerate(results):
        loss, dx, dw = per_rank["cross-entropy"][2]
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx.double(), h64.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dw.double(), w64.grad[rank * v_local:(rank + 1) * v_local], rtol=1e-4, atol=1e-5)
    # the per-token losses (0 at ignored labels) and their gradients under a per-token upstream
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    per_token = torch.nn.functional.cross_entropy((h64 @ w64.T)[:, :VOCAB] / 0.7, labels, ignore_index=-100,
                                                  reduction="none")
    (per_token * rollout["upstream"].double()).sum().backward()
    for rank, per_rank in enumerate(results):
        losses, dx, dw = per_rank["cross-entropy per token"][2]
        torch.testing.assert_close(losses.double(), per_token.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx.double(), h64.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dw.double(), w64.grad[rank * v_local:(rank + 1) * v_local], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(per_rank["cross-entropy per token, forward-only"][2][0], losses, rtol=0, atol=0)


def _check_routed(results, impl="torch"):
    for rank, per_rank in enumerate(results):
        assert per_rank, "no case ran"
        for name, (general_calls, same, got, backend, _) in per_rank.items():
            assert backend == impl, (name, backend)
            assert general_calls == 2, f"rank {rank}, {name}: the third call runs the route the second recorded"
            assert same, f"rank {rank}, {name}: the route's results are the general path's bit for bit"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo harness runs on CPU tensors")
def test_routes_at_tp_on_the_triton_backend():
    pytest.importorskip("triton")
    fused = "log-probs forward-only, fused statistics GEMM"
    results = run_workers(_routes_worker, 2, "triton", ("cross-entropy", "grpo", "log-probs, sampling mask replay", fused),
                          timeout=240)
    _check_routed(results, "triton")
    assert all(per_rank[fused][4] == "log-probs forward-only, fused statistics" for per_rank in results)


def _differing_worker(rank, world, case, impl="torch"):
    """Routes recorded, then a routed call whose labels (or GRPO's advantages) differ on the last
    rank: every rank's results are NaN and every rank raises at the next check."""
    general = _GeneralCalls()
    try:
        agreement.forget_signatures()
        call = _calls(rank, world, impl=impl)[case]
        for _ in range(3):
            call()
        check_deferred_errors()

        def differ(r, labels):
            labels = labels.clone()
            if r == world - 1:
                labels[1] = (labels[1] + 1) % VOCAB
            return labels

        general.count = 0
        got = _calls(rank, world, labels_of_rank=differ, impl=impl)[case]()
        routed = general.count == 0
        poisoned = bool(got[0].isnan().all())
        try:
            check_deferred_errors()
            raised = ""
        except ValueError as error:
            raised = str(error)
        return routed, poisoned, raised
    finally:
        general.restore()


# (log-probs with dlogits in the forward: their poison must be read after the merge, which decides
# the rank check; read before, the differing call gave finite log-probs)
@pytest.mark.parametrize("case", ["cross-entropy", "grpo", "log-probs forward-only",
                                  "log-probs, dlogits in the forward", "log-probs, sampling mask replay"])
def test_routes_at_tp_still_compare_the_ranks(case):
    _check_compared(run_workers(_differing_worker, 2, case, timeout=120))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo harness runs on CPU tensors")
def test_the_fused_statistics_route_at_tp_still_compares_the_ranks():
    pytest.importorskip("triton")
    _check_compared(run_workers(_differing_worker, 2, "log-probs forward-only, fused statistics GEMM", "triton",
                                timeout=120))


def _check_compared(results):
    for rank, (routed, poisoned, raised) in enumerate(results):
        assert routed, f"rank {rank}: the differing call ran the route"
        assert poisoned, f"rank {rank}: NaN results where the ranks' labels differ"
        assert "differ across" in raised, f"rank {rank}: {raised!r}"


def _group_lifetime_worker(rank, world):
    """A route recorded on a group of its own, then the group destroyed: nothing of the op keeps it
    alive (a route holds its group weakly: a group kept until the interpreter's teardown made gloo
    abort there), and a later call with another group of the same layout runs the general path's
    agreement again on that group."""
    import gc
    import weakref

    agreement.forget_signatures()
    group = dist.new_group(list(range(world)))
    hidden, weight, labels, _ = _inputs(world)
    h, w = _shard(rank, world, hidden, weight, False)

    def call(g):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(hh, ww, labels, tp_group=g, vocab_size=VOCAB, impl="torch")
        loss.backward()
        return loss.detach()

    losses = [call(group) for _ in range(3)]
    recorded = len(remembered_routes._ROUTES)
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    freed = alive() is None
    again = call(dist.new_group(list(range(world))))
    return recorded, freed, torch.equal(again, losses[0])


def test_a_route_does_not_keep_its_group_alive():
    for rank, (recorded, freed, same) in enumerate(run_workers(_group_lifetime_worker, 2, timeout=120)):
        assert recorded >= 1, f"rank {rank}: a route was recorded"
        assert freed, f"rank {rank}: the destroyed group was freed"
        assert same, f"rank {rank}: a new group's call gives the same loss"
