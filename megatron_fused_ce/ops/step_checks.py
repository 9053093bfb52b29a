"""Checks that run before every torch optimizer step.

Megatron's optimizers (the distributed one included) step a torch optimizer on their fp32 main
parameters, so a step pre-hook on every torch optimizer runs before any update is applied: the
last moment at which a gradient made wrong on purpose (main_grad.py) or a call's deferred device
errors (deferred_errors.py) can stop the step. One global hook, registered on first need; each
check raises to stop the step.
"""

from __future__ import annotations

from typing import Callable, List

_CHECKS: List[Callable[[], None]] = []
_HOOK: list = []  # the handle of the global step pre-hook, once registered


def before_optimizer_steps(check: Callable[[], None]) -> None:
    """Run `check()` before every step of every torch optimizer of this process (once per check)."""
    if check not in _CHECKS:
        _CHECKS.append(check)
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_run_checks))


def _run_checks(optimizer=None, args=None, kwargs=None) -> None:
    for check in list(_CHECKS):
        check()
