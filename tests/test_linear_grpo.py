"""linear_grpo_loss (gradients in the forward pass) == grpo_loss(linear_logprobs(...)) (recompute),
for the loss, the metrics, dX and dW, over the GRPO options; at TP=1 and TP=2 with sequence
parallelism. fp32, tolerance 1e-5 relative (the two paths differ only in summation order)."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import reference
from dist import run_workers
from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, grpo_loss
from megatron_fused_ce.losses.linear_grpo import GRPOGrads, gradients_in_forward_apply, linear_grpo_loss

B, T, H, V_LOCAL = 4, 6, 16, 23

CONFIGS = {
    "dapo_old": (dict(), ("old",)),
    "grpo_kl_k3": (dict(loss_type="grpo", beta=0.05), ("old", "ref")),
    "dr_grpo": (dict(loss_type="dr_grpo", max_completion_length=8), ("old",)),
    "bnpo_delta_dual": (dict(loss_type="bnpo", delta=1.5, dual_clip_c=3.0, epsilon_high=0.28), ("old",)),
    "cispo": (dict(loss_type="cispo", cispo_max_ratio=1.1), ("old",)),
    "sapo": (dict(loss_type="sapo"), ("old",)),
    "token_truncate": (dict(is_correction="token_truncate", is_clip_max=1.2), ("old", "sampling")),
    "sequence_mask_offpolicy": (dict(is_correction="sequence_mask", is_clip_min=0.5, is_clip_max=2.0),
                                ("old", "sampling")),
    "k2_bias_corrected": (dict(beta=0.1, kl_estimator="k2", use_bias_correction_kl=True), ("old", "ref")),
    "force_on_policy": (dict(force_on_policy_ratio=True, beta=0.1, kl_estimator="k1"), ("old", "ref")),
    "on_policy_normalizer": (dict(), ()),
    # convention options: the per-sequence SAPO mean needs the sequence totals before the loop
    "sapo_token_reduction": (dict(loss_type="sapo", sapo_reduction="token"), ("old",)),
    "sapo_without_empty_sequences": (dict(loss_type="sapo", count_empty_sequences=False), ("old",)),
    "cispo_two_sided": (dict(loss_type="cispo", cispo_min_ratio=0.9, cispo_max_ratio=1.1), ("old",)),
    # -inf old / sampling log-probs exclude their tokens (known before the chunk loop)
    "excluded_tokens": (dict(loss_type="grpo", is_correction="sequence_truncate", is_clip_max=2.0),
                        ("old", "sampling")),
    # not decomposable per token: must take the recompute path and still agree
    "gspo_sequence_ratio": (dict(importance_sampling_level="sequence"), ("old",)),
    "sequence_truncate_on_policy": (dict(is_correction="sequence_truncate", is_clip_max=1.5), ("sampling",)),
}


def _inputs(seed, tp, sequence_first):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V_LOCAL * tp, H, generator=g) / H**0.5 * 3
    labels = torch.randint(0, V_LOCAL * tp - 3, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[1] = 0.0  # an empty sequence
    adv = torch.randn(B, generator=g)
    noise = lambda: 0.3 * torch.randn(B, T, generator=g)  # noqa: E731
    extra = {"old": noise(), "ref": noise(), "sampling": noise()}
    if sequence_first:
        hidden, labels = hidden.transpose(0, 1).contiguous(), labels.t().contiguous()
    return hidden, weight, labels, mask, adv, extra


def _worker(rank, world, name, seed, chunk_size=5):
    cfg_kwargs, needs = CONFIGS[name]
    config = GRPOConfig(**cfg_kwargs)
    sp = world > 1
    hidden_full, weight_full, labels, mask, adv, extra = _inputs(seed, world, sp)
    group = dist.group.WORLD if world > 1 else None
    shard = weight_full[rank * V_LOCAL:(rank + 1) * V_LOCAL]
    if sp:
        s_local = hidden_full.shape[0] // world
        hidden_full = hidden_full[rank * s_local:(rank + 1) * s_local]
    # old log-probs near the policy's own, so the ratio crosses the clip boundaries
    with torch.no_grad():
        lp_now = linear_logprobs(hidden_full, shard, labels, tp_group=group, vocab_size=V_LOCAL * world - 3,
                                 sequence_parallel=sp).logprobs
        lp_now = lp_now.t() if sp else lp_now
    names = {"old": "old_logprobs", "ref": "reference_logprobs", "sampling": "sampling_logprobs"}
    tensors = {names[k]: lp_now + extra[k] for k in needs}
    if name == "excluded_tokens":
        mask[0, 1] = mask[2, 3] = 1.0
        tensors["old_logprobs"][0, 1] = tensors["sampling_logprobs"][2, 3] = float("-inf")
    normalizer = 37 if name == "on_policy_normalizer" else None
    common = dict(tp_group=group, vocab_size=V_LOCAL * world - 3, chunk_size=chunk_size, sequence_parallel=sp,
                  temperature=0.9, **tensors, normalizer=normalizer)
    results = []
    for fused in (True, False):
        h = hidden_full.clone().requires_grad_()
        w = shard.clone().requires_grad_()
        if fused:
            loss, metrics = linear_grpo_loss(h, w, labels, adv, mask, config, **common)
        else:
            op_kw = {k: common[k] for k in ("tp_group", "vocab_size", "chunk_size", "sequence_parallel", "temperature")}
            lp = linear_logprobs(h, w, labels, **op_kw).logprobs
            loss, metrics = grpo_loss(lp.t() if sp else lp, adv, mask, config, **tensors, normalizer=normalizer)
        (2.5 * loss).backward()
        results.append((loss.detach(), {k: v.detach() for k, v in metrics.items()}, h.grad, w.grad))
    return results


@pytest.mark.parametrize("chunk_size", [5, None], ids=["chunks", "one_chunk"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_linear_grpo_matches_recompute_composition(name, tp, chunk_size):
    """Several chunks (the table, each chunk's terms and the metrics apart) and one chunk (the
    whole call's terms as one function)."""
    for fused, unfused in run_workers(_worker, tp, name, 40 + tp, chunk_size):
        (lf, mf, dxf, dwf), (lu, mu, dxu, dwu) = fused, unfused
        assert torch.allclose(lf, lu, rtol=1e-5, atol=1e-7), (lf, lu)
        assert mf.keys() == mu.keys()
        assert float(mf["num_excluded_tokens"]) == (2 if name == "excluded_tokens" else 0)
        for key in mf:
            assert torch.allclose(mf[key], mu[key], rtol=1e-5, atol=1e-7), key
        assert dxu.abs().max() > 0 and dwu.abs().max() > 0
        for what, a, b in (("dX", dxf, dxu), ("dW", dwf, dwu)):
            err = reference.record_difference(f"linear_grpo_loss {what} vs grpo_loss(linear_logprobs)", tp,
                                              torch.float32, reference.rel_err(a, b))
            assert err < 1e-5, (what, err)


@pytest.mark.parametrize("chunk_size", [5, None], ids=["chunks", "one_chunk"])
def test_one_chunk_takes_the_whole_call_function(chunk_size, monkeypatch):
    """A call whose loop has one chunk evaluates its table, terms and metrics in one function (one
    compiled call on CUDA instead of three); several chunks never do (each chunk's terms need the
    table first)."""
    from megatron_fused_ce.losses import linear_grpo

    calls = []
    whole = linear_grpo._whole_call_terms

    def counted(*args):
        calls.append(1)
        return whole(*args)

    monkeypatch.setattr(linear_grpo, "_whole_call_terms", counted)
    hidden, weight, labels, mask, adv, extra = _inputs(3, 1, False)
    loss, metrics = linear_grpo_loss(hidden.requires_grad_(), weight.requires_grad_(), labels, adv, mask,
                                     GRPOConfig(beta=0.1), old_logprobs=extra["old"], reference_logprobs=extra["ref"],
                                     chunk_size=chunk_size)
    loss.backward()
    assert len(calls) == (1 if chunk_size is None else 0) and torch.isfinite(loss)


def test_path_choice_and_gemm_count():
    from op_cases import CountMatmuls, autograd_node_names

    hidden, weight, labels, mask, adv, extra = _inputs(0, 1, False)
    mask[1] = 1.0
    for name, expect_fused in (("dapo_old", True), ("gspo_sequence_ratio", False),
                               ("sequence_truncate_on_policy", False), ("sequence_mask_offpolicy", True)):
        cfg_kwargs, needs = CONFIGS[name]
        config = GRPOConfig(**cfg_kwargs)
        kw = {"old_logprobs": extra["old"] if "old" in needs else None,
              "sampling_logprobs": extra["sampling"] if "sampling" in needs else None}
        assert gradients_in_forward_apply(config, kw["old_logprobs"], kw["sampling_logprobs"]) == expect_fused
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with CountMatmuls() as mode:
            loss, _ = linear_grpo_loss(h, w, labels, adv, mask, config, chunk_size=B * T, **kw)
            nodes = autograd_node_names(loss)
            loss.backward()
        # one chunk: gradients in the forward (3 GEMMs), or log-probs whose dlogits are made in the
        # forward (3 GEMMs too, chunked.LinearLogprobDlogitsInForward) under grpo_loss
        assert mode.count == 3, name
        # (the general path's nodes, or a remembered route's: ops/remembered_routes.py)
        fused = bool({"LinearLossGradInForwardBackward", "StraightLossBackward"} & set(nodes))
        assert fused == expect_fused, (name, nodes)
        assert bool({"LinearLogprobDlogitsInForwardBackward", "StraightLogprobsBackward"} & set(nodes)) != expect_fused, (
            name, nodes)
        # several chunks: the log-probs hold the last chunk's dlogits from the forward (3 GEMMs) and
        # recompute the other's logits in the backward (4)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with CountMatmuls() as mode:
            loss, _ = linear_grpo_loss(h, w, labels, adv, mask, config, chunk_size=B * T // 2, **kw)
            loss.backward()
        assert mode.count == (6 if expect_fused else 7), name


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_mask", ["transposed", "flat", "short", "broadcast"])
@pytest.mark.parametrize("fused", [True, False])
def test_wrong_mask_shape_raises(bad_mask, fused):
    """A mask that does not match the labels used to fail deep in the chunk loop (IndexError) or
    with a misleading message."""
    hidden, weight, labels, mask, adv, extra = _inputs(0, 1, False)
    masks = {"transposed": mask.t().contiguous(), "flat": mask.reshape(-1), "short": mask[:, :-1],
             "broadcast": mask[:, :1]}
    h, w = hidden.clone().requires_grad_(fused), weight.clone().requires_grad_(fused)
    with pytest.raises(ValueError, match="mask"):
        linear_grpo_loss(h, w, labels, adv, masks[bad_mask], GRPOConfig(), old_logprobs=extra["old"])


@pytest.mark.parametrize("normalizer", [0, -3.0, torch.tensor(0.0)], ids=repr)
def test_bad_normalizer_raises(normalizer):
    hidden, weight, labels, mask, adv, extra = _inputs(0, 1, False)
    with pytest.raises(ValueError, match="normalizer"):
        linear_grpo_loss(hidden.requires_grad_(), weight, labels, adv, mask, GRPOConfig(), normalizer=normalizer)


def _bad_mask_on_one_rank(rank, world):
    hidden, weight, labels, mask, adv, extra = _inputs(0, world, False)
    shard = weight[rank * V_LOCAL:(rank + 1) * V_LOCAL]
    if rank == 1:
        mask = mask[:, :-1]
    try:
        linear_grpo_loss(hidden.requires_grad_(), shard.requires_grad_(), labels, adv, mask, GRPOConfig(),
                         tp_group=dist.group.WORLD, vocab_size=V_LOCAL * world - 3)
    except ValueError as error:
        return str(error)
    return None


def test_wrong_mask_on_one_tp_rank_raises_on_every_rank():
    messages = run_workers(_bad_mask_on_one_rank, 2, timeout=30)
    assert all(m is not None for m in messages), messages
    assert "mask" in messages[1] and "another rank" in messages[0]


@pytest.mark.parametrize("name", ["dapo_old", "grpo_kl_k3", "sequence_mask_offpolicy", "cispo"])
def test_masked_position_without_label_enters_with_log_prob_zero(name):
    """A position with a mask but ignore_index as its label: linear_logprobs reports log-prob 0
    there, and the fused loss (whose chunks may pass such a row with any value) counts its term
    with that log-prob, as grpo_loss(linear_logprobs(...)) does; every call alike."""
    cfg_kwargs, needs = CONFIGS[name]
    config = GRPOConfig(**cfg_kwargs)
    hidden, weight, labels, mask, adv, extra = _inputs(3, 1, False)
    names = {"old": "old_logprobs", "ref": "reference_logprobs", "sampling": "sampling_logprobs"}
    tensors = {names[k]: extra[k] - 2.0 for k in needs}
    labels[0, 2] = labels[3, 0] = -100
    mask[0, 2] = mask[3, 0] = 1.0
    h = hidden.clone().requires_grad_()
    lp = linear_logprobs(h, weight, labels, chunk_size=5).logprobs
    want, want_metrics = grpo_loss(lp, adv, mask, config, **tensors)
    want.backward()
    want_grad = h.grad
    for _ in range(2):
        h = hidden.clone().requires_grad_()
        loss, metrics = linear_grpo_loss(h, weight, labels, adv, mask, config, chunk_size=5, **tensors)
        loss.backward()
        assert torch.allclose(loss, want, rtol=1e-5, atol=1e-7), (loss, want)
        for key, value in want_metrics.items():
            assert torch.allclose(metrics[key], value, rtol=1e-5, atol=1e-7), key
        assert reference.rel_err(h.grad, want_grad) < 1e-5


def _garbage_at_masked_positions_worker(rank, world):
    """(loss, metrics, dX, dW) of three calls of one signature with garbage labels (out of range, or
    differing across ranks) where the mask is 0, and of the same calls with ignore_index there;
    what the deferred checks found after them."""
    from megatron_fused_ce import check_deferred_errors

    group = dist.group.WORLD if world > 1 else None
    config = GRPOConfig(loss_type="grpo", beta=0.05)
    hidden, weight_full, labels, mask, adv, extra = _inputs(11, world, False)
    weight = weight_full[rank * V_LOCAL:(rank + 1) * V_LOCAL]
    garbage = labels.clone()
    dropped = mask == 0
    garbage[dropped] = 10**6 + rank  # out of range, and not the same on every rank
    ignored = labels.masked_fill(dropped, -100)
    common = dict(tp_group=group, vocab_size=V_LOCAL * world - 3, old_logprobs=extra["old"],
                  reference_logprobs=extra["ref"])
    results = {}
    for name, y in (("garbage", garbage), ("ignored", ignored)):
        runs = []
        for _ in range(3):  # the signature's first call (full agreement), then steady ones (the label kernel)
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss, metrics = linear_grpo_loss(h, w, y, adv, mask, config, **common)
            loss.backward()
            runs.append((loss.detach(), {k: v.detach() for k, v in metrics.items()}, h.grad, w.grad))
        results[name] = runs
    try:
        check_deferred_errors()
        results["raised"] = None
    except ValueError as error:
        results["raised"] = str(error)
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_garbage_labels_where_the_mask_is_zero_are_never_read(tp):
    """Masked tokens have no label: a label there (out of range, or one that differs across TP
    ranks) is neither refused by the first call's agreement nor flagged by a later call's device
    checks, and every call gives what the same call with ignore_index there gives, bit for bit
    (the label kernel reads the mask on the gradients-in-forward path)."""
    for rank, results in enumerate(run_workers(_garbage_at_masked_positions_worker, tp)):
        assert results["raised"] is None, (rank, results["raised"])
        for got, want in zip(results["garbage"], results["ignored"]):
            assert torch.equal(got[0], want[0]), rank
            assert all(torch.equal(got[1][k], want[1][k]) for k in want[1]), rank
            assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3]), rank


# ---- the loss's own work per chunk ----------------------------------------------------------------


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


COUNT_CASES = {  # config, inputs
    "dapo_on_policy": (dict(), ()),
    "dapo_old": (dict(), ("old",)),
    "grpo_kl": (dict(loss_type="grpo", beta=0.1), ("old", "ref")),
    "sapo": (dict(loss_type="sapo"), ("old",)),
    "cispo_sequence_mask": (dict(loss_type="cispo", is_correction="sequence_mask", is_clip_min=0.5, is_clip_max=2.0),
                            ("old", "sampling")),
    "every_option": (dict(loss_type="dapo", delta=1.5, dual_clip_c=3.0, beta=0.1, kl_estimator="k3",
                          use_bias_correction_kl=True, is_correction="token_truncate", is_clip_max=1.2),
                     ("old", "ref", "sampling")),
}
# Aten ops that GRPOGrads.token_grads dispatches for one chunk after the first (the gather of its
# inputs, its log-probs, the per-token terms and their sums), whatever the options; here eagerly on
# CPU, on CUDA one compiled kernel for the terms and sums.
#                         dapo on-policy  dapo  grpo+KL  sapo  cispo+seq.mask  every option
#   before (autograd.grad on a [B, T] buffer):  78    81      148    80              77           156
#   now:                                        52    53       72    47              59           101
# A whole forward + backward, the op's own work included: per extra chunk before 131 to 210, now 101
# to 155; with one chunk, dapo / grpo+KL / every option: before 345 / 457 / 543, now 295 / 352 / 435.
# (On an H200, compiled: CUDA kernels per extra chunk of forward + backward, B=4, T=256, H=256,
# V=4096: before 89 / 144 / 150 for dapo / grpo+KL / every option, now 22 for each; host syncs per
# call: before 2 / 12 / 2, now 0.)
LOSS_OPS_PER_CHUNK = 110


@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_linear_grpo_ops_per_chunk_are_bounded(case, monkeypatch):
    cfg_kwargs, needs = COUNT_CASES[case]
    batch, length, hidden_size, vocab = 4, 8, 16, 32
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, length, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen)
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.2).float()
    lp = -2 + 0.1 * torch.randn(batch, length, generator=gen)
    given = {"old": ("old_logprobs", lp), "ref": ("reference_logprobs", lp + 0.1),
             "sampling": ("sampling_logprobs", lp - 0.1)}
    kwargs = dict(given[name] for name in needs)
    adv = torch.randn(batch, generator=gen)

    per_chunk = []
    token_grads = GRPOGrads.token_grads

    def counted(self, *args, **kw):
        with _CountOps() as ops:
            out = token_grads(self, *args, **kw)
        per_chunk.append(ops.count)
        return out

    monkeypatch.setattr(GRPOGrads, "token_grads", counted)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with _CountOps():
        loss, _ = linear_grpo_loss(h, w, labels, adv, mask, GRPOConfig(**cfg_kwargs), chunk_size=6, **kwargs)
        loss.backward()
    assert len(per_chunk) >= 4 and torch.isfinite(loss)
    # the first chunk also builds the per-position table and the batch totals
    assert max(per_chunk[1:]) <= LOSS_OPS_PER_CHUNK, per_chunk


def _bad_ignore_index_on_one_rank(rank, world, bad):
    hidden, weight, labels, mask, adv, extra = _inputs(0, world, False)
    shard = weight[rank * V_LOCAL:(rank + 1) * V_LOCAL]
    try:
        linear_grpo_loss(hidden.requires_grad_(), shard.requires_grad_(), labels, adv, mask, GRPOConfig(),
                         tp_group=dist.group.WORLD, vocab_size=V_LOCAL * world - 3,
                         ignore_index=bad if rank == 1 else -100)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("bad", [None, "-100", 1.5], ids=repr)
def test_bad_ignore_index_on_one_tp_rank_raises_on_every_rank(bad):
    """Before: the masked labels were filled with ignore_index before any check, so a bad one
    raised a TypeError on that rank alone and its peer waited in the next collective."""
    for rank, message in enumerate(run_workers(_bad_ignore_index_on_one_rank, 2, bad, timeout=60)):
        assert message is not None and "ignore_index" in message, (rank, message)
