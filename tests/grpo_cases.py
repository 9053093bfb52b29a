"""What the per-token kernel's tests and the one launch's share (tests/test_grpo_triton.py,
tests/test_grpo_one_launch.py): the kernels' module, interpreted on a CPU machine (imported before
Triton loads: it sets TRITON_INTERPRET), and the GRPO option sets (GRPOConfig keyword arguments):
each loss type, clip variant, KL estimator and clamp, train/inference correction."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def triton_grpo():
    """ops/backends/triton_grpo.py, its kernels interpreted without a GPU."""
    if DEVICE.type != "cuda":
        from triton_interpret import kernel_modules

        return kernel_modules()["triton_grpo"]
    from megatron_fused_ce.ops.backends import triton_grpo as module

    return module


CONFIGS = {
    "dapo": dict(),
    "dapo_delta_dual": dict(delta=1.3, dual_clip_c=2.0),
    "grpo": dict(loss_type="grpo"),
    "grpo_nonempty": dict(loss_type="grpo", count_empty_sequences=False),
    "bnpo_k1_clamped": dict(loss_type="bnpo", beta=0.1, kl_estimator="k1", kl_input_clamp=0.3, kl_output_clamp=0.2),
    "dr_grpo_k2": dict(loss_type="dr_grpo", max_completion_length=9, beta=0.05, kl_estimator="k2",
                       kl_input_clamp=None, kl_output_clamp=None),
    "dapo_k3_bias": dict(beta=0.2, use_bias_correction_kl=True, kl_output_clamp=0.05),
    "cispo": dict(loss_type="cispo", cispo_max_ratio=1.1),
    "cispo_open_low": dict(loss_type="cispo", cispo_min_ratio=0.0, cispo_max_ratio=1.2),
    "sapo": dict(loss_type="sapo"),
    "sapo_token": dict(loss_type="sapo", sapo_reduction="token", sapo_temperature_neg=2.0),
    "token_truncate": dict(is_correction="token_truncate", is_clip_max=1.2),
    "token_mask": dict(is_correction="token_mask", is_clip_min=0.8, is_clip_max=1.25),
    "sequence_truncate": dict(loss_type="grpo", is_correction="sequence_truncate", is_clip_min=0.5, is_clip_max=1.5),
    "sequence_mask_high": dict(is_correction="sequence_mask", is_clip_max=1.1, beta=0.1),
    "on_policy_forced": dict(force_on_policy_ratio=True, beta=0.1, kl_estimator="k2"),
}
