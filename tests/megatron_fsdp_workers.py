"""The FSDP harness of tests/test_megatron_fsdp.py, also run over NCCL by tests/test_multigpu_fsdp.py
and (device, gathered_grads) by the CP workers: a GPTModel (local spec) sharded over the
data-parallel group by torch FSDP2 or Megatron-FSDP (`wrap`), the worker that runs SFT / GRPO /
Megatron-LM labels fused vs unfused vs a float64 reference and logs every collective (`fsdp_worker`),
the checks of its reports, and the tied-embeddings worker.
"""

from __future__ import annotations

import math
import threading
import warnings
import traceback
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import megatron_harness as common
from megatron_harness import (
    GRAD_RTOL,
    GRAD_RTOL_BF16,
    GRPO,
    HEADS,
    HIDDEN,
    LOSS_RTOL,
    LOSS_RTOL_BF16,
    MBS,
    PADDED_VOCAB,
    SEQ,
    TRUE_VOCAB,
    megatron_lm_loss_func,
)

from megatron_fused_ce.losses import grpo_loss
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    enable_cpu_mode,
    grpo_loss_func,
    install_fused_output_layer,
    sft_loss_func,
    unwrap_model,
)

FUSED = FusedCEConfig(enabled=True, chunk_size=8)
NUM_MICROBATCHES = 2
# float64 reference vs either fp32 run (relative norm); measured <= 3e-7.
REF_RTOL = 2e-5
LONG_SEQ = 256  # 12 x 256 tokens: room for 3000 labelled ones


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
        torch.device("cpu")


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------
def build_gpt(tp: int, *, max_seq: int = SEQ, bf16: bool = False, seed: int = 1234, tied: bool = False):
    """A GPTModel (local spec, no dropout; untied unless `tied`) on megatron's parallel state
    (TP = tp, the rest data-parallel), not wrapped."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from dist import init_megatron_parallel

    enable_cpu_mode()
    init_megatron_parallel(tp, 1)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16, calculate_per_token_loss=True,
        hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local")
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=PADDED_VOCAB,
                   max_sequence_length=max_seq, share_embeddings_and_output_weights=tied)
    return gpt.to(device())


def dp_mesh():
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(parallel_state.get_data_parallel_group(), device().type)


def megatron_torch_fsdp2(gpt):
    """megatron's TorchFullyShardedDataParallel (`use_torch_fsdp2`). It builds its mesh on "cuda";
    on the CPU the mesh goes to the CPU (this worker only)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import torch_fully_sharded_data_parallel as megatron_fsdp2
    from torch.distributed.device_mesh import DeviceMesh

    if not torch.cuda.is_available():
        class CpuMesh:
            @staticmethod
            def from_group(group, device_type, **kwargs):
                return DeviceMesh.from_group(group, "cpu", **kwargs)

        megatron_fsdp2.DeviceMesh = CpuMesh
    return megatron_fsdp2.TorchFullyShardedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)


class _NoStream:
    """A CUDA stream / event stand-in on the CPU, where all work is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):  # wait_stream, wait_event, record, synchronize, ...
        return lambda *args, **kwargs: _NoStream()

    def query(self):
        return True


def megatron_fsdp_on_cpu():
    """Megatron-FSDP runs its collectives on side CUDA streams and builds its device meshes on
    "cuda": on the CPU (this forked worker only) the streams and events become no-ops, the meshes
    go to the CPU, the CUDA RNG state is the CPU's. Its hooks and buffers run unchanged over gloo,
    and its collectives too, but one at a time (common.megatron_gloo_collectives_in_order says
    why)."""
    import contextlib

    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from torch.distributed.device_mesh import DeviceMesh

    common.megatron_gloo_collectives_in_order()

    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.empty_cache = lambda: None
    # megatron-core >= 0.19 syncs the CUDA RNG state over TP (CPU mode's tracker is on the CPU)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": None

    class CpuMesh:
        @staticmethod
        def from_group(group, device_type, **kwargs):
            return DeviceMesh.from_group(group, "cpu", **kwargs)

    mcore_fsdp_adapter.DeviceMesh = CpuMesh


def megatron_fsdp(model, own_unit: bool = False):
    """megatron's FullyShardedDataParallel (Megatron-FSDP, `use_megatron_fsdp`): parameters,
    gradients and optimizer state sharded. Default units (transformer layers): the output layer is
    a non-unit module, gathered in its forward pre-hook and kept through the step. `own_unit`: a
    fused output layer is a unit too (`fsdp_unit_modules`), released after its forward and after
    its backward."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fused_ce.megatron.output_layer import FusedOutputLayer

    units = {}
    if own_unit and isinstance(unwrap_model(model).output_layer, FusedOutputLayer):
        units = {"fsdp_unit_modules": [TransformerLayer, FusedOutputLayer]}

    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True)
    config = unwrap_model(model).config
    if not isinstance(getattr(mcore_fsdp_adapter, "TELinear", type), type):
        # megatron-core 0.16 without Transformer Engine (its TELinear a placeholder) checks
        # isinstance(module, TELinear) at TP > 1
        mcore_fsdp_adapter.TELinear = type("NoTransformerEngine", (), {})
    if torch.cuda.is_available():
        return FullyShardedDataParallel(config, ddp_config, model, **units)
    megatron_fsdp_on_cpu()
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # it formats f"cuda:{current_device()}" (a warning on CPU)
    try:
        return FullyShardedDataParallel(config, ddp_config, model, device=torch.device("cpu"), **units)
    finally:
        torch.cuda.current_device = current_device


# Megatron-FSDP: the output layer a non-unit module (default units) / a unit of its own.
MEGATRON_FSDP = ("megatron_fsdp", "megatron_fsdp_unit")


def wrap(model, wrapper: str):
    """Shard `model` (a GPTModel, or Float16Module around one) over the data-parallel group."""
    from torch.distributed.fsdp import fully_shard

    if wrapper == "megatron":
        return megatron_torch_fsdp2(model)
    if wrapper in MEGATRON_FSDP:
        return megatron_fsdp(model, own_unit=wrapper == "megatron_fsdp_unit")
    gpt, mesh = unwrap_model(model), dp_mesh()
    for layer in gpt.decoder.layers:
        fully_shard(layer, mesh=mesh)
    if wrapper == "fully_shard":
        fully_shard(gpt.embedding, mesh=mesh)
        fully_shard(gpt.output_layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root (default: not resharded after forward)
    return model


def plain_name(name: str) -> str:
    return name.replace("module.", "")


def gathered_grads(model) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered from its data-parallel shards (collectives).

    FSDP2's gradients are DTensors sharded on dim 0 over a 1-D mesh: gathered like Megatron-FSDP's,
    by a blocking `dist.all_gather` of the local shards (`gather_rows`), not by
    `DTensor.full_tensor()`: that is torch's functional all-gather, which over gloo runs as gloo's
    `allgather_coalesced`, the kernel that megatron's coalesced all-gathers use and that kills a
    worker in native code now and then (common.megatron_gloo_collectives_in_order)."""
    from megatron.core import parallel_state
    from torch.distributed.tensor import Shard

    from megatron_fused_ce.megatron.sharded import is_megatron_fsdp_param

    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if is_megatron_fsdp_param(param):
            local = param.to_local()
            grad = gather_rows(local, grad.to_local() if grad is not None else torch.zeros_like(local),
                               parallel_state.get_data_parallel_group())
        elif grad is not None and hasattr(grad, "full_tensor"):  # FSDP2
            # Shard(0) on a 1-D mesh: rank r holds the r-th torch.chunk of the rows
            assert grad.device_mesh.ndim == 1 and tuple(grad.placements) == (Shard(0),), \
                (name, grad.device_mesh, grad.placements)
            grad = gather_rows(grad.to_local(), grad.to_local(), grad.device_mesh.get_group())
            assert grad.shape == param.shape, (name, grad.shape, param.shape)
        out[plain_name(name)] = None if grad is None else grad.detach().double().cpu()
    return out


def gather_rows(local, local_grad, group) -> torch.Tensor:
    """The whole gradient of a parameter of which each rank of `group` holds a contiguous block of
    rows (`local`, possibly none; `local_grad` its gradient, any shape of the same numel), in rank
    order: a parameter of Megatron-FSDP (this TP rank's) or FSDP2. Gathered padded (gloo needs
    equal sizes), by blocking collectives."""
    rows = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, local.shape[0] if local.dim() else local.numel(), group=group)
    shape = (sum(rows),) + tuple(local.shape[1:])
    row = math.prod(shape[1:])
    padded = torch.zeros(max(rows) * row, dtype=local_grad.dtype, device=local_grad.device)
    padded[:local_grad.numel()] = local_grad.reshape(-1)
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n * row] for n, part in zip(rows, parts)]).reshape(shape)


def fsdp_units(model):
    """{unit module: numel of its all-gather} for every FSDP2 unit (padded along dim 0)."""
    from megatron_fused_ce.megatron.sharded import is_fsdp2_module

    world = dist.get_world_size(dp_mesh().get_group())
    units = [m for m in model.modules() if is_fsdp2_module(m)]  # outer units first
    owner = {}
    for unit in reversed(units):  # a parameter belongs to its innermost unit
        for param in unit.parameters():
            owner.setdefault(param, unit)
    sizes = {unit: 0 for unit in units}
    for param in model.parameters():
        rows = -(-param.shape[0] // world) * world
        sizes[owner[param]] += rows * math.prod(param.shape[1:])
    return sizes


def output_unit_size(model) -> int:
    """The all-gather size of the unit holding the output weight; unique among the units."""
    gpt = unwrap_model(model)
    weight = gpt.output_layer.weight
    sizes = fsdp_units(model)
    unit = next(u for u in reversed(list(model.modules())) if u in sizes and
                any(p is weight for p in u.parameters()))
    assert list(sizes.values()).count(sizes[unit]) == 1, sizes
    return sizes[unit]


def unsharded_storage_bytes(layer) -> Optional[int]:
    """Bytes held by the unsharded parameters of an FSDP2 unit (0 once resharded)."""
    state = layer._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    total = 0
    for group in groups:
        for fsdp_param in group.fsdp_params:
            if hasattr(fsdp_param, "_unsharded_param"):
                total += fsdp_param._unsharded_param.untyped_storage().size()
    return total


class MegatronFSDPBucket:
    """The Megatron-FSDP bucket of one parameter: how often it was all-gathered, whether it holds
    unsharded storage now."""

    def __init__(self, model, name: str):
        engine = next(m for m in model.modules() if hasattr(m, "all_gather_pipeline"))
        self.pipeline = pipeline = engine.all_gather_pipeline
        buffer = engine.param_and_grad_buffer  # keyed by the parameters it was given
        param = next(p for p, n in buffer.param_to_name.items() if plain_name(n) == name)
        self.bucket = buffer.param_to_param_group[param]
        self.gathers = 0
        gather = pipeline.async_bucket_gather

        def counted(bucket_id, bwd):
            if bucket_id == self.bucket and pipeline.bucket_status[pipeline.get_bucket_key(bucket_id, bwd)] \
                    .name == "EMPTY":
                self.gathers += 1
            return gather(bucket_id, bwd)

        pipeline.async_bucket_gather = counted

    def take_gathers(self) -> int:
        gathers, self.gathers = self.gathers, 0
        return gathers

    def unsharded(self) -> bool:
        return any(self.pipeline.bucket_status[self.pipeline.get_bucket_key(self.bucket, bwd)].name != "EMPTY"
                   for bwd in (False, True))


# ------------------------------------------------------------------------------------------------
# Every collective, and who issued it
# ------------------------------------------------------------------------------------------------
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "_reduce_scatter_base", "broadcast", "reduce",
                "all_to_all", "all_to_all_single", "barrier", "gather", "scatter")


class CollectiveLog:
    """Records (name, group ranks, numel, issuer) of every torch.distributed collective; the
    issuer is the innermost of: this package, FSDP (torch's or megatron's), megatron-core. Calls
    nested inside a recorded one (a collective built on another) are not recorded."""

    def __init__(self):
        self.calls: List[tuple] = []
        self.local = threading.local()
        self.originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
        for name, original in self.originals.items():
            setattr(dist, name, self._wrap(name, original))

    def restore(self):  # (a forked worker need not; the NCCL suite runs in-process)
        for name, original in self.originals.items():
            setattr(dist, name, original)

    def _wrap(self, name, original):
        def recorded(*args, **kwargs):
            if getattr(self.local, "inside", False):
                return original(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(dist.get_world_size()))
            numel = max([a.numel() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)],
                        default=0)  # all-gather: the output; reduce-scatter: the input
            self.calls.append((name, ranks, numel, _issuer()))
            self.local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self.local.inside = False

        return recorded

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def _issuer() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/megatron_fused_ce/" in path:
            return "fused_ce"
        if "/distributed/fsdp/" in path or "/megatron_fsdp/" in path:  # torch's, megatron's
            return "fsdp"
        if "/megatron/core/" in path:
            return "megatron"
    return "other"


# ------------------------------------------------------------------------------------------------
# Data and the float64 reference
# ------------------------------------------------------------------------------------------------
def sized_batch(rows: int, seq: int, labelled: int, seed: int):
    """One micro-batch [rows, seq] with exactly `labelled` loss tokens (plus GRPO's inputs)."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, TRUE_VOCAB, (rows, seq + 1), generator=g)
    mask = torch.zeros(rows * seq)
    mask[torch.randperm(rows * seq, generator=g)[:labelled]] = 1.0
    return {"tokens": seqs[:, :-1].contiguous(), "labels": seqs[:, 1:].contiguous(),
            "loss_mask": mask.reshape(rows, seq),
            "position_ids": torch.arange(seq).unsqueeze(0).expand(rows, seq),
            "attention_mask": common.causal_mask(seq),
            "advantages": torch.randn(rows, generator=g), "noise": 0.1 * torch.randn(rows, seq, generator=g)}


def rank_batches(dp_rank: int, token_counts):
    """This data-parallel rank's micro-batches: the standard ones, or one micro-batch with
    token_counts[dp_rank] loss tokens (the other ranks' counts differ)."""
    if token_counts is None:
        return common.make_batches("grpo", NUM_MICROBATCHES, seed=100 + dp_rank)
    labelled = token_counts[dp_rank]
    rows, seq = (12, LONG_SEQ) if labelled > MBS * SEQ else (MBS, SEQ)
    return [sized_batch(rows, seq, labelled, seed=100 + dp_rank)]


def to_device(batch):
    return {k: v.to(device()) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def reference_logprobs(ref, batch, vocab=TRUE_VOCAB):
    """float64 log p(label) [b, s] from the full (TP-gathered) logits of the unwrapped copy."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    logits = ref(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    full = gather_from_tensor_model_parallel_region(logits)[..., :vocab]
    return torch.log_softmax(full, -1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)


def grpo_inputs(batch, lp):
    """Old / reference / sampling log-probs: the float64 model's, perturbed (fp32 as a caller has
    them; the same for every run)."""
    mask = batch["loss_mask"]
    noise = batch["noise"].to(lp.device) * (mask != 0)
    lp = lp.detach().float()
    return {"old_logprobs": lp + noise, "reference_logprobs": lp - noise,
            "sampling_logprobs": lp + 0.5 * noise}


def reference_loss_sum(kind, ref, batch, extras):
    mask = batch["loss_mask"].double()
    if kind == "labels":  # megatron's cross-entropy: over the padded vocab
        return -(reference_logprobs(ref, batch, PADDED_VOCAB) * mask).sum()
    lp = reference_logprobs(ref, batch)
    if kind == "sft":
        return -(lp * mask).sum()
    extras = {k: v.double() for k, v in extras.items()}
    loss, _ = grpo_loss(lp, batch["advantages"].double(), mask, GRPO, normalizer=1, **extras)
    return loss


# ------------------------------------------------------------------------------------------------
# The worker
# ------------------------------------------------------------------------------------------------
def run_step(model, batches, kind, post, extras):
    """One `get_forward_backward_func` call (no pipelining, per-token loss: the loss sums are
    back-propagated as they are; FSDP2 averages the gradients over the data-parallel ranks)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        index, batch = next(data_iterator)
        labels, mask = batch["labels"], batch["loss_mask"]
        if kind == "labels":  # Megatron-LM style: the model returns per-token losses
            output = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=labels)
            return output, megatron_lm_loss_func(mask)
        output = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        if kind == "sft":
            return output, sft_loss_func(post, chunk, labels, mask)
        return output, grpo_loss_func(post, chunk, labels, mask, batch["advantages"], GRPO, **extras[index])

    seq = batches[0]["tokens"].shape[1]
    rows = batches[0]["tokens"].shape[0]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(list(enumerate(batches))), model=[model],
        num_microbatches=len(batches), seq_length=seq, micro_batch_size=rows)


# The output weight in an FSDP2 unit of its own (gathered once per micro-batch, resharded after).
OWN_FSDP2_UNIT = ("fully_shard", "megatron")


def fsdp_worker(rank, world, tp: int, wrapper: str, kinds, token_counts=None, bf16: bool = False,
                grad_acc_fusion: bool = False):
    log = CollectiveLog()
    in_flight = common.GlooCollectivesInFlight() if dist.get_backend() == "gloo" else None
    try:
        report = _fsdp_worker(log, tp, wrapper, kinds, token_counts, bf16, grad_acc_fusion)
        report["gloo_in_flight"] = in_flight.take() if in_flight is not None else None
        return report
    finally:
        log.restore()
        if in_flight is not None:
            in_flight.restore()


def _fsdp_worker(log, tp, wrapper, kinds, token_counts, bf16, grad_acc_fusion):
    from megatron.core import parallel_state

    max_seq = LONG_SEQ if token_counts else SEQ
    unfused = build_gpt(tp, max_seq=max_seq, bf16=bf16)
    fused = build_gpt(tp, max_seq=max_seq, bf16=bf16)
    fused.load_state_dict(unfused.state_dict())
    ref = build_gpt(tp, max_seq=max_seq).double()  # float64 math throughout
    ref.load_state_dict(unfused.state_dict())
    install_fused_output_layer(fused, FUSED)  # before wrapping
    if bf16:
        from megatron.core.transformer.module import Float16Module

        unfused, fused = Float16Module(unfused.config, unfused), Float16Module(fused.config, fused)
    unfused, fused = wrap(unfused, wrapper), wrap(fused, wrapper)
    fused_layer = unwrap_model(fused).output_layer
    # megatron's gradient-accumulation fusion (TE layers add dW into main_grad): the fused ops
    # would too, where the engine allows it (not Megatron-FSDP, which sets main_grad itself)
    unwrap_model(fused).config.gradient_accumulation_fusion = grad_acc_fusion
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    tp_ranks = tuple(dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()))
    dp_ranks = tuple(dist.get_process_group_ranks(parallel_state.get_data_parallel_group()))
    all_batches = [[to_device(b) for b in rank_batches(r, token_counts)] for r in range(dp_size)]
    batches = all_batches[dp_rank]
    with torch.no_grad():
        all_extras = [[grpo_inputs(b, reference_logprobs(ref, b)) for b in bs] for bs in all_batches]
    extras = all_extras[dp_rank]
    # FSDP2 averages the gradients over data-parallel ranks; Megatron-FSDP sums them with a
    # per-token loss (megatron's finalize_model_grads divides by the token count afterwards).
    grad_divisor = 1 if wrapper in MEGATRON_FSDP else dp_size
    output_size = output_unit_size(fused) if wrapper not in MEGATRON_FSDP else None
    bucket = MegatronFSDPBucket(fused, "output_layer.weight") if wrapper == "megatron_fsdp_unit" else None
    report = {"dp_rank": dp_rank, "tp_ranks": tp_ranks, "dp_ranks": dp_ranks, "wrapper": wrapper,
              "kinds": {}}
    log.take()
    for kind in kinds:
        runs = {}
        for mode, model in (("unfused", unfused), ("fused", fused)):
            if hasattr(model, "zero_grad_buffer"):
                model.zero_grad_buffer()
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                metrics = run_step(model, batches, kind, post, extras)
            if hasattr(model, "finish_grad_sync"):  # megatron's wrappers (Megatron-FSDP: waits)
                model.finish_grad_sync()
            calls = log.take()
            dp_calls = [(name, numel) for name, ranks, numel, _ in calls if ranks == dp_ranks and dp_size > 1]
            runs[mode] = {
                "losses": [m["loss" if kind == "grpo" else "lm loss"][0].item() for m in metrics],
                "grads": gathered_grads(model), "dp_sequence": dp_calls,
                "op_groups": {ranks for name, ranks, _, issuer in calls if issuer == "fused_ce"},
                "output_gathers": bucket.take_gathers() if bucket else
                sum(1 for name, _, numel in _fsdp_calls(calls, "gather") if numel == output_size),
                "output_reduce_scatters": sum(1 for name, _, numel in _fsdp_calls(calls, "reduce_scatter")
                                              if numel == output_size),
                # FSDP2 warns when a unit returns a view (an in-place op on it would drop its hook)
                "view_warnings": sum("returned a view tensor" in str(w.message) for w in caught)}
            log.take()  # the gathers of gathered_grads
        weight_storage = unsharded_storage_bytes(fused_layer) if wrapper in OWN_FSDP2_UNIT else \
            (int(bucket.unsharded()) if bucket else None)
        # the float64 reference: every data-parallel rank's micro-batches, reduced as the engine does
        ref.zero_grad(set_to_none=True)
        ref_losses = []
        for r in range(dp_size):
            for batch, extra in zip(all_batches[r], all_extras[r]):
                loss = reference_loss_sum(kind, ref, batch, extra)
                (loss / grad_divisor).backward()
                if r == dp_rank:
                    ref_losses.append(loss.item())
        ref_grads = {n: p.grad.detach().double().cpu() for n, p in ref.named_parameters()}
        report["kinds"][kind] = {
            "losses": {"unfused": runs["unfused"]["losses"], "fused": runs["fused"]["losses"],
                       "ref": ref_losses},
            "grad_vs_unfused": {n: common.max_rel_diff(g, runs["unfused"]["grads"][n])
                                for n, g in runs["fused"]["grads"].items()},
            "grad_vs_ref": {mode: {n: _rel_norm(runs[mode]["grads"][n], g) for n, g in ref_grads.items()}
                            for mode in runs},
            "runs": {mode: {k: v for k, v in run.items() if k not in ("grads", "losses")}
                     for mode, run in runs.items()},
            "weight_storage_after_step": weight_storage,
            "num_microbatches": len(batches),
        }
    if wrapper in OWN_FSDP2_UNIT or bucket:  # a forward-only pass gives the weight back to its shard too
        with torch.no_grad():
            batch = batches[0]
            post(fused(batch["tokens"], batch["position_ids"], batch["attention_mask"]), fused, batch["labels"])
        if bucket:
            report["weight_storage_after_forward_only"] = int(bucket.unsharded())
            report["gathers_forward_only"] = bucket.take_gathers()
        else:
            report["weight_storage_after_forward_only"] = unsharded_storage_bytes(fused_layer)
            report["gathers_forward_only"] = sum(1 for name, _, numel in _fsdp_calls(log.take(), "gather")
                                                 if numel == output_size)
    return report


def _fsdp_calls(calls, kind: str):
    return [(name, ranks, numel) for name, ranks, numel, issuer in calls if issuer == "fsdp" and kind in name]


def _rel_norm(a, b) -> float:
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def check_reports(reports, *, bf16=False, exact=True):
    loss_rtol, grad_rtol = (LOSS_RTOL_BF16, GRAD_RTOL_BF16) if bf16 else (LOSS_RTOL, GRAD_RTOL)
    worst = 0.0
    for report in reports:
        for kind, r in report["kinds"].items():
            n, fused, unfused = r["num_microbatches"], r["runs"]["fused"], r["runs"]["unfused"]
            # the fused op talks to its tensor-parallel group only
            assert fused["op_groups"] <= {report["tp_ranks"]}, (kind, fused["op_groups"])
            if len(report["tp_ranks"]) > 1:
                assert fused["op_groups"], "the fused op ran without its TP collectives?"
            assert fused["view_warnings"] == 0, kind
            if report["wrapper"] == "megatron_fsdp":
                # the output layer is a non-unit module either way: the same collectives
                assert fused["dp_sequence"] == unfused["dp_sequence"], kind
            elif report["wrapper"] == "megatron_fsdp_unit":
                # a Megatron-FSDP unit is released after its forward: gathered in the loss's
                # call of the layer (GPTModel's skips the hooks) and again for its backward
                assert fused["output_gathers"] == 2 * n, (kind, fused["output_gathers"])
            else:
                # one all-gather of the output weight per forward, one reduce-scatter per backward
                assert fused["output_gathers"] == n, (kind, fused["output_gathers"])
                assert fused["output_reduce_scatters"] == n, (kind, fused["output_reduce_scatters"])
            if r["weight_storage_after_step"] is not None:
                assert r["weight_storage_after_step"] == 0
            for f, u in zip(r["losses"]["fused"], r["losses"]["unfused"]):
                assert abs(f - u) <= loss_rtol * max(abs(u), 1e-6), (kind, f, u)
            bad = {name: d for name, d in r["grad_vs_unfused"].items() if d > grad_rtol}
            assert not bad, (kind, bad)
            if exact:
                for f, ref in zip(r["losses"]["fused"], r["losses"]["ref"]):
                    assert abs(f - ref) <= REF_RTOL * max(abs(ref), 1e-6), (kind, f, ref)
                for mode, diffs in r["grad_vs_ref"].items():
                    bad = {name: d for name, d in diffs.items() if d > REF_RTOL}
                    assert not bad, (kind, mode, bad)
                    worst = max(worst, max(diffs.values()))
        if "weight_storage_after_forward_only" in report:
            assert report["weight_storage_after_forward_only"] == 0
            assert report["gathers_forward_only"] == 1
        # over gloo, no collective is left in flight when the next one of its group is issued
        if report.get("gloo_in_flight") is not None:
            assert report["gloo_in_flight"][0] == 0, report["gloo_in_flight"]
    # the data-parallel collectives (FSDP's): the same sequence on every data-parallel rank
    for kind in reports[0]["kinds"]:
        for mode in ("fused", "unfused"):
            sequences = {}
            for report in reports:
                sequences.setdefault(report["dp_ranks"], []).append(report["kinds"][kind]["runs"][mode]["dp_sequence"])
            for group_sequences in sequences.values():
                assert group_sequences[0] and all(s == group_sequences[0] for s in group_sequences), (kind, mode)
    return worst


def needs_engine(wrapper):
    """Megatron-FSDP's adapter builds its meshes with einops (an optional dependency)."""
    if wrapper in MEGATRON_FSDP:
        pytest.importorskip("einops", reason="megatron's Megatron-FSDP adapter needs einops")


# ------------------------------------------------------------------------------------------------
# Tied embeddings
# ------------------------------------------------------------------------------------------------
def tied_worker(rank, world, wrapper):
    """Tied embeddings: one SFT step, fused vs unfused (or the error each raises)."""
    out = {}
    for mode in ("unfused", "fused"):
        gpt = build_gpt(1, tied=True)
        if mode == "fused":
            install_fused_output_layer(gpt, FUSED)
        model = wrap(gpt, wrapper)
        batch = to_device(common.make_batches("sft", 1, seed=rank)[0])
        post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
        try:
            hidden = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
            loss = sft_loss_func(post, model, batch["labels"], batch["loss_mask"])(hidden)[0]
            loss.backward()
            if hasattr(model, "finish_grad_sync"):  # Megatron-FSDP
                model.finish_grad_sync()
            out[mode] = (loss.item(), gathered_grads(model))
        except (RuntimeError, ValueError) as error:
            out[mode] = f"{type(error).__name__}: {error}"
    return out


def check_tied(reports, wrapper):
    """The tied weight belongs to the embedding's unit. An FSDP2 unit of its own (resharded after
    the embedding's forward): the unfused layer fails inside torch (DTensor and Tensor mixed), the
    fused one raises a ValueError saying why, on every rank. In FSDP2's root unit (kept gathered
    through the forward) and under Megatron-FSDP (a non-unit module): fused equals unfused."""
    for report in reports:
        if wrapper == "fully_shard":
            assert "DTensor" in report["unfused"], report["unfused"]
            assert report["fused"].startswith("ValueError") and "tied output weight" in report["fused"]
            continue
        (loss, grads), (fused_loss, fused_grads) = report["unfused"], report["fused"]
        assert abs(fused_loss - loss) <= LOSS_RTOL * abs(loss)
        assert grads.keys() == fused_grads.keys() and "embedding.word_embeddings.weight" in grads
        bad = {n: d for n in grads if (d := common.max_rel_diff(fused_grads[n], grads[n])) > GRAD_RTOL}
        assert not bad, bad
