"""The Megatron CPU test harness, shared by the Megatron test files and the NCCL suites.

A tiny GPTModel (local spec, fp32, no dropout) on CPU/gloo, wrapped in Megatron's DDP, driven by
`get_forward_backward_func` exactly like a training job: micro-batches, 1F1B or interleaved
pipelining, `finalize_model_grads` (DP all-reduce, tied-embedding all-reduce, division by the
token count of `calculate_per_token_loss`). With `Setup.cp > 1`, context parallelism: megatron's
local attention refuses CP, so the layers use `GatheredKVAttention` (exact under CP: every rank
attends over the all-gathered keys/values in original positions); a CP=1 reference sets
`gathered_attention=True` to run the very same model. `cp_batches` cuts micro-batches as megatron's
`get_batch_on_this_cp_rank` does.

Also the tolerances and loss settings of the fused-vs-unfused comparisons, Megatron-LM's loss_func,
and the data-parallel batches and log-prob stand-ins of the loss-func tests.
"""

from __future__ import annotations

import contextlib
import functools
import dataclasses
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# Import megatron-core once, here in the pytest process: the forked workers inherit it (a worker
# importing it itself costs ~5 s).
import megatron.core.distributed  # noqa: F401
import megatron.core.models.gpt  # noqa: F401
import megatron.core.pipeline_parallel  # noqa: F401

from megatron_fused_ce.losses import GRPOConfig
from megatron_fused_ce.megatron import enable_cpu_mode
from megatron_fused_ce.testing import with_context_parallel_attention

TRUE_VOCAB = 100  # the tokenizer's vocab; the model's is padded to PADDED_VOCAB
PADDED_VOCAB = 128
HIDDEN = 32
HEADS = 4
SEQ = 16
MBS = 2  # micro-batch size (rows)

# Fused vs unfused, fp32 (the fused path sums the softmax over chunks and vocab shards in another
# order): losses and log-probs relative, each parameter's gradient relative to its largest entry.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
# bf16 (Float16Module): the two paths round the bf16 logits differently.
LOSS_RTOL_BF16 = 1e-3
GRAD_RTOL_BF16 = 2e-2

GRPO = GRPOConfig(loss_type="dapo", beta=0.05, is_correction="token_truncate", is_clip_max=1.05)
DPO = dict(beta=0.5, sft_weight=0.3)


@dataclass(frozen=True)
class Setup:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vp: Optional[int] = None
    tied: bool = False
    sp: bool = False
    layers: int = 2
    chunk_size: int = 8  # small, so that chunking is exercised on 32-token micro-batches
    bf16: bool = False  # bf16 parameters, wrapped in megatron's Float16Module
    grad_acc_fusion: bool = False  # fused path adds dW straight into main_grad
    mtp_layers: int = 0  # multi-token prediction depths (on the last stage)
    mtp_scale: float = 0.3  # mtp_loss_scaling_factor
    mtp_detach_heads: bool = False  # megatron-core >= 0.19: MTP losses do not train the output weight
    per_token_loss: bool = True  # calculate_per_token_loss
    # DDP for the distributed optimizer with overlap_param_gather and overlap_grad_reduce, small
    # buckets (the output weight gets a bucket of its own)
    overlap: bool = False
    distributed_optimizer: bool = False  # DDP for megatron's distributed optimizer, no overlap
    overlap_grad_reduce: bool = False  # DDP's grad-reduce overlap alone (small buckets)
    cp: int = 1  # context parallel size
    # GatheredKVAttention (exact under CP, see megatron_fused_ce/testing/cp_attention.py) instead of
    # megatron's local DotProductAttention; always on with cp > 1 (a CP=1 reference sets it)
    gathered_attention: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def __str__(self):
        vp = f"vp{self.vp}-" if self.vp else ""
        return (f"tp{self.tp}-pp{self.pp}-{vp}dp{self.dp}-{'tied' if self.tied else 'untied'}"
                f"{'-sp' if self.sp else ''}{'-bf16' if self.bf16 else ''}"
                f"{'-gradaccfusion' if self.grad_acc_fusion else ''}"
                f"{f'-mtp{self.mtp_layers}' if self.mtp_layers else ''}"
                f"{'-detachheads' if self.mtp_detach_heads else ''}"
                f"{'' if self.per_token_loss else '-meanloss'}{'-overlap' if self.overlap else ''}"
                f"{'-distopt' if self.distributed_optimizer else ''}"
                f"{'-overlapgradreduce' if self.overlap_grad_reduce else ''}"
                f"{f'-cp{self.cp}' if self.cp > 1 else ''}{'-gathered' if self.gathered_attention else ''}")


class SPLayerNorm(torch.nn.LayerNorm):
    """LayerNorm usable under sequence parallelism: marks its parameters so that
    `finalize_model_grads` all-reduces their gradients over TP (megatron's torch-norm wrapper
    refuses SP; the Apex/TE norms are not available on CPU)."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def layer_spec(config, setup: Setup, vp_stage=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec = get_gpt_layer_local_spec()
    if setup.cp > 1 or setup.gathered_attention:
        spec = with_context_parallel_attention(spec)
    if not setup.sp:
        return spec
    sub = dataclasses.replace(spec.submodules, input_layernorm=SPLayerNorm,
                              pre_mlp_layernorm=SPLayerNorm)
    layer = ModuleSpec(module=spec.module, submodules=sub)
    n = get_num_layers_to_build(config, vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=SPLayerNorm)


def mtp_block_spec(config, spec, setup: Setup, vp_stage=None):
    """megatron-core's MTP block spec for the local layer spec (its norms made SP-capable)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    class Backend(LocalSpecProvider):
        def layer_norm(self, *args, **kwargs):
            return SPLayerNorm if setup.sp else super().layer_norm(*args, **kwargs)

    return get_gpt_mtp_block_spec_for_backend(config, spec, Backend(), vp_stage=vp_stage)


def megatron_gloo_collectives_in_order() -> None:
    """Over gloo (this worker only): the collectives of each coalescing block of megatron's DDP and
    Megatron-FSDP are issued one by one as the block ends, each waited for before the next, so a
    gloo group never runs two at once. Megatron's hooks, dispatch order, buckets and handles are
    unchanged (a handle finds its work done). A no-op on any other backend: the NCCL suites keep
    the overlap."""
    # Megatron overlaps data-parallel communication with compute by coalescing each bucket group's
    # collectives and leaving them in flight while it issues more (DDP's overlap_param_gather:
    # every bucket group's all-gather at once; overlap_grad_reduce; Megatron-FSDP's prefetched
    # all-gathers beside its reduce-scatters), which is meant for NCCL streams. Over gloo, torch's
    # coalescing manager runs a block through gloo's coalesced kernels (all-gathers: one
    # `allgather_coalesced`; reduce-scatters: one all-reduce per tensor, all in flight at once on
    # the group's two worker threads), and with those a worker dies in native code now and then
    # (SIGSEGV, SIGABRT "double free or corruption"). The rest of the CPU suite (torch FSDP2
    # included) issues single collectives and waits for each before the next.
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    c10d = dist.distributed_c10d
    coalescing = c10d._coalescing_manager
    # a recorded collective (torch's _CollOp), issued alone and waited for; torch >= 2.13 names the
    # tensor all-gather / reduce-scatter *_single, older torch *_into_tensor / *_tensor
    issue = {c10d.all_reduce: lambda op, group: c10d.all_reduce(op.tensor, op=op.redop, group=group)}
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(c10d, name):
            issue[getattr(c10d, name)] = functools.partial(
                lambda fn, op, group: fn(op.dst_tensor, op.tensor, group=group), getattr(c10d, name))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(c10d, name):
            issue[getattr(c10d, name)] = functools.partial(
                lambda fn, op, group: fn(op.dst_tensor, op.tensor, op=op.redop, group=group), getattr(c10d, name))

    @contextlib.contextmanager
    def one_by_one(group=None, device=None, async_ops=False):
        if device is not None:  # the per-collective path (not megatron's): just wait
            with coalescing(group, device, async_ops=False) as cm:
                yield cm
            return
        group = group or c10d._get_default_group()
        state = c10d._world.pg_coalesce_state
        if state.get(group):
            raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
        state[group] = []  # the block's collectives are recorded, as torch's manager does
        try:
            yield c10d._CoalescingManager()  # no works: waiting on it returns at once
        finally:
            ops = state.pop(group)
        for op in ops:
            issue[op.op](op, group)

    for module in list(sys.modules.values()):  # megatron's buffers imported it by name
        if getattr(module, "__name__", "").startswith("megatron") and \
                getattr(module, "_coalescing_manager", None) is coalescing:
            module._coalescing_manager = one_by_one


# The process groups' collectives (ProcessGroup methods, which torch.distributed's functions call).
_PG_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
                   "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
                   "_allgather_base", "reduce_scatter", "reduce_scatter_single",
                   "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
                   "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter", "alltoall",
                   "alltoall_base", "all_to_all_single", "barrier")


class GlooCollectivesInFlight:
    """The most collectives that one process group had issued and not yet waited for when it issued
    the next one (0: one at a time), and the first few such overlaps. Records the ProcessGroup
    methods behind torch.distributed's collectives and `Work.wait`, in this worker (torch's
    functional collectives, issued and waited for in C++, are not seen)."""

    def __init__(self):
        process_group, work = dist.ProcessGroup, dist.distributed_c10d.Work
        self.most, self.pending, self.overlaps = 0, {}, []
        self.originals = [(process_group, name, getattr(process_group, name))
                          for name in _PG_COLLECTIVES if hasattr(process_group, name)]
        self.originals.append((work, "wait", work.wait))
        for owner, name, original in self.originals[:-1]:
            setattr(owner, name, self._issue(name, original))
        wait = work.wait

        def waited(handle, *args, **kwargs):
            for handles in self.pending.values():
                handles[:] = [(name, h) for name, h in handles if h is not handle]
            return wait(handle, *args, **kwargs)

        work.wait = waited

    def _issue(self, name, original):
        def issued(group, *args, **kwargs):
            handles = self.pending.setdefault(group.group_name, [])
            if handles:
                self.most = max(self.most, len(handles))
                if len(self.overlaps) < 5:
                    self.overlaps.append((name, dist.get_process_group_ranks(group),
                                          [pending for pending, _ in handles]))
            handle = original(group, *args, **kwargs)
            handles.append((name, handle))
            return handle

        return issued

    def restore(self):
        for owner, name, original in self.originals:
            setattr(owner, name, original)

    def take(self):
        """(most, overlaps) since the last take."""
        taken = self.most, self.overlaps
        self.most, self.overlaps = 0, []
        return taken


def build(setup: Setup, seed: int = 1234, install_before_wrap=None):
    """parallel_state + a DDP-wrapped GPTModel (list of chunks) with deterministic weights.

    `install_before_wrap`: a FusedCEConfig installed on each GPTModel before the DDP wrapping.
    Over gloo, megatron's coalesced collectives run one at a time (megatron_gloo_collectives_in_order)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from dist import init_megatron_parallel
    from megatron_fused_ce.megatron import install_fused_output_layer

    enable_cpu_mode()
    init_megatron_parallel(setup.tp, setup.pp, virtual_pipeline_model_parallel_size=setup.vp,
                           context_parallel_size=setup.cp)
    megatron_gloo_collectives_in_order()
    torch.manual_seed(seed + parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    dtype = torch.bfloat16 if setup.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=setup.layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        tensor_model_parallel_size=setup.tp, pipeline_model_parallel_size=setup.pp,
        virtual_pipeline_model_parallel_size=setup.vp, sequence_parallel=setup.sp,
        context_parallel_size=setup.cp,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=setup.bf16,
        calculate_per_token_loss=setup.per_token_loss, hidden_dropout=0.0, attention_dropout=0.0,
        **({"mtp_num_layers": setup.mtp_layers, "mtp_loss_scaling_factor": setup.mtp_scale}
           if setup.mtp_layers else {}),
        **({"mtp_detach_heads": True} if setup.mtp_detach_heads else {}))
    overlap_grad_reduce = setup.overlap or setup.overlap_grad_reduce
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=setup.overlap or setup.distributed_optimizer,
        overlap_param_gather=setup.overlap, overlap_grad_reduce=overlap_grad_reduce,
        **({"bucket_size": 1000} if overlap_grad_reduce else {}))
    chunks = []
    for vp_stage in range(setup.vp or 1):
        kw = {} if setup.vp is None else {"vp_stage": vp_stage}
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=setup.vp is None, **kw)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=setup.vp is None, **kw)
        spec = layer_spec(config, setup, kw.get("vp_stage"))
        if setup.mtp_layers:
            kw["mtp_block_spec"] = mtp_block_spec(config, spec, setup, kw.get("vp_stage"))
        gpt = GPTModel(config, spec, vocab_size=PADDED_VOCAB, max_sequence_length=SEQ,
                       pre_process=pre, post_process=post,
                       share_embeddings_and_output_weights=setup.tied, **kw)
        if torch.cuda.is_available():  # as training scripts do: megatron leaves plain torch
            gpt.cuda(torch.cuda.current_device())  # modules (position embedding, norms) on the CPU
        if install_before_wrap is not None:
            install_fused_output_layer(gpt, install_before_wrap)
        if setup.bf16:
            gpt = Float16Module(config, gpt)
        ddp = DistributedDataParallel(config, ddp_config, gpt)
        chunks.append(ddp)
    config.finalize_model_grads_func = finalize_model_grads
    return chunks


def causal_mask(seq: int = SEQ) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


def make_batches(kind: str, num_microbatches: int, seed: int):
    """Micro-batches of the data-parallel rank `seed` (identical on all its TP/PP ranks)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_microbatches):
        seqs = torch.randint(0, TRUE_VOCAB, (MBS, SEQ + 1), generator=g)
        loss_mask = (torch.rand(MBS, SEQ, generator=g) > 0.2).float()
        loss_mask[:, :3] = 0.0  # a "prompt"
        batch = {
            "tokens": seqs[:, :-1].contiguous(),
            "labels": seqs[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ),
            "attention_mask": causal_mask(),
        }
        if kind == "grpo":
            batch["advantages"] = torch.randn(MBS, generator=g)
            batch["noise"] = 0.1 * torch.randn(MBS, SEQ, generator=g)
        if kind == "dpo":
            batch["noise"] = 0.1 * torch.randn(MBS, SEQ, generator=g)
        batches.append(batch)
    return batches


def cp_batches(batches):
    """This CP rank's slices of the micro-batches (unchanged without context parallelism)."""
    from megatron_fused_ce.megatron import batch_on_this_cp_rank, context_parallel_group

    group = context_parallel_group()
    return [batch_on_this_cp_rank(batch, group) for batch in batches]


def forward_fn(chunk, batch):
    return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"])


def run_step(chunks, batches, make_loss_func, forward_only=False, forward=forward_fn):
    """One `get_forward_backward_func` call; returns the last stage's per-micro-batch metrics."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        index, batch = next(data_iterator)
        return forward(chunk, batch), make_loss_func(chunk, batch, index)

    iterators = [iter(list(enumerate(batches))) for _ in chunks]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks, num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS,
        forward_only=forward_only)


def grads(chunks):
    """{name: main_grad copy} of every parameter of every chunk (after finalize_model_grads)."""
    out = {}
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            out[f"{i}.{name}"] = param.main_grad.detach().clone()
    return out


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both vanish)."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def rel_norm_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both vanish): a gradient's difference as a whole, where bf16's
    rounding noise in single entries of a small parameter would set max_rel_diff."""
    a, b = a.double(), b.double()
    scale = b.norm().item()
    diff = (a - b).norm().item()
    return diff / scale if scale > 0 else diff


def megatron_lm_loss_func(loss_mask):
    """pretrain_gpt.py's loss_func on the per-token losses the model returns."""

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.float() * loss_mask)
        count = loss_mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    return loss_func


def all_batches(kind, dp=2, micro=2):
    """Every micro-batch of every DP rank: [(dp_rank, [micro-batches])]."""
    return [(r, make_batches(kind, micro, seed=100 + r)) for r in range(dp)]


def logprob_stand_ins(batch):
    """Deterministic stand-ins for old / reference / sampling log-probs (GRPO) and the reference
    log-probs (DPO): around log(1/100), data-dependent noise."""
    noise = batch["noise"] * (batch["loss_mask"] != 0)
    base = torch.full_like(noise, -4.6) * (batch["loss_mask"] != 0)
    return {"old": base + noise, "reference": base - noise, "sampling": base + 0.5 * noise}


def cat_rows(batches, key):
    return torch.cat([b[key] for b in batches])


def all_gather_cat(tensor, dim, group):
    """`tensor` of every rank of `group`, concatenated along `dim`."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
