"""Helpers shared by the Triton kernels' launchers (triton_backend.py, triton_gemm_*.py,
sampling_triton.py)."""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

try:  # (the package runs without Triton, on the torch backend: only the kernel modules need it)
    from triton.runtime.jit import JITFunction
except ImportError:
    JITFunction = None
try:  # Triton >= 3.4: the launch convention CachedLaunch follows (checked on 3.6 and 3.9)
    from triton import knobs
except ImportError:
    knobs = None

# the current device and stream as Triton's driver reads them for torch (its GPUDriver binds these
# two), called here directly: its `driver.active` lookups are a few microseconds of host time a launch
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

_SM_COUNT: dict = {}
_CAPABILITY: dict = {}


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run on CPU tensors (the test suite on a CPU machine)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (cached), or a small number off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def compute_capability(device: torch.device) -> tuple:
    """(major, minor) of a CUDA device, cached: torch's lookup costs a few microseconds of host time
    on every call, and the launchers ask on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' grids: triton.cdiv is a constexpr function since Triton 3.5,
    a couple of microseconds of host time a call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), without triton.next_power_of_2's host cost (cdiv's)."""
    return 1 << max(n - 1, 0).bit_length()


def f32(t: Tensor) -> Tensor:
    """A per-row coefficient (or a 0-d scalar: a pointer to its value, as a [1] tensor is) as the
    kernels read it: fp32, contiguous; the tensor itself where it already is (`.to` is a
    dispatched op even then, host time at every launch)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return t.to(torch.float32).contiguous()


class CachedLaunch:
    """A @triton.jit kernel launched as `kernel[grid](*args, **options)` with Triton's binding of
    the arguments done once per specialization, not on every call.

    Triton's launch binds every argument, derives the kernel's specialization from it (dtypes,
    16-byte alignment of pointers and integers, integers equal to 1), looks the compiled kernel up and
    launches it: ~34 us of host time a call on an H200 host, where launching the compiled kernel
    itself takes ~12. At the row counts RL runs a call of the op is bound by its host time, and it
    makes several such launches. Here the first call of each specialization goes through Triton
    (compiling it if needed) and keeps its compiled kernel; later calls with the same
    specialization key launch that kernel directly on the current stream, their tensors passed as
    the addresses the key read (the launcher otherwise calls each tensor's data_ptr again and asks
    the driver whether it is a device pointer: ~1 us of host time a tensor). The key holds at least
    what Triton specializes on (`_launch_key`) and whether each tensor is on a CUDA device (a call
    with another tensor goes through Triton, which refuses it), so two calls share a kernel only
    where Triton would give them the same one. The key is computed by a function generated for the
    kinds of arguments the kernel was last launched with (`_specializer`): a launch site passes
    the same kinds on every call. Under the interpreter (CPU tests), with Triton's
    launch hooks (its profiler), a callable grid, an argument of another kind or a Triton older
    than 3.4 (another launch convention), Triton launches as usual."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}
        self._direct = (knobs is not None and isinstance(kernel, JITFunction) and not interpreting()
                        and _current_device is not None and _current_stream is not None)
        # the function that keys the argument kinds this kernel was last launched with (a launch
        # site passes the same kinds every call; `_specializer`), (None, None) for other kinds
        self._specialize = _no_specializer

    def __getattr__(self, name):  # arg_names, fn, ... of the kernel
        if name == "kernel":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **options):
        if not self._direct or callable(grid):
            return self.kernel[grid](*args, **options)
        key, values = self._specialize(args, options)
        if key is None:  # other kinds of arguments than the last launch's
            specialize = _specializer(tuple(map(_kind, args)))
            if specialize is None:  # an argument of a kind not covered here
                return self.kernel[grid](*args, **options)
            self._specialize = specialize
            key, values = specialize(args, options)
        if _launch_hooks_set():
            return self.kernel[grid](*args, **options)
        device = _current_device()
        try:
            entry = self._compiled.get((device, key))
        except TypeError:  # an unhashable option
            return self.kernel[grid](*args, **options)
        if entry is None:
            compiled = self.kernel[grid](*args, **options)
            tail = self._trailing_arguments(len(args), options)
            if compiled is not None and tail is not None:
                self._compiled[(device, key)] = (compiled.run, compiled.function, compiled.packed_metadata, tail)
            return compiled
        run, function, metadata, tail = entry
        grid_size = len(grid)
        run(grid[0], grid[1] if grid_size > 1 else 1, grid[2] if grid_size > 2 else 1,
            _current_stream(device), function, metadata, None, None, None, *values, *tail)
        return None

    def _trailing_arguments(self, num_positional: int, options: dict):
        """The values of the parameters after the positional arguments (constexprs given by name,
        or their defaults), in the kernel's order; None where one has neither."""
        tail = []
        for param in self.kernel.params[num_positional:]:
            if param.name in options:
                if not param.is_constexpr:  # a value given by name would join the key
                    return None
                tail.append(options[param.name])
            elif param.has_default:
                tail.append(param.default)
            else:
                return None
        return tuple(tail)


def _launch_hooks_set() -> bool:
    """Whether a launch hook of Triton's is set (its profiler's): None, or since Triton 3.5 a chain
    of hooks, empty unless one was added."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def cached_launch(kernel) -> CachedLaunch:
    """Decorator (above @triton.jit) of a kernel the host launches: see CachedLaunch."""
    return CachedLaunch(kernel)


def _launch_key(args: tuple, options: dict):
    """What Triton's specialization of these arguments depends on (`_specializer`'s key), or None
    where an argument or an option is of a kind not covered here."""
    specialize = _specializer(tuple(map(_kind, args)))
    key = None if specialize is None else specialize(args, options)[0]
    try:
        hash(key)
    except TypeError:  # an unhashable option
        return None
    return key


# The kinds of positional arguments a key covers, as `_kind` names them (None: another kind).
_KINDS = {Tensor: "tensor", int: "int", float: "float", bool: "bool", type(None): "none"}


def _kind(arg):
    return _KINDS.get(type(arg)) or ("tensor" if isinstance(arg, Tensor) else None)


def _no_specializer(args: tuple, options: dict) -> tuple:
    return None, None


@functools.lru_cache(maxsize=None)
def _specializer(kinds: tuple):
    """For argument lists of these kinds (`_kind`'s, by position), one generated function
    (args, options) -> (key, values): what Triton's specialization of the arguments depends on, and
    the arguments as the compiled kernel's launcher takes them (a tensor as its address); (None,
    None) where the arguments are of other kinds. None where a kind is not covered. The key: a
    tensor's dtype, then whether its address is a multiple of 16 plus 2 where it is on a CUDA
    device; an int's being 1, its width (i32 / i64 / u64) and whether it is a multiple of 16; the
    type of a float or a bool, None; then the options (constexprs, num_warps, ...) by name and
    value (unhashable where an option is). One flat tuple (a tensor adds two items, its dtype, which
    nothing else adds, and a number 0-3; an i32 adds 32 or 48, the latter a multiple of 16).
    Straight-line code, each argument read once: a loop dispatching on every argument's type took
    ~10 us of host time for a launch of 20 arguments on an H200 host, about half of a cached
    launch (tests/test_cached_launch.py keeps that loop as the reference)."""
    if None in kinds:
        return None
    names = [f"a{i}" for i in range(len(kinds))]
    checks = {"tensor": "not isinstance({a}, Tensor)", "int": "type({a}) is not int",
              "float": "type({a}) is not float", "bool": "type({a}) is not bool", "none": "{a} is not None"}
    body, key, values = [], [], []
    for a, kind in zip(names, kinds):
        if kind == "tensor":
            body.append(f"    p_{a} = {a}.data_ptr()")
            key += [f"{a}.dtype", f"(not p_{a} & 15) + 2 * {a}.is_cuda"]
            values.append(f"p_{a}")
        elif kind == "int":  # (1, else i32 / i64 / u64 and divisibility by 16)
            key.append(f"(1 if {a} == 1 else (32 if {a} & 15 else 48) if -2147483648 <= {a} <= 2147483647 "
                       f"else (64 if {a} < 2**63 else 65, not {a} & 15))")
            values.append(a)
        else:  # float, bool, None: by kind
            key.append({"float": "float", "bool": "bool", "none": "NoneType"}[kind])
            values.append(a)
    source = "\n".join([
        "def specialize(args, options):",
        f"    if len(args) != {len(kinds)}:",
        "        return None, None",
        f"    ({', '.join(names)},) = args" if names else "    pass",
        f"    if {' or '.join(checks[kind].format(a=a) for a, kind in zip(names, kinds))}:" if names else "    if False:",
        "        return None, None",
        *body,
        f"    return ({''.join(item + ', ' for item in key)}tuple(options.items()),), [{', '.join(values)}]",
    ])
    namespace = {"Tensor": Tensor, "NoneType": type(None)}
    exec(compile(source, f"<specializer of {len(kinds)} arguments>", "exec"), namespace)
    return namespace["specialize"]
