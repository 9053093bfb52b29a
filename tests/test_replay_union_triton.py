"""replay_union_triton's union-tile kernels against a float64 torch reference, tile by tile.

Instances: S slots not a multiple of BM (and S < BM), rows gathered by a permutation subset or with
repeated rows (padding slots repeat one), each tile's union a random subset of the columns in any
order, one tile with an empty union, one column in every non-empty union, uids' entries past the
last tile garbage (-7, 2**40), NaN in the dZ entries no kernel may read (slots past S, entries past
the last tile), rows / weight / outputs as row-strided views in some cases, integer-valued
inputs (small ints times 0.25: every product and sum exact in bf16) for bit-exact checks. Without a
GPU the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set at import),
with small blocks.

Tolerance of a rounded result (logits, sums of rows) against the float64 reference r: half a unit
in the last place of r in the result's dtype (the one rounding of the stored value) plus 2**-18 *
sum of |terms| (the fp32 sums of at most 64 terms, in any order; a GPU's tf32x3 products of fp32
operands err by about 2**-20 of each term).
"""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from triton_interpret import _interpreted, kernel_modules  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODULE = "megatron_fused_ce.ops.backends.replay_union_triton"
COLS, HIDDEN, SHARED = 90, 40, 3  # H = 40: not a multiple of the 16-wide blocks
GARBAGE = (-7, 2**40)
SENTINEL = -768.0  # exact in bf16 / fp16
NAN = float("nan")

# name: dtype, BM, S, row-strided views, repeated rows, integer-valued, max_union bound, P's bound
CASES = {
    "fp32-strided": dict(dtype=torch.float32, bm=16, slots=2 * 16 + 5, strided=True, repeated=False, exact=False,
                         bound="cols", max_programs=2),
    "bf16-fewer-slots-than-bm": dict(dtype=torch.bfloat16, bm=16, slots=11, strided=False, repeated=True,
                                     exact=False, bound="tight", max_programs=16),
    "bf16-exact": dict(dtype=torch.bfloat16, bm=32, slots=2 * 32 + 5, strided=True, repeated=True, exact=True,
                       bound="tight", max_programs=2),
    "fp16": dict(dtype=torch.float16, bm=16, slots=3 * 16 + 1, strided=False, repeated=False, exact=False,
                 bound="cols", max_programs=16),
}


@pytest.fixture(scope="module")
def union_triton():
    """The kernel module, interpreted off CUDA (defined after triton_interpret's reloads)."""
    if DEVICE.type == "cuda":
        return importlib.import_module(MODULE)
    modules = kernel_modules()
    module = importlib.import_module(MODULE)
    if (not _interpreted(module._union_logits_kernel)
            or module.round_bf16_by_hand is not modules["triton_gemm_stats"].round_bf16_by_hand):
        module = importlib.reload(module)
    assert _interpreted(module._union_sum_rows_kernel)
    return module


@pytest.fixture(params=list(CASES))
def case(request, union_triton, monkeypatch):
    """(module with 16-wide blocks, the instance)."""
    spec = CASES[request.param]
    for name in ("LOGITS_BLOCK_U", "LOGITS_BLOCK_K", "SUM_BLOCK_U", "SUM_BLOCK_H"):
        monkeypatch.setattr(union_triton, name, 16)
    monkeypatch.setattr(union_triton, "MAX_PROGRAMS_PER_TILE", spec["max_programs"])
    return union_triton, _instance(spec, seed=len(request.param))


def _values(g, shape, spec, dtype=None):
    dtype = dtype or spec["dtype"]
    if spec["exact"]:
        return (torch.randint(-2, 3, shape, generator=g) * 0.25).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _strided(g, shape, spec, dtype=None):
    """Random values of `shape`, where the case says so as a row-strided view of a wider tensor
    whose other columns hold NaN (a load past H that is not masked shows)."""
    values = _values(g, shape, spec, dtype).to(DEVICE)
    if not spec["strided"]:
        return values
    wide = torch.full((shape[0], shape[1] + 24), NAN, dtype=values.dtype, device=DEVICE)
    wide[:, 8:8 + shape[1]] = values
    return wide[:, 8:8 + shape[1]]


def _instance(spec, seed):
    g = torch.Generator().manual_seed(seed)
    bm, slots = spec["bm"], spec["slots"]
    tiles = -(-slots // bm)
    n = slots + 7
    if spec["repeated"]:
        set_rows = torch.randint(0, n, (slots,), generator=g)
        set_rows[-3:] = set_rows[0]  # padding slots repeat a row
    else:
        set_rows = torch.randperm(n, generator=g)[:slots]
    unions = []
    for t in range(tiles):
        # tile 0: 50 entries (several union blocks per program); tile 1 empty where there are 3+ tiles
        size = 50 if t == 0 else 0 if (t == 1 and tiles >= 3) else int(torch.randint(1, 41, (), generator=g))
        others = torch.randperm(COLS - 1, generator=g)[:max(size - 1, 0)]
        others = others + (others >= SHARED).long()  # any column but SHARED
        union = torch.cat([torch.tensor([SHARED]), others])[:size]
        unions.append(union[torch.randperm(size, generator=g)])
    sizes = torch.tensor([u.numel() for u in unions])
    tile_start = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    garbage = torch.tensor(GARBAGE).repeat(3)  # U_cap: 6 spare entries
    uids = torch.cat(unions + [garbage])
    return dict(
        spec=spec, bm=bm, slots=slots, tiles=tiles, set_rows=set_rows.to(DEVICE), tile_start=tile_start.to(DEVICE),
        uids=uids.to(DEVICE), used=int(tile_start[-1]), unions=unions, g=g,
        rows=_strided(g, (n, HIDDEN), spec), weight=_strided(g, (COLS, HIDDEN), spec),
        max_union=COLS if spec["bound"] == "cols" else int(sizes.max()))


def _tile_slots(inst, t):
    return range(t * inst["bm"], min((t + 1) * inst["bm"], inst["slots"]))


def _dz(inst, dtype):
    """dZ [U_cap, BM]: random at the written places, NaN where no kernel may read."""
    dz = torch.full((inst["uids"].numel(), inst["bm"]), NAN, dtype=dtype)
    start = inst["tile_start"].cpu()
    for t in range(inst["tiles"]):
        a, b, m = int(start[t]), int(start[t + 1]), len(_tile_slots(inst, t))
        dz[a:b, :m] = _values(inst["g"], (b - a, m), inst["spec"], dtype)
    return dz.to(DEVICE)


def _assert_rounded(got, ref, magnitude, exact):
    """got (a rounded result) within the module doc's tolerance of the float64 reference; equal to
    it where the inputs are integer-valued (the reference is then exact in got's dtype)."""
    dtype, got = got.dtype, got.double().cpu()
    if exact:
        assert torch.equal(ref.to(dtype).double(), ref), "the instance is not exact in the dtype"
        assert torch.equal(got, ref)
        return
    eps = torch.finfo(dtype).eps
    _, exponent = torch.frexp(ref)
    tol = eps * torch.pow(2.0, exponent - 1.0) / 2 + 2.0**-18 * magnitude
    bad = ~((got - ref).abs() <= tol)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off, e.g. {got[bad][:4]} vs {ref[bad][:4]}"


def _union_ids(inst):
    used = inst["uids"][:inst["used"]].cpu()
    assert bool((used >= 0).all()) and bool((used < COLS).all())
    return used


def test_union_logits(case):
    union_triton, inst = case
    x, w = inst["rows"].double().cpu(), inst["weight"].double().cpu()
    start, set_rows = inst["tile_start"].cpu(), inst["set_rows"].cpu()
    dtype = inst["spec"]["dtype"]
    for out_dtype in dict.fromkeys((dtype, torch.float32)):
        # [U_cap, BM] at the head of a longer buffer: a store past U_cap lands in its tail
        spare = torch.full((inst["uids"].numel() + 64, inst["bm"]), SENTINEL, dtype=out_dtype, device=DEVICE)
        out = spare[:inst["uids"].numel()]
        union_triton.union_logits(inst["rows"], inst["weight"], inst["set_rows"], inst["tile_start"], inst["uids"],
                                  out, inst["max_union"], inst["bm"])
        assert bool((spare[out.shape[0]:] == SENTINEL).all()), "written past U_cap"
        out = out.cpu()
        written = torch.zeros(out.shape, dtype=torch.bool)
        for t in range(inst["tiles"]):
            a, b = int(start[t]), int(start[t + 1])
            slots = _tile_slots(inst, t)
            xt, wt = x[set_rows[slots.start:slots.stop]], w[_union_ids(inst)[a:b]]
            written[a:b, :len(slots)] = True
            _assert_rounded(out[a:b, :len(slots)], wt @ xt.T, wt.abs() @ xt.abs().T,
                            inst["spec"]["exact"])
        assert bool((out[~written] == SENTINEL).all()), "written outside the tiles' unions and slots"
        assert written.any() and not written.all()


@pytest.mark.parametrize("order", ["blocks-of-h", "groups-of-1", "groups-of-2"])
@pytest.mark.parametrize("into", ["slots", "rows-added"])
def test_union_sum_rows(case, into, order, monkeypatch):
    """out[r(t * BM + s)] (+)= sum_g dZ[g, s] src[uids[g]]: "slots" overwrites out's rows in slot
    order (dW's use: a tile of columns, its rows of dW), "rows-added" adds into the rows the slots
    name (dX's use: out_rows = the slots' rows, a prefilled buffer; repeated rows only ever get
    zeros added, as replay's padding slots; an empty union's rows are left unwritten). Each program
    order (`by_columns`: groups of tiles, each group's blocks of H together; the last group partial
    where the tiles do not divide) writes every (tile, block of H) once: a block left out stays NaN
    or unchanged, one taken twice adds twice."""
    union_triton, inst = case
    by_columns = order != "blocks-of-h"
    if by_columns:
        monkeypatch.setattr(union_triton, "SUM_GROUP_TILES_BY_COLUMNS", int(order[-1]))
    w = inst["weight"].double().cpu()
    start = inst["tile_start"].cpu()
    dtype = inst["spec"]["dtype"]
    slots = inst["slots"]
    for dz_dtype in dict.fromkeys((dtype, torch.float32)):
        dz = _dz(inst, dz_dtype)
        if into == "rows-added":
            # distinct rows for the slots with entries; a repeated row only where its slots add zeros
            out_rows = torch.randperm(slots + 5, generator=inst["g"])[:slots]
            zero_slots = [t * inst["bm"] + s for t in range(inst["tiles"]) if int(start[t]) == int(start[t + 1])
                          for s in range(inst["bm"]) if t * inst["bm"] + s < slots]
            for s in zero_slots:
                out_rows[s] = out_rows[zero_slots[0]]
            wide = _values(inst["g"], (slots + 5, HIDDEN + 8), inst["spec"], dtype).to(DEVICE)
            out = wide[:, 4:4 + HIDDEN] if inst["spec"]["strided"] else wide[:, :HIDDEN]
            if zero_slots:  # (adding zeros there would write +0.0)
                out[out_rows[zero_slots].to(DEVICE)] = -0.0
            before = out.clone().cpu().double()
            union_triton.union_sum_rows(dz, inst["weight"], inst["tile_start"], inst["uids"], out, inst["bm"],
                                        out_rows=out_rows.to(DEVICE), accumulate=True, by_columns=by_columns)
        else:
            wide = torch.full((slots, HIDDEN + 8), NAN, dtype=dtype, device=DEVICE)
            out = wide[:, 4:4 + HIDDEN] if inst["spec"]["strided"] else wide[:, :HIDDEN].contiguous()
            union_triton.union_sum_rows(dz, inst["weight"], inst["tile_start"], inst["uids"], out, inst["bm"],
                                        by_columns=by_columns)
        dz64, got = dz.double().cpu(), out.cpu()
        for t in range(inst["tiles"]):
            a, b = int(start[t]), int(start[t + 1])
            tile = _tile_slots(inst, t)
            dzt, wt = dz64[a:b, :len(tile)], w[_union_ids(inst)[a:b]]
            ref = dzt.T @ wt  # (zeros for the empty union)
            if into == "rows-added":
                rows = out_rows[tile.start:tile.stop]
                if a == b:  # an empty union: its rows neither read nor written (-0.0 stays)
                    assert torch.equal(got[rows].double(), before[rows]) and bool(got[rows].signbit().all())
                    continue
                ref = ref + before[rows]
                _assert_rounded(got[rows], ref, dzt.abs().T @ wt.abs() + before[rows].abs(), inst["spec"]["exact"])
            else:
                _assert_rounded(got[tile.start:tile.stop], ref, dzt.abs().T @ wt.abs(), inst["spec"]["exact"])
        if into == "rows-added":
            untouched = torch.ones(slots + 5, dtype=torch.bool)
            untouched[out_rows] = False
            assert torch.equal(got[untouched].double(), before[untouched]), "rows no slot names changed"
        if inst["spec"]["strided"]:  # the columns around the view untouched
            if into == "slots":
                assert bool(wide[:, :4].isnan().all()) and bool(wide[:, 4 + HIDDEN:].isnan().all())


def test_no_slots_or_no_union_launches_nothing(union_triton):
    """S = 0 (no tiles) or max_union = 0: the launchers return their outputs untouched."""
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    rows, weight = torch.ones(3, HIDDEN, device=DEVICE), torch.ones(COLS, HIDDEN, device=DEVICE)
    out, dw = torch.full((4, 16), SENTINEL, device=DEVICE), torch.full((COLS, HIDDEN), 2.0, device=DEVICE)
    dx = torch.empty(0, HIDDEN, device=DEVICE)
    start = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    union_triton.union_logits(rows, weight, empty, start, empty, out, COLS, 16)
    union_triton.union_sum_rows(out, weight, start, empty, dx, 16)
    union_triton.union_sum_rows(out, weight, start, empty, dw, 16, out_rows=empty, accumulate=True)
    one_tile = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    union_triton.union_logits(rows, weight, torch.tensor([1, 2], device=DEVICE), one_tile, empty, out, 0, 16)
    assert bool((out == SENTINEL).all()) and bool((dw == 2.0).all())
