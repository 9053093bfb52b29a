"""PeakTensorMemory on the CPU: live tensor bytes, followed until freed (the examples' memory
figures). Known allocations are counted exactly; views, in-place updates and tensors that existed
before are not; the fused op's peak is a fraction of the dense logits it avoids."""

from __future__ import annotations

import torch

from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.testing import PeakTensorMemory


def test_counts_live_bytes_exactly():
    before = torch.randn(100, 100)
    with PeakTensorMemory("cpu") as mem:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500)  # 2000 B: 6000 alive
        del a
        c = torch.empty(250)  # 1000 B: 3000 alive
        view = before.t()  # a view of an older tensor: nothing new
        before.mul_(2)  # in place: nothing new
        d = b.view(5, 100)  # a view of a followed tensor: nothing new
        del b
    assert mem.peak_bytes == 6000
    assert c.numel() + d.numel() + view.numel()  # (keep them alive)


def test_freed_memory_is_reused_without_raising_the_peak():
    with PeakTensorMemory("cpu") as mem:
        for _ in range(5):
            x = torch.ones(1024, dtype=torch.float64)  # 8 KiB, the previous one freed
            y = x * 2  # + 8 KiB
            del x, y
    assert mem.peak_bytes == 2 * 8192


def test_pause_and_resume_count_only_windows():
    with PeakTensorMemory("cpu", paused=True) as mem:
        outside = torch.empty(10_000)  # 40 KB, not counted
        mem.resume()
        inside = torch.empty(100)  # 400 B
        mem.pause()
        outside2 = torch.empty(20_000)  # not counted
        mem.resume()
        inside2 = torch.empty(50)  # 200 B, with the first window's 400 B still alive
    assert mem.peak_bytes == 600
    assert outside.numel() + inside.numel() + outside2.numel() + inside2.numel()


def test_backward_allocations_are_counted():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(256, 64)
    with PeakTensorMemory("cpu") as forward_only:
        out = x @ w
        out.sum()
    del out
    with PeakTensorMemory("cpu") as forward_backward:
        out = x @ w
        out.sum().backward()  # out stays alive while w.grad is made
    assert forward_only.peak_bytes == 256 * 64 * 4 + 4
    assert forward_backward.peak_bytes >= forward_only.peak_bytes + 64 * 64 * 4


def test_fused_op_peak_is_a_fraction_of_the_dense_logits():
    n, hidden, vocab, chunk = 1024, 32, 512, 64
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (n,), generator=g)
    logits_bytes = n * vocab * 4
    with PeakTensorMemory("cpu") as dense:
        torch.log_softmax(h @ w.t(), -1).gather(1, y[:, None]).sum().backward()
    with PeakTensorMemory("cpu") as fused:
        linear_logprobs(h, w, y, chunk_size=chunk).logprobs.sum().backward()
    assert dense.peak_bytes >= 2 * logits_bytes  # logits + log-softmax (+ their gradients)
    assert fused.peak_bytes < logits_bytes / 2
