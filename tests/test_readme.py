"""The integration guide's snippets (docs/integration.md, linked from the README), extracted and
run as written on forked gloo ranks with a tiny GPTModel: fused against unfused, the same
losses (1e-5 relative) and every parameter's gradient (1e-4 of its largest entry), as in
test_megatron_parity.py. An edit that breaks a snippet fails here.

- Megatron-LM route at PP=2 (tied embeddings): the snippet's `add_fused_ce_args` parses the flags,
  `fused_model_provider` wraps a Megatron-LM-style `model_provider` (bare GPTModel, wrapped in DDP
  afterwards, as Megatron-LM's `get_model` does), and Megatron-LM's unchanged `forward_step` /
  `loss_func` pattern (`model(..., labels=labels)` -> per-token loss) trains. `megatron.training`
  (Megatron-LM, not part of megatron-core) is stood in for by its one function the snippet
  calls, `get_args`.
- megatron_cfg route at TP=2: `prepare_model` and `train_step` as written.
- megatron-core's `output_processor` hook at TP=2 (megatron-core >= 0.18; skipped before):
  `make_processor` and `forward_step` as written, under `get_forward_backward_func`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import types
from functools import partial

import pytest
import torch

import megatron_harness as common
from dist import run_workers
from megatron_harness import PADDED_VOCAB, SEQ, TRUE_VOCAB, Setup

from megatron_fused_ce.megatron import is_fused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where the integration snippets live: the README links this page for them
GUIDE = os.path.join(ROOT, "docs", "integration.md")
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def snippet(heading: str) -> str:
    """The first ```python block after the guide's heading that starts with `heading`."""
    text = open(GUIDE).read()
    start = re.search(rf"\n#+ {re.escape(heading)}", text).start()
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


# ------------------------------------------------------------------------------------------------
# Megatron-LM (argparse)
# ------------------------------------------------------------------------------------------------
def megatron_lm_worker(rank, world, code, argv):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from dist import init_megatron_parallel
    from megatron_fused_ce.megatron import enable_cpu_mode

    parsed = {}
    training = types.ModuleType("megatron.training")  # Megatron-LM's, as far as the snippet uses it
    training.get_args = lambda: parsed["args"]
    sys.modules["megatron.training"] = training
    namespace = {}
    exec(compile(code, "docs/integration.md (Megatron-LM snippet)", "exec"), namespace)
    parsed["args"] = namespace["add_fused_ce_args"](argparse.ArgumentParser()).parse_args(argv)

    setup = Setup(pp=2, tied=True)
    enable_cpu_mode()
    init_megatron_parallel(setup.tp, setup.pp)
    torch.manual_seed(1234 + parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=setup.layers, hidden_size=common.HIDDEN, num_attention_heads=common.HEADS,
        pipeline_model_parallel_size=setup.pp, pipeline_dtype=torch.float32,
        calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0)

    def model_provider(pre_process=True, post_process=True):  # Megatron-LM's, in miniature
        return GPTModel(config, common.layer_spec(config, setup), vocab_size=PADDED_VOCAB,
                        max_sequence_length=SEQ, pre_process=pre_process, post_process=post_process,
                        share_embeddings_and_output_weights=setup.tied)

    gpt = namespace["fused_model_provider"](
        model_provider, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
    config.finalize_model_grads_func = finalize_model_grads

    def loss_func(loss_mask, output_tensor):  # Megatron-LM's pretrain_gpt.loss_func, unchanged
        losses = output_tensor.view(-1).float()
        loss = torch.sum(losses * loss_mask.view(-1).float())
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def forward_step(data_iterator, model):  # Megatron-LM's pretrain_gpt.forward_step, unchanged
        batch = next(data_iterator)
        output_tensor = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                              labels=batch["labels"])
        return output_tensor, partial(loss_func, batch["loss_mask"])

    batches = common.make_batches("sft", 2, seed=11)
    model.zero_grad_buffer()
    metrics = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=common.MBS, forward_only=False)
    last = parallel_state.is_pipeline_last_stage()
    return {"fused": last and is_fused(model), "losses": [m["lm loss"] for m in metrics],
            "grads": common.grads([model]), "last": last}


def test_megatron_lm_snippet():
    code = snippet("Megatron-LM")
    fused = run_workers(megatron_lm_worker, 2, code,
                        ["--use-linear-ce-fusion-loss", "--linear-ce-fusion-chunk-size", "8"], timeout=120)
    unfused = run_workers(megatron_lm_worker, 2, code, [], timeout=120)
    for f, u in zip(fused, unfused):
        assert f["fused"] == f["last"]  # installed on the last stage only, and only with the flag
        assert not u["fused"]
        assert len(f["losses"]) == (2 if f["last"] else 0)
        for a, b in zip(f["losses"], u["losses"]):
            assert common.max_rel_diff(a, b) <= LOSS_RTOL
        for name, g in u["grads"].items():
            assert common.max_rel_diff(f["grads"][name], g) <= GRAD_RTOL, name


# ------------------------------------------------------------------------------------------------
# NeMo-RL-style megatron_cfg
# ------------------------------------------------------------------------------------------------
def megatron_cfg_worker(rank, world, code, megatron_cfg):
    from megatron.core import parallel_state

    namespace = {}
    exec(compile(code, "docs/integration.md (megatron_cfg snippet)", "exec"), namespace)
    (model,) = common.build(Setup(tp=2))
    fused = namespace["prepare_model"](model, megatron_cfg)
    batches = common.make_batches("sft", 2, seed=5 + parallel_state.get_data_parallel_rank())
    model.zero_grad_buffer()
    metrics = namespace["train_step"](model, fused, batches, TRUE_VOCAB, SEQ)
    return {"fused": is_fused(model), "chunk_size": fused.chunk_size,
            "losses": [m["lm loss"] for m in metrics], "grads": common.grads([model])}


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_megatron_cfg_snippet(chunk_size):
    code = snippet("NeMo-RL-style")
    megatron_cfg = {"tensor_model_parallel_size": 2, "sequence_parallel": False,  # Megatron's keys
                    "optimizer": {"lr": 1e-5}, "use_linear_ce_fusion_loss": True}
    if chunk_size is not None:
        megatron_cfg["linear_ce_fusion_chunk_size"] = chunk_size
    fused = run_workers(megatron_cfg_worker, 2, code, megatron_cfg, timeout=120)
    unfused = run_workers(megatron_cfg_worker, 2, code, {"use_linear_ce_fusion_loss": False}, timeout=120)
    for f, u in zip(fused, unfused):
        assert f["fused"] and not u["fused"] and f["chunk_size"] == chunk_size
        assert len(f["losses"]) == 2
        for a, b in zip(f["losses"], u["losses"]):
            assert common.max_rel_diff(a, b) <= LOSS_RTOL
        for name, g in u["grads"].items():
            assert common.max_rel_diff(f["grads"][name], g) <= GRAD_RTOL, name


# ------------------------------------------------------------------------------------------------
# megatron-core's output_processor hook
# ------------------------------------------------------------------------------------------------
def output_processor_worker(rank, world, code, megatron_cfg):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_fused_ce.megatron import loss_funcs

    calls = []  # the fused loss ran (forked worker: the patch dies with it)
    original = loss_funcs.linear_cross_entropy
    loss_funcs.linear_cross_entropy = lambda *a, **k: calls.append(1) or original(*a, **k)
    namespace = {}
    exec(compile(code, "docs/integration.md (output_processor snippet)", "exec"), namespace)
    (model,) = common.build(Setup(tp=2))
    proc = namespace["make_processor"](megatron_cfg, TRUE_VOCAB)
    batches = common.make_batches("sft", 2, seed=7 + parallel_state.get_data_parallel_rank())
    model.zero_grad_buffer()
    metrics = get_forward_backward_func()(
        forward_step_func=partial(namespace["forward_step"], proc), data_iterator=iter(batches),
        model=[model], num_microbatches=len(batches), seq_length=SEQ,
        micro_batch_size=common.MBS, forward_only=False)
    return {"fused": is_fused(model), "losses": [m["lm loss"] for m in metrics],
            "grads": common.grads([model]), "fused_loss_calls": len(calls)}


def test_output_processor_snippet():
    from megatron_fused_ce.megatron import compat

    if not compat.has_output_processor():
        pytest.skip(f"megatron-core {compat.megatron_core_version_string()} has no GPTModel "
                    f"output_processor (>= 0.18)")
    code = snippet("megatron-core >= 0.18")
    fused = run_workers(output_processor_worker, 2, code,
                        {"use_linear_ce_fusion_loss": True, "linear_ce_fusion_chunk_size": 8}, timeout=120)
    unfused = run_workers(output_processor_worker, 2, code, {"use_linear_ce_fusion_loss": False},
                          timeout=120)
    for f, u in zip(fused, unfused):
        assert not f["fused"] and not u["fused"]  # nothing installed either way
        assert f["fused_loss_calls"] == 2 and u["fused_loss_calls"] == 0  # per micro-batch
        assert len(f["losses"]) == 2
        for a, b in zip(f["losses"], u["losses"]):
            assert common.max_rel_diff(a, b) <= LOSS_RTOL
        for name, g in u["grads"].items():
            assert common.max_rel_diff(f["grads"][name], g) <= GRAD_RTOL, name
