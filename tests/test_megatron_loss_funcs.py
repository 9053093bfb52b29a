"""The loss funcs under Megatron's `calculate_per_token_loss` give the design-§3 loss of the whole
global batch: 2 data-parallel ranks x 2 micro-batches through `get_forward_backward_func` + DDP +
`finalize_model_grads` must equal one process computing `megatron_fused_ce.losses` on all rows
at once with the default (= global) normalizer. Checked for the loss value and every gradient, for
SFT, DPO (with its SFT term) and each GRPO reduction (token, sequence, Dr. GRPO, CISPO).

Tolerance: 1e-5 relative (fp32; only the order of the sums differs).
"""

from __future__ import annotations

import pytest
import torch

import megatron_harness as common
from dist import run_workers
from megatron_harness import Setup, all_batches, cat_rows, logprob_stand_ins

from megatron_fused_ce.losses import GRPOConfig, dpo_loss, grpo_loss, nll_loss
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    dpo_loss_func,
    grpo_logprob_passes,
    grpo_loss_func,
    install_fused_output_layer,
    sft_loss_func,
)

RTOL = 1e-5
DP, MICRO = 2, 2
FUSED = FusedCEConfig(enabled=True, chunk_size=8)
DPO = dict(beta=0.3, sft_weight=0.5, loss_type="sigmoid", label_smoothing=0.1)
GRPO_CONFIGS = {
    "dapo": GRPOConfig(loss_type="dapo", beta=0.1, is_correction="token_truncate", is_clip_max=1.1),
    "grpo": GRPOConfig(loss_type="grpo", beta=0.1, importance_sampling_level="sequence"),
    "dr_grpo": GRPOConfig(loss_type="dr_grpo", max_completion_length=12),
    "cispo": GRPOConfig(loss_type="cispo", cispo_max_ratio=1.05),
}


def megatron_worker(rank, world, kind, grpo_name):
    """DP=2 through the schedule: the loss funcs' (sum, count) and Megatron's normalization."""
    from megatron.core import parallel_state

    chunks = common.build(Setup(dp=DP))
    install_fused_output_layer(chunks, FUSED)
    post = LogprobsPostProcessor(FUSED, vocab_size=common.TRUE_VOCAB)
    everything = all_batches(kind, DP, MICRO)
    batches = dict(everything)[parallel_state.get_data_parallel_rank()]
    all_rows = [b for _, bs in everything for b in bs]
    pairs = sum(b["tokens"].shape[0] // 2 for b in all_rows)
    sft_tokens = sum(float(b["loss_mask"][0::2].sum()) for b in all_rows)

    def make(chunk, batch, index):
        labels, mask = batch["labels"], batch["loss_mask"]
        if kind == "sft":
            return sft_loss_func(post, chunk, labels, mask)
        extra = logprob_stand_ins(batch)
        if kind == "dpo":
            return dpo_loss_func(post, chunk, labels, mask, extra["reference"],
                                 global_num_pairs=pairs, global_num_sft_tokens=sft_tokens, **DPO)
        config = GRPO_CONFIGS[grpo_name]
        return grpo_loss_func(post, chunk, labels, mask, batch["advantages"], config,
                              old_logprobs=extra["old"], reference_logprobs=extra["reference"],
                              sampling_logprobs=extra["sampling"])

    metrics = common.run_step(chunks, batches, make)
    key = "lm loss" if kind == "sft" else "loss"
    total = torch.stack([m[key] for m in metrics]).sum(0)
    torch.distributed.all_reduce(total)
    return {"loss": float(total[0] / total[1]), "grads": common.grads(chunks)}


def direct_worker(rank, world, kind, grpo_name):
    """One process, all rows at once, plain autograd on megatron_fused_ce.losses."""
    (model,) = common.build(Setup())
    install_fused_output_layer(model, FUSED)
    post = LogprobsPostProcessor(FUSED, vocab_size=common.TRUE_VOCAB)
    rows = [b for _, bs in all_batches(kind, DP, MICRO) for b in bs]
    batch = {k: cat_rows(rows, k) for k in ("tokens", "labels", "loss_mask")}
    batch["position_ids"] = cat_rows(rows, "position_ids")
    batch["attention_mask"] = common.causal_mask()
    model.zero_grad_buffer()
    lp = post(common.forward_fn(model, batch), model, batch["labels"]).logprobs
    mask = batch["loss_mask"]
    if kind == "sft":
        loss, _ = nll_loss(lp, mask)
    else:
        extras = [logprob_stand_ins(b) for b in rows]
        extra = {k: torch.cat([e[k] for e in extras]) for k in extras[0]}
        if kind == "dpo":
            loss, _ = dpo_loss(lp, extra["reference"], mask, **DPO)
        else:
            loss, _ = grpo_loss(lp, cat_rows(rows, "advantages"), mask, GRPO_CONFIGS[grpo_name],
                                old_logprobs=extra["old"], reference_logprobs=extra["reference"],
                                sampling_logprobs=extra["sampling"])
    loss.backward()
    return {"loss": float(loss), "grads": common.grads([model])}


CASES = [("sft", None), ("dpo", None)] + [("grpo", name) for name in GRPO_CONFIGS]


@pytest.mark.parametrize("kind,grpo_name", CASES, ids=[c[1] or c[0] for c in CASES])
def test_global_normalization(kind, grpo_name):
    via_megatron = run_workers(megatron_worker, DP, kind, grpo_name)
    (direct,) = run_workers(direct_worker, 1, kind, grpo_name)
    for result in via_megatron:
        assert result["loss"] == pytest.approx(direct["loss"], rel=RTOL)
        assert result["grads"].keys() == direct["grads"].keys()
        for name, grad in direct["grads"].items():
            assert common.max_rel_diff(result["grads"][name], grad) <= RTOL, name


def test_grpo_logprob_passes():
    assert grpo_logprob_passes(GRPOConfig()) == {"reference": False, "old": True}
    assert grpo_logprob_passes(GRPOConfig(force_on_policy_ratio=True)) == \
        {"reference": False, "old": False}
    assert grpo_logprob_passes(GRPOConfig(beta=0.1)) == {"reference": True, "old": True}


def test_grpo_loss_func_requires_reference_only_with_kl():
    post = LogprobsPostProcessor(FUSED)
    labels = mask = advantages = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="reference_logprobs"):
        grpo_loss_func(post, None, labels, mask, advantages, GRPOConfig(beta=0.1))
    grpo_loss_func(post, None, labels, mask, advantages, GRPOConfig(beta=0.0))  # no reference: fine


def test_dpo_loss_func_owns_the_normalizers():
    post = LogprobsPostProcessor(FUSED)
    with pytest.raises(ValueError, match="normalizer"):
        dpo_loss_func(post, None, None, None, None, normalizer=4)


class _LogprobsStub(LogprobsPostProcessor):
    """Stands in for the post-processor: returns fixed log-probs (no model needed)."""

    def __init__(self, logprobs):
        super().__init__(FUSED)
        self.logprobs = logprobs

    def fused_inputs(self, *args, **kwargs):
        return None

    def __call__(self, output_tensor, model, labels, cu_seqlens=None):
        from megatron_fused_ce import LogprobsOutput
        return LogprobsOutput(self.logprobs, None)


def test_loss_funcs_count_excluded_tokens_and_empty_rows():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 5, generator=g)
    lp[3, 2] = float("-inf")  # outside a sampler's kept set: excluded
    labels = torch.ones(4, 5, dtype=torch.long)
    mask = torch.ones(4, 5)
    mask[1] = 0.0  # an empty sequence
    config = GRPOConfig(loss_type="grpo", count_empty_sequences=False)
    loss_sum, count, out = grpo_loss_func(_LogprobsStub(lp), None, labels, mask, torch.randn(4), config)(None)
    assert int(count) == 3  # sequences with a loss token, as the loss's own default normalizer
    assert out["num_excluded_tokens"].tolist() == [1.0, 3.0]  # a sum, not a mean
    assert int(grpo_loss_func(_LogprobsStub(lp), None, labels, mask, torch.randn(4),
                              GRPOConfig(loss_type="grpo"))(None)[1]) == 4

    # DPO: chosen rows without loss tokens (the SFT term is 0) must not make a zero normalizer
    mask = torch.ones(4, 5)
    mask[0::2] = 0.0
    loss_sum, pairs, out = dpo_loss_func(_LogprobsStub(lp), None, labels, mask, lp.detach() + 0.1,
                                         sft_weight=0.5)(None)
    assert torch.isfinite(loss_sum) and int(pairs) == 2
    assert out["num_excluded_tokens"].tolist() == [1.0, 2.0]


class _LabelsSeen(_LogprobsStub):
    """The stub, keeping the labels the loss func asks log-probs for."""

    def __call__(self, output_tensor, model, labels, cu_seqlens=None, **replay):
        self.labels = labels
        return super().__call__(output_tensor, model, labels)


def _each_loss_func(post, labels, mask):
    """The three loss funcs on the stub's log-probs, each through its log-probs path."""
    lp = post.logprobs
    yield "sft", lambda: sft_loss_func(post, None, labels, mask)(None)
    yield "dpo", lambda: dpo_loss_func(post, None, labels, mask, lp.detach() + 0.1, sft_weight=0.5)(None)
    yield "grpo", lambda: grpo_loss_func(post, None, labels, mask, torch.randn(lp.shape[0]), GRPOConfig(),
                                         old_logprobs=lp.detach() - 0.1)(None)


@pytest.mark.parametrize("mask_shape", [(5,), (1, 5), (4, 1)])
def test_loss_funcs_refuse_a_mask_of_another_shape_than_the_labels(mask_shape):
    """A loss mask that is not [b, s] like the labels ([s], [1, s], [b, 1]) raises, without context
    parallelism too: it used to broadcast into a loss over other tokens (8-34 % off, the count
    wrong), where under CP the same input raised."""
    lp = -torch.rand(4, 5, generator=torch.Generator().manual_seed(1))
    labels = torch.ones(4, 5, dtype=torch.long)
    for name, call in _each_loss_func(_LabelsSeen(lp), labels, torch.ones(mask_shape)):
        with pytest.raises(ValueError, match=r"loss_mask shape"):  # (every loss func)
            call()


def test_log_prob_paths_of_the_loss_funcs_never_read_a_masked_label():
    """A masked position's label (a padded-vocab id or -1 there, as Megatron's own loss accepts)
    reaches the post-processor as ignore_index: the log-probs paths (DPO, GRPO with entropy or
    sampler settings, SFT with a weighted mask) accept the batch the fused paths accept, and the
    unmasked labels arrive unchanged."""
    lp = -torch.rand(4, 5, generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(4, 5)
    mask[:, -1] = 0.0
    mask[0, 1] = 0.5  # (a weighted mask: SFT's log-probs path)
    labels[:, -1] = 100000  # beyond any vocab: read, it would raise
    for name in ("sft", "dpo", "grpo"):
        post = _LabelsSeen(lp)
        dict(_each_loss_func(post, labels, mask))[name]()
        seen = post.labels
        assert torch.equal(seen[:, -1], torch.full((4,), post.ignore_index)), name
        assert torch.equal(seen[:, :-1], labels[:, :-1]), name
