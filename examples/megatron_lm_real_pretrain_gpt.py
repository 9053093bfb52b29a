"""Megatron-LM's `pretrain_gpt.py`, on Megatron-LM's own training loop (`megatron.training.pretrain`,
shipped in the megatron-core wheels >= 0.19, Python >= 3.12), with the fused linear cross-entropy
added in two places marked "fused CE" below:

    1. `parse_and_validate_args(extra_args_provider=add_fused_ce_args, ...)`: the flags
       --use-linear-ce-fusion-loss, --linear-ce-fusion-chunk-size, --linear-ce-fusion-memory-mode,
       --linear-ce-fusion-logits-dtype, parsed and validated with Megatron-LM's own arguments;
    2. `install_fused_output_layer` where the model provider's result is: from 0.19 on,
       Megatron-LM's pretrain_gpt.py builds the model from a `GPTModelConfig`, whose
       `pre_wrap_hooks` run on the freshly built model chunks before Float16Module / DDP wrap them
       (exactly where a `model_provider` used to return), so the install is a pre-wrap hook.

`forward_step` / `loss_func` are Megatron-LM's conventions: the model, called with labels, returns
the per-token loss [b, s] (computed from the hidden states chunk by chunk when the flag is on; the
MTP depths' losses, with --mtp-num-layers, are added by megatron as before). Everything else is
Megatron-LM's loop: argument validation, the distributed optimizer, checkpointing, logging.

    torchrun --nproc_per_node 1 examples/megatron_lm_real_pretrain_gpt.py \\
        --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \\
        --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32 \\
        --train-iters 500 --lr 3e-4 --bf16 --use-distributed-optimizer \\
        --transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm \\
        --no-masked-softmax-fusion --position-embedding-type rope --no-rope-fusion \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR \\
        --data-path DIR/text_document --split 100,0,0 --eval-iters 0 \\
        --use-linear-ce-fusion-loss

(DIR from `python tools/make_text_dataset.py --output-dir DIR`; `--tokenizer-type
GPT2BPETokenizer --vocab-file DIR/vocab.json --merge-file DIR/merges.txt` reads the same tokenizer
where the Hugging Face hub is reachable. The `--no-*` flags select the local layer spec's plain
PyTorch paths where neither Transformer Engine nor Apex is installed; RoPE is what --mtp-num-layers
needs. Megatron-LM's default stack, `--transformer-impl transformer_engine` with
gradient-accumulation fusion on, runs too: where Apex's `fused_weight_gradient_mlp_cuda` is absent
(it is not on PyPI), the script installs the package's pure-torch stand-in for it before the model
is built and says so in one line; see `install_grad_accum_fusion_standin`. Megatron-LM's
initialization runs `make` in megatron/core/datasets, which a pip-installed wheel lacks a Makefile
for: tools/real_loop_curves.sh adds one.) Without `megatron.training`
(megatron-core < 0.19 or Python < 3.12) the script says so and exits with status 2.

The functions below that need no `megatron.training` (`loss_func`, the dataset config, the fused
CE configuration) are shared with examples/megatron_lm_pretrain.py, the CPU stand-in for this loop.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial

_PROGRAM_START_TIME = time.time()

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_fused_ce.megatron import add_fused_ce_args, install_fused_output_layer  # noqa: E402
from megatron_fused_ce.megatron.megatron_lm import fused_ce_config_from_args  # noqa: E402

MISSING_TRAINING = ("megatron.training is not importable here ({error}): this script runs on "
                    "Megatron-LM's own training loop, shipped in the megatron-core wheels >= 0.19 "
                    "(Python >= 3.12). examples/megatron_lm_pretrain.py runs the same model, "
                    "forward_step and loss_func on a stand-in loop.")


def megatron_training_error():
    """None where `megatron.training` (with `pretrain` and its config container) imports, else
    the reason it does not."""
    try:
        import megatron.training  # noqa: F401
        from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: F401
    except Exception as error:  # ImportError, or a SyntaxError/NameError of a too-old Python
        return f"{type(error).__name__}: {error}"
    return None


def _training_args():
    """Megatron-LM's parsed args, or None outside its loop (the stand-in shares loss_func)."""
    try:
        from megatron.training.global_vars import _GLOBAL_ARGS
    except Exception:
        return None
    return _GLOBAL_ARGS


# ------------------------------------------------------------------------------------------------
# loss_func / forward_step (Megatron-LM's conventions)
# ------------------------------------------------------------------------------------------------
def loss_func(loss_mask, output_tensor, model=None):
    """The model returned per-token losses [b, s]: their masked sum, the number of tokens, and the
    report megatron averages over data-parallel ranks. In Megatron-LM's loop, NaN / Inf losses are
    rejected through its rerun state machine (--check-for-nan-in-loss-and-grad)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    args = _training_args()
    if args is not None and getattr(args, "check_for_nan_in_loss_and_grad", False):
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, report


BATCH_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels",
              "local_cp_size", "loss_mask", "max_seqlen", "position_ids", "tokens")


def get_batch(data_iterator, vp_stage=None):
    """tokens, labels, loss_mask, attention_mask, position_ids of this rank (None where a pipeline
    stage needs none): tensor-parallel rank 0 reads the loader, megatron broadcasts to the others
    and slices for context parallelism."""
    from megatron.core import mpu
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    mtp_here = mtp_on_this_rank(layout=_transformer_config(args).pipeline_model_parallel_layout,
                                mtp_num_layers=args.mtp_num_layers, ignore_virtual=False,
                                vp_stage=vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {key: raw[key].cuda(non_blocking=True) if raw.get(key) is not None else None
                 for key in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                      cp_group=mpu.get_context_parallel_group())
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron-LM's forward step: the batch, then `model(..., labels=, loss_mask=)`, which returns
    per-token losses; `loss_func` reduces them."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    if return_schedule_plan:
        raise NotImplementedError("--overlap-moe-expert-parallel-comm is not used by this example")
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


_TRANSFORMER_CONFIG = {}


def _transformer_config(args):
    if "config" not in _TRANSFORMER_CONFIG:
        from megatron.training.arguments import core_transformer_config_from_args

        _TRANSFORMER_CONFIG["config"] = core_transformer_config_from_args(args)
    return _TRANSFORMER_CONFIG["config"]


# ------------------------------------------------------------------------------------------------
# Datasets (shared with the stand-in): megatron-core's GPTDataset over --data-path
# ------------------------------------------------------------------------------------------------
def core_gpt_dataset_config_from_args(args, tokenizer):
    """megatron-core's GPTDatasetConfig from Megatron-LM's data flags."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    try:  # Megatron-LM's reader (also --train-data-path / --valid-data-path / --test-data-path)
        from megatron.training.utils import get_blend_and_blend_per_split

        blend, blend_per_split = get_blend_and_blend_per_split(args)
    except ImportError:
        blend, blend_per_split = get_blend_from_list(args.data_path), None
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split, path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files, tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)


def build_gpt_datasets(args, tokenizer, train_val_test_num_samples, is_built_on_rank):
    """(train, valid, test) through megatron-core's BlendedMegatronDatasetBuilder."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    dataset_type = MockGPTDataset if getattr(args, "mock_data", False) else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, is_built_on_rank,
                                         core_gpt_dataset_config_from_args(args, tokenizer)).build()


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core import mpu
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()

    def is_built_on_rank():
        return (is_first_or_last_pipeline_stage(vp_stage)
                and mpu.get_tensor_model_parallel_rank() == 0)

    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = build_gpt_datasets(args, build_tokenizer(args), train_val_test_num_samples,
                                  is_built_on_rank)
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True


# ------------------------------------------------------------------------------------------------
# The model: Megatron-LM's GPTModelConfig, and the fused output layer as its pre-wrap hook
# ------------------------------------------------------------------------------------------------
def install_fused_ce(model_chunks):
    """Pre-wrap hook (fused CE): the fused output layer on the last stage's chunk, from the flags.
    A no-op without --use-linear-ce-fusion-loss and on the other pipeline stages."""
    from megatron.training import get_args

    return install_fused_output_layer(model_chunks, fused_ce_config_from_args(get_args()))


def install_grad_accum_fusion_standin(args, log):
    """With --gradient-accumulation-fusion (Megatron-LM's default) megatron-core's own linears
    (the unfused output layer among them, also under --transformer-impl transformer_engine) need
    Apex's fused_weight_gradient_mlp_cuda, which pip cannot install: where it is absent, the
    package's pure-torch stand-in (megatron_fused_ce/megatron/grad_accum_fusion.py) takes its place
    before the model is built. Returns "apex", "standin", or None with the fusion off."""
    if not getattr(args, "gradient_accumulation_fusion", False):
        return None
    from megatron_fused_ce.megatron.grad_accum_fusion import install_wgrad_accumulation_standin

    used = install_wgrad_accumulation_standin()
    if used == "standin":
        log("> gradient-accumulation fusion: Apex's fused_weight_gradient_mlp_cuda is not installed, "
            "using megatron_fused_ce's pure-torch stand-in (one fp32-output GEMM into main_grad)")
    return used


def main():
    error = megatron_training_error()
    if error is not None:
        print(MISSING_TRAINING.format(error=error), file=sys.stderr, flush=True)
        return 2
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, print_rank_0, set_startup_timestamps
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    args = parse_and_validate_args(extra_args_provider=add_fused_ce_args,  # fused CE: 1, the flags
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    fused = fused_ce_config_from_args(args, log=print_rank_0)  # checks the flags against megatron's
    install_grad_accum_fusion_standin(args, print_rank_0)
    model_cfg = gpt_config_from_args(args)
    model_cfg.pre_wrap_hooks.append(install_fused_ce)  # fused CE: 2, the install
    print_rank_0(f"> fused linear cross-entropy: {'on' if fused.enabled else 'off'} ({fused})")
    run(pretrain_cfg_container_from_args(args, model_cfg), train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder, forward_step, store=store)
    if torch.cuda.is_available():
        peak = torch.tensor([torch.cuda.max_memory_allocated()], device="cuda", dtype=torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        print_rank_0(f"> peak GPU memory allocated (max over ranks): {peak.item() / 2**30:.3f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
