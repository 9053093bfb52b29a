"""Float64 dense references (full logits, F.log_softmax) and the error bookkeeping of the tests."""

from collections import defaultdict

import torch
import torch.nn.functional as F

# (what, tp, dtype) -> worst relative error seen in this run; printed by conftest at the end.
ERRORS = defaultdict(float)
# what -> a memory ratio a test measured (e.g. largest tensor / dense logits); printed apart.
MEMORY = {}


def rel_err(out, ref) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def record(what: str, tp: int, dtype, err: float) -> float:
    key = (what, tp, str(dtype).replace("torch.", ""))
    ERRORS[key] = max(ERRORS[key], err)
    return err


def record_memory(what: str, ratio: float) -> float:
    MEMORY[what] = max(MEMORY.get(what, 0.0), ratio)
    return ratio


def memory_table():
    width = max(map(len, MEMORY)) + 2
    for what in sorted(MEMORY):
        yield f"{what.ljust(width)}{MEMORY[what]:.4f}"


def error_table():
    whats = sorted({k[0] for k in ERRORS})
    cols = sorted({(k[1], k[2]) for k in ERRORS})
    yield "quantity".ljust(20) + "".join(f"TP={tp} {dt}".rjust(17) for tp, dt in cols)
    for what in whats:
        cells = [ERRORS.get((what, tp, dt)) for tp, dt in cols]
        yield what.ljust(20) + "".join(("-" if c is None else f"{c:.2e}").rjust(17) for c in cells)


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
