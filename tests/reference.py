"""Float64 dense references (full logits, F.log_softmax) and the bookkeeping of what the tests
measured (errors, differences, ratios), printed by conftest at the end of the run."""

from collections import defaultdict

import torch
import torch.nn.functional as F

# What the tests measured, one dict per kind of quantity (see tables()); conftest prints each as
# its own table at the end of the run, with a column per (TP, dtype) that some test recorded: a
# backend or layout that did not run has no row or column. A test adds to the dict of what it
# measured through its record_* function (never by writing a dict), naming the row by what it is.
ERRORS = defaultdict(float)  # (what, tp, dtype) -> worst ||out - ref|| / ||ref||, ref the float64 dense reference
DIFFERENCES = defaultdict(float)  # (what, tp, dtype) -> worst ||a - b|| / ||b||, two computations that must agree
ERROR_RATIOS = defaultdict(float)  # (what, tp, dtype) -> worst (the op's error) / (plain fp32 dense error)
MEMORY = {}  # what (numerator / denominator named in it) -> largest ratio measured


def tables() -> list:
    """[(heading, results)] of every kind, in the order printed."""
    return [
        ("worst relative error vs the float64 dense reference (||out - ref|| / ||ref||)", ERRORS),
        ("worst relative difference between two computations that must agree, neither of them the "
         "float64 reference (||a - b|| / ||b||)", DIFFERENCES),
        ("worst error ratio: the op's error / a plain fp32 dense computation's error, both vs float64",
         ERROR_RATIOS),
        ("memory: largest tensor allocated / the size named in the row (worst)", MEMORY),
    ]


def export() -> list:
    """Every table's entries as lists of (key, value) pairs: what a pytest-xdist worker hands its
    controller (conftest), whose tables are printed."""
    return [list(results.items()) for _, results in tables()]


def merge(exported: list) -> None:
    """Another process's `export()` joined into these tables (the worst value of each entry)."""
    for (_, results), items in zip(tables(), exported):
        for key, value in items:
            key = tuple(key) if isinstance(key, list) else key
            results[key] = max(results.get(key, 0.0), value)


def rel_err(out, ref) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def _worst(results, what: str, tp: int, dtype, value: float) -> float:
    key = (what, tp, str(dtype).replace("torch.", ""))
    results[key] = max(results[key], value)
    return value


def record(what: str, tp: int, dtype, err: float) -> float:
    """A relative error against the float64 dense reference."""
    return _worst(ERRORS, what, tp, dtype, err)


def record_difference(what: str, tp: int, dtype, diff: float) -> float:
    """A relative difference between two computations that must agree (e.g. CP=2 vs CP=1, one
    pass vs recompute), neither of them the float64 reference; `what` names both."""
    return _worst(DIFFERENCES, what, tp, dtype, diff)


def record_error_ratio(what: str, tp: int, dtype, ratio: float) -> float:
    """The op's error / a plain fp32 dense computation's error, both against float64."""
    return _worst(ERROR_RATIOS, what, tp, dtype, ratio)


def record_memory(what: str, ratio: float) -> float:
    """A memory ratio; `what` names the numerator and the denominator (e.g. "largest tensor /
    dense [N, V] logits")."""
    MEMORY[what] = max(MEMORY.get(what, 0.0), ratio)
    return ratio


def table(results) -> list:
    """The lines of one table: (what, tp, dtype) -> value as rows x (TP, dtype) columns, or
    what -> value as one column."""
    if not results:
        return []
    if not isinstance(next(iter(results)), tuple):
        width = max(map(len, results)) + 2
        return [f"{what.ljust(width)}{results[what]:.4f}" for what in sorted(results)]
    whats = sorted({k[0] for k in results})
    cols = sorted({(k[1], k[2]) for k in results})
    width = max(len("quantity"), *map(len, whats)) + 2
    lines = ["quantity".ljust(width) + "".join(f"TP={tp} {dt}".rjust(17) for tp, dt in cols)]
    for what in whats:
        cells = [results.get((what, tp, dt)) for tp, dt in cols]
        lines.append(what.ljust(width) + "".join(("-" if c is None else f"{c:.2e}").rjust(17) for c in cells))
    return lines


def dense_stats(hidden, weight_full, labels, *, vocab_size, temperature=1.0, ignore_index=-100):
    """float64 log p(label), entropy and logits from materialized logits (padding columns cut)."""
    h = hidden.double().reshape(-1, hidden.shape[-1])
    z = (h @ weight_full.double().t())[:, :vocab_size] / temperature
    logp = F.log_softmax(z, dim=-1)
    y = labels.reshape(-1)
    keep = y != ignore_index
    lp = torch.where(keep, logp.gather(1, y.clamp(0, vocab_size - 1).unsqueeze(1)).squeeze(1), 0.0)
    ent = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
    return lp.reshape(labels.shape), ent.reshape(labels.shape), z


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor (in elements) any aten op creates while active: what the memory claims
    (a chunk of logits, never [N, V]) are asserted on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
