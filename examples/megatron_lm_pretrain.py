"""Megatron-LM's pretrain_gpt.py, in miniature: argparse flags, `model_provider`, `forward_step`,
`loss_func` as Megatron-LM writes them, and the fused linear cross-entropy added in two lines
(marked "fused CE" below). A small stand-in for Megatron-LM's `pretrain()` loop runs it on mock
data, on CPU/gloo or on GPUs/NCCL:

    torchrun --nproc_per_node 4 examples/megatron_lm_pretrain.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --mtp-num-layers 1 --use-linear-ce-fusion-loss --compare-unfused

    # GPUs: megatron's distributed optimizer, param all-gather and grad reduce-scatter overlapped
    torchrun --nproc_per_node 2 examples/megatron_lm_pretrain.py --bf16 --use-linear-ce-fusion-loss \\
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --compare-unfused

    # real text: python tools/make_text_dataset.py --output-dir DIR --vocab-size 4096, then
    torchrun --nproc_per_node 2 examples/megatron_lm_pretrain.py --data-path DIR/text_document \\
        --tokenizer-type GPT2BPETokenizer --vocab-file DIR/vocab.json --merge-file DIR/merges.txt \\
        --use-linear-ce-fusion-loss --compare-unfused

With `--use-linear-ce-fusion-loss` the model, called with labels, returns the per-token loss of the
main head computed from the hidden states chunk by chunk, and every multi-token-prediction depth's
loss likewise: no `[tokens, vocab/TP]` logits. `--compare-unfused` reports, on the first batch, the
loss and MTP losses of the same model with and without the fused output layer.

`loss_func`, the fused-CE configuration (`fused_ce_config_from_args`, which reconciles Megatron-LM's
--cross-entropy-loss-fusion / --cross-entropy-fusion-impl) and the GPTDataset reading of --data-path
are those of examples/megatron_lm_real_pretrain_gpt.py, the same script on Megatron-LM's own loop
(megatron-core >= 0.19). Without --data-path the data are mock sequences.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from functools import partial

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

# These messages only, filtered before megatron-core is imported (the library installs no filter):
# megatron-core warns on import that its optional Apex / Transformer Engine (and, from 0.19, absl)
# are missing and logs (0.19) that GPTModel is deprecated; its MTP layer gathers with
# torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates. On GPUs, 0.19's optimizer
# package imports its experimental multimodal config (which warns so at import) and, without
# Transformer Engine, it warns that TE's MoE experts need TE >= 1.7 (this model has no MoE). Nothing
# a user of this script can act on.
for _message in (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                 r"absl\.logging is not installed"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=r"megatron\.")
for _message in (r"MimoModelConfig is experimental", r"Only transformer-engine>=1\.7\.0 supports MoE experts"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning)  # (raised from import frames)
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)
logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(
    lambda record: not str(record.msg).startswith("GPTModel IS DEPRECATED"))
# (a CUDA build of torch without a visible GPU logs where it looked for CUDA)
logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: not str(record.msg).startswith("No CUDA runtime is found"))

import torch  # noqa: E402
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_fused_ce.megatron import (  # noqa: E402  (fused CE)
    FusedCEConfig,
    add_fused_ce_args,
    enable_cpu_mode,
    install_fused_output_layer,
    uninstall_fused_output_layer,
)
from megatron_fused_ce.megatron.megatron_lm import fused_ce_config_from_args  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_lm_real_pretrain_gpt import (  # noqa: E402  (shared with the real loop's script)
    build_gpt_datasets,
    loss_func,
)

_ARGS = None


def get_args():
    return _ARGS


# ------------------------------------------------------------------------------------------------
# Arguments (a few of Megatron-LM's, same names)
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None, extra_args_provider=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--sequence-parallel", action="store_true")
    add("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    add("--num-layers", type=int, default=2)
    add("--hidden-size", type=int, default=64)
    add("--num-attention-heads", type=int, default=4)
    add("--seq-length", type=int, default=64)
    add("--vocab-size", type=int, default=1000, help="tokenizer vocab (padded for the model)")
    add("--make-vocab-size-divisible-by", type=int, default=128)
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--mtp-num-layers", type=int, default=None)
    add("--mtp-loss-scaling-factor", type=float, default=0.1)
    add("--no-calculate-per-token-loss", dest="calculate_per_token_loss", action="store_false")
    add("--micro-batch-size", type=int, default=2)
    add("--global-batch-size", type=int, default=8)
    add("--train-iters", type=int, default=20)
    add("--lr", type=float, default=3e-3)
    add("--bf16", action="store_true")
    add("--use-distributed-optimizer", action="store_true")
    add("--overlap-grad-reduce", action="store_true")
    add("--overlap-param-gather", action="store_true")
    add("--seed", type=int, default=1234)
    # Megatron-LM's cross-entropy flags (see fused_ce_config_from_args)
    add("--cross-entropy-loss-fusion", action="store_true")
    add("--cross-entropy-fusion-impl", choices=["native", "te"], default="native")
    # Megatron-LM's data / tokenizer flags (without --data-path: mock sequences)
    add("--data-path", nargs="*", default=None)
    add("--split", default="100,0,0", help="train,valid,test weights (the stand-in trains only)")
    add("--data-cache-path", default=None)
    add("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false")
    add("--reset-position-ids", action="store_true")
    add("--reset-attention-mask", action="store_true")
    add("--eod-mask-loss", action="store_true")
    add("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
        action="store_false")
    add("--tokenizer-type", choices=["GPT2BPETokenizer", "HuggingFaceTokenizer"],
        default="GPT2BPETokenizer")
    add("--vocab-file", default=None)
    add("--merge-file", default=None)
    add("--tokenizer-model", default=None, help="HuggingFaceTokenizer: folder with tokenizer.json")
    add("--log-interval", type=int, default=5)
    add("--compare-unfused", action="store_true")
    # The stand-in reads --data-path only, but the shared dataset builder hands these arguments to
    # Megatron-LM's blend reader where megatron.training is installed (megatron-core >= 0.19 ships
    # it), and that reader also reads the per-split sources: they exist here, unset.
    parser.set_defaults(data_args_path=None, train_data_path=None, valid_data_path=None,
                        test_data_path=None, per_split_data_args_path=None)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# pretrain_gpt.py: model_provider, get_batch, loss_func, forward_step
# ------------------------------------------------------------------------------------------------
def padded_vocab_size(args) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-args.vocab_size // multiple) * multiple


def transformer_config(args):
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=args.bf16, calculate_per_token_loss=args.calculate_per_token_loss,
        mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(), **whole_layer_cuda_graph_scope())


def whole_layer_cuda_graph_scope() -> dict:
    """megatron-core's default CUDA-graph scope is "full", which its own check then calls deprecated
    (a warning per rank): the empty list it asks for instead means the same. (No graph is captured
    here.) The field is cuda_graph_scope up to 0.18, cuda_graph_modules from 0.19."""
    from megatron.core.transformer import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    for name in ("cuda_graph_modules", "cuda_graph_scope"):
        if name in fields and fields[name].default == "full":
            return {name: []}
    return {}


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
        get_gpt_mtp_block_spec,
    )

    args = get_args()
    config = transformer_config(args)
    te = args.transformer_impl == "transformer_engine"
    if args.sequence_parallel and not te:
        raise SystemExit("--sequence-parallel needs --transformer-impl transformer_engine "
                         "(megatron-core's local norm refuses sequence parallelism)")
    layer_spec = get_gpt_layer_with_transformer_engine_spec() if te else get_gpt_layer_local_spec()
    mtp_block_spec = None
    if args.mtp_num_layers:
        mtp_block_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=te,
                                                vp_stage=vp_stage)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=padded_vocab_size(args),
        max_sequence_length=args.seq_length, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        mtp_block_spec=mtp_block_spec, vp_stage=vp_stage)
    install_fused_output_layer(model, fused_ce_config_from_args(args))  # fused CE
    return model


def get_batch(data_iterator):
    return next(data_iterator)


def forward_step(data_iterator, model):
    batch = get_batch(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                          labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


# ------------------------------------------------------------------------------------------------
# A stand-in for Megatron-LM's pretrain(): processes, DDP, optimizer, mock data, the loop.
# ------------------------------------------------------------------------------------------------
def device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def initialize(args):
    from megatron.core import parallel_state, tensor_parallel

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        enable_cpu_mode()
        backend = "gloo"
        if args.use_distributed_optimizer:
            raise SystemExit("--use-distributed-optimizer: megatron's optimizer needs CUDA")
    if not dist.is_initialized():  # (the tests call main() in already-initialized workers)
        dist.init_process_group(backend)
        if backend == "gloo":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    torch.manual_seed(args.seed + parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    return parallel_state


def wrap_model(args, model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = model.config
    model.to(device())
    if args.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather)
    return DistributedDataParallel(config, ddp_config, model)


class MainGradAdamW:
    """CPU stand-in for megatron's optimizer (which allocates CUDA tensors): its "adam" without
    Apex / Transformer Engine is torch's AdamW, here with megatron's defaults (less its gradient
    clipping) on DDP's fp32 `main_grad`, so that CPU and GPU runs learn alike."""

    def __init__(self, model, lr):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def zero_grad(self):
        pass

    def step(self):
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        self.opt.step()
        for p in self.params:
            p.grad = None


def build_optimizer(args, model):
    if not torch.cuda.is_available():
        return MainGradAdamW(model, args.lr)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=args.bf16,
                        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                        use_distributed_optimizer=args.use_distributed_optimizer),
        [model])


class TextTokenizer:
    """What megatron-core's GPTDataset reads of Megatron-LM's tokenizer (`vocab_size`, `eod`), from
    the files of --tokenizer-type GPT2BPETokenizer (--vocab-file / --merge-file) or
    HuggingFaceTokenizer (--tokenizer-model DIR with tokenizer.json), through `tokenizers`."""

    EOD = "<|endoftext|>"

    def __init__(self, args):
        import tokenizers

        if args.tokenizer_type == "GPT2BPETokenizer":
            if not (args.vocab_file and args.merge_file):
                raise SystemExit("--tokenizer-type GPT2BPETokenizer needs --vocab-file and "
                                 "--merge-file")
            self._tokenizer = tokenizers.ByteLevelBPETokenizer(args.vocab_file, args.merge_file)
        else:
            if not args.tokenizer_model:
                raise SystemExit("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
            self._tokenizer = tokenizers.Tokenizer.from_file(
                os.path.join(args.tokenizer_model, "tokenizer.json"))
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.eod = self._tokenizer.token_to_id(self.EOD)
        # (part of the dataset's cache key, as for megatron's tokenizers)
        self.unique_identifiers = {"class": args.tokenizer_type, "vocab_file": args.vocab_file,
                                   "merge_file": args.merge_file,
                                   "tokenizer_model": args.tokenizer_model}
        if self.eod is None:
            raise SystemExit(f"the tokenizer has no {self.EOD} token")

    def tokenize(self, text):
        return self._tokenizer.encode(text).ids


def text_data(args, parallel_state):
    """megatron-core's GPTDataset over --data-path (the real script's builder); None without it."""
    if not args.data_path:
        return None
    tokenizer = TextTokenizer(args)
    args.vocab_size = tokenizer.vocab_size  # the model's vocab (padded) follows the tokenizer
    train, _, _ = build_gpt_datasets(args, tokenizer,
                                     [args.train_iters * args.global_batch_size, 0, 0],
                                     lambda: True)
    return train


def text_batches(args, parallel_state, iteration, dataset):
    """This data-parallel rank's micro-batches of step `iteration`: consecutive samples of the
    dataset, as Megatron-LM's pretraining sampler hands them out."""
    dp = parallel_state.get_data_parallel_world_size()
    rows = args.global_batch_size // dp
    first = iteration * args.global_batch_size + parallel_state.get_data_parallel_rank() * rows
    batches = []
    for begin in range(0, rows, args.micro_batch_size):
        samples = [dataset[first + begin + j] for j in range(min(args.micro_batch_size, rows - begin))]
        batch = {key: torch.stack([torch.as_tensor(sample[key]) for sample in samples])
                 for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
                 if key in samples[0]}
        if "attention_mask" not in batch:  # --no-create-attention-mask-in-dataloader
            batch["attention_mask"] = torch.triu(torch.ones(
                1, 1, args.seq_length, args.seq_length, dtype=torch.bool), 1)
        batches.append({k: v.to(device()) for k, v in batch.items()})
    return batches


# Mock tokens count up by one from a random start, wrapping within the first MOCK_IDS ids: a
# pattern the default model learns within its 20 iterations (lm loss 6.9 -> about 3). Progressions
# over the whole vocab with strides 1-8 kept it near ln(vocab) = 6.9.
MOCK_IDS = 128


def mock_batches(args, parallel_state, iteration):
    """Counting sequences (learnable, see MOCK_IDS), different per data-parallel rank and step."""
    dp = parallel_state.get_data_parallel_world_size()
    rows = args.global_batch_size // dp
    ids = min(MOCK_IDS, args.vocab_size)
    g = torch.Generator().manual_seed(args.seed * 1000003 + iteration * 1009
                                      + parallel_state.get_data_parallel_rank())
    start = torch.randint(0, ids, (rows, 1), generator=g)
    seq = (start + torch.arange(args.seq_length + 1)) % ids
    mask = torch.triu(torch.ones(1, 1, args.seq_length, args.seq_length, dtype=torch.bool), 1)
    batches = []
    for begin in range(0, rows, args.micro_batch_size):
        tokens = seq[begin:begin + args.micro_batch_size]
        b = tokens.shape[0]
        batches.append({k: v.to(device()) for k, v in {
            "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, args.seq_length),
            "position_ids": torch.arange(args.seq_length).unsqueeze(0).expand(b, -1),
            "attention_mask": mask}.items()})
    return batches


def run(model, batches, args, forward_only=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # the backward on this thread (docs/performance.md, "RL passes"; examples/example_common.run_batches)
    with torch.autograd.set_multithreading_enabled(False):
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=forward_only)


def reduce_losses(args, metrics, parallel_state):
    """{'lm loss': mean over tokens, 'mtp_k loss': ...} of the step (last stage; {} elsewhere),
    the MTP losses through megatron's own MTPLossLoggingHelper."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    out = {}
    if metrics:
        total = torch.stack([m["lm loss"] for m in metrics]).sum(0)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        out["lm loss"] = (total[0] / total[1]).item()
    if args.mtp_num_layers:
        MTPLossLoggingHelper.track_mtp_metrics(1.0 / len(metrics or [None]), 0, None,
                                               total_loss_dict=out)
    return {k: float(v) for k, v in out.items()}


def compare_unfused(args, model, batches, parallel_state):
    """The first batch, forward only, with and without the fused output layer."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    results = {}
    with torch.no_grad():
        for fused in (True, False):
            if fused:
                install_fused_output_layer(model, FusedCEConfig.from_megatron_cfg(
                    {"use_linear_ce_fusion_loss": True,
                     "linear_ce_fusion_chunk_size": args.linear_ce_fusion_chunk_size}))
            else:
                uninstall_fused_output_layer(model)
            MTPLossLoggingHelper.tracker.clear()
            results[fused] = reduce_losses(args, run(model, batches, args, forward_only=True),
                                           parallel_state)
    MTPLossLoggingHelper.tracker.clear()
    install_fused_output_layer(model, fused_ce_config_from_args(args))  # as configured
    if not results[True]:
        return None
    return "first batch: " + "; ".join(
        f"{k} fused {results[True][k]:.6f} vs unfused {results[False][k]:.6f}, "
        f"|difference| {abs(results[True][k] - results[False][k]):.2e}" for k in results[False])


def main(argv=None):
    global _ARGS
    _ARGS = args = parse_args(argv, extra_args_provider=add_fused_ce_args)  # fused CE: the flags
    parallel_state = initialize(args)
    dataset = text_data(args, parallel_state)
    model = model_provider(pre_process=parallel_state.is_pipeline_first_stage(),
                           post_process=parallel_state.is_pipeline_last_stage())
    model = wrap_model(args, model)
    config = model.config
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    if args.overlap_grad_reduce:
        config.grad_sync_func = model.start_grad_sync
    optimizer = build_optimizer(args, model)
    reporter = dist.get_rank() == dist.get_world_size() - 1
    if reporter:
        fused_ce_config_from_args(args, log=print)  # names Megatron-LM loss flags it supersedes
        print(f"world {dist.get_world_size()}: TP {args.tensor_model_parallel_size} x PP "
              f"{args.pipeline_model_parallel_size} x DP "
              f"{parallel_state.get_data_parallel_world_size()} on "
              f"{'CUDA' if torch.cuda.is_available() else 'CPU'}; MTP depths "
              f"{args.mtp_num_layers or 0}; fused linear CE: "
              f"{'on' if args.use_linear_ce_fusion_loss else 'off'}; data: "
              f"{'GPTDataset ' + ' '.join(args.data_path) if dataset is not None else 'mock'}",
              flush=True)
    for iteration in range(args.train_iters):
        batches = (mock_batches(args, parallel_state, iteration) if dataset is None
                   else text_batches(args, parallel_state, iteration, dataset))
        if iteration == 0 and args.compare_unfused:
            line = compare_unfused(args, model, batches, parallel_state)
            if reporter and line:
                print(line, flush=True)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = reduce_losses(args, run(model, batches, args), parallel_state)
        optimizer.step()
        if reporter and (iteration % args.log_interval == 0 or iteration == args.train_iters - 1):
            print(f"iteration {iteration + 1}/{args.train_iters}: "
                  + " | ".join(f"{k} {v:.4f}" for k, v in losses.items()), flush=True)
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
