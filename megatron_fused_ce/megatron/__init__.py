"""Megatron-Core integration: flip `use_linear_ce_fusion_loss: true` in `megatron_cfg` and the
last pipeline stage computes log-probs and losses from hidden states, never the `[b, s, V/TP]` logits.

    from megatron_fused_ce.megatron import (FusedCEConfig, install_fused_output_layer,
                                            LogprobsPostProcessor, sft_loss_func)

    fused = FusedCEConfig.from_megatron_cfg(cfg["megatron_cfg"])
    install_fused_output_layer(model, fused)            # no-op when fused.enabled is False
    post = LogprobsPostProcessor(fused, vocab_size=tokenizer_vocab_size)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        return output, sft_loss_func(post, model, batch["labels"], batch["loss_mask"])

On megatron-core >= 0.18 the same, with nothing installed, through megatron-core's own hook:

    proc = FusedOutputProcessor(fused, vocab_size=tokenizer_vocab_size)
    output = model(tokens, position_ids, attention_mask, output_processor=proc)
    loss_func = sft_loss_func(proc, model, labels, loss_mask)      # dpo_ / grpo_loss_func alike

`compute_logprobs` runs forward-only passes (reference / old policy) and broadcasts the result from
the last pipeline stage to every stage; `grpo_logprob_passes(config)` says which passes GRPO needs.
Megatron-LM-style `model(..., labels=labels)` keeps returning the per-token loss with fusion on,
and multi-token prediction (`mtp_num_layers`) computes every depth's loss without logits too.

Context parallelism: the post-processor and the loss funcs take the CP group from the model (or
`parallel_state`) and stay exact (loss_funcs.py says how); `batch_on_this_cp_rank` cuts a batch as
megatron does (packed THD batches too, without Transformer Engine), `compute_logprobs(...,
layout="gathered")` returns whole sequences.

Sampling-distribution replay: the post-processor, `FusedOutputProcessor(returns="logprobs")`,
`compute_logprobs` and `grpo_loss_func` take the engine's kept sets (`sampling_mask=`, `[b, s]`
like the labels, whole sequences under CP; `local_sampling_mask` cuts a rank's part).

Modules: config.py (the switches), output_layer.py (hidden states out of the last stage),
output_processor.py (the same through megatron-core's `output_processor` hook), lazy_logits.py
(what the output layer returns instead of logits), mtp.py (multi-token prediction), compat.py
(every difference between megatron-core versions), grad_accum_fusion.py (a pure-torch stand-in
for Apex's `fused_weight_gradient_mlp_cuda`, for gradient-accumulation fusion without Apex),
megatron_lm.py (the argparse flags for Megatron-LM scripts),
postprocess.py (log-probs from hidden states or logits; pipeline broadcast), loss_funcs.py
(Megatron loss funcs for SFT / DPO / GRPO), context_parallel.py (CP layouts). The harness the tests
and examples run with (megatron-core on CPU/gloo, a CP attention without Transformer Engine) is
megatron_fused_ce.testing, re-exported here: `enable_cpu_mode`, `with_context_parallel_attention`.
Importing this package does not import megatron-core or transformer-engine.
"""

from .config import FusedCEConfig
from .context_parallel import (
    batch_on_this_cp_rank,
    context_parallel_group,
    gather_from_cp_ranks,
    positions_on_cp_rank,
)
from .grad_accum_fusion import install_wgrad_accumulation_standin
from .lazy_logits import LazyLogits
from .loss_funcs import dpo_loss_func, grpo_logprob_passes, grpo_loss_func, sft_loss_func
from .megatron_lm import add_fused_ce_args
from .output_layer import (
    FusedOutputLayer,
    HiddenStates,
    install_fused_output_layer,
    is_fused,
    output_weight,
    uninstall_fused_output_layer,
    unwrap_model,
)
from .output_processor import FusedOutputProcessor
from .pipeline import broadcast_from_last_stage, compute_logprobs
from .postprocess import LogprobsPostProcessor, local_sampling_mask, packed_sequence_labels
from .unfused_logprobs import vocab_parallel_logprobs

__all__ = [
    "FusedCEConfig",
    "context_parallel_group",
    "positions_on_cp_rank",
    "batch_on_this_cp_rank",
    "gather_from_cp_ranks",
    "GatheredKVAttention",
    "with_context_parallel_attention",
    "enable_cpu_mode",
    "install_fused_output_layer",
    "uninstall_fused_output_layer",
    "FusedOutputLayer",
    "FusedOutputProcessor",
    "HiddenStates",
    "LazyLogits",
    "add_fused_ce_args",
    "install_wgrad_accumulation_standin",
    "is_fused",
    "output_weight",
    "unwrap_model",
    "LogprobsPostProcessor",
    "broadcast_from_last_stage",
    "compute_logprobs",
    "local_sampling_mask",
    "packed_sequence_labels",
    "vocab_parallel_logprobs",
    "sft_loss_func",
    "dpo_loss_func",
    "grpo_loss_func",
    "grpo_logprob_passes",
]

_HARNESS = {"enable_cpu_mode": "cpu", "GatheredKVAttention": "cp_attention",
            "with_context_parallel_attention": "cp_attention"}


def __getattr__(name):
    """The harness (megatron_fused_ce/testing/), where the documentation has long put it; looked
    up on first use, since the harness itself builds on this package."""
    if name in _HARNESS:
        import importlib

        return getattr(importlib.import_module(f"megatron_fused_ce.testing.{_HARNESS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
