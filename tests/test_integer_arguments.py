"""Integer and flag arguments given as NumPy scalars or 0-d tensors behave as the Python int / bool.

Trainers pass them all the time (configs read through NumPy, `tensor.item()` skipped). Every public
entry point turns them into Python ints and bools first; before, a NumPy `ignore_index` turned the
sampling-mask replay off without a word (`isinstance(ignore_index, int)` deep inside), a NumPy
`vocab_size` reached the Triton kernels as an argument they cannot specialize, and a NumPy
`return_entropy` reached them as a constexpr they cannot compile.

Each test calls the function once with Python values and once per spelling of every integer
argument (np.int64, np.int32, a 0-d int64 tensor; flags: np.bool_, a 0-d bool tensor), and compares
values and gradients, bit for bit (the same computation). On a GPU the op runs its Triton kernels.
"""

import numpy as np
import pytest
import torch

from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, dpo_loss, grpo_loss, linear_grpo_loss, nll_loss
from megatron_fused_ce.megatron import FusedCEConfig, LogprobsPostProcessor
from megatron_fused_ce.megatron.unfused_logprobs import vocab_parallel_logprobs
from megatron_fused_ce.ops.replay import build_sampling_mask, flat_positions, slice_sampling_mask

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
B, T, H, V_PADDED, V = 2, 9, 16, 64, 61


def _integers(value):
    return [np.int64(value), np.int32(value), torch.tensor(value)]


def _flags(value):
    return [np.bool_(value), torch.tensor(value)]


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g).to(DTYPE)
    w = (torch.randn(V_PADDED, H, generator=g) * 0.5).to(DTYPE)
    y = torch.randint(0, V, (B, T), generator=g)
    y[:, :2] = -7  # an ignore_index other than the default
    return h.to(DEVICE), w.to(DEVICE), y.to(DEVICE)


def _grads(fn, h, w):
    """(outputs, dX, dW) of fn(hidden, weight) -> tensor or tuple of tensors."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(h, w)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    total = sum(torch.where(torch.isfinite(o), o, 0).float().sum() for o in outs)
    total.backward()
    return [o.detach() for o in outs] + [h.grad, w.grad]


def _same(a, b, what):
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, what
        assert torch.equal(torch.nan_to_num(x, neginf=-1e30), torch.nan_to_num(y, neginf=-1e30)), what


def _sets(labels):
    """A kept set at every position: each label's own set keeps it and 4 others (every 5th
    labelled position keeps a set without its label: -inf there)."""
    sets = []
    for i, label in enumerate(labels.reshape(-1).tolist()):
        base = (label if label >= 0 else 0) + (1 if i % 5 == 0 else 0)
        sets.append(sorted({(base + k) % V for k in range(5)}))
    ids = torch.tensor([t for s in sets for t in s], dtype=torch.int64)
    offsets = torch.tensor([0] + list(np.cumsum([len(s) for s in sets])), dtype=torch.int64)
    return ids.to(labels.device), offsets.to(labels.device)


def test_linear_logprobs_integer_and_flag_arguments():
    h, w, y = _case(1)
    mask = _sets(y)
    ints = dict(vocab_size=V, ignore_index=-7, chunk_size=5, max_chunk_bytes=1 << 20)

    def call(**kw):
        return lambda x, wt: linear_logprobs(x, wt, y, **{**ints, "return_entropy": True, **kw})

    plain = _grads(call(), h, w)
    replayed = _grads(call(sampling_mask=mask), h, w)
    assert not torch.equal(plain[0], replayed[0])  # the mask changes the values: replay ran
    for name, value in ints.items():
        for other in _integers(value):
            _same(_grads(call(**{name: other}), h, w), plain, f"{name}={other!r}")
            _same(_grads(call(**{name: other}, sampling_mask=mask), h, w), replayed, f"{name}={other!r}, mask")
    for other in _flags(True):
        _same(_grads(call(return_entropy=other), h, w), plain, f"return_entropy={other!r}")
    for name, value in (("top_k", 7), ("return_topk", 3)):
        want = linear_logprobs(h, w, y, **ints, **{name: value})
        for other in _integers(value):
            got = linear_logprobs(h, w, y, **ints, **{name: other})
            _same([t for t in (*got, got.topk_logprobs, got.topk_ids) if t is not None],
                  [t for t in (*want, want.topk_logprobs, want.topk_ids) if t is not None], f"{name}={other!r}")


def test_linear_cross_entropy_integer_and_flag_arguments():
    h, w, y = _case(2)
    ints = dict(vocab_size=V, ignore_index=-7, chunk_size=5, max_chunk_bytes=1 << 20)

    def call(**kw):
        return lambda x, wt: linear_cross_entropy(x, wt, y, **{**ints, **kw}, label_smoothing=0.1)

    want = _grads(call(), h, w)
    for name, value in ints.items():
        for other in _integers(value):
            _same(_grads(call(**{name: other}), h, w), want, f"{name}={other!r}")
    for other in _flags(False):
        _same(_grads(call(accumulate_into_main_grad=other), h, w), want, f"accumulate_into_main_grad={other!r}")


def test_linear_grpo_loss_integer_arguments():
    h, w, y = _case(3)
    g = torch.Generator().manual_seed(4)
    mask = (y != -7).float()
    adv = torch.randn(B, generator=g).to(DEVICE)
    old = (-torch.rand(B, T, generator=g) * 3).to(DEVICE)
    ints = dict(vocab_size=V, ignore_index=-7, chunk_size=5, max_chunk_bytes=1 << 20)
    config = GRPOConfig(loss_type="dr_grpo", max_completion_length=T, beta=0.0)
    labels = y.clamp(min=0)

    def call(config=config, **kw):
        return lambda x, wt: linear_grpo_loss(x, wt, labels, adv, mask, config, old_logprobs=old,
                                              **{**ints, **kw})[0]

    want = _grads(call(), h, w)
    for name, value in ints.items():
        for other in _integers(value):
            _same(_grads(call(**{name: other}), h, w), want, f"{name}={other!r}")
    for other in _integers(2):
        _same(_grads(call(normalizer=other), h, w), _grads(call(normalizer=2), h, w), f"normalizer={other!r}")
    for other in _integers(T):
        numpy_config = GRPOConfig(loss_type="dr_grpo", max_completion_length=other, beta=0.0)
        assert numpy_config == config and type(numpy_config.max_completion_length) is int
        assert numpy_config.fingerprint() == config.fingerprint()
        _same(_grads(call(config=numpy_config), h, w), want, f"max_completion_length={other!r}")
    # the replay bug through the loss: a NumPy ignore_index with a sampling mask
    masked = _grads(call(sampling_mask=_sets(labels)), h, w)
    for other in _integers(-7):
        _same(_grads(call(ignore_index=other, sampling_mask=_sets(labels)), h, w), masked, f"mask, {other!r}")


def test_losses_and_configs_integer_and_flag_arguments():
    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    ref = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) > 0.2).double()
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    for other in _integers(7):
        assert torch.equal(nll_loss(lp, mask, normalizer=other)[0], nll_loss(lp, mask, normalizer=7)[0])
        assert torch.equal(grpo_loss(lp, adv, mask, GRPOConfig(), normalizer=other)[0],
                           grpo_loss(lp, adv, mask, GRPOConfig(), normalizer=7)[0])
        assert torch.equal(dpo_loss(lp, ref, mask, normalizer=other)[0], dpo_loss(lp, ref, mask, normalizer=7)[0])
    for other in _flags(True):
        assert torch.equal(dpo_loss(lp, ref, mask, average_log_probs=other)[0],
                           dpo_loss(lp, ref, mask, average_log_probs=True)[0])
        for field in ("use_bias_correction_kl", "force_on_policy_ratio", "count_empty_sequences"):
            config = GRPOConfig(**{field: other})
            assert getattr(config, field) is True and config.fingerprint() == GRPOConfig(**{field: True}).fingerprint()
    # equal configs agree across ranks whatever the spelling of their numbers (the fingerprint
    # compares reprs: 0 and 0.0, 0.2 and np.float64(0.2) once differed)
    for spelled in (dict(beta=0, epsilon_low=np.float64(0.2)), dict(beta=torch.tensor(0.0), epsilon_low=np.float32(0.25))):
        plain = {k: float(v) for k, v in spelled.items()}
        assert GRPOConfig(**spelled).fingerprint() == GRPOConfig(**plain).fingerprint(), spelled
    for value in _integers(64):
        config = FusedCEConfig(enabled=np.bool_(True), chunk_size=value, max_chunk_bytes=value)
        assert config == FusedCEConfig(enabled=True, chunk_size=64, max_chunk_bytes=64)
        assert type(config.chunk_size) is int and type(config.max_chunk_bytes) is int and config.enabled is True
        from_cfg = FusedCEConfig.from_megatron_cfg({"use_linear_ce_fusion_loss": torch.tensor(True),
                                                    "linear_ce_fusion_chunk_size": value})
        assert from_cfg == FusedCEConfig(enabled=True, chunk_size=64)


def test_post_processor_and_unfused_path_integer_arguments():
    h, w, y = _case(6)
    logits = (h @ w.t()).float()
    want = vocab_parallel_logprobs(logits, y, vocab_size=V, ignore_index=-7, return_entropy=True, top_p=0.9)
    for other in _integers(V):
        got = vocab_parallel_logprobs(logits, y, vocab_size=other, ignore_index=np.int64(-7),
                                      return_entropy=np.bool_(True), top_p=0.9)
        _same(list(got), list(want), f"vocab_size={other!r}")
    post = LogprobsPostProcessor(FusedCEConfig(enabled=True), vocab_size=np.int64(V), ignore_index=torch.tensor(-7),
                                 top_k=np.int32(5), return_topk=np.int64(2), return_entropy=np.bool_(True))
    assert (type(post.vocab_size), type(post.ignore_index), type(post.top_k), type(post.return_topk),
            post.return_entropy) == (int, int, int, int, True)


def test_replay_helpers_refuse_what_they_would_truncate():
    """Positions and rows are indices: a bool tensor is not read as 0 / 1, a float not truncated."""
    mask = (torch.arange(6), torch.tensor([0, 2, 4, 6]))
    assert torch.equal(slice_sampling_mask(mask, np.array([2, 0])).offsets,
                       slice_sampling_mask(mask, [2, 0]).offsets)
    for bad in (torch.tensor([True, False, True]), [0.5, 1.0]):
        with pytest.raises(ValueError, match="integer indices"):
            slice_sampling_mask(mask, bad)
        with pytest.raises(ValueError, match="integer indices"):
            flat_positions(bad, 2, 3)
    assert torch.equal(flat_positions([1], np.int64(2), torch.tensor(3)), flat_positions([1], 2, 3))
    request = (torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    want = build_sampling_mask([(1, 0, request)], (2, 3))
    got = build_sampling_mask([(np.int64(1), torch.tensor(0), request)], (2, 3))
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.offsets, want.offsets)
    with pytest.raises(ValueError, match="integers"):
        build_sampling_mask([(1.7, 0, request)], (2, 3))
