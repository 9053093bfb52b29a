"""TP=2 over NCCL on CUDA: the parity suite of test_ops.py (float64 dense reference, values, dX and
dW, SP on/off, fp32 and bf16) with the Triton backend, plus a larger bf16 shape.

    torchrun --nproc_per_node 2 -m pytest tests/test_multigpu.py -m multigpu -q

Every rank runs the same tests in the same order; results are all-gathered and every rank checks
every rank's result, so a failure fails on all ranks alike (no rank left waiting in a collective).
Skipped unless launched by torchrun with >= 2 CUDA devices.
"""

import datetime
import os
import zlib

import pytest
import torch
import torch.distributed as dist

import reference
from megatron_fused_ce import linear_cross_entropy, linear_logprobs

pytestmark = pytest.mark.multigpu

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if WORLD < 2 or not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
    pytest.skip("needs torchrun with >= 2 CUDA GPUs", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def nccl():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=3),
                                device_id=torch.device("cuda", local))
    yield
    dist.barrier()


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nccl_logprobs_match_dense_reference(impl, sp, dtype):
    from test_ops import _logprobs_worker, check_against_reference, make_case

    tp, rank = dist.get_world_size(), dist.get_rank()
    # a seed that is the same in every process (str hashes are salted per process)
    case = make_case(zlib.crc32(repr((impl, sp, str(dtype))).encode()) % 1000, tp, dtype=dtype, sp=sp, ignored=0.3)
    cuda_case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out = _logprobs_worker(rank, tp, cuda_case, impl=impl)
    results = _gather([t.cpu() for t in out])
    check_against_reference(case, results, what_prefix="nccl ")


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("sp", [False, True])
def test_nccl_large_bf16_cross_entropy_and_logprobs(impl, sp):
    """N=4096, H=1024, V=32000 (+pad) bf16 against float64 math on the GPU."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device="cuda").manual_seed(123)
    n, h_size, vocab = 4096, 1024, 32000
    v_local = -(-vocab // tp) + 64
    hidden = torch.randn(n, h_size, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v_local * tp, h_size, device="cuda", generator=g) / h_size**0.5 * 2).bfloat16()
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::7] = -100
    grad_lp = torch.randn(n, device="cuda", generator=g)

    n_local = n // tp
    h_in = (hidden[rank * n_local:(rank + 1) * n_local] if sp else hidden).clone().requires_grad_()
    w_in = weight[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    lp = linear_logprobs(h_in, w_in, labels, tp_group=dist.group.WORLD, vocab_size=vocab,
                         temperature=0.8, chunk_size=1000, sequence_parallel=sp, impl=impl).logprobs
    (lp * grad_lp).sum().backward()
    dx, dw = h_in.grad, w_in.grad
    h_in.grad, w_in.grad = None, None
    ce = linear_cross_entropy(h_in, w_in, labels, tp_group=dist.group.WORLD, vocab_size=vocab,
                              temperature=0.8, chunk_size=1000, sequence_parallel=sp, impl=impl,
                              label_smoothing=0.1)
    (3.0 * ce).backward()

    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, _, z = reference.dense_stats(hd, wd, labels, vocab_size=vocab, temperature=0.8)
    ref_dx, ref_dw = torch.autograd.grad((ref_lp * grad_lp.double()).sum(), (hd, wd), retain_graph=True)
    ref_ce = torch.nn.functional.cross_entropy(z, labels, label_smoothing=0.1)
    ce_dx, ce_dw = torch.autograd.grad(3.0 * ref_ce, (hd, wd))
    rows = slice(rank * n_local, (rank + 1) * n_local) if sp else slice(None)
    vrows = slice(rank * v_local, (rank + 1) * v_local)
    errors = {
        "logprobs": reference.rel_err(lp, ref_lp), "dX": reference.rel_err(dx, ref_dx[rows]),
        "dW": reference.rel_err(dw, ref_dw[vrows]), "ce_loss": reference.rel_err(ce, ref_ce),
        "ce_dX": reference.rel_err(h_in.grad, ce_dx[rows]), "ce_dW": reference.rel_err(w_in.grad, ce_dw[vrows]),
    }
    for rank_errors in _gather(errors):
        for name, err in rank_errors.items():
            reference.record(f"nccl big {name}", tp, torch.bfloat16, err)
            assert err < 2e-2, (name, err)
