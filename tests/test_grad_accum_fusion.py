"""megatron_fused_ce.megatron.grad_accum_fusion: the pure-torch stand-in for Apex's
fused_weight_gradient_mlp_cuda. Its two functions against a float64 reference, and megatron-core's
ColumnParallelLinear / RowParallelLinear built with gradient_accumulation_fusion=True (TP = 1 and 2
over gloo) adding their weight gradient into main_grad once it is installed, refusing to be built
without it."""

import pytest
import torch

from dist import init_megatron_parallel, run_workers
from megatron_fused_ce.megatron import grad_accum_fusion as gaf

IN, OUT, SEQ, BATCH = 24, 20, 5, 3

try:  # where Apex's extension is installed the stand-in is never put in place
    import fused_weight_gradient_mlp_cuda  # noqa: F401

    HAVE_APEX_EXTENSION = True
except ImportError:
    HAVE_APEX_EXTENSION = False
without_apex = pytest.mark.skipif(HAVE_APEX_EXTENSION, reason="Apex's fused_weight_gradient_mlp_cuda is installed")


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, IN, generator=g).to(dtype)
    dy = torch.randn(SEQ, BATCH, OUT, generator=g).to(dtype)
    prior = torch.randn(OUT, IN, generator=g)
    return x, dy, prior


def _reference(x, dy, prior):
    """prior + dy^T @ x in float64, the leading (sequence, batch) dims flattened."""
    return prior.double() + dy.reshape(-1, OUT).double().t() @ x.reshape(-1, IN).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_gemm_accum_fp32_adds_into_main_grad(dtype):
    x, dy, prior = _data(dtype)
    main_grad = prior.clone()
    address = main_grad.data_ptr()
    gaf.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad.dtype == torch.float32 and main_grad.data_ptr() == address  # in place
    torch.testing.assert_close(main_grad.double(), _reference(x, dy, prior), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wgrad_gemm_accum_fp16_adds_into_a_half_main_grad(dtype):
    x, dy, prior = _data(dtype, seed=1)
    main_grad = prior.to(dtype)
    gaf.wgrad_gemm_accum_fp16(x, dy, main_grad)
    assert main_grad.dtype == dtype
    expected = _reference(x, dy, prior.to(dtype).float())
    # one rounding of the result to the half dtype
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-2, atol=0.1)


def test_the_functions_check_their_arguments():
    x, dy, prior = _data(torch.float32)
    with pytest.raises(TypeError, match="fp32 main_grad"):
        gaf.wgrad_gemm_accum_fp32(x, dy, prior.bfloat16())
    with pytest.raises(TypeError, match="fp16/bf16"):
        gaf.wgrad_gemm_accum_fp16(x, dy, prior)
    with pytest.raises(ValueError, match="main_grad"):
        gaf.wgrad_gemm_accum_fp32(x, dy, prior.t().contiguous())
    with pytest.raises(ValueError, match="leading"):
        gaf.wgrad_gemm_accum_fp32(x[:2], dy, prior)


def _layer_worker(rank, world, kind, dtype, install):
    """Build megatron-core's `kind` linear with gradient_accumulation_fusion=True at TP = world;
    return the construction error, or main_grad's largest relative difference from the float64
    reference after one backward and what weight.grad was left."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from megatron_fused_ce.megatron import enable_cpu_mode

    enable_cpu_mode()
    used = gaf.install_wgrad_accumulation_standin() if install else None
    if not install:
        gaf.uninstall_wgrad_accumulation_standin()
        assert not layers._grad_accum_fusion_available  # no Apex on these machines
    init_megatron_parallel(tp=world)
    config = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4, params_dtype=dtype,
                               gradient_accumulation_fusion=True, use_cpu_initialization=True,
                               bf16=dtype == torch.bfloat16)
    init = torch.nn.init.xavier_normal_
    try:
        if kind == "column":
            layer = ColumnParallelLinear(IN, OUT, config=config, init_method=init, bias=False,
                                         gather_output=False)
        else:
            layer = RowParallelLinear(IN, OUT, config=config, init_method=init, bias=False,
                                      input_is_parallel=True, skip_bias_add=True)
    except RuntimeError as error:
        return {"error": str(error)}
    x, dy, prior = _data(dtype, seed=2)
    # this rank's pieces: ColumnParallelLinear owns rows of W (output columns of y), RowParallelLinear
    # owns columns of W (its input is split along the hidden dim)
    if kind == "column":
        rows = slice(rank * OUT // world, (rank + 1) * OUT // world)
        x_local, dy_local, prior_local = x, dy[..., rows], prior[rows]
    else:
        cols = slice(rank * IN // world, (rank + 1) * IN // world)
        x_local, dy_local, prior_local = x[..., cols], dy, prior[:, cols]
    main_grad = prior_local.clone().contiguous()
    layer.weight.main_grad = main_grad
    x_local = x_local.clone().requires_grad_(True)
    y, _ = layer(x_local)
    try:
        (y.float() * dy_local.float()).sum().backward()
    except NameError as error:  # RowParallelLinear checks nothing when built: its backward fails
        return {"error": f"NameError: {error}"}
    expected = prior_local.double() + dy_local.reshape(-1, dy_local.shape[-1]).double().t() @ \
        x_local.detach().reshape(-1, x_local.shape[-1]).double()
    diff = ((layer.weight.main_grad.double() - expected).abs().max() / expected.abs().max()).item()
    return {"used": used, "rel_diff": diff, "same_buffer": layer.weight.main_grad is main_grad,
            "grad": layer.weight.grad, "dx_ok": x_local.grad is not None}


@without_apex
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_megatron_linear_accumulates_into_main_grad_through_the_standin(tp, kind, dtype):
    for result in run_workers(_layer_worker, tp, kind, dtype, True):
        assert "error" not in result, result
        assert result["used"] == "standin"
        assert result["same_buffer"] and result["dx_ok"]
        assert result["grad"] is None  # Megatron's DDP reads main_grad, not .grad
        assert result["rel_diff"] < 1e-6, result


@without_apex
@pytest.mark.parametrize("kind, message", [
    ("column", "fused_weight_gradient_mlp_cuda module is not found"),  # refused when built
    ("row", "name 'fused_weight_gradient_mlp_cuda' is not defined"),  # fails in its backward
])
def test_megatron_refuses_the_fusion_without_the_standin(kind, message):
    (result,) = run_workers(_layer_worker, 1, kind, torch.float32, False)
    assert message in result.get("error", ""), result


@without_apex
def test_install_is_idempotent_and_reversible(monkeypatch):
    import sys

    from megatron.core.tensor_parallel import layers

    monkeypatch.delitem(sys.modules, gaf.MODULE_NAME, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    assert gaf.install_wgrad_accumulation_standin() == "standin"
    module = sys.modules[gaf.MODULE_NAME]
    assert gaf.install_wgrad_accumulation_standin() == "standin"
    assert sys.modules[gaf.MODULE_NAME] is module and layers.fused_weight_gradient_mlp_cuda is module
    assert layers._grad_accum_fusion_available
    gaf.uninstall_wgrad_accumulation_standin()
    assert gaf.MODULE_NAME not in sys.modules and not layers._grad_accum_fusion_available
    assert not hasattr(layers, gaf.MODULE_NAME)


def test_a_real_extension_is_left_in_place(monkeypatch):
    import sys
    import types

    real = types.ModuleType(gaf.MODULE_NAME)
    monkeypatch.setitem(sys.modules, gaf.MODULE_NAME, real)
    assert gaf.install_wgrad_accumulation_standin() == "apex"
    assert sys.modules[gaf.MODULE_NAME] is real
