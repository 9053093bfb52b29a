"""Agreement of the tensor-parallel ranks on one call's arguments: one collective, the same error on
every rank.

Every rank of a tensor-parallel group must pass the same arguments to one call (labels, temperature,
vocab size, chunk size, options ...). A difference either desynchronizes the collectives (a hang, or
a crash in a mismatched all-reduce) or returns the same wrong values on every rank without a
word. And a check that raises on one rank only leaves its peers waiting in the next collective. So
each rank first collects, without raising:

- its own problems: a failed check, by argument name;
- values that must be equal on every rank: numbers, flags, names, dtypes, counts computed on the
  device, and tensors by a fingerprint computed where they live (`tensor_fingerprint`);
- values the ranks agree on by taking the largest (a count of bad labels, a resolved option);

packs them into one int64 vector, all-reduces it once with MAX (reductions.max_over_ranks) and reads
it back once. A value v that must be equal is stored as the pair (v, ~v): after the MAX,
max(v) == ~max(~v) exactly when every rank had the same v. Then every rank raises the same
ValueError naming the arguments, or goes on with the agreed values.

The layout of the vector must be the same on every rank: every entry is registered
unconditionally, in the same order and by the same method (pass None, or a 0 count, for a value a
rank cannot compute). When a check fails anywhere, only the failed checks are reported: the values
that then differ are its consequences.
"""

from __future__ import annotations

import math
import numbers
import struct
import zlib
from collections import OrderedDict
from typing import Dict, List, Optional

import torch
from torch import Tensor

from . import reductions

# Fingerprints are sums of 31-bit terms (value * odd weight, both taken mod 2^31 with a bit mask:
# integer multiplies, shifts and masks only, no division); a sum of up to 2^32 such terms stays
# below 2^63. An odd weight is invertible mod 2^31, so a changed element always changes its term.
_MASK = 2**31 - 1
_SCRAMBLE = 2654435761  # Knuth's multiplicative hash: a second weight unrelated to the position
_NONE = -(2**62) + 12345  # the code of None (a value no int argument takes in practice)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


# Integer and flag arguments arrive as Python ints / bools, NumPy scalars (configs read through
# NumPy) and 0-d tensors (`.item()` skipped). Every public entry point turns them into Python ints /
# bools first, so that no later `isinstance(x, int)`, `x is True` or repr-based code sees two
# types for one value (a NumPy ignore_index once turned the sampling-mask replay off).
def integer_argument(value):
    """An integer-like argument as a Python int: NumPy integers and 0-d integer tensors become
    `int` (a tensor is read on the host once); anything else, bools included, is returned as it
    is, for the argument's own check to accept or refuse."""
    if type(value) is int or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and not _is_numpy_bool(value):
        return int(value)
    if (isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point()
            and not value.is_complex() and value.dtype != torch.bool):
        return int(value.item())
    return value


def flag_argument(value):
    """A flag as a Python bool: NumPy bools and 0-d bool tensors become `bool`; anything else is
    returned as it is."""
    if value is True or value is False:
        return value
    if _is_numpy_bool(value) or (isinstance(value, Tensor) and value.dim() == 0 and value.dtype == torch.bool):
        return bool(value)
    return value


def real_argument(value):
    """A real-number argument as a Python float: NumPy floats and 0-d floating tensors become
    `float` (ints and bools are returned as they are, like anything else)."""
    if type(value) is float or isinstance(value, (bool, numbers.Integral)):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Tensor) and value.dim() == 0 and value.is_floating_point():
        return float(value.item())
    return value


def typed_options(values) -> Optional[tuple]:
    """Python-level options as a call key holds them: ((type, value), ...); None where one is a
    tensor, which a key would hold by identity, so that a value changed in place between calls
    would find the key of the old one (such calls make no key)."""
    typed = []
    for value in values:
        if isinstance(value, Tensor):
            return None
        typed.append((type(value), value))
    return tuple(typed)


def _is_numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def fits_int64(x) -> bool:
    return is_int(x) and _INT64_MIN <= int(x) <= _INT64_MAX


def value_code(value) -> int:
    """A process-independent int64 code of a plain value (ints as themselves, floats by their
    IEEE-754 bits so that 0.7 and 0.7000001 differ, anything else by a CRC of its repr)."""
    kind = type(value)  # exact-type fast paths first: this runs ~20 times per call
    if kind is int and _INT64_MIN <= value <= _INT64_MAX:
        return value
    if kind is float:
        return struct.unpack("<q", struct.pack("<d", value))[0]
    if value is None:
        return _NONE
    if isinstance(value, bool):
        return int(value)
    if fits_int64(value):
        return int(value)
    if isinstance(value, numbers.Real) and not is_int(value):
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return zlib.crc32(repr(value).encode())


# per device: the position weights of the fingerprint, [2, size] tables of growing sizes (the last
# the largest); a call of n elements reads the first n columns of the last one
_WEIGHT_TABLES: Dict[torch.device, List[Tensor]] = {}


def _position_weights(numel: int, device: torch.device) -> Tensor:
    """[2, numel] int64: (2i + 1) and hash(i) | 1, mod 2^31 (odd, so invertible)."""
    position = torch.arange(numel, dtype=torch.int64, device=device)
    return torch.stack([2 * position + 1, (position * _SCRAMBLE) | 1]) & _MASK


def _fingerprint_weights(numel: int, device: torch.device) -> Tensor:
    """The first `numel` position weights, from a table kept per device (five kernels fewer per
    call; a call fingerprints tensors of several sizes, e.g. GRPO's advantages and mask).

    No table is ever freed: a CUDA graph captured while it was the last one reads it on every
    replay, and freed memory would be handed to other tensors under it. Sizes grow by doubling, so
    the tables of a device take at most twice the largest (16 bytes an element). One made during a
    CUDA graph capture is not kept: its kernels run only when the graph is replayed, and an eager
    call before that would read memory nothing has written."""
    tables = _WEIGHT_TABLES.get(device)
    if tables and tables[-1].shape[1] >= numel:
        table = tables[-1]
        return table if table.shape[1] == numel else table[:, :numel]
    size = max(numel, 2 * tables[-1].shape[1]) if tables else numel
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _position_weights(numel, device)
    table = _position_weights(size, device)
    _WEIGHT_TABLES.setdefault(device, []).append(table)
    return table if size == numel else table[:, :numel]


def tensor_fingerprint(tensor: Tensor) -> Tensor:
    """Two int64 sums over the flattened values (their bits for floats), on the tensor's device:
    sum_i v_i (2i + 1) and sum_i v_i hash(i), every term mod 2^31, v_i = the value's 64 bits folded
    to 31. Equal tensors give equal sums; a changed, swapped or shifted element changes them (for
    all but contrived inputs). A few elementwise integer kernels, no host synchronization."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        flat = flat.view(_SAME_WIDTH_INT[flat.element_size()])
    bits = flat.to(torch.int64)
    if flat.element_size() == 8:  # fold the high 33 bits in: ids >= 2^31 or float64 bit patterns
        bits = bits ^ (bits >> 31)
    # int64 products wrap mod 2^64; their low 31 bits are those of the exact products
    return ((bits & _MASK) * _fingerprint_weights(bits.numel(), bits.device) & _MASK).sum(1)


class Agreement:
    """The checks and must-agree values of one call (see the module doc).

    `checks`: the names of every check this call can fail (the same tuple on every rank).
    Register values with `equal` / `equal_count` / `equal_tensor` / `maximum` / `maximum_count`
    (each returns a key), then `agree()` raises or returns an object whose `[key]` is the agreed
    value (the maximum over ranks). Without a group (one rank) nothing can differ: plain values and
    tensors that must be equal are not recorded (their keys read None), and the vector only
    carries the checks and the counts.
    """

    def __init__(self, fn_name: str, group, device: torch.device, checks):
        self.fn_name, self.group, self.device = fn_name, group, device
        self.single_rank = reductions.group_size(group) == 1
        self.checks = tuple(checks)
        self.problems: dict = {}
        self._signature: list = []  # (name, code) of every plain value: this call's signature
        self._key = None  # the signature, once `remembered` took it
        self._host: list = []  # int64 entries
        self._dev: list = []  # 0-d / 1-d int64 tensors on `device`
        self._slots: list = []  # (key, kind, name, message, host index or (dev index, width))

    # -- registration --------------------------------------------------------------------------
    def fail(self, name: str, message: str) -> None:
        assert name in self.checks, name
        self.problems.setdefault(name, message)

    def failed(self, *names) -> bool:
        return any(name in self.problems for name in names)

    def equal(self, name: str, value, message: Optional[str] = None, *, show_range: bool = False):
        """A plain value (number, flag, name, dtype, tuple ...) that must be the same on every
        rank; `show_range` prints the smallest and largest value (ints) in the error."""
        assert not isinstance(value, Tensor), "use equal_count / equal_tensor for tensors"
        code = value_code(value)
        self._signature.append((name, code))
        if self.single_rank:  # nothing can differ: no slot (a key that reads None)
            return None
        return self._add_host("equal", name, message, [code, ~code], show_range)

    def equal_per_call(self, name: str, value, message: Optional[str] = None):
        """A plain number that must be the same on every rank but may change from call to call (a
        global token count): its type joins the signature, its value this agreement only (a
        remembered signature's later calls compare it in the rank check: api.call_code)."""
        assert not isinstance(value, Tensor), "use equal_count / equal_tensor for tensors"
        self._signature.append((name, ("per call", type(value).__name__)))
        if self.single_rank:
            return None
        code = value_code(value)
        return self._add_host("equal", name, message, [code, ~code], False)

    def equal_count(self, name: str, count, message: Optional[str] = None):
        """An integer computed on the device (a 0-d tensor; an int where a rank has none) that
        must be the same on every rank; kept on the device (no host synchronization here)."""
        return self._add_dev("equal", name, message, self._on_device(count), True)

    def equal_tensor(self, name: str, tensor, message: Optional[str] = None):
        """A tensor (or None, or a plain value) that must be the same on every rank: its shape and
        dtype by a host code, its values by `tensor_fingerprint`."""
        self.equal_layout(name, tensor, message)
        return self.equal_values(name, tensor, message)

    def equal_layout(self, name: str, tensor, message: Optional[str] = None):
        """equal_tensor's host part, in the signature: the shape and dtype (or the plain value)."""
        if isinstance(tensor, Tensor):
            return self.equal(name, (tuple(tensor.shape), str(tensor.dtype)), message)
        return self.equal(name, ("not a tensor", value_code(tensor)), message)

    def equal_values(self, name: str, tensor, message: Optional[str] = None):
        """equal_tensor's device part: the values, by fingerprint (not recorded on one rank)."""
        if self.single_rank:
            return None
        if isinstance(tensor, Tensor):
            fingerprint = tensor_fingerprint(tensor).to(self.device)
        else:  # the same layout as for a tensor
            fingerprint = torch.zeros(2, dtype=torch.int64, device=self.device)
        return self._add_dev("equal", name, message, fingerprint, False)

    def maximum(self, name: str, value: int):
        """A plain int (a flag, an option); agreed = its max over ranks."""
        assert not isinstance(value, Tensor), "use maximum_count for tensors"
        return self._add_host("max", name, None, [int(value)], False)

    def maximum_count(self, name: str, count):
        """An integer computed on the device (a 0-d tensor; an int where a rank has none);
        agreed = its max over ranks."""
        return self._add_dev("max", name, None, self._on_device(count), False)

    def maximum_counts(self, name: str, counts: Tensor):
        """Several integers computed on the device (a 1-D tensor, the same length on every rank);
        agreed = the list of their maxima over ranks."""
        return self._add_dev("maxes", name, None, counts.to(device=self.device, dtype=torch.int64).reshape(-1),
                             False)

    def _on_device(self, count) -> Tensor:
        if isinstance(count, Tensor):
            return count.to(device=self.device, dtype=torch.int64).reshape(1)
        return torch.full((1,), int(count), dtype=torch.int64, device=self.device)

    def _add_host(self, kind, name, message, entries, show_range):
        key = len(self._slots)
        self._slots.append((key, kind, name, message, ("host", len(self._host), len(entries)), show_range))
        self._host.extend(entries)
        return key

    def _add_dev(self, kind, name, message, entries: Tensor, show_range):
        key = len(self._slots)
        offset = sum(t.numel() for t in self._dev)
        self._slots.append((key, kind, name, message, ("dev", offset, entries.numel()), show_range))
        self._dev.append(entries)
        return key

    # -- the collective ----------------------------------------------------------------------------
    def agree(self, extra_messages=None) -> "Agreed":
        """One all-reduce MAX of [failed checks | host entries | device entries | their
        complements] (one concatenation on the device for all device entries); raise the same
        ValueError on every rank if anything failed or differs. `extra_messages(agreed)` may add
        messages computed from the agreed values (e.g. a bad label's example)."""
        flags = [int(name in self.problems) for name in self.checks]
        dev_width = sum(t.numel() for t in self._dev)
        if self.single_rank:  # nothing to reduce: read the device values only (one small copy)
            dev = torch.cat([t.reshape(-1) for t in self._dev]).tolist() if self._dev else []
            values = flags + self._host + dev + [~v for v in dev]
        else:
            vector = torch.tensor(flags + self._host, dtype=torch.int64).to(self.device)
            if self._dev:  # device values, then their complements (read for the "equal" ones)
                dev = torch.cat([t.reshape(-1) for t in self._dev])
                vector = torch.cat([vector, dev, ~dev])
            values = reductions.max_over_ranks(vector, self.group).tolist()

        head = len(flags)
        dev_start = head + len(self._host)
        agreed = Agreed()
        messages, named = [], set()
        for name, failed in zip(self.checks, values[:head]):
            if failed:
                messages.append(self.problems.get(name, f"{name}: invalid on another tensor-parallel rank"))
                named.add(name)
        # A failed check explains the values that differ (a rank that failed registers None):
        # differences are reported only when every check passed everywhere.
        report_differences = not messages
        for key, kind, name, message, (where, offset, width), show_range in self._slots:
            if where == "host":  # "equal": v then ~v side by side; "max": v
                entries = values[head + offset:head + offset + width]
                half = width if kind == "max" else width // 2
                largest, complement = entries[:half], entries[half:]
            else:  # v among the device values, ~v at the same place among their complements
                largest = values[dev_start + offset:dev_start + offset + width]
                complement = values[dev_start + dev_width + offset:dev_start + dev_width + offset + width]
            if kind == "max":
                agreed.values[key] = largest[0]
                continue
            if kind == "maxes":
                agreed.values[key] = list(largest)
                continue
            agreed.values[key] = largest[0]
            if not report_differences or all(a == ~b for a, b in zip(largest, complement)) or name in named:
                continue
            named.add(name)
            if message is None:
                message = (f"{name}: differs across tensor-parallel ranks; every rank of the group "
                           f"must pass the same {name}")
            if show_range:
                message += f" ({~complement[0]} to {largest[0]})"
            messages.append(message)
        if extra_messages is not None:
            messages.extend(extra_messages(agreed))
        if messages:
            raise ValueError(f"{self.fn_name}: " + "; ".join(messages))
        return agreed


    # -- the signature: what the first call of it agreed is remembered -----------------------------
    def signature(self) -> tuple:
        """Everything this call's agreement depends on besides the tensors' contents: the function,
        the group (and this rank in it), the device, every plain value registered so far (shapes,
        dtypes, options), and the checks that failed here."""
        group = (id(self.group), reductions.group_size(self.group), reductions.group_rank(self.group))
        return _Signature((self.fn_name, group, str(self.device), self.checks, tuple(sorted(self.problems)),
                           tuple(self._signature)))

    def remembered(self) -> bool:
        """Whether a call of the same signature was agreed before, with no failed check here. The
        signature is taken here, after the plain values and before the contents are registered:
        `remember` records that one."""
        key = self._key = self.signature()
        if self.problems or key not in _REMEMBERED:
            return False
        _REMEMBERED.move_to_end(key)
        return True

    def remember(self, facts=None) -> None:
        """Record this call's signature (as `remembered` took it) as agreed, after `agree` returned,
        with `facts`: what its later calls must know of this first one (api.py: whether a sampling
        mask had a set at every labelled row), read back by `remembered_facts`."""
        key = self._key
        _REMEMBERED[key] = facts
        _REMEMBERED.move_to_end(key)
        while len(_REMEMBERED) > REMEMBERED_SIGNATURES:
            _REMEMBERED.popitem(last=False)

    def remembered_facts(self):
        """The facts `remember` stored with the signature `remembered` found (None if none)."""
        return _REMEMBERED.get(self._key)

    def signature_code(self) -> int:
        """A process-independent 32-bit code of the signature's values (the part every rank must
        share: not the rank), for the fingerprint that rides on the statistics' all-gather."""
        return zlib.crc32(repr((self.fn_name, self.checks, self._key[-1])).encode())


class _Signature(tuple):
    """A signature that hashes its ~40 values once: a steady call looks its remembered signature
    up on every call (api.py's call memo keeps the object)."""

    _hash = None

    def __hash__(self):
        if self._hash is None:
            self._hash = tuple.__hash__(self)
        return self._hash


# Signatures agreed by a full agreement (least recently used first). A call whose signature is in
# here skips the collective and the read-back: steady state makes no host synchronization. Bounded:
# a run whose shapes keep changing re-agrees an evicted signature, nothing worse.
REMEMBERED_SIGNATURES = 512
_REMEMBERED: "OrderedDict[tuple, object]" = OrderedDict()  # signature -> its first call's facts
MEMOS = [_REMEMBERED]  # every such memo (the losses' input agreement adds its own)


def still_remembered(signature: tuple) -> bool:
    """Whether `signature` (an Agreement.signature() that was remembered) still is; if so it
    becomes the most recently used."""
    if signature not in _REMEMBERED:
        return False
    _REMEMBERED.move_to_end(signature)
    return True


def forget_signatures() -> None:
    """Drop every remembered signature: the next call of each runs the full agreement again."""
    for memo in MEMOS:
        memo.clear()


def fingerprint_pieces(codes: Tensor) -> Tensor:
    """int64 codes (any shape; fingerprints, a signature code) -> fp32 pieces of 21 bits each, exact
    in fp32, for an exact comparison across ranks of fp32 values gathered with the statistics (reductions.RankCheck)."""
    flat = codes.reshape(-1).to(torch.int64)
    mask = 2**21 - 1  # (python scalars only: no host-to-device copy, which would synchronize)
    return torch.cat([flat & mask, (flat >> 21) & mask, (flat >> 42) & mask]).to(torch.float32)


class Agreed:
    def __init__(self):
        self.values = {None: None}  # None: the key of a value registered without a slot (one rank)

    def __getitem__(self, key):
        return self.values[key]


def finite_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
