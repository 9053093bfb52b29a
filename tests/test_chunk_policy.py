"""The default chunk of logits is bounded: `max_chunk_bytes` (1 GiB unless set) whatever the number
of tokens, so the op's extra memory is flat in N.

- The CUDA policy itself (`auto_chunk_size` for a CUDA device, checked on the CPU): every chunk's
  logits fit the budget, the chunks are of equal size, and the benchmark shapes get the chunks the
  docs state.
- End to end on the CPU with a small budget: the largest logits-shaped tensor the op allocates
  (forward and backward, every entry point, fast mode) stays under the budget and does not grow
  with the number of tokens; results equal those of an explicit chunk size.
- The knob from Megatron: FusedCEConfig(max_chunk_bytes=...), the megatron_cfg keys
  `linear_ce_fusion_max_chunk_bytes` / `fused_linear_logprobs_max_chunk_bytes` and the
  Megatron-LM flag `--linear-ce-fusion-max-chunk-bytes` reach the op.
"""

from __future__ import annotations

import argparse
import weakref

import pytest
import torch

from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss
from megatron_fused_ce.megatron import FusedCEConfig, add_fused_ce_args
from megatron_fused_ce.ops import api
from megatron_fused_ce.ops.api import DEFAULT_MAX_CHUNK_BYTES, auto_chunk_size

CUDA = torch.device("cuda")  # only a device type: the policy is plain arithmetic
GiB = 1 << 30


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("budget", [None, 256 << 20, 4 * GiB])
def test_cuda_policy_bounds_every_chunk(element_size, budget):
    limit = DEFAULT_MAX_CHUNK_BYTES if budget is None else budget
    for v_local in (32_000, 50_304, 64_128, 128_256, 152_064, 256_000, 2**21):
        full = limit // (v_local * element_size)
        for n in (1, 100, 2047, 4096, 8192, 32_768, 131_072, 1_000_000):
            rows = auto_chunk_size(n, v_local, CUDA, logits_element_size=element_size, max_chunk_bytes=budget)
            assert 1 <= rows <= n
            assert rows * v_local * element_size <= max(limit, v_local * element_size), (n, v_local)
            if n <= full:
                assert rows == n  # under the budget: one chunk
            else:  # equal chunks of at least half the budget's rows: never a sliver
                chunks = -(-n // rows)
                assert n - (chunks - 1) * rows > 0
                assert rows >= min(full, 128) // 2 and rows >= full // 2 - 128


def test_cuda_policy_on_the_benchmark_shapes():
    """8192 x 128256: 2 chunks of 4096 rows; 8192 x 256000: 4 of 2048; 16384 x 152064: 5 of at most
    3328 (multiples of the GEMM's 128-row tiles); the chunk does not grow with N."""
    assert auto_chunk_size(8192, 128_256, CUDA) == 4096
    assert auto_chunk_size(8192, 256_000, CUDA) == 2048
    assert auto_chunk_size(16_384, 152_064, CUDA) == 3328
    assert auto_chunk_size(131_072, 128_256, CUDA) == 4096
    assert auto_chunk_size(8192, 128_256 // 2, CUDA) == 8192  # TP=2: the shard's logits fit
    assert auto_chunk_size(8192, 128_256, CUDA, logits_element_size=4) == 2048  # fp32 logits
    assert auto_chunk_size(8192, 128_256, CUDA, max_chunk_bytes=8 * GiB) == 8192
    # the CPU keeps its own cap as well (the torch backend holds fp32 copies of a chunk)
    assert auto_chunk_size(100_000, 128_256, torch.device("cpu")) * 128_256 <= 64 * 2**20


class _LargestLogitsTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor with `cols` columns (the shape of a chunk of logits) created inside."""

    def __init__(self, cols):
        super().__init__()
        self.cols, self.bytes = cols, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == self.cols:
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


V, H = 200, 8
BUDGET = 64 * 1024  # 80 rows of fp32 logits


def _run(entry, n, **kw):
    g = torch.Generator().manual_seed(n)
    h = torch.randn(n, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, V, (n,), generator=g)
    y[::9] = -100
    if entry == "logprobs":
        out = linear_logprobs(h, w, y, impl="torch", **kw).logprobs.sum()
    elif entry == "ce":
        out = linear_cross_entropy(h, w, y, impl="torch", **kw)
    elif entry == "ce_per_token":  # (Megatron's output layer: the last chunk's dlogits held from the forward)
        out = linear_cross_entropy(h, w, y, impl="torch", reduction="none", **kw).sum()
    else:
        b = n // 16
        out = linear_grpo_loss(h.view(b, 16, H), w, y.clamp(min=0).view(b, 16), torch.randn(b, generator=g),
                               (y != -100).float().view(b, 16), GRPOConfig(), impl="torch", **kw)[0]
    out.backward()
    return out.detach(), h.grad, w.grad


@pytest.mark.parametrize("entry", ["logprobs", "ce", "ce_per_token", "grpo"])
def test_largest_logits_tensor_is_bounded_and_flat_in_tokens(entry):
    sizes = {}
    for n in (512, 4096):
        with _LargestLogitsTensor(V) as largest:
            out = _run(entry, n, max_chunk_bytes=BUDGET)
        sizes[n] = largest.bytes
        assert 0 < largest.bytes <= BUDGET, (n, largest.bytes)
        explicit = _run(entry, n, chunk_size=BUDGET // (V * 4))
        for a, b in zip(out, explicit):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # flat: equal chunks of nearly the budget's rows whatever N (8x more tokens, not 8x the chunk)
    assert min(sizes.values()) > BUDGET // 2, sizes


class _ChunksAlive:
    """How many chunks of logits (gemm.logits_gemm's outputs) are still alive each time the next
    one is made: 0 means one chunk at a time, whatever else the loop keeps."""

    def __init__(self, monkeypatch):
        from megatron_fused_ce.ops import fast, gemm

        self.alive_when_made, self._chunks = [], []
        make = gemm.logits_gemm

        def counted(h, weight, logits_dtype):
            self.alive_when_made.append(sum(ref() is not None for ref in self._chunks))
            logits = make(h, weight, logits_dtype)
            self._chunks.append(weakref.ref(logits))
            return logits

        monkeypatch.setattr(gemm, "logits_gemm", counted)
        monkeypatch.setattr(fast, "logits_gemm", counted)


@pytest.mark.parametrize("entry", ["logprobs", "ce", "ce_per_token", "ce_main_grad", "grpo"])
def test_one_chunk_of_logits_alive_at_a_time(monkeypatch, entry):
    """Each chunk's logits (and the dlogits made from them in place) are released before the next
    chunk is made, in the forward loop and the backward's recompute: the peak is one chunk."""
    chunks = _ChunksAlive(monkeypatch)
    if entry == "ce_main_grad":
        g = torch.Generator().manual_seed(3)
        h = torch.randn(512, H, generator=g, requires_grad=True)
        w = torch.randn(V, H, generator=g, requires_grad=True)
        w.main_grad = torch.zeros(V, H)
        linear_cross_entropy(h, w, torch.randint(0, V, (512,), generator=g), impl="torch",
                             max_chunk_bytes=BUDGET, accumulate_into_main_grad=True).backward()
    else:
        _run(entry, 512, max_chunk_bytes=BUDGET)
    assert len(chunks.alive_when_made) >= 6  # 512 rows in chunks of 80: several per pass
    assert chunks.alive_when_made == [0] * len(chunks.alive_when_made)


def test_max_chunk_bytes_is_checked_and_agreed():
    h, w, y = torch.randn(4, H), torch.randn(V, H), torch.zeros(4, dtype=torch.long)
    for bad in (0, -1, 1.5, "1GiB"):
        with pytest.raises(ValueError, match="max_chunk_bytes"):
            linear_logprobs(h, w, y, max_chunk_bytes=bad)


# ------------------------------------------------------------------------- the Megatron knob
@pytest.mark.parametrize("key", ["linear_ce_fusion_max_chunk_bytes", "fused_linear_logprobs_max_chunk_bytes"])
def test_megatron_cfg_key(key):
    assert FusedCEConfig().max_chunk_bytes is None
    assert FusedCEConfig.from_megatron_cfg({key: 1 << 28}) == FusedCEConfig(max_chunk_bytes=1 << 28)
    assert FusedCEConfig.from_megatron_cfg({key: None}).max_chunk_bytes is None
    for bad in (0, -5, 2.5, "1GiB", True):
        with pytest.raises(ValueError, match=key):
            FusedCEConfig.from_megatron_cfg({key: bad})
    with pytest.raises(ValueError, match="disagree"):
        FusedCEConfig.from_megatron_cfg({"linear_ce_fusion_max_chunk_bytes": 1 << 20,
                                         "fused_linear_logprobs_max_chunk_bytes": 1 << 21})
    with pytest.raises(ValueError, match="did you mean 'linear_ce_fusion_max_chunk_bytes'"):
        FusedCEConfig.from_megatron_cfg({"linear_ce_fusion_max_chunk_byte": 1 << 20})


def test_megatron_lm_flag():
    def parse(*argv):
        return FusedCEConfig.from_megatron_cfg(vars(add_fused_ce_args(argparse.ArgumentParser()).parse_args(argv)))

    assert parse("--use-linear-ce-fusion-loss", "--linear-ce-fusion-max-chunk-bytes", "1048576").max_chunk_bytes == 1 << 20
    assert parse("--use-linear-ce-fusion-loss").max_chunk_bytes is None
    with pytest.raises(SystemExit):
        parse("--linear-ce-fusion-max-chunk-bytes", "big")


def test_max_chunk_bytes_reaches_the_op_from_the_output_layer(monkeypatch):
    """The fused output layer and the post-processor pass FusedCEConfig.max_chunk_bytes on."""
    import types

    from megatron_fused_ce.megatron.output_layer import FusedOutputLayer

    seen = []
    auto = api.auto_chunk_size

    def recording(*args, **kwargs):
        seen.append(kwargs.get("max_chunk_bytes"))
        return auto(*args, **kwargs)

    monkeypatch.setattr(api, "auto_chunk_size", recording)
    linear = torch.nn.Module()
    linear.weight = torch.nn.Parameter(torch.randn(V, H) * 0.3)
    linear.sequence_parallel = False
    linear.tp_group = None
    linear.config = types.SimpleNamespace(gradient_accumulation_fusion=False)
    layer = FusedOutputLayer(linear, FusedCEConfig(enabled=True, max_chunk_bytes=12_345))
    kwargs = layer.fused_op_kwargs(linear.weight)
    assert kwargs["max_chunk_bytes"] == 12_345
    hidden = torch.randn(6, 2, H)
    labels = torch.randint(0, V, (2, 6))
    linear_cross_entropy(hidden.transpose(0, 1), linear.weight, labels, **kwargs)
    assert seen == [12_345]
