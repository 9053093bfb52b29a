"""triton_common.CachedLaunch: the Triton kernels' launches that skip Triton's per-call argument
binding once a specialization was launched (host time at the row counts RL runs).

A direct launch is only right if it reuses the kernel Triton would have chosen: the key must
separate every pair of argument lists that Triton specializes apart (a tensor's dtype and 16-byte
alignment, an int equal to 1, an int's width and divisibility by 16, the constexprs), and the
parameters after the positional arguments must be passed in the kernel's order with their
defaults. On CPU the key and that order are checked directly; on a GPU a kernel launched through
the cache across those specializations (misaligned views, ints of 1, 16, 17, 2**31) gives
torch's values, as does a launch replayed from a CUDA graph.
"""

import gc

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from megatron_fused_ce.ops.backends import triton_common  # noqa: E402
from megatron_fused_ce.ops.backends.triton_common import CachedLaunch, _kind, _launch_key, _specializer  # noqa: E402


def _scaled_gather(x_ptr, y_ptr, out_ptr, n, stride, scale, BLOCK: tl.constexpr, ADD_Y: tl.constexpr = True):
    """out[i] = scale * x[i * stride] (+ y[i]), i < n."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    value = tl.load(x_ptr + offsets * stride, mask=keep, other=0.0) * scale
    if ADD_Y:
        value += tl.load(y_ptr + offsets, mask=keep, other=0.0)
    tl.store(out_ptr + offsets, value, mask=keep)


def _specialization(args: tuple, options: dict) -> tuple:
    """The reference the generated specializers must equal: (key, values) by a loop over the
    arguments, each dispatched on its type (triton_common._specializer says what the key holds)."""
    key = []
    values = list(args)
    for index, arg in enumerate(args):
        kind = type(arg)
        if kind is torch.Tensor or (kind is not int and isinstance(arg, torch.Tensor)):
            address = arg.data_ptr()
            key += (arg.dtype, (not address & 15) + 2 * arg.is_cuda)
            values[index] = address
        elif kind is int:
            key.append(1 if arg == 1 else (32 if arg & 15 else 48) if -2147483648 <= arg <= 2147483647
                       else (64 if arg < 2**63 else 65, not arg & 15))
        elif kind is float or kind is bool or arg is None:
            key.append(kind)
        else:
            return None, None
    key.append(tuple(options.items()))
    return tuple(key), values


def _key(*args, **options):
    return _launch_key(args, options)


def test_the_key_separates_what_triton_specializes():
    base = torch.zeros(64)
    aligned, misaligned = base[4:], base[1:]  # 16 and 4 bytes past an aligned start
    assert base.data_ptr() % 16 == 0
    assert _key(base) == _key(aligned) != _key(misaligned)
    assert _key(base) != _key(base.double()) != _key(base.long())
    # ints: 1 (a constexpr for Triton), then width (i32 / i64 / u64) and divisibility by 16
    assert _key(1) != _key(17) and _key(1) != _key(16)
    assert _key(16) == _key(32) == _key(-48) == _key(0) != _key(17)
    assert _key(3) == _key(17) == _key(-5) == _key(2**31 - 1)
    assert _key(2**31) != _key(3) and _key(2**31 + 16) != _key(16)
    assert _key(2**40) != _key(2**64 - 16)
    # floats, bools and None by kind, never by value (Triton does not specialize on them)
    assert _key(0.5) == _key(2.0) != _key(True)
    assert _key(True) == _key(False) != _key(1) and _key(None) != _key(0)
    # the options (constexprs, num_warps) by name and value
    assert _key(base, BLOCK=64) != _key(base, BLOCK=128) != _key(base, BLOCK=128, num_warps=8)


def test_the_key_declines_what_it_does_not_cover():
    assert _key([1, 2]) is None  # another kind of argument: Triton's own launch
    assert _key(torch.zeros(4), OPTION=[1]) is None  # an unhashable option
    assert _key(torch.zeros(4), 3, 2.0, BLOCK=8) is not None


def _argument_lists():
    """Argument lists across what the key separates: tensors aligned or not, of other dtypes, a
    CPU one and a Parameter; ints 1, multiples of 16 or not, beyond int32 and int64; floats,
    bools, None; each with options."""
    base = torch.zeros(64)
    tensors = [base, base[1:], base[4:], base.double(), torch.nn.Parameter(torch.zeros(8))]
    ints = [1, 0, 16, 17, -5, -48, 2**31 - 1, 2**31, 2**31 + 16, 2**40, 2**63 + 16, 2**64 - 16]
    lists = []
    for i, tensor in enumerate(tensors):
        for j, number in enumerate(ints):
            lists.append(((tensor, number, tensors[(i + j) % len(tensors)], 0.5 * j, j % 2 == 0, None),
                          {"BLOCK": 64 << (j % 2), "num_warps": 4}))
    lists.append(((), {}))
    lists.append(((3,), {"BLOCK": 8}))
    return lists


def test_the_generated_specializers_give_the_general_key_and_values():
    """The launches compute the key with a function generated for the arguments' kinds: it must
    give _specialization's key and values for every argument list of those kinds."""
    for args, options in _argument_lists():
        specialize = _specializer(tuple(map(_kind, args)))
        assert specialize is not None
        assert specialize(args, options) == _specialization(args, options)


def test_a_specializer_declines_arguments_of_other_kinds():
    base = torch.zeros(4)
    specialize = _specializer(("tensor", "int", "float"))
    assert specialize((base, 3, 0.5), {}) == _specialization((base, 3, 0.5), {})
    # another kind at a position, or another count: (None, None), the launch derives the kinds again
    for args in ((base, 3.0, 0.5), (base, True, 0.5), (3, 3, 0.5), (base, 3, None), (base, 3), (base, 3, 0.5, 1)):
        assert specialize(args, {}) == (None, None)
    # a kind the key does not cover: no specializer (Triton's own launch)
    assert _kind([1, 2]) is None and _kind(torch.float32) is None
    assert _specializer(("tensor", None)) is None


def test_trailing_parameters_follow_the_kernel_order_with_defaults():
    launcher = CachedLaunch(JITFunction(_scaled_gather))
    assert launcher.arg_names[:3] == ["x_ptr", "y_ptr", "out_ptr"]  # the kernel's attributes pass through
    # positional up to `scale`; BLOCK by name; ADD_Y's default
    assert launcher._trailing_arguments(6, {"BLOCK": 64, "num_warps": 4}) == (64, True)
    assert launcher._trailing_arguments(6, {"ADD_Y": False, "BLOCK": 32}) == (32, False)
    # BLOCK has no default: not cached (Triton's launch reports it)
    assert launcher._trailing_arguments(6, {}) is None
    # a runtime parameter given by name would make its value part of the key: not cached
    assert launcher._trailing_arguments(5, {"scale": 2.0, "BLOCK": 64}) is None


def test_launch_hooks_are_seen_when_set(monkeypatch):
    """Triton's profiler adds launch hooks: then Triton launches (it calls them). Unset is None, or
    (Triton >= 3.5) an empty chain, which is always there: read as set, nothing would be cached."""
    from triton import knobs

    from megatron_fused_ce.ops.backends.triton_common import _launch_hooks_set

    assert not _launch_hooks_set()  # the default, on this Triton
    chain_type = type(knobs.runtime.launch_enter_hook)
    if hasattr(knobs.runtime.launch_enter_hook, "calls"):
        hooks = chain_type()
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hooks)
        assert not _launch_hooks_set()
        hooks.add(lambda *args: None)
        assert _launch_hooks_set()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert not _launch_hooks_set()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", lambda *args: None)  # Triton < 3.5: a function
    assert _launch_hooks_set()


def test_interpreted_kernels_launch_through_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not CachedLaunch(JITFunction(_scaled_gather))._direct


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need CUDA")


@pytest.fixture
def launcher():
    if triton_common.interpreting():
        pytest.skip("TRITON_INTERPRET is set: Triton launches as usual")
    return CachedLaunch(triton.jit(_scaled_gather))


def _expected(x, y, n, stride, scale, add_y):
    out = x[: n * stride : stride][:n] * scale
    return out + y[:n] if add_y else out


@cuda
def test_cached_launches_match_torch_across_specializations(launcher):
    g = torch.Generator(device="cuda").manual_seed(0)
    storage = torch.randn(4096 + 64, device="cuda", generator=g)
    y_storage = torch.randn(4096 + 64, device="cuda", generator=g)
    cases = []
    for offset in (0, 1, 4):  # aligned, 4 bytes off, 16 bytes off
        for n, stride in ((16, 1), (17, 1), (1, 2), (33, 3), (1000, 1)):
            for add_y in (True, False):
                cases.append((offset, n, stride, add_y))
    for repeat in range(2):  # the second pass launches every case from the cache
        for offset, n, stride, add_y in cases:
            storage.normal_(generator=g)
            x, y = storage[offset:], y_storage[offset:]
            out = torch.full((n + 8,), float("nan"), device="cuda")
            scale = 0.5 * (1 + repeat)  # a power of two: x * scale + y rounds once, fused or not
            launcher[(triton.cdiv(n, 64),)](x, y, out, n, stride, scale, BLOCK=64, ADD_Y=add_y)
            torch.testing.assert_close(out[:n], _expected(x, y, n, stride, scale, add_y), rtol=0, atol=0)
            assert out[n:].isnan().all()
    assert 0 < len(launcher._compiled) < len(cases)  # shared where the specialization is
    # an int beyond int32: a kernel of its own
    x64 = torch.randn(64, device="cuda", generator=g)
    out = torch.empty(64, device="cuda")
    before = len(launcher._compiled)
    launcher[(1,)](x64, x64, out, 64, 1, 1.0, BLOCK=64, ADD_Y=False)  # an i32 case of the loop's
    assert len(launcher._compiled) == before
    out.fill_(float("nan"))
    launcher[(1,)](x64, x64, out, 2**31 + 64, 1, 1.0, BLOCK=64, ADD_Y=False)  # n as i64: all 64 valid
    assert len(launcher._compiled) == before + 1
    torch.testing.assert_close(out, x64, rtol=0, atol=0)


@cuda
def test_a_cached_launch_is_captured_by_a_cuda_graph(launcher):
    x, y, out = (torch.randn(256, device="cuda") for _ in range(3))
    for _ in range(2):  # compiled and cached before the capture
        launcher[(4,)](x, y, out, 256, 1, 2.0, BLOCK=64)
    torch.cuda.synchronize()
    gc.collect()  # earlier graphs freed now, not by a collection during the capture (docs/performance.md)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher[(4,)](x, y, out, 256, 1, 2.0, BLOCK=64)
    for _ in range(2):
        x.normal_(), y.normal_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)


@cuda
def test_launches_alternating_kinds_of_arguments_match_torch(launcher):
    """A launch site whose arguments change kind (here the scale, an int then a float) takes the
    specializer of the new kinds: each kind its own kernel, each launch torch's values."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x, y = (torch.randn(300, device="cuda", generator=g) for _ in range(2))
    for repeat in range(3):
        for scale in (2, 0.5, 4, 0.25):  # (powers of two: x * scale + y rounds once, fused or not)
            out = torch.full((300,), float("nan"), device="cuda")
            launcher[(5,)](x, y, out, 300, 1, scale, BLOCK=64)
            torch.testing.assert_close(out, x * scale + y, rtol=0, atol=0)
    assert len(launcher._compiled) == 2  # an int scale (not 1) and a float one
