"""The fused output layer under torch FSDP2 and Megatron-FSDP over NCCL on CUDA: the workers of
tests/test_megatron_fsdp.py (in tests/megatron_fsdp_workers.py: GPTModel, megatron's schedule,
SFT / GRPO / Megatron-LM labels, fused vs unfused vs a float64 reference; all-gather /
reduce-scatter counts of the output weight; every collective of this package on the TP group; the
same data-parallel collectives on every rank, also with 3 vs 3000 and 0 vs 3000 labelled tokens),
with the Triton backend, in fp32 (checked against float64) and bf16 (Float16Module, fused vs
unfused at the bf16 tolerances); tied embeddings (DP=2).

    torchrun --nproc_per_node 2 -m pytest tests/test_multigpu_fsdp.py -m multigpu -q   # DP=2
    torchrun --nproc_per_node 4 -m pytest tests/test_multigpu_fsdp.py -m multigpu -q   # TP=2 x DP=2

Megatron-FSDP needs `einops` (skipped without it). Every rank checks every rank's report
(all-gathered), so a failure fails on all ranks alike. Skipped unless launched by torchrun with
2 or 4 CUDA devices; a case whose TP x DP=2 is not the world size is skipped.
"""

import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
from dist import init_nccl_once

pytestmark = pytest.mark.multigpu

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if WORLD not in (2, 4) or not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
    pytest.skip("needs torchrun with 2 or 4 CUDA GPUs", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def nccl():
    init_nccl_once()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 cases are checked against float64
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32
    dist.barrier()


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _run(tp, wrapper, kinds, token_counts=None, bf16=False, grad_acc_fusion=False):
    from megatron_fsdp_workers import fsdp_worker

    if 2 * tp != WORLD:
        pytest.skip(f"TP={tp} x DP=2 needs {2 * tp} GPUs")
    return _on_every_rank(fsdp_worker, wrapper, tp, wrapper, kinds, token_counts, bf16, grad_acc_fusion)


def _on_every_rank(worker, wrapper, *args):
    """`worker(rank, world, *args)` here; every rank's report (or every rank's errors, raised)."""
    from megatron.core import parallel_state
    from megatron_fsdp_workers import needs_engine

    needs_engine(wrapper)
    report, error = None, None
    try:
        report = worker(dist.get_rank(), WORLD, *args)
    except Exception:  # noqa: BLE001  (re-raised on every rank after the gather)
        error = traceback.format_exc()
        print(f"rank {dist.get_rank()} failed in {worker.__name__}{args}:\n{error}", file=sys.stderr, flush=True)
    finally:
        parallel_state.destroy_model_parallel()
    gathered = _gather((report, error))
    errors = [f"--- rank {r} ---\n{e}" for r, (_, e) in enumerate(gathered) if e is not None]
    assert not errors, "\n".join(errors)
    return [r for r, _ in gathered]


WRAPPERS = ("fully_shard", "megatron", "root", "megatron_fsdp", "megatron_fsdp_unit")
KINDS = ("sft", "grpo", "labels")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_nccl_fsdp_fp32_matches_unfused_and_float64(tp, wrapper):
    from megatron_fsdp_workers import check_reports

    worst = check_reports(_run(tp, wrapper, KINDS))
    print(f"tp{tp}-dp2-{wrapper} fp32: worst gradient error vs float64 {worst:.2e}")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("wrapper", ["fully_shard", "megatron", "megatron_fsdp", "megatron_fsdp_unit"])
def test_nccl_fsdp_bf16_matches_unfused(tp, wrapper):
    from megatron_fsdp_workers import check_reports

    check_reports(_run(tp, wrapper, KINDS, bf16=True), bf16=True, exact=False)


@pytest.mark.parametrize("tp,token_counts,wrapper", [
    (1, (3, 3000), "fully_shard"), (1, (0, 3000), "megatron_fsdp"),
    (2, (0, 3000), "megatron"), (2, (3000, 3), "megatron_fsdp")])
def test_nccl_fsdp_unequal_token_counts(tp, token_counts, wrapper):
    from megatron_fsdp_workers import check_reports

    check_reports(_run(tp, wrapper, ("sft", "grpo"), token_counts))


def test_nccl_megatron_fsdp_keeps_its_main_grad():
    from megatron_fsdp_workers import check_reports

    check_reports(_run(WORLD // 2, "megatron_fsdp", ("sft", "grpo"), grad_acc_fusion=True))


@pytest.mark.parametrize("wrapper", ["fully_shard", "root", "megatron_fsdp"])
def test_nccl_fsdp_tied_weights(wrapper):
    from megatron_fsdp_workers import check_tied, tied_worker

    if WORLD != 2:
        pytest.skip("DP=2")
    check_tied(_on_every_rank(tied_worker, wrapper, wrapper), wrapper)
