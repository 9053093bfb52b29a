"""The forward-gradient contract (megatron_fused_ce/ops/forward_grad.py) is enough to add a fused
loss: a token-weighted NLL, -sum_i w_i log p(y_i), written here as one small ForwardGradLoss
subclass and run through `token_statistics`, matches its float64 dense reference in value, dX and
dW at TP=1 and TP=2 with sequence parallelism, in both memory modes, with main_grad and an
upstream gradient g != 1, and with the one-pass row kernel's per-token path (PER_ROW)."""

import pytest
import torch

import reference
from dist import run_workers
from megatron_fused_ce.ops import PER_ROW, ForwardGradLoss, TokenGrads
from megatron_fused_ce.ops.api import token_statistics

N, HIDDEN, VOCAB, TRUE_VOCAB, CHUNK = 40, 16, 64, 60, 9


class WeightedNLL(ForwardGradLoss):
    """-sum_i w_i log p(y_i): d/d target_i = -w_i, d/d lse_i = w_i, so dlogits_i = w_i (softmax - one_hot)."""

    def __init__(self, weights):
        self.weights = weights  # [N], indexed by a token's flat position

    def token_grads(self, stats, positions, num_labelled):
        w = self.weights[positions].to(stats.lse.dtype)
        return TokenGrads(target=-w, lse=w)

    def one_hot_scale(self, num_labelled):
        return PER_ROW


def weighted_nll(hidden, weight, labels, weights, *, vocab_size=TRUE_VOCAB, tp_group=None, sequence_parallel=False,
                 accumulate_into_main_grad=False, memory_mode="fast"):
    """The whole new loss: its ForwardGradLoss above, token_statistics, and value + anchor."""
    stats = token_statistics("weighted_nll", hidden, weight, labels, tp_group=tp_group, vocab_size=vocab_size,
                             temperature=1.0, ignore_index=-100, chunk_size=CHUNK, sequence_parallel=sequence_parallel,
                             impl="auto", accumulate_into_main_grad=accumulate_into_main_grad, memory_mode=memory_mode,
                             want_sum_logits=False, want_entropy=False, forward_grad=WeightedNLL(weights),
                             must_agree={"weights": weights})
    value = -(stats.logprob() * weights[stats.row_index if stats.row_index is not None else slice(None)]).sum()
    return value + stats.anchor


def make_case(seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, TRUE_VOCAB, (N,), generator=g)
    labels[::7] = -100
    return dict(h=torch.randn(N, HIDDEN, generator=g, dtype=torch.float64),
                w=torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.5,
                y=labels, weights=torch.rand(N, generator=g, dtype=torch.float64) * 2 - 0.5)


def float64_reference(case, g, vocab=TRUE_VOCAB):
    h, w = case["h"].clone().requires_grad_(), case["w"].clone().requires_grad_()
    lp = torch.log_softmax((h @ w.t())[:, :vocab], -1).gather(1, case["y"].clamp(min=0)[:, None])[:, 0]
    loss = -(lp * case["weights"] * (case["y"] != -100)).sum()
    (loss * g).backward()
    return loss.detach(), h.grad, w.grad


def _run(case, g, memory_mode, main_grad, tp_group=None, rank=0, world=1, sp=False):
    v_local = VOCAB // world
    h = case["h"].float()
    if sp:
        h = h[rank * N // world:(rank + 1) * N // world]
    h = h.unsqueeze(1).clone().requires_grad_() if sp else h.clone().requires_grad_()
    w = case["w"][rank * v_local:(rank + 1) * v_local].float().clone().requires_grad_()
    if main_grad:
        w.main_grad = torch.zeros(w.shape)
    labels = case["y"].unsqueeze(1) if sp else case["y"]
    loss = weighted_nll(h, w, labels, case["weights"].float(), tp_group=tp_group, sequence_parallel=sp,
                        memory_mode=memory_mode, accumulate_into_main_grad=main_grad)
    (loss * g).backward()
    return loss.detach(), h.grad.reshape(-1, HIDDEN), (w.main_grad if main_grad else w.grad)


@pytest.mark.parametrize("memory_mode", ["fast", "lean"])
@pytest.mark.parametrize("main_grad", [False, True])
def test_weighted_nll_on_the_contract_matches_float64(memory_mode, main_grad):
    case = make_case(1)
    ref_loss, ref_dx, ref_dw = float64_reference(case, 0.3)
    loss, dx, dw = _run(case, 0.3, memory_mode, main_grad)
    assert reference.rel_err(loss, ref_loss) < 1e-5
    assert reference.rel_err(dx, ref_dx) < 1e-5
    assert reference.rel_err(dw, ref_dw) < 1e-5


def test_weighted_nll_takes_the_row_kernel_per_token(reference_kernel):
    """bf16 with the row kernel (its torch contract on CPU): one pass per chunk, c_i = w_i."""
    calls = reference_kernel
    case = make_case(2)  # the row kernel takes unpadded rows: the whole vocab
    ref_loss, ref_dx, ref_dw = float64_reference(case, 1.0, vocab=VOCAB)
    h = case["h"].bfloat16().requires_grad_()
    w = case["w"].bfloat16().requires_grad_()
    weighted_nll(h, w, case["y"], case["weights"].float(), vocab_size=VOCAB).backward()
    assert calls and sum(calls) == N  # every row: an ignored one with c_i = 0
    assert reference.rel_err(h.grad, ref_dx) < 2e-2
    assert reference.rel_err(w.grad, ref_dw) < 2e-2


def _tp_worker(rank, world, case):
    import torch.distributed as dist

    return _run(case, 2.5, "fast", True, dist.group.WORLD, rank, world, sp=True)


def test_weighted_nll_tp2_sequence_parallel():
    case = make_case(3)
    ref_loss, ref_dx, ref_dw = float64_reference(case, 2.5)
    v_local = VOCAB // 2
    for rank, (loss, dx, dw) in enumerate(run_workers(_tp_worker, 2, case)):
        assert reference.rel_err(loss, ref_loss) < 1e-5
        assert reference.rel_err(dx, ref_dx[rank * N // 2:(rank + 1) * N // 2]) < 1e-5
        assert reference.rel_err(dw, ref_dw[rank * v_local:(rank + 1) * v_local]) < 1e-5
