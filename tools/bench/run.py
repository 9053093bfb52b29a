"""One row (a method at a chunk size on one shape: first call, errors, memory, time) and one
shape (inputs, reference, every row, × floor)."""

from __future__ import annotations

import time
import traceback

import torch

from .measure import (GIB, Skip, float64_reference, free, log, make_inputs, measure_memory, rel_err, sync,
                      time_paired, time_step, top_probability)
from .methods import ALL_CHUNKS, CHUNKED, MAIN_GRAD, MAKERS, SAMPLERS
from .report import write_json


def resolved_auto_chunk(n, v_local, device, hdim, method):
    """The package's automatic chunk size for this call; None if unknown."""
    try:
        from megatron_fused_ce.ops import api
        return api.auto_chunk_size(n, v_local, device,
                                   logits_element_size=4 if method.endswith("fp32_logits") else 2)
    except Exception:  # noqa: BLE001
        return None


def _search_note(first_call):
    """Run the first call with the sampler's search counters reset -> (its output, note)."""
    from megatron_fused_ce.ops import sampling

    sampling.SEARCH_COUNTS.clear()
    out = first_call()
    c = dict(sampling.SEARCH_COUNTS)
    if not c.get("rows"):
        return out, "no filter: candidates only"
    rows = c["rows"]
    searched = c.get("top_p_search_rows", 0) + c.get("top_k_search_rows", 0)
    return out, f"exact search {searched}/{rows} rows ({100.0 * searched / rows:.1f}%)"


def add_x_plain(rows):
    """Sampler rows: time / ours_logprobs at the same chunk (and TP), same run."""
    plain = {r["chunk"]: r for r in rows if r["method"] in ("ours_logprobs",) and "ms" in r}
    for r in rows:
        if r["method"] in SAMPLERS and "ms" in r and r["chunk"] in plain:
            r["x_plain"] = r["ms"] / plain[r["chunk"]]["ms"]
            r["note"] = (r.get("note", "") + "; " if r.get("note") else "") + f"× plain {r['x_plain']:.3f}"


def run_one(name, chunk, h, w, y, args, reference=None, floor_steps=None):
    """`floor_steps` ({"floor": step, "floor_fwd": step}, --paired-floor): the row is timed in
    alternation with its floor (measure.time_paired) and its x floor is against those times."""
    n, hdim = h.shape
    v = w.shape[0]
    label = f"{name}@{chunk or 'auto'}" if name in CHUNKED else name
    row = dict(impl=label, method=name, chunk=(chunk or "auto") if name in CHUNKED else None,
               N=n, H=hdim, V=v, flops=6.0 * n * hdim * v, dense_logits_bytes=2 * n * v)
    if name in CHUNKED and chunk is None:
        row["chunk_resolved"] = resolved_auto_chunk(n, v, h.device, hdim, name)
    out = None
    try:
        step = MAKERS[name](h, w, y, chunk)
        row["forward_only"] = getattr(step, "forward_only", False)
        if row["forward_only"]:
            row["flops"] = 2.0 * n * hdim * v
        t0 = time.perf_counter()
        if name in SAMPLERS:
            out, row["note"] = _search_note(step)
        else:
            out = step()  # first call: compiles (torch.compile, Triton JIT)
        sync()
        row["first_call_s"] = time.perf_counter() - t0
        if reference is not None and not getattr(step, "is_floor", False):
            first, dx, dw = out
            if row["forward_only"]:
                row["err_logprobs"] = rel_err(first, reference[3])
            elif getattr(step, "loss_kind", "ce") == "ce":
                row["err_loss"] = rel_err(first, reference[0])
                row["err_dx"], row["err_dw"] = rel_err(dx, reference[1]), rel_err(dw, reference[2])
        del out
        out = None
        if name in MAIN_GRAD:
            w.main_grad.zero_()
        if getattr(step, "graphed", False):  # the graphs' memory pool is taken at capture, before any step
            extra = None
            row["note"] = "CUDA graph: memory not measured"
        else:
            extra, out = measure_memory(step)
        del out
        out = None
        row["extra_bytes"] = extra
        if extra is not None:
            row["extra_gib"] = extra / GIB
            row["extra_pct_dense_logits"] = 100.0 * extra / row["dense_logits_bytes"]
            row["extra_pct_dense_logits_8192"] = 100.0 * extra / (2 * 8192 * v)
        if floor_steps and not getattr(step, "is_floor", False):
            floor_step = floor_steps["floor_fwd" if row["forward_only"] else "floor"]
            ms, times, floor_ms, floor_times = time_paired(step, floor_step, args.warmup, args.min_reps,
                                                           args.max_reps, args.budget_ms, args.steady_ms)
            row.update(floor_ms=floor_ms, floor_times_ms=floor_times, x_floor=ms / floor_ms, floor_paired=True)
        else:
            ms, times = time_step(step, args.warmup, args.min_reps, args.max_reps, args.budget_ms)
        row.update(ms=ms, times_ms=times, tflops=row["flops"] / ms / 1e9)
    except Skip as exc:
        row["skipped"] = str(exc)
    except torch.cuda.OutOfMemoryError as exc:
        row["skipped"] = "OOM: " + str(exc).split("\n")[0][:200]
    except Exception as exc:  # noqa: BLE001  (a broken peer must not stop the run)
        row["skipped"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        row["traceback"] = traceback.format_exc()[-2000:]
    finally:
        out = None
        if hasattr(w, "main_grad"):
            del w.main_grad
        if hasattr(w, "grad_added_to_main_grad"):
            del w.grad_added_to_main_grad
        free()
    err = row.get("err_logprobs") if row.get("forward_only") else row.get("err_dx")
    status = row.get("skipped") or (f"{row['ms']:.2f} ms  {row['tflops']:.0f} TFLOP/s  "
                                    f"extra {row.get('extra_gib', float('nan')):.3f} GiB  "
                                    f"err {'lp' if row.get('forward_only') else 'dx'} {err} dw {row.get('err_dw')}")
    log(f"  {label:28s} {status}")
    return row


def impl_list(spec, chunks):
    out = []
    for name in spec.split(","):
        name = name.strip()
        if not name:
            continue
        if name not in MAKERS:
            raise SystemExit(f"unknown impl {name!r}; known: {', '.join(MAKERS)}")
        if name in CHUNKED:
            cs = chunks if name in ALL_CHUNKS else chunks[:1]  # the first --chunks value
            out.extend((name, c) for c in cs)
        else:
            out.append((name, None))
    return out


def bench_shape(shape, impls, args, device, results, section, check=True, spread="random"):
    n, hdim, v = shape
    log(f"\n== {section} ({spread} logits): N={n} H={hdim} V={v}  "
        f"(floor flops 6NHV = {6.0 * n * hdim * v / 1e12:.1f} TFLOP)")
    free()
    h, w, y = make_inputs(n, hdim, v, device, spread=spread)
    p_top = top_probability(h, w)
    log(f"  mean probability of the top token: {p_top:.3f}")
    reference = None
    rows = []
    if check and any(not name.startswith("floor") for name, _ in impls):
        try:
            reference = float64_reference(h, w, y)
        except torch.cuda.OutOfMemoryError:
            log("  (no float64 reference: OOM; errors not checked)")
        free()
    floors = {}
    seen = set()
    # --paired-floor: each row timed in alternation with its own floor (made once per shape)
    floor_steps = ({name: MAKERS[name](h, w, y, None) for name in ("floor", "floor_fwd")}
                   if getattr(args, "paired_floor", False) else None)
    for name, chunk in impls:
        effective = (name, None if chunk is None else min(chunk, n))
        if effective in seen:  # chunk >= N: the same run as chunk = N
            continue
        seen.add(effective)
        row = run_one(name, chunk, h, w, y, args, reference, floor_steps)
        row.update(section=section, spread=spread, p_top=p_top)
        if name in ("floor", "floor_fwd") and "ms" in row:
            floors[name] = row["ms"]
        rows.append(row)
        results["rows"].append(row)
        write_json(results, args.out)
    for row in rows:
        floor = floors.get("floor_fwd" if row.get("forward_only") else "floor")
        if floor and "ms" in row and not row.get("floor_paired"):
            row["x_floor"] = row["ms"] / floor
            row["floor_ms"] = floor
    add_x_plain(rows)
    write_json(results, args.out)
    del h, w, y, reference, floor_steps
    free()
    return rows


