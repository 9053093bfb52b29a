#!/usr/bin/env python3
"""Weight-gradient error of the gradients-in-forward losses under a loss scale g, with and without
Megatron's main_grad, against float64.

    python tools/main_grad_loss_scale.py                        # one GPU: N=8192, H=2048, V=65536, bf16
    python tools/main_grad_loss_scale.py --device cpu --shape 256,64,512 --dtype float32

For `linear_cross_entropy` (reduction="sum") and `linear_grpo_loss` (DAPO, 8 sequences), each loss
is multiplied by g before the backward, as Megatron's schedule does (g ~ 1/(tokens x micro-batches)
under calculate_per_token_loss=False). Columns: dW in autograd's .grad (no main_grad), in
main_grad with g unknown at forward time (an fp32 buffer until the backward), and in main_grad
with `expected_upstream_grad=g` (added in the forward, as Megatron's loss funcs do). Each cell is
||dW - g dW_64|| / ||g dW_64||, dW_64 the float64 gradient of the same inputs (full logits,
log_softmax).
"""

from __future__ import annotations

import argparse

import torch

from megatron_fused_ce import linear_cross_entropy
from megatron_fused_ce.losses import GRPOConfig, grpo_loss, linear_grpo_loss

TARGETS = ("grad", "main_grad", "main_grad_expected")
SEQUENCES = 8


def make_inputs(n, h, v, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, generator=gen).to(dtype)
    weight = (torch.randn(v, h, device=device, generator=gen) * h ** -0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    advantages = torch.randn(SEQUENCES, device=device, generator=gen)
    return hidden, weight, labels, advantages


def reference_dw(entry, hidden, weight, labels, advantages):
    w = weight.double().requires_grad_()
    lp = torch.log_softmax(hidden.double() @ w.t(), -1).gather(1, labels[:, None])[:, 0]
    if entry == "ce":
        loss = -lp.sum()
    else:
        mask = torch.ones(SEQUENCES, lp.numel() // SEQUENCES, dtype=torch.float64, device=lp.device)
        loss = grpo_loss(lp.view(SEQUENCES, -1), advantages.double(), mask, GRPOConfig())[0]
    loss.backward()
    return w.grad


def fused_dw(entry, hidden, weight, labels, advantages, g, target, impl):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    kw = dict(impl=impl, accumulate_into_main_grad=target != "grad",
              expected_upstream_grad=g if target == "main_grad_expected" else None)
    if target != "grad":
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    if entry == "ce":
        loss = linear_cross_entropy(h, w, labels, reduction="sum", **kw)
    else:
        mask = torch.ones(SEQUENCES, labels.numel() // SEQUENCES, device=h.device)
        loss = linear_grpo_loss(h.view(SEQUENCES, -1, h.shape[-1]), w, labels.view(SEQUENCES, -1), advantages,
                                mask, GRPOConfig(), **kw)[0]
    (loss * g).backward()
    return (w.grad if target == "grad" else w.main_grad).double()


def table(shape, dtype, device, scales, impl="auto"):
    """{(entry, g): {target: relative error}}."""
    inputs = make_inputs(*shape, dtype, device)
    out = {}
    for entry in ("ce", "grpo"):
        ref = reference_dw(entry, *inputs)
        for g in scales:
            out[(entry, g)] = {target: ((fused_dw(entry, *inputs, g, target, impl) - g * ref).norm()
                                        / (g * ref).norm()).item() for target in TARGETS}
        del ref
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192,2048,65536", help="N,H,V")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scales", default="1,1e-2,1e-3,1e-5", help="comma list of g")
    p.add_argument("--impl", default="auto")
    args = p.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    scales = [float(x) for x in args.scales.split(",")]
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, {args.dtype}, N x H x V = {' x '.join(map(str, shape))}, impl={args.impl}")
    print("| loss | g | " + " | ".join(TARGETS) + " |")
    print("|---|---|" + "---|" * len(TARGETS))
    for (entry, g), errors in table(shape, getattr(torch, args.dtype), device, scales, args.impl).items():
        print(f"| {entry} | {g:g} | " + " | ".join(f"{errors[t]:.2e}" for t in TARGETS) + " |")


if __name__ == "__main__":
    main()
