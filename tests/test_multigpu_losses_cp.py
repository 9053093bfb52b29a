"""Context parallelism of the losses over NCCL on CUDA: the CPU/gloo suite of test_losses_cp.py
(float64; loss, every metric and per-rank gradients equal to CP=1) with CP = the world size, and
`linear_grpo_loss(cp_group=...)` with the Triton backend against `grpo_loss` at CP=1.

    torchrun --nproc_per_node 2 -m pytest tests/test_multigpu_losses_cp.py -m multigpu -q
    torchrun --nproc_per_node 4 -m pytest tests/test_multigpu_losses_cp.py -m multigpu -q

Every rank checks every rank's result (all-gathered), so a failure fails on all ranks alike.
Skipped unless launched by torchrun with >= 2 CUDA devices (and a world size that divides 16).
"""

import os

import pytest
import torch
import torch.distributed as dist
from dist import init_nccl_once

pytestmark = pytest.mark.multigpu

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if WORLD < 2 or not torch.cuda.is_available() or torch.cuda.device_count() < WORLD or 16 % (2 * WORLD):
    pytest.skip("needs torchrun with 2, 4 or 8 CUDA GPUs", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def nccl():
    init_nccl_once()
    yield
    dist.barrier()


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _cuda(data):
    return {k: v.cuda() for k, v in data.items()}


@pytest.mark.parametrize("layout", ["balanced", "arbitrary"])
def test_nccl_losses_under_context_parallelism_equal_cp1(layout):
    from losses_cp_cases import CASES, make_data, positions, run_case, slice_positions

    cp, rank = dist.get_world_size(), dist.get_rank()
    if layout == "arbitrary" and cp not in (2, 4):
        pytest.skip("arbitrary layouts are defined for CP = 2, 4")
    data = make_data()
    local = _cuda(slice_positions(data, positions(layout, cp, rank)))
    mine = {name: tuple(_to_cpu(x) for x in run_case(name, local, dist.group.WORLD)) for name in CASES}
    everyone = _gather(mine)
    for name in CASES:
        loss, metrics, grad = run_case(name, data)
        for r, result in enumerate(everyone):
            got_loss, got_metrics, got_grad = result[name]
            torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=1e-13)
            assert got_metrics.keys() == metrics.keys(), name
            for key, value in metrics.items():
                torch.testing.assert_close(got_metrics[key], value, rtol=1e-12, atol=1e-13,
                                           msg=lambda m, key=key: f"{name} metric {key}: {m}")
            torch.testing.assert_close(got_grad, grad[:, positions(layout, cp, r)], rtol=1e-12, atol=1e-14,
                                       msg=lambda m: f"{name} rank {r} grad: {m}")


def _to_cpu(x):
    if isinstance(x, dict):
        return {k: v.cpu() for k, v in x.items()}
    return x.cpu()


def test_nccl_linear_grpo_under_context_parallelism_equals_cp1():
    from losses_cp_cases import FUSED_CONFIGS, LOGPROB_ARGS, fused_inputs, fused_reference, positions

    from megatron_fused_ce.losses import GRPOConfig
    from megatron_fused_ce.losses.linear_grpo import linear_grpo_loss

    cp, rank = dist.get_world_size(), dist.get_rank()
    hidden, weight, labels, mask, adv, others = fused_inputs(1)
    index = positions("balanced", cp, rank)
    hidden, labels, mask = hidden[:, index].cuda(), labels[:, index].cuda(), mask[:, index].cuda()
    others = {k: v[:, index].cuda() for k, v in others.items()}
    mine = {}
    for name, (cfg_kwargs, needs) in FUSED_CONFIGS.items():
        h, w = hidden.clone().requires_grad_(), weight.cuda().clone().requires_grad_()
        loss, metrics = linear_grpo_loss(
            h, w, labels, adv.cuda(), mask, GRPOConfig(**cfg_kwargs), cp_group=dist.group.WORLD,
            vocab_size=weight.shape[0] - 3, temperature=0.9, chunk_size=5, impl="triton",
            normalizer=29 if "normalizer" in name else None, **{LOGPROB_ARGS[k]: others[k] for k in needs})
        (2.5 * loss).backward()
        mine[name] = (loss.detach().cpu(), _to_cpu(metrics), h.grad.cpu(), w.grad.cpu())
    everyone = _gather(mine)
    for name in FUSED_CONFIGS:
        loss, metrics, dx, dw = fused_reference(name, 1)
        dw_sum = torch.zeros_like(dw)
        for r, result in enumerate(everyone):
            got_loss, got_metrics, got_dx, got_dw = result[name]
            torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-7)
            for key, value in metrics.items():
                torch.testing.assert_close(got_metrics[key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, key=key: f"{name} metric {key}: {m}")
            want_dx = dx[:, positions("balanced", cp, r)]
            assert (got_dx - want_dx).norm() <= 1e-5 * want_dx.norm(), (name, r, "dX")
            dw_sum += got_dw
        assert (dw_sum - dw).norm() <= 1e-5 * dw.norm(), (name, "dW")
