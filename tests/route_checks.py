"""Checks that a remembered signature's route (ops/remembered_routes.py) gives what the general path
gives: calls through the general path counted, and a route's outputs compared with the general
path's bit for bit."""

import torch

from megatron_fused_ce.ops import agreement, remembered_routes


def count_general_calls(monkeypatch, module) -> list:
    """One entry per call through the general path (token_statistics, as `module` calls it)."""
    calls = []
    original = module.token_statistics

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "token_statistics", counted)
    return calls


def routed_equals_general(monkeypatch, call, general_calls, names, what) -> tuple:
    """Three calls of one signature through the general path, then three with routes on: the third
    runs the route the second recorded (the first remembered call), and its outputs (`names`) are
    the general path's bit for bit. -> the routed call's outputs."""
    monkeypatch.setattr(remembered_routes, "ENABLED", False)
    want = [call() for _ in range(3)]
    monkeypatch.setattr(remembered_routes, "ENABLED", True)
    agreement.forget_signatures()
    general_calls.clear()
    got = [call() for _ in range(3)]
    assert len(general_calls) == 2, "the third call runs the route the second recorded"
    assert len(got[2]) == len(want[2])
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        name = names[i] if i < len(names) else f"output {i}"
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{what}: {name}"
    return got[2]
