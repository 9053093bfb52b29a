"""How results are reported: results.json, the markdown tables (summary, targets met / missed,
per shape; tensor parallel), the Pareto and sweep plots, the environment line."""

from __future__ import annotations

import json
import os
import platform
import subprocess

import torch

import megatron_fused_ce

from . import methods
from .measure import GIB, REPO, log


def write_json(results, out_dir, name="results.json"):
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=1, default=str)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(results):
    lines = [f"Device: {results['env'].get('device')}; torch {results['env']['torch']}, "
             f"triton {results['env'].get('triton')}; peers: megatron-core {results['env'].get('megatron-core')}, "
             f"liger-kernel {results['env'].get('liger-kernel')}, cut-cross-entropy "
             f"{results['env'].get('cut-cross-entropy')}, quack-kernels {results['env'].get('quack-kernels')} "
             f"(nvidia-cutlass-dsl {results['env'].get('nvidia-cutlass-dsl')}); QuACK's row kernel in ours: "
             f"{results['env'].get('cute_row_kernel')}; code: {results['env'].get('git')}; "
             f"command: `{results['command']}`", ""]
    main = [r for r in results["rows"] if r["section"] == "shapes"]
    shapes = list(dict.fromkeys((r["N"], r["H"], r["V"]) for r in main))
    for spread in dict.fromkeys(r.get("spread", "random") for r in main):
        rows = [r for r in main if r.get("spread", "random") == spread]
        ptop = {(r["N"], r["H"], r["V"]): r.get("p_top") for r in rows}
        lines += [f"### Summary, {spread} logits: x floor (extra memory, % of the dense bf16 logits)", "",
                  "Fwd+bwd rows against the 3-GEMM floor, forward-only rows (`*_fwd`) against the 1-GEMM "
                  "floor, " + ("each row's floor timed in alternation with it (`--paired-floor`)"
                               if any(r.get("floor_paired") for r in rows) else "both measured in this run")
                  + ". Mean top-token probability: "
                  + ", ".join(f"{s[0]}x{s[1]}x{s[2]}: {ptop.get(s, float('nan')):.3f}" for s in shapes), "",
                  "| method | " + " | ".join(f"{s[0]}x{s[1]}x{s[2]}" for s in shapes) + " |",
                  "|---|" + "---|" * len(shapes)]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            cells = []
            for shape in shapes:
                r = next((r for r in rows if r["impl"] == impl and (r["N"], r["H"], r["V"]) == shape), None)
                if r is None:
                    cells.append("")
                elif "ms" not in r:
                    cells.append("skipped")
                elif r["method"] in ("floor", "floor_fwd"):
                    cells.append(f"{r['ms']:.2f} ms")
                else:
                    mem = r.get("extra_pct_dense_logits")
                    cells.append(f"{_fmt(r.get('x_floor'), '.3f')} ({_fmt(mem, '.1f')} %)")
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(targets_markdown(results))
    for section in dict.fromkeys(r["section"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["section"] == section]
        for key in dict.fromkeys((r.get("spread", "random"), r["N"], r["H"], r["V"]) for r in rows):
            sr = [r for r in rows if (r.get("spread", "random"), r["N"], r["H"], r["V"]) == key]
            floor = next((r for r in sr if r["method"] == "floor" and "ms" in r), None)
            lines.append(f"### {section}, {key[0]} logits: N={key[1]}, H={key[2]}, V={key[3]}"
                         + (f" — floor {floor['ms']:.2f} ms" if floor else ""))
            lines.append("")
            lines.append("| method | ms | TFLOP/s | × floor | extra GiB | extra % dense logits | "
                         "% of N=8192 logits | err loss/log-probs | err dX | err dW | note |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
            for r in sr:
                if "ms" not in r:
                    lines.append(f"| {r['impl']} | - | - | - | - | - | - | - | - | - | {r.get('skipped', '')[:120]} |")
                    continue
                note = f"auto = {r['chunk_resolved']} rows" if r.get("chunk_resolved") else ""
                if r.get("forward_only"):
                    note = (note + "; " if note else "") + "forward only: x 1-GEMM floor"
                err_first = r.get("err_logprobs") if r.get("forward_only") else r.get("err_loss")
                if r.get("note"):
                    note = (note + "; " if note else "") + r["note"]
                lines.append(
                    f"| {r['impl']} | {r['ms']:.2f} | {r['tflops']:.0f} | {_fmt(r.get('x_floor'), '.3f')} | "
                    f"{_fmt(r.get('extra_gib'), '.3f')} | {_fmt(r.get('extra_pct_dense_logits'), '.1f')} | "
                    f"{_fmt(r.get('extra_pct_dense_logits_8192'), '.2f')} | {_fmt(err_first, '.1e')} | "
                    f"{_fmt(r.get('err_dx'), '.1e')} | {_fmt(r.get('err_dw'), '.1e')} | {note} |")
            lines.append("")
    if "kernels" in results:
        k = results["kernels"]
        lines.append(f"### Per-chunk breakdown: [{k['chunk']}, {k['shape'][2]}] bf16 chunk, H={k['shape'][1]}")
        lines.append("")
        lines.append("| op | ms |")
        lines.append("|---|---|")
        for name, ms in k["times_ms"].items():
            lines.append(f"| {name} | {ms if isinstance(ms, str) else format(ms, '.3f')} |")
        lines.append("")
        lines.append(f"Kernel check (triton vs torch backend, rel. err.): {'OK' if k['ok'] else 'FAILED'}; "
                     f"worst {max((v for v in k['checks'].values() if isinstance(v, float)), default=0):.2e}")
    if "sampler_kernels" in results:
        k = results["sampler_kernels"]
        lines += ["", f"### Sampler kernels: [{k['chunk']}, {k['shape'][2]}] bf16 chunk, "
                  f"T={methods.SAMPLER_TEMPERATURE}; check vs torch: {'OK' if k['ok'] else 'FAILED'}", "",
                  "| op | ms |", "|---|---|"]
        lines += [f"| {name} | {ms if isinstance(ms, str) else format(ms, '.3f')} |" for name, ms in k["times_ms"].items()]
    return "\n".join(lines) + "\n"


def _targets(rows_by_impl, sweep_rows):
    """(target, {shape: (value text, ok)}) of the single-GPU targets (docs/design.md §6) for one spread."""

    def x(impl, shape):
        r = rows_by_impl.get((impl, shape))
        return None if r is None or "x_floor" not in r else r

    def check(impl, test, text, needs=(), peers=()):
        def per_shape(shape):  # None: not measured (no row, no memory figure on the CPU, a peer absent)
            r = x(impl, shape)
            if r is None or any(r.get(key) is None for key in needs) or any(x(p, shape) is None for p in peers):
                return None
            return text(r, shape), bool(test(r, shape))
        return per_shape

    def faster(a, b):  # a's x_floor below b's (same shape, spread)
        return lambda r, s: x(b, s) is None or r["x_floor"] < x(b, s)["x_floor"]

    mem = lambda r: r.get("extra_pct_dense_logits_8192", float("nan"))
    x_floor = lambda r, s: f"{r['x_floor']:.3f}"  # noqa: E731

    def at_most(bound):
        return lambda r, s: r["x_floor"] <= bound

    def versus(impl, peer):  # ours' x floor against a peer's, same shape and spread
        return check(impl, faster(impl, peer),
                     lambda r, s: f"{r['x_floor']:.3f} vs {_fmt((x(peer, s) or {}).get('x_floor'), '.3f')}",
                     peers=(peer,))

    out = [
        ("fast SFT CE (`ours_ce`) faster than torch.compile", versus("ours_ce@auto", "torch_compile")),
        ("fast SFT CE ≤ 1.05× floor (stretch)", check("ours_ce@auto", at_most(1.05), x_floor)),
        ("main_grad path (`ours_ce_main_grad`) faster than torch.compile",
         versus("ours_ce_main_grad@auto", "torch_compile")),
        ("main_grad path ≤ 1.05× floor (stretch)", check("ours_ce_main_grad@auto", at_most(1.05), x_floor)),
        ("fast GRPO (`ours_grpo`) ≤ 1.08×", check("ours_grpo@auto", at_most(1.08), x_floor)),
        ("log-probs fwd+bwd (`ours_logprobs`) ≤ 1.36×", check("ours_logprobs@auto", at_most(1.36), x_floor)),
        ("forward-only log-probs (`ours_fwd`) ≤ 1.03× 1-GEMM floor", check("ours_fwd@auto", at_most(1.03), x_floor)),
        ("forward-only log-probs extra ≤ 3 % of the dense logits", check(
            "ours_fwd@auto", lambda r, s: r.get("extra_pct_dense_logits", 1e9) <= 3.0,
            lambda r, s: f"{r.get('extra_pct_dense_logits', float('nan')):.1f} %", needs=("extra_pct_dense_logits",))),
        ("lean CE ≤ 1.40×", check("ours_ce_lean", at_most(1.40), x_floor)),
        ("lean CE extra ≤ 3 % of the N=8192 dense logits", check(
            "ours_ce_lean", lambda r, s: mem(r) <= 3.0, lambda r, s: f"{mem(r):.2f} %",
            needs=("extra_pct_dense_logits_8192",))),
        ("lean CE dW error ≤ 2× fast mode's", check(
            "ours_ce_lean", lambda r, s: x("ours_ce@auto", s) is None or r.get("err_dw", 1) <= 2 * x("ours_ce@auto", s).get("err_dw", 0),
            lambda r, s: f"{_fmt(r.get('err_dw'), '.1e')} vs {_fmt((x('ours_ce@auto', s) or {}).get('err_dw'), '.1e')}")),
        ("main_grad extra ≤ one chunk of logits", check(
            "ours_ce_main_grad@auto",
            lambda r, s: r.get("extra_bytes", 1e30) <= 2 * r.get("chunk_resolved", s[0]) * s[2] * 1.01,
            lambda r, s: f"{r.get('extra_gib', float('nan')):.3f} GiB vs {2 * r.get('chunk_resolved', s[0]) * s[2] / GIB:.3f}",
            needs=("extra_bytes",))),
    ]
    if sweep_rows:
        lean = sorted((r["N"], r) for r in sweep_rows if r["method"] == "ours_ce_lean" and "ms" in r
                      and r.get("extra_pct_dense_logits_8192") is not None)
        if lean:
            worst = max(mem(r) for _, r in lean)
            text = ", ".join(f"N={n}: {mem(r):.2f} %" for n, r in lean)
            out.append(("lean CE flat in N (sweep; % of the N=8192 logits)", lambda s, t=text, w=worst: (t, w <= 3.0)))
    return out


def targets_markdown(results):
    """Each single-GPU target met / missed, per spread, with the measured numbers."""
    main = [r for r in results["rows"] if r["section"] == "shapes"]
    sweep = [r for r in results["rows"] if r["section"] != "shapes"]
    shapes = list(dict.fromkeys((r["N"], r["H"], r["V"]) for r in main))
    lines = []
    for spread in dict.fromkeys(r.get("spread", "random") for r in main):
        by_impl = {(r["impl"], (r["N"], r["H"], r["V"])): r for r in main if r.get("spread", "random") == spread}
        lines += [f"### Targets, {spread} logits (met / missed, measured in this run)", "",
                  "| target | " + " | ".join(f"{s[0]}x{s[1]}x{s[2]}" for s in shapes) + " | verdict |",
                  "|---|" + "---|" * (len(shapes) + 1)]
        for name, per_shape in _targets(by_impl, sweep):
            if name.startswith("lean CE flat"):
                text, ok = per_shape(None)
                lines.append(f"| {name} | {text} |" + " |" * (len(shapes) - 1) + f" **{'met' if ok else 'missed'}** |")
                continue
            cells = [per_shape(s) for s in shapes]
            measured = [c for c in cells if c is not None]
            verdict = "not measured" if not measured else ("met" if all(ok for _, ok in measured) else "missed")
            lines.append(f"| {name} | " + " | ".join("-" if c is None else c[0] + ("" if c[1] else " ✗")
                                                    for c in cells) + f" | **{verdict}** |")
        lines.append("")
    return "\n".join(lines) + "\n"


OURS_STYLE = {"ours_ce": ("fast", "tab:red"), "ours_ce_lean": ("lean", "tab:red"),
              "ours_grpo": ("fast", "tab:orange"), "ours_grpo_lean": ("lean", "tab:orange"),
              "ours_logprobs": ("fast", "tab:purple"), "ours_logprobs_lean": ("lean", "tab:purple"),
              "ours_ce_main_grad": ("fast", "tab:brown"), "ours_ce_main_grad_lean": ("lean", "tab:brown")}


def plot(results, out_dir):
    """One Pareto plot per shape (extra memory vs x floor; fwd+bwd rows, both spreads) and the
    memory sweep."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return []
    paths = []
    main = [r for r in results["rows"] if r["section"] == "shapes" and "x_floor" in r
            and not r.get("forward_only") and r["method"] != "floor" and r.get("extra_bytes") is not None]
    markers = {"random": "o", "peaked": "^"}
    peers = sorted({r["method"] for r in main if r["method"] not in OURS_STYLE})
    colors = dict(zip(peers, plt.get_cmap("tab10").colors[:len(peers)]))
    for shape in dict.fromkeys((r["N"], r["H"], r["V"]) for r in main):
        fig, ax = plt.subplots(figsize=(9, 6))
        for r in (r for r in main if (r["N"], r["H"], r["V"]) == shape):
            mem = max(r["extra_pct_dense_logits"], 0.01)
            mode, color = OURS_STYLE.get(r["method"], (None, colors.get(r["method"], "gray")))
            ax.scatter(mem, r["x_floor"], marker=markers.get(r.get("spread"), "s"), s=55 if mode else 35,
                       color=color, edgecolors="k" if mode == "lean" else "none", linewidths=1.2)
            ax.annotate(r["impl"].replace("@auto", ""), (mem, r["x_floor"]), fontsize=6,
                        xytext=(4, 2), textcoords="offset points")
        ax.axhline(1.0, color="k", lw=0.8)
        for level, style in ((1.05, ":"), (1.40, "--")):
            ax.axhline(level, color="gray", ls=style, lw=0.8)
        ax.axvline(3.0, color="gray", ls="-.", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("extra memory, % of the dense bf16 logits (peak - inputs - returned gradients)")
        ax.set_ylabel("time / 3-GEMM floor (fwd+bwd, same run)")
        ax.set_title(f"N={shape[0]} H={shape[1]} V={shape[2]} on {results['env'].get('device')}\n"
                     "o random logits, ^ peaked logits; ours: red CE, orange GRPO, purple log-probs, "
                     "brown main_grad; black edge = lean", fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"pareto_{shape[0]}x{shape[1]}x{shape[2]}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
        log(f"plot: {path}")
    sweep = [r for r in results["rows"] if r["section"] == "memory sweep" and r.get("extra_gib") is not None
             and not r["method"].startswith("floor")]
    if sweep:
        fig, ax = plt.subplots(figsize=(9, 6))
        for impl in dict.fromkeys(r["impl"] for r in sweep):
            pts = sorted((r["N"], r["extra_gib"]) for r in sweep if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [max(p[1], 1e-4) for p in pts], marker="o", label=impl)
        ns = sorted({r["N"] for r in sweep})
        v = sweep[0]["V"]
        ax.plot(ns, [n * v * 2 / GIB for n in ns], "k--", lw=0.8, label="dense bf16 logits")
        ax.plot(ns, [0.03 * 8192 * v * 2 / GIB for _ in ns], "k:", lw=0.8, label="3 % of the N=8192 logits")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel("extra memory, GiB")
        ax.set_title("Extra memory vs tokens (H=%d, V=%d)" % (sweep[0]["H"], v))
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, "sweep.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def grid_plot(results, out_dir):
    """x floor against N (log scale), one panel per (H, V): every method of the run (forward-only
    rows against the 1-GEMM floor), the targets as dashed lines. None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return None
    rows = [r for r in results["rows"] if r["section"] == "shapes" and "x_floor" in r
            and r["method"] not in ("floor", "floor_fwd")]
    panels = sorted({(r["H"], r["V"]) for r in rows})
    if not panels:
        return None
    columns = min(4, len(panels))
    fig, axes = plt.subplots(-(-len(panels) // columns), columns, figsize=(4.2 * columns, 3.4 * -(-len(panels) // columns)),
                             squeeze=False, sharey=True)
    methods = sorted({r["impl"] for r in rows})
    colors = dict(zip(methods, plt.get_cmap("tab20").colors * 2))
    top = min(3.0, max(r["x_floor"] for r in rows) * 1.05)  # small-N outliers clipped: the targets stay readable
    for ax, (hidden, vocab) in zip(axes.flat, panels):
        for impl in methods:
            points = sorted((r["N"], r["x_floor"]) for r in rows if r["impl"] == impl and (r["H"], r["V"]) == (hidden, vocab))
            if points:
                ax.plot(*zip(*points), marker="o", ms=3, color=colors[impl], label=impl.replace("@auto", ""),
                        ls="--" if "graphed" in impl else "-")  # CUDA-graphed rows dashed
        for level in (1.10, 1.40):
            ax.axhline(level, color="gray", ls=":", lw=0.7)
        ax.axhline(1.0, color="k", lw=0.7)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0.9, top)
        ax.set_title(f"H={hidden} V/rank={vocab}", fontsize=9)
        ax.set_xlabel("N tokens")
    axes.flat[0].set_ylabel("time / floor (same run)")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(f"RL shapes on {results['env'].get('device')}: fwd+bwd / 3-GEMM floor, forward-only / 1 GEMM; "
                 f"CUDA-graphed dashed; dotted: 1.10 and 1.40; clipped at {top:.1f}",
                 fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "rl_grid.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"plot: {path}")
    return path


def environment():
    env = dict(python=platform.python_version(), torch=torch.__version__,
               package=getattr(megatron_fused_ce, "__version__", None))
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), sms=p.multi_processor_count,
                   memory_gib=p.total_memory / GIB, cuda=torch.version.cuda)
    else:
        env["device"] = "cpu (TRITON_INTERPRET=1)"
    for mod, dist in (("megatron.core", "megatron-core"), ("liger_kernel", "liger-kernel"),
                      ("cut_cross_entropy", "cut-cross-entropy"), ("quack", "quack-kernels"),
                      ("cutlass", "nvidia-cutlass-dsl")):
        try:
            from importlib.metadata import version
            env[dist] = version(dist)
        except Exception:  # noqa: BLE001
            env[dist] = None
    if torch.cuda.is_available():
        from megatron_fused_ce.ops.backends import cute_backend
        # (where a chunk holds the work of cute_backend.worth_launching)
        env["cute_row_kernel"] = cute_backend.ENABLED and cute_backend._available(torch.device("cuda"))
    try:
        git = ["git", "-C", str(REPO)]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        changed = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=10).stdout.strip()
        env["git"] = (head + ("+uncommitted changes" if changed else "")) or None
    except Exception:  # noqa: BLE001
        env["git"] = None
    return env


# ------------------------------------------------------------------------------ tensor-parallel mode
# torchrun --nproc_per_node N tools/benchmark.py --tp N: one process per GPU (NCCL), the same global
# shapes (N tokens, H, V); every rank holds the full hidden [N, H] (no sequence parallel) and a V/TP
# vocab shard of the weight. Every method's dX is the full (TP-summed) input gradient, so the

def tp_markdown(results):
    tp = results["tp"]
    lines = [f"Device: {results['env'].get('device')} × {tp} ({results['backend']}); torch {results['env']['torch']}, "
             f"triton {results['env'].get('triton')}; command: `{results['command']}`", "",
             "Per GPU, forward+backward, median over repeats (max over ranks), barrier before each timed "
             "region; every dX is the full TP-summed input gradient (Megatron rows include the "
             "all-reduce after backward). Floor = the 3 GEMMs of one vocab shard + the dX all-reduce "
             "([N, H] bf16), each measured in this run.", ""]
    sec = f"tp{tp}"
    rows = [r for r in results["rows"] if r.get("section") == sec]
    for shape in dict.fromkeys((r["N"], r["H"], r["V"]) for r in rows):
        sr = [r for r in rows if (r["N"], r["H"], r["V"]) == shape]
        floor = next((r for r in sr if r["method"] == "floor"), None)
        head = f"### TP={tp}: N={shape[0]}, H={shape[1]}, V={shape[2]}"
        if floor:
            head += (f" — per-GPU floor {floor['ms']:.2f} ms = GEMMs {floor['floor_gemm_ms']:.2f} + "
                     f"dX all-reduce {floor['allreduce_ms']:.2f}")
        lines += [head, "", "| method | ms | × per-GPU floor | × floor GEMMs | extra GiB | extra % dense logits "
                  "(shard) | err loss | err dX | err dW | note |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sr:
            if r["method"] == "floor":
                continue
            if "ms" not in r:
                lines.append(f"| {r['impl']} | - | - | - | - | - | - | - | - | {r.get('skipped', '')[:160]} |")
                continue
            note = r.get("note", "")
            if r.get("chunk_resolved"):
                note = (note + "; " if note else "") + f"auto = {r['chunk_resolved']} rows"
            lines.append(
                f"| {r['impl']} | {r['ms']:.2f} | {_fmt(r.get('x_floor'), '.3f')} | {_fmt(r.get('x_floor_gemm'), '.3f')} | "
                f"{_fmt(r.get('extra_gib'), '.3f')} | {_fmt(r.get('extra_pct_dense_logits'), '.1f')} | "
                f"{_fmt(r.get('err_loss'), '.1e')} | {_fmt(r.get('err_dx'), '.1e')} | {_fmt(r.get('err_dw'), '.1e')} | "
                f"{note} |")
        lines.append("")
    if results["scaling"]:
        lines += [f"### Scaling TP=1 → TP={tp} (best chunk per method; targets: fraction ≤ 0.55 at TP=2, "
                  f"efficiency ≥ 85% at TP=4)", "",
                  "| N, H, V | method | TP=1 ms | TP=%d ms per GPU | fraction of TP=1 | efficiency t1/(TP·tN) | "
                  "TP=1 source |" % tp, "|---|---|---|---|---|---|---|"]
        for s in results["scaling"]:
            lines.append(f"| {s['N']}, {s['H']}, {s['V']} | {s['method']} ({s['impl_tp1']} → {s['impl_tp']}) | "
                         f"{s['t1_ms']:.2f} | {s['tN_ms']:.2f} | {s['fraction']:.3f} | {100 * s['efficiency']:.1f}% | "
                         f"{s.get('source') or ''} |")
        lines.append("")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


