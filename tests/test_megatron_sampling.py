"""Sampler settings through the Megatron adapters (CPU, gloo): LogprobsPostProcessor(top_k=,
top_p=, min_p=, return_topk=) on a real GPTModel, fused and unfused, against the float64 dense
reference of sampling_reference.py; the GRPO loss func excluding and not counting tokens outside
the kept set, through Megatron's schedule at DP=2 (equal to one process on all rows); the pipeline
broadcast of top-k fields; examples/grpo.py with `sampling.*` overrides at TP=2 x PP=2.
"""

from __future__ import annotations

import pytest
import torch

import megatron_harness as common
import sampling_reference as sref
from dist import init_megatron_parallel, run_workers
from megatron_harness import TRUE_VOCAB, Setup, all_batches, all_gather_cat, cat_rows, logprob_stand_ins

from megatron_fused_ce import LogprobsOutput
from megatron_fused_ce.losses import GRPOConfig, grpo_loss
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    broadcast_from_last_stage,
    enable_cpu_mode,
    grpo_loss_func,
    install_fused_output_layer,
    output_weight,
)

ATOL = 1e-5
FUSED = FusedCEConfig(enabled=True, chunk_size=8)
SAMPLERS = [dict(top_p=0.9, return_topk=5), dict(top_k=7, min_p=0.9), dict(top_k=40, top_p=0.95),
            dict(top_k=-1, min_p=1.0)]  # vLLM's spellings: top_k -1 = off, min_p 1 = ties with the max


def postprocess_worker(rank, world, setup: Setup, temperature: float):
    from megatron.core import parallel_state

    (model,) = common.build(setup)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    batch = common.make_batches("sft", 1, seed=7)[0]
    labels = batch["labels"].clone()
    labels[0, 5] = -100
    results = {}
    with torch.no_grad():
        for mode in ("unfused", "fused"):
            if mode == "fused":
                install_fused_output_layer(model, FUSED)
            output = common.forward_fn(model, batch)
            for i, sampler in enumerate(SAMPLERS):
                post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB, temperature=temperature,
                                             return_entropy=True, **sampler)
                results[mode, i] = post(output, model, labels)
            if mode == "fused":
                hidden = all_gather_cat(output, 1, tp_group) if setup.sp else output
        weight = all_gather_cat(output_weight(model), 0, tp_group)
    z = (hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().t())[:, :TRUE_VOCAB] / temperature
    report = []
    for i, sampler in enumerate(SAMPLERS):
        filters = {k: v for k, v in sampler.items() if k != "return_topk"}
        keep = sref.kept_set(z, **filters)
        lp, ent = sref.processed_stats(z, labels.reshape(-1), keep)
        lp, ent = lp.reshape(labels.shape), ent.reshape(labels.shape)
        finite = torch.isfinite(lp)
        for mode in ("unfused", "fused"):
            out = results[mode, i]
            entry = dict(mode=mode, sampler=i, finite_ok=torch.equal(torch.isfinite(out.logprobs), finite),
                         excluded=int((~finite).sum()),
                         lp_err=(out.logprobs[finite].double() - lp[finite]).abs().max().item(),
                         ent_err=(out.entropy.double() - ent).abs().max().item(), logprobs=out.logprobs)
            if sampler.get("return_topk"):
                k = sampler["return_topk"]
                tlp, tid = sref.topk_reference(z, k)
                scored = (labels != -100).reshape(-1)
                entry["topk_ids_ok"] = torch.equal(out.topk_ids.reshape(-1, k)[scored], tid[scored])
                entry["topk_err"] = (out.topk_logprobs.reshape(-1, k)[scored].double() - tlp[scored]).abs().max().item()
                entry["topk_ignored"] = bool((out.topk_ids[0, 5] == -1).all())
            report.append(entry)
    return report


@pytest.mark.parametrize("setup,temperature", [(Setup(tp=2, tied=True), 0.7), (Setup(tp=2, sp=True), 1.3)],
                         ids=["tp2-tied", "tp2-sp"])
def test_post_processor_matches_dense_reference(setup, temperature):
    results = run_workers(postprocess_worker, setup.world, setup, temperature)
    for report in results:
        for entry in report:
            assert entry["finite_ok"], entry
            assert entry["lp_err"] <= ATOL and entry["ent_err"] <= ATOL, entry
            if "topk_ids_ok" in entry:
                assert entry["topk_ids_ok"] and entry["topk_err"] <= ATOL and entry["topk_ignored"], entry
        assert any(e["excluded"] > 0 for e in report)  # some labels fall outside the kept sets
    for report in results[1:]:
        for a, b in zip(report, results[0]):
            assert torch.equal(a["logprobs"], b["logprobs"])


def test_post_processor_rejects_bad_settings():
    for kwargs, name in ((dict(top_k=-2), "top_k"), (dict(top_p=1.2), "top_p"), (dict(min_p=1.5), "min_p"),
                         (dict(min_p=float("nan")), "min_p"), (dict(return_topk=-2), "return_topk")):
        with pytest.raises(ValueError, match=name):
            LogprobsPostProcessor(FUSED, **kwargs)
    # the engine's settings as vLLM reads them: top_k 0 / -1 are off, min_p = 1 is a filter
    for off in (dict(top_p=1.0, min_p=0.0), dict(top_k=0), dict(top_k=-1, top_p=1.0),
                dict(top_k=TRUE_VOCAB)):
        assert not LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB, **off).filters, off
    assert LogprobsPostProcessor(FUSED, top_k=3).filters
    assert LogprobsPostProcessor(FUSED, top_k=0, min_p=1.0).filters


# ------------------------------------------------------------------------------------------------
# GRPO loss func: excluded tokens are masked and left out of Megatron's count
# ------------------------------------------------------------------------------------------------
CONFIG = GRPOConfig(loss_type="dapo", beta=0.1, is_correction="token_truncate", is_clip_max=1.1)
SAMPLER = dict(top_k=30, top_p=0.9)


def grpo_megatron_worker(rank, world, fused):
    from megatron.core import parallel_state

    chunks = common.build(Setup(dp=2))
    if fused:
        install_fused_output_layer(chunks, FUSED)
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB, **SAMPLER)
    batches = dict(all_batches("grpo"))[parallel_state.get_data_parallel_rank()]

    def make(chunk, batch, index):
        extra = logprob_stand_ins(batch)
        return grpo_loss_func(post, chunk, batch["labels"], batch["loss_mask"], batch["advantages"], CONFIG,
                              old_logprobs=extra["old"], reference_logprobs=extra["reference"],
                              sampling_logprobs=extra["sampling"])

    metrics = common.run_step(chunks, batches, make)
    total = torch.stack([torch.stack([m["loss"], m["num_excluded_tokens"]]) for m in metrics]).sum(0)
    torch.distributed.all_reduce(total)
    return {"loss": float(total[0, 0] / total[0, 1]), "excluded": float(total[1, 0]),
            "grads": common.grads(chunks)}


def grpo_direct_worker(rank, world):
    (model,) = common.build(Setup())
    install_fused_output_layer(model, FUSED)
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB, **SAMPLER)
    rows = [b for _, bs in all_batches("grpo") for b in bs]
    batch = {k: cat_rows(rows, k) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    batch["attention_mask"] = common.causal_mask()
    model.zero_grad_buffer()
    lp = post(common.forward_fn(model, batch), model, batch["labels"]).logprobs
    extras = [logprob_stand_ins(b) for b in rows]
    extra = {k: torch.cat([e[k] for e in extras]) for k in extras[0]}
    loss, metrics = grpo_loss(lp, cat_rows(rows, "advantages"), batch["loss_mask"], CONFIG,
                              old_logprobs=extra["old"], reference_logprobs=extra["reference"],
                              sampling_logprobs=extra["sampling"])
    loss.backward()
    return {"loss": float(loss), "excluded": float(metrics["num_excluded_tokens"]),
            "grads": common.grads([model])}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_grpo_loss_func_with_sampler_settings(fused):
    via_megatron = run_workers(grpo_megatron_worker, 2, fused)
    (direct,) = run_workers(grpo_direct_worker, 1)
    assert direct["excluded"] > 0
    for result in via_megatron:
        assert result["excluded"] == direct["excluded"]
        assert result["loss"] == pytest.approx(direct["loss"], rel=1e-5)
        for name, grad in direct["grads"].items():
            assert common.max_rel_diff(result["grads"][name], grad) <= 1e-5, name


# ------------------------------------------------------------------------------------------------
# Pipeline broadcast of the top-k fields
# ------------------------------------------------------------------------------------------------
def _values():
    g = torch.Generator().manual_seed(0)
    return {"topk": LogprobsOutput(torch.randn(2, 7, generator=g), torch.rand(2, 7, generator=g),
                                   torch.randn(2, 7, 3, generator=g), torch.randint(0, 9, (2, 7, 3), generator=g)),
            "topk_no_entropy": LogprobsOutput(torch.randn(2, 7, generator=g), None,
                                              torch.randn(2, 7, 4, generator=g),
                                              torch.randint(0, 9, (2, 7, 4), generator=g))}


def broadcast_worker(rank, world):
    from megatron.core import parallel_state

    enable_cpu_mode()
    init_megatron_parallel(1, world)
    last = parallel_state.is_pipeline_last_stage()
    return {name: broadcast_from_last_stage(value if last else None) for name, value in _values().items()}


def test_broadcast_carries_topk():
    for received in run_workers(broadcast_worker, 2):
        for name, value in _values().items():
            got = received[name]
            for field in ("logprobs", "entropy", "topk_logprobs", "topk_ids"):
                a, b = getattr(got, field), getattr(value, field)
                assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), (name, field)


# ------------------------------------------------------------------------------------------------
# examples/grpo.py with the rollouts' sampler settings
# ------------------------------------------------------------------------------------------------
def test_grpo_example_with_sampler_overrides(capfd):
    from example_runner import FAST, example_worker

    argv = FAST + ["--compare-unfused", "data.prompt_length=8", "rollout.num_prompts=2",
                   "sampling.top_p=0.9", "sampling.top_k=50"]
    for calls in run_workers(example_worker, 4, "grpo", argv, timeout=180):
        # the reference pass of each of the 2 steps, and --compare-unfused's fused and unfused
        # log-probs of the first rollout; the old policy's log-probs are the sampler's record
        # (rollout.old_logprobs=sampler, the default), which needs no pass
        assert calls["compute_logprobs"] == 2 + 2
    text = "".join(capfd.readouterr())
    assert "first rollout" in text and "excluded" in text
    assert float(text.split("max |difference| ")[1].split()[0]) <= 1e-4
