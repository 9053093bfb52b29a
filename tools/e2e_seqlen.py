"""End-to-end on GPUs: a Megatron-Core GPT with a 128k vocab trained with the fused loss vs the
unfused one (and Megatron's own loss) -- tokens/s and the longest sequence length that fits, for each.

    torchrun --nproc_per_node 1 tools/e2e_seqlen.py                  # defaults below, ~1.3B params
    torchrun --nproc_per_node 1 tools/e2e_seqlen.py --attention sdpa --seqs 8192,16384,24576,32768,49152,65536,98304,131072
    torchrun --nproc_per_node 4 tools/e2e_seqlen.py --tp 4           # TP=4 + sequence parallelism
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tools/e2e_seqlen.py --tp 2 --hidden 64 --layers 2 \
        --heads 4 --vocab 1000 --seqs 64,128 --steps 2 --modes fused,unfused,megatron \
        --device-memory-limit-gb 0                                   # CPU smoke test (gloo)

Model: megatron-core `GPTModel`, RoPE, untied embeddings, bf16 weights in `Float16Module` (fp32
on CPU), megatron DDP with fp32 `main_grad` (as examples/example_common.py builds it), micro-batch
1, activation recomputation (`--recompute full|selective|none`; full = uniform, one layer per
checkpoint). Layer spec (`--transformer-impl`): Transformer Engine's where it is installed (on
CUDA), megatron-core's local spec otherwise. Tensor parallelism: `--tp N` with N processes (one
per GPU; every rank sees the same tokens), sequence parallelism on by default at TP > 1
(`--no-sequence-parallel` turns it off). Under the local spec without Apex, megatron's torch-norm
wrapper refuses sequence parallelism; the norms are then torch LayerNorms whose parameters are
marked for the TP all-reduce of their gradients (what the Apex / TE norms do).

Modes (`--modes`, default fused,unfused; run one after the other on the same model):
  fused    megatron_cfg.use_linear_ce_fusion_loss = true: the last stage returns hidden states and
           `sft_loss_func` computes the loss chunk by chunk (`--chunk-size auto`: the op's CUDA
           auto size, >= 4096 rows), never the [s, V/TP] logits.
  unfused  use_linear_ce_fusion_loss = false: megatron's [b, s, V/TP] logits, then the same
           `sft_loss_func` (the package's logits path, `vocab_parallel_logprobs`).
  megatron (optional) megatron's own loss on the materialized logits: `model(..., labels=labels)` ->
           GPTModel's `compute_language_model_loss`: `vocab_parallel_cross_entropy`
           (`--megatron-ce vocab_parallel`, the default) or, with `cross_entropy_loss_fusion`,
           `fused_vocab_parallel_cross_entropy` (`--megatron-ce native`) or Transformer Engine's
           (`--megatron-ce te`). Its softmax runs over the padded vocab, so its loss differs from
           the other two by about log(padded / true vocab) at initialization.

For each mode and each sequence length, in increasing order: `--steps` forward-backward steps on
mock tokens through `get_forward_backward_func` (`--sgd-lr > 0` adds a plain SGD update from
`main_grad`; the default skips the optimizer: what is measured is forward+backward time and
memory). tokens/s = tokens per step / median step time after the first (rank 0's clock); peak =
`torch.cuda.max_memory_allocated` (reset per length, max over ranks). With `--sgd-lr`, the weights
are restored before every length, so that the step-0 losses of the modes stay comparable. A mode
stops at its first CUDA OOM (under TP, an OOM on some ranks only leaves the others waiting in a
collective: the run then ends at torchrun's timeout).

Attention (`--attention`): `local` (the local spec's default) is megatron's `DotProductAttention`,
which materializes the [b, heads/TP, s, s] scores (bf16, plus fp32 softmax copies), so attention,
not the logits, may bound the longest sequence for every mode; the estimates printed before the
run show both. `te` (the TE spec's default) is Transformer Engine's fused attention. `sdpa` swaps
only the core attention for `torch.nn.functional.scaled_dot_product_attention` (causal,
flash/memory-efficient kernels: O(s) memory), so that the logits are what differs.

Writes `e2e_seqlen.json` and `e2e_seqlen.md` to `--out` (default `$OUT`, else `./e2e_out`; rank 0).
`--simulate-oom-tokens N` raises `torch.cuda.OutOfMemoryError` in the loss of any step with more
than N tokens (tests the OOM path on CPU).
"""

from __future__ import annotations

import os

# Less fragmentation between lengths (applies to both modes alike); set before torch/CUDA init.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

from example_common import (  # noqa: E402
    LogprobsPostProcessorFor,
    device,
    init_distributed,
    padded_vocab_size,
    run_batches,
    shutdown,
)

from megatron_fused_ce.megatron import (  # noqa: E402
    FusedCEConfig,
    install_fused_output_layer,
    sft_loss_func,
    uninstall_fused_output_layer,
)

GiB = 2 ** 30
OOM = torch.cuda.OutOfMemoryError
MEGATRON_CE = {"vocab_parallel": "`vocab_parallel_cross_entropy`",
               "native": "`fused_vocab_parallel_cross_entropy`",
               "te": "Transformer Engine's `parallel_cross_entropy`"}


def log(*parts):
    """Rank 0 prints (every rank runs the same steps)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


def transformer_engine_available():
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 (ImportError, or a TE build that fails to load)
        return False
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=None, help="ffn hidden size (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=128256, help="tokenizer vocab (padded to x128)")
    p.add_argument("--seqs", default="4096,8192,16384,24576,32768,49152,65536",
                   help="comma-separated sequence lengths (run in increasing order)")
    p.add_argument("--steps", type=int, default=3, help="forward-backward steps per length")
    p.add_argument("--modes", default="fused,unfused",
                   help="comma-separated, from fused / unfused / megatron, run in this order")
    p.add_argument("--megatron-ce", choices=["vocab_parallel", "native", "te"], default="vocab_parallel",
                   help="megatron mode's loss: vocab_parallel_cross_entropy, or with "
                        "cross_entropy_loss_fusion megatron's fused (native) or TE's")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size = number of processes (torchrun --nproc_per_node)")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when --tp > 1)")
    p.add_argument("--transformer-impl", choices=["auto", "local", "transformer_engine"], default="auto",
                   help="layer spec: auto = Transformer Engine's where it imports (CUDA), else local")
    p.add_argument("--recompute", choices=["full", "selective", "none"], default="full")
    p.add_argument("--attention", choices=["local", "te", "sdpa"], default=None,
                   help="core attention: megatron's DotProductAttention (s x s scores; the local "
                        "spec's default), TE's (the TE spec's default) or torch SDPA")
    p.add_argument("--chunk-size", default="auto",
                   help="fused chunk rows: 'auto' (the op's size for the device) or an int")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--sgd-lr", type=float, default=0.0,
                   help="> 0: plain SGD update from main_grad after each step (default: no update)")
    p.add_argument("--device-memory-limit-gb", type=float, default=79.0,
                   help="cap this process's CUDA allocations at this many GiB (an H100's ~79 GiB by "
                        "default, so that a run on a larger GPU stays comparable); 0 = no cap")
    p.add_argument("--simulate-oom-tokens", type=int, default=0,
                   help="raise torch.cuda.OutOfMemoryError for steps with more tokens (CPU tests)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.environ.get("OUT") or "./e2e_out")
    args = p.parse_args(argv)
    args.seq_list = sorted({int(s) for s in args.seqs.split(",") if s.strip()})
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.mode_list:
        if m not in ("fused", "unfused", "megatron"):
            p.error(f"unknown mode {m!r}")
    if args.chunk_size != "auto" and not args.chunk_size.isdigit():
        p.error("--chunk-size must be 'auto' or a positive int")
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if args.sequence_parallel is None:
        args.sequence_parallel = args.tp > 1
    args.sequence_parallel = args.sequence_parallel and args.tp > 1
    if args.sequence_parallel and any(s % args.tp for s in args.seq_list):
        p.error(f"sequence parallelism splits every sequence over the {args.tp} TP ranks: each "
                f"length in --seqs must be a multiple of {args.tp}")
    if args.heads % args.tp:
        p.error(f"--heads {args.heads} must be a multiple of --tp {args.tp}")
    if args.transformer_impl == "auto":
        args.transformer_impl = ("transformer_engine" if torch.cuda.is_available()
                                 and transformer_engine_available() else "local")
    default_attention = "te" if args.transformer_impl == "transformer_engine" else "local"
    args.attention = args.attention or default_attention
    if args.attention != "sdpa" and args.attention != default_attention:
        p.error(f"--attention {args.attention} needs the other layer spec "
                f"(--transformer-impl {args.transformer_impl}: {default_attention} or sdpa)")
    return args


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
def sdpa_core_attention_class():
    """A drop-in for megatron's DotProductAttention (same constructor keywords, same forward
    layout: q/k/v [s, b, heads, dim] -> [s, b, heads*dim]) running torch's fused causal SDPA."""
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None,
                     attention_dropout=None, softmax_scale=None, **unused):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None, **unused):
            assert packed_seq_params is None and attention_bias is None
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
            if k.shape[1] != q.shape[1]:  # grouped-query attention
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale,
                dropout_p=self.dropout if self.training else 0.0)
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPACoreAttention


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm under sequence parallelism (the local spec without Apex): each TP rank
    normalizes its own part of the sequence, so the norm's weight gradients differ per rank;
    marked `sequence_parallel`, they are all-reduced over TP by `finalize_model_grads`, as those
    of the Apex / TE norms are. (megatron's torch-norm wrapper refuses sequence parallelism.)"""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def layer_spec(args):
    """The layer spec (TE's or local), its norms SP-capable and its core attention swapped as asked."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if args.transformer_impl == "transformer_engine":
        spec = copy.deepcopy(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec())
    else:
        spec = copy.deepcopy(gpt_layer_specs.get_gpt_layer_local_spec())
    if args.attention == "sdpa":
        attn_spec = spec.submodules.self_attention
        attn_spec.submodules = dataclasses.replace(attn_spec.submodules,
                                                   core_attention=sdpa_core_attention_class())
    if not (args.sequence_parallel and spec.submodules.input_layernorm is WrappedTorchNorm):
        return spec
    sub = dataclasses.replace(spec.submodules, input_layernorm=SequenceParallelLayerNorm,
                              pre_mlp_layernorm=SequenceParallelLayerNorm)
    layer = ModuleSpec(module=spec.module, submodules=sub)
    return TransformerBlockSubmodules(layer_specs=[layer] * args.layers,
                                      layer_norm=SequenceParallelLayerNorm)


def build_gpt(args, dtype):
    """Like example_common.build_model (GPTModel, Float16Module for bf16, megatron DDP with fp32
    main_grad), plus recomputation, RoPE, untied embeddings, the layer spec and attention choice,
    and the megatron mode's loss. Built unfused; the fused mode installs the fused output layer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    recompute = {}
    if args.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    elif args.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    megatron_ce = {}
    if args.megatron_ce != "vocab_parallel":
        megatron_ce = dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=args.megatron_ce)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=1,
        sequence_parallel=args.sequence_parallel,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(), **recompute, **megatron_ce)
    gpt = GPTModel(
        config, layer_spec(args), vocab_size=padded_vocab_size(args.vocab, 128, args.tp),
        max_sequence_length=max(args.seq_list), pre_process=True, post_process=True,
        share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module

        gpt = Float16Module(config, gpt)
    gpt.to(device())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
    config.finalize_model_grads_func = finalize_model_grads
    return model, config


# ------------------------------------------------------------------------------------------------
# One length, one mode
# ------------------------------------------------------------------------------------------------
def make_batch(seq, vocab, seed, attention):
    gen = torch.Generator().manual_seed(seed * 1000003 + seq)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=gen)
    dev = device()
    batch = {"tokens": tokens[:, :-1].to(dev), "labels": tokens[:, 1:].to(dev),
             "loss_mask": torch.ones(1, seq, device=dev),
             "position_ids": torch.arange(seq, device=dev).unsqueeze(0)}
    if attention == "local":  # [1, 1, s, s], True = masked; built on the device (s^2 bytes)
        batch["attention_mask"] = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=dev).triu_(1)
    else:  # TE's attention and SDPA are causal by their mask type: no [s, s] mask
        batch["attention_mask"] = None
    return batch


def megatron_labels_step(model, batch, seq, loss_func):
    """One fwd+bwd with megatron's own loss: model(..., labels=labels) -> [b, s] per-token CE."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        b = next(data_iterator)
        out = chunk(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return out, loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
        num_microbatches=1, seq_length=seq, micro_batch_size=1, forward_only=False)


def per_token_loss_func(mask):
    def loss_func(per_token):
        loss_sum = (per_token.float() * mask).sum()
        count = (mask != 0).sum().to(torch.int)
        return loss_sum, count, {"lm loss": torch.stack([loss_sum.detach(), count.float()])}

    return loss_func


def clear_megatron_buffers(parallel_state):
    """megatron's global memory buffer keeps the largest attention-score buffer [b*heads, s, s]
    allocated across calls: drop it between lengths and modes (it is regrown on demand)."""
    try:
        parallel_state.get_global_memory_buffer().buffer.clear()
    except Exception:  # noqa: BLE001 (other megatron versions: nothing to clear)
        pass


def free_memory(model, parallel_state):
    model.zero_grad_buffer()
    for p in model.parameters():
        p.grad = None
    clear_megatron_buffers(parallel_state)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_length(model, mode, seq, args, cfg, parallel_state):
    """`args.steps` fwd+bwd steps at length `seq` -> result dict (raises OutOfMemoryError)."""
    v_local = padded_vocab_size(args.vocab, 128, args.tp) // args.tp
    chunk = None
    if mode == "fused":
        if args.chunk_size == "auto":
            from megatron_fused_ce.ops.api import auto_chunk_size

            chunk = auto_chunk_size(seq, v_local, device())
        else:
            chunk = int(args.chunk_size)
        fused = FusedCEConfig(enabled=True, chunk_size=chunk)
        install_fused_output_layer(model, fused)
    else:
        fused = FusedCEConfig(enabled=False)
        uninstall_fused_output_layer(model)
    post = LogprobsPostProcessorFor(cfg, fused)
    if args.initial_weights is not None:  # (--sgd-lr) every length starts from the same weights
        with torch.no_grad():
            for p, saved in zip(model.parameters(), args.initial_weights):
                p.copy_(saved)
    batch = make_batch(seq, args.vocab, args.seed, args.attention)

    def check_simulated_oom():
        if args.simulate_oom_tokens and seq > args.simulate_oom_tokens:
            raise OOM(f"simulated: {seq} tokens > --simulate-oom-tokens {args.simulate_oom_tokens}")

    def make_loss_func(chunk_model, b):
        inner = sft_loss_func(post, chunk_model, b["labels"], b["loss_mask"])

        def loss_func(output_tensor):
            check_simulated_oom()  # raised with the forward graph alive, as a real OOM would be
            return inner(output_tensor)

        return loss_func

    times, losses = [], []
    for step in range(args.steps):
        model.zero_grad_buffer()
        sync()
        t0 = time.perf_counter()
        if mode == "megatron":
            inner = per_token_loss_func(batch["loss_mask"])

            def loss_func(out, inner=inner):
                check_simulated_oom()
                return inner(out)

            metrics = megatron_labels_step(model, batch, seq, loss_func)
        else:
            metrics = run_batches(model, [batch], make_loss_func)
        if args.sgd_lr > 0:
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(p.main_grad.to(p.dtype), alpha=-args.sgd_lr)
        sync()
        times.append(time.perf_counter() - t0)
        pair = metrics[0]["lm loss"]
        losses.append((pair[0] / pair[1]).item())
        log(f"    {mode:8s} seq {seq:>7d} step {step}: {times[-1]:8.3f} s, loss {losses[-1]:.5f}")
    timed = times[1:] if len(times) > 1 else times
    step_s = statistics.median(timed)
    return {"ok": True, "step_s": step_s, "tokens_per_s": seq / step_s, "step_times_s": times,
            "losses": losses, "chunk_size": chunk, "peak_gib": peak_gib()}


def peak_gib():
    """The largest peak over the ranks (all of them run the same shapes)."""
    if torch.cuda.is_available():
        peak = torch.tensor([torch.cuda.max_memory_allocated()], dtype=torch.float64, device=device())
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak.item() / GiB
    return None  # (peak RSS cannot be reset per length on CPU)


def is_oom(exc):
    """A CUDA out-of-memory error (the allocator's, or a library's failed workspace allocation)."""
    text = str(exc)
    return isinstance(exc, OOM) or "out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text


def run_mode(model, mode, args, cfg, parallel_state):
    results = {}
    for seq in args.seq_list:
        free_memory(model, parallel_state)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        log(f"  [{mode}] seq {seq} ...")
        t0 = time.perf_counter()
        error = None
        try:
            results[seq] = run_length(model, mode, seq, args, cfg, parallel_state)
        except (OOM, RuntimeError) as exc:  # the traceback (and the graph it holds) dies with `exc`
            if not is_oom(exc):
                raise
            error = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "CUDA OOM"
        if error is not None:
            peak = peak_gib()
            free_memory(model, parallel_state)
            results[seq] = {"ok": False, "error": error, "peak_gib_before_oom": peak}
            log(f"  [{mode}] seq {seq}: OOM after {time.perf_counter() - t0:.1f} s "
                f"(peak before it {fmt_gib(peak)}): {error}")
            break
        r = results[seq]
        log(f"  [{mode}] seq {seq}: {r['tokens_per_s']:,.0f} tok/s, median step {r['step_s']:.3f} s, "
            f"peak {fmt_gib(r['peak_gib'])}"
            + (f", chunk {r['chunk_size']} rows" if r["chunk_size"] else "")
            + f" ({time.perf_counter() - t0:.1f} s)")
    free_memory(model, parallel_state)
    return results


# ------------------------------------------------------------------------------------------------
# Estimates and report
# ------------------------------------------------------------------------------------------------
def fmt_gib(x):
    return "n/a" if x is None else f"{x:.2f} GiB"


def estimates(args, seq, vp):
    """Bytes per rank of the tensors that grow with s (one micro-batch): logits and attention
    scores are split over TP, the layer checkpoints too under sequence parallelism."""
    tp, heads = args.tp, args.heads // args.tp
    local = args.attention == "local"
    return {
        "logits_bf16_gib": seq * vp // tp * 2 / GiB,  # the [s, V/TP] output of the output layer
        "logits_fp32_gib": seq * vp // tp * 4 / GiB,  # one fp32 copy (softmax math); the unfused path holds several
        "attn_scores_bf16_gib_per_layer": heads * seq * seq * 2 / GiB if local else 0.0,
        "attn_scores_fp32_gib_per_layer": heads * seq * seq * 4 / GiB if local else 0.0,
        "layer_checkpoints_gib": (args.layers * seq * args.hidden * 2 / GiB
                                  / (tp if args.sequence_parallel else 1)),
    }


def summarize(results, args):
    modes = args.mode_list
    fits = {m: max([s for s, r in results[m].items() if r["ok"]], default=0) for m in modes}
    first_oom = {m: next((s for s, r in sorted(results[m].items()) if not r["ok"]), None)
                 for m in modes}
    summary = {"longest_fitting_seq": fits, "first_oom_seq": first_oom, "comparisons": {}}
    if "fused" in modes:
        for other in modes:
            if other == "fused":
                continue
            both = [s for s in args.seq_list if results["fused"].get(s, {}).get("ok")
                    and results[other].get(s, {}).get("ok")]
            comp = {"seq_ratio": (fits["fused"] / fits[other]) if fits[other] else None,
                    # fused never OOMed: its true limit is higher; the other never OOMed either:
                    # neither limit was reached, the ratio says nothing
                    "seq_ratio_is_lower_bound": first_oom["fused"] is None and first_oom[other] is not None,
                    "seq_ratio_undetermined": first_oom["fused"] is None and first_oom[other] is None,
                    "largest_common_seq": max(both) if both else None}
            if both:
                s = max(both)
                comp["tokens_per_s_ratio_at_largest_common"] = (
                    results["fused"][s]["tokens_per_s"] / results[other][s]["tokens_per_s"])
                comp["max_abs_loss_diff_first_step"] = max(
                    abs(results["fused"][t]["losses"][0] - results[other][t]["losses"][0]) for t in both)
            summary["comparisons"][f"fused_vs_{other}"] = comp
    return summary


def markdown(meta, results, summary, args):
    modes = args.mode_list
    lines = [f"# Fused vs unfused loss: {meta['device']}", "",
             f"Model: GPTModel ({meta['spec']} spec, attention `{args.attention}`), {meta['parallel']}, "
             f"{args.layers} layers, hidden "
             f"{args.hidden}, {args.heads} heads, vocab {args.vocab} (padded {meta['padded_vocab']}), "
             f"{meta['params']:,} params ({meta['params_b']:.3f} B), {meta['dtype']}, untied embeddings, micro-batch 1, "
             f"recompute `{args.recompute}`, {args.steps} fwd+bwd steps per length "
             f"({'SGD lr ' + str(args.sgd_lr) if args.sgd_lr > 0 else 'no optimizer step'}), "
             f"memory cap {meta['memory_cap']}"
             + (f"; megatron mode: {MEGATRON_CE[args.megatron_ce]}" if "megatron" in modes else "") + ".", "",
             "| seq | " + " | ".join(f"{m} tok/s | {m} peak" for m in modes)
             + " | dense logits per rank bf16 / fp32 | attn scores per layer and rank bf16 / fp32 |",
             "|---:|" + "---:|---:|" * len(modes) + "---:|---:|"]
    for seq in args.seq_list:
        cells = []
        for m in modes:
            r = results[m].get(seq)
            if r is None:
                cells += ["-", "-"]
            elif r["ok"]:
                cells += [f"{r['tokens_per_s']:,.0f}", fmt_gib(r["peak_gib"])]
            else:
                cells += ["OOM", "OOM"]
        e = meta["estimates"][str(seq)]
        attn = (f"{e['attn_scores_bf16_gib_per_layer']:.1f} / {e['attn_scores_fp32_gib_per_layer']:.1f} GiB"
                if args.attention == "local" else f"O(s) ({args.attention})")
        lines.append(f"| {seq} | " + " | ".join(cells)
                     + f" | {e['logits_bf16_gib']:.1f} / {e['logits_fp32_gib']:.1f} GiB | {attn} |")
    lines.append("")
    for m in modes:
        fit, oom = summary["longest_fitting_seq"][m], summary["first_oom_seq"][m]
        lines.append(f"- {m}: longest fitting sequence {fit or 'none'}"
                     + (f" (OOM at {oom})" if oom else " (no OOM up to the largest length tried)"))
    for name, c in summary["comparisons"].items():
        ratio = c["seq_ratio"]
        ratio_s = "n/a" if ratio is None else f"{ratio:.2f}x"
        if c["seq_ratio_is_lower_bound"]:
            ratio_s += " (a lower bound: fused never ran out of memory; try longer --seqs)"
        elif c["seq_ratio_undetermined"]:
            ratio_s += " (undetermined: neither mode ran out of memory up to the largest length)"
        lines.append(f"- {name}: sequence-length ratio {ratio_s}")
        if c.get("largest_common_seq"):
            lines.append(f"- {name}: tokens/s ratio at {c['largest_common_seq']} (largest both fit) "
                         f"{c['tokens_per_s_ratio_at_largest_common']:.3f}; max |loss difference| at "
                         f"step 0 over common lengths {c['max_abs_loss_diff_first_step']:.3e}")
    if args.attention == "local":
        lines += ["", "Note: megatron's local DotProductAttention materializes the [heads/TP, s, s] "
                  "scores (bf16 buffer + fp32 softmax copies, per layer being run); when those "
                  "exceed the logits, attention bounds the longest sequence of every mode. "
                  "`--attention sdpa` removes that bound."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    cfg = {"megatron_cfg": {"tensor_model_parallel_size": args.tp, "pipeline_model_parallel_size": 1,
                            "context_parallel_size": 1},
           "model": {"vocab_size": args.vocab}}
    parallel_state = init_distributed(cfg, args.seed)
    if dist.get_world_size() != args.tp:
        raise SystemExit(f"run with torchrun --nproc_per_node {args.tp} (one process per TP rank, "
                         f"no data parallelism): {dist.get_world_size()} processes were started")
    cuda = torch.cuda.is_available()
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    memory_cap = "none"
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        dev_name = f"{props.name}, {props.total_memory / GiB:.1f} GiB" + (f" x {args.tp}" if args.tp > 1 else "")
        if args.device_memory_limit_gb > 0:
            fraction = min(1.0, args.device_memory_limit_gb * GiB / props.total_memory)
            torch.cuda.set_per_process_memory_fraction(fraction)
            memory_cap = f"{fraction * props.total_memory / GiB:.1f} GiB"
    else:
        dev_name = (f"CPU ({platform.processor() or platform.machine()}, {args.tp} process"
                    f"{'es' if args.tp > 1 else ''} x {torch.get_num_threads()} threads)")
    import megatron.core

    t_build = time.perf_counter()
    model, _ = build_gpt(args, dtype)
    params = sum(p.numel() for p in model.parameters())
    args.initial_weights = ([p.detach().to("cpu", copy=True) for p in model.parameters()]
                            if args.sgd_lr > 0 else None)
    vp = padded_vocab_size(args.vocab, 128, args.tp)
    parallel = f"TP {args.tp}" + (" + sequence parallel" if args.sequence_parallel else "")
    spec = "Transformer Engine" if args.transformer_impl == "transformer_engine" else "local"
    log(f"device: {dev_name}; torch {torch.__version__}, megatron-core "
        f"{getattr(megatron.core, '__version__', '?')}; memory cap {memory_cap}; "
        f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}")
    log(f"model: {params:,} params on rank 0 ({params / 1e9:.3f} B; {parallel}, {spec} spec, "
        f"{args.layers} layers, hidden {args.hidden}, heads {args.heads}, vocab {args.vocab} -> {vp}), "
        f"{dtype}, attention {args.attention}, recompute "
        f"{args.recompute}; built in {time.perf_counter() - t_build:.1f} s"
        + (f"; {torch.cuda.memory_allocated() / GiB:.2f} GiB allocated (weights + fp32 main_grad)"
           if cuda else ""))
    est = {str(s): estimates(args, s, vp) for s in args.seq_list}
    log("estimates per length and rank: dense logits [s, V/TP] bf16 / one fp32 copy | attention "
        "scores [heads/TP, s, s] per layer bf16 / fp32 | layer-input checkpoints")
    for s in args.seq_list:
        e = est[str(s)]
        attn = (f"{e['attn_scores_bf16_gib_per_layer']:7.2f} / {e['attn_scores_fp32_gib_per_layer']:7.2f} GiB"
                if args.attention == "local" else f"  O(s) ({args.attention})")
        log(f"  seq {s:>7d}: logits {e['logits_bf16_gib']:7.2f} / {e['logits_fp32_gib']:7.2f} GiB | "
            f"attn {attn} | checkpoints {e['layer_checkpoints_gib']:.2f} GiB")

    results = {}
    t_all = time.perf_counter()
    for mode in args.mode_list:
        log(f"mode {mode}:")
        t0 = time.perf_counter()
        results[mode] = run_mode(model, mode, args, cfg, parallel_state)
        log(f"mode {mode} done in {time.perf_counter() - t0:.1f} s")
    uninstall_fused_output_layer(model)
    summary = summarize(results, args)
    meta = {"device": dev_name, "torch": torch.__version__,
            "megatron_core": getattr(megatron.core, "__version__", "?"), "dtype": str(dtype),
            "params": params, "params_b": params / 1e9, "padded_vocab": vp, "memory_cap": memory_cap,
            "tp": args.tp, "sequence_parallel": args.sequence_parallel, "parallel": parallel,
            "spec": spec, "megatron_ce": args.megatron_ce,
            "estimates": est,
            "args": {k: v for k, v in vars(args).items() if k != "initial_weights"},
            "total_s": time.perf_counter() - t_all}
    md = markdown(meta, results, summary, args)
    log("")
    log(md)
    report = {"meta": meta, "summary": summary,
              "results": {m: {str(s): r for s, r in rs.items()} for m, rs in results.items()}}
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "e2e_seqlen.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "e2e_seqlen.md"), "w") as f:
            f.write(md)
    log(f"wrote {args.out}/e2e_seqlen.json and e2e_seqlen.md (runs took {meta['total_s']:.1f} s)")
    shutdown()
    return report


if __name__ == "__main__":
    main()
