"""`FusedCEConfig`: the `megatron_cfg` switches, read the way NeMo-RL users write them."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ..ops.agreement import flag_argument, integer_argument

# (canonical key, NeMo-RL's newer alias) for each field.
_ENABLED_KEYS = ("use_linear_ce_fusion_loss", "use_fused_linear_logprobs")
_CHUNK_KEYS = ("linear_ce_fusion_chunk_size", "fused_linear_logprobs_chunk_size")
_MEMORY_MODE_KEYS = ("linear_ce_fusion_memory_mode", "fused_linear_logprobs_memory_mode")
_LOGITS_DTYPE_KEYS = ("linear_ce_fusion_logits_dtype", "fused_linear_logprobs_logits_dtype")
_MAX_CHUNK_BYTES_KEYS = ("linear_ce_fusion_max_chunk_bytes", "fused_linear_logprobs_max_chunk_bytes")
OWN_KEYS = _ENABLED_KEYS + _CHUNK_KEYS + _MEMORY_MODE_KEYS + _LOGITS_DTYPE_KEYS + _MAX_CHUNK_BYTES_KEYS
MEMORY_MODES = ("fast", "lean")  # the ops' memory_mode values (ops.api.MEMORY_MODES)
_LOGITS_DTYPES = ("float32", "fp32")  # spellings of the one non-default choice (fp32 logits)

# A key is a near-miss of one of OWN_KEYS when, lower-cased and with '-' read as '_', its
# difflib similarity ratio to that key is at least this. Every field name of megatron-core's
# TransformerConfig / DistributedDataParallelConfig / OptimizerConfig scores below 0.6 against
# OWN_KEYS; a dropped or swapped letter or a missing suffix (`_loss`, `_size`) scores above 0.85.
NEAR_MISS_RATIO = 0.8


@dataclass(frozen=True)
class FusedCEConfig:
    """Whether the fused log-prob path is on, and how many tokens each chunk of logits covers.

    `chunk_size=None` (the default) lets the op choose (`ops.api.auto_chunk_size`: equal chunks
    whose logits take at most `max_chunk_bytes`, default None = 1 GiB, so the extra memory is flat
    in the number of tokens); an int bounds the transient logits of one chunk to
    `chunk_size x V/TP` elements (and `max_chunk_bytes` is not used).
    `memory_mode`: "fast" (chunks of logits) or "lean" (tiles: extra memory ~2.5 % of the N=8192
    dense logits whatever N, fp32-accurate dW, slower; see `linear_logprobs`).
    `logits_dtype`: None (logits rounded to the input dtype, like Megatron's output layer) or
    "float32" ("fp32" and torch.float32 are read as "float32"): the fused path keeps the fp32
    output of the logits GEMM (`linear_logprobs(logits_dtype=torch.float32)`).
    """

    enabled: bool = False
    chunk_size: Optional[int] = None
    memory_mode: str = "fast"
    logits_dtype: Optional[str] = None
    max_chunk_bytes: Optional[int] = None

    def __post_init__(self):
        for name, as_type in (("enabled", flag_argument), ("chunk_size", integer_argument),
                              ("max_chunk_bytes", integer_argument)):
            object.__setattr__(self, name, as_type(getattr(self, name)))  # one type (frozen dataclass)
        _check_bool("enabled", self.enabled)
        if self.chunk_size is not None:
            _check_chunk_size("chunk_size", self.chunk_size)
        _check_memory_mode("memory_mode", self.memory_mode)
        if self.max_chunk_bytes is not None:
            _check_chunk_size("max_chunk_bytes", self.max_chunk_bytes)
        if self.logits_dtype is not None:
            _check_logits_dtype("logits_dtype", self.logits_dtype)
            object.__setattr__(self, "logits_dtype", "float32")  # one spelling (frozen dataclass)

    def op_logits_dtype(self):
        """The ops' `logits_dtype` argument: torch.float32 or None."""
        if self.logits_dtype is None:
            return None
        import torch

        return torch.float32

    @classmethod
    def from_megatron_cfg(cls, cfg: Optional[Mapping]) -> "FusedCEConfig":
        """Read `use_linear_ce_fusion_loss` / `linear_ce_fusion_chunk_size` (or the aliases
        `use_fused_linear_logprobs` / `fused_linear_logprobs_chunk_size`) from a `megatron_cfg`
        mapping. A missing key keeps its default; a null chunk size means the automatic chunk.

        `linear_ce_fusion_memory_mode` (alias `fused_linear_logprobs_memory_mode`): "fast" / "lean".
        `linear_ce_fusion_logits_dtype` (alias `fused_linear_logprobs_logits_dtype`): null or
        "float32" / "fp32".
        `linear_ce_fusion_max_chunk_bytes` (alias `fused_linear_logprobs_max_chunk_bytes`): a positive
        int, the bound of one chunk of logits when no chunk size is given (null: 1 GiB).
        `megatron_cfg` also carries Megatron's own keys, which pass through unread. A key that
        looks like a misspelling of one of the ten keys above (see `near_miss`) raises
        `ValueError` naming it and the intended key: otherwise a typo would silently leave fusion
        off. A wrong type, or an alias that contradicts its canonical key, also raises `ValueError`
        naming the key.
        """
        if cfg is None:
            return cls()
        if not isinstance(cfg, Mapping):
            raise ValueError(f"megatron_cfg must be a mapping, got {type(cfg).__name__}")
        for key in cfg:
            intended = near_miss(key)
            if intended is not None:
                raise ValueError(f"megatron_cfg key {key!r} is not a megatron_fused_ce key: did you "
                                 f"mean {intended!r}? (valid: {', '.join(OWN_KEYS)})")
        enabled = _read(cfg, _ENABLED_KEYS, _check_bool, normalize=flag_argument)
        chunk_size = _read(cfg, _CHUNK_KEYS, _check_chunk_size, normalize=integer_argument)
        memory_mode = _read(cfg, _MEMORY_MODE_KEYS, _check_memory_mode)
        logits_dtype = _read(cfg, _LOGITS_DTYPE_KEYS, _check_logits_dtype, same=_logits_dtype_name)
        max_chunk_bytes = _read(cfg, _MAX_CHUNK_BYTES_KEYS, _check_chunk_size, normalize=integer_argument)
        return cls(
            enabled=False if enabled is None else bool(enabled),
            chunk_size=None if chunk_size is None else int(chunk_size),
            memory_mode="fast" if memory_mode is None else memory_mode,
            logits_dtype=logits_dtype,
            max_chunk_bytes=None if max_chunk_bytes is None else int(max_chunk_bytes),
        )


def near_miss(key) -> Optional[str]:
    """The package key that `key` most likely misspells, or None (also None for the keys themselves).

    Near-miss: `key` is not one of OWN_KEYS, and lower-cased with '-' read as '_' it either equals
    one of them or has a difflib similarity ratio >= NEAR_MISS_RATIO (0.8) to one.
    """
    if not isinstance(key, str) or key in OWN_KEYS:
        return None
    normalized = key.lower().replace("-", "_")
    if normalized in OWN_KEYS:
        return normalized
    close = difflib.get_close_matches(normalized, OWN_KEYS, n=1, cutoff=NEAR_MISS_RATIO)
    return close[0] if close else None


def _read(cfg: Mapping, keys: tuple, check, same=lambda value: value, normalize=lambda value: value) -> Any:
    found = {key: normalize(cfg[key]) for key in keys if key in cfg and cfg[key] is not None}
    for key, value in found.items():
        check(key, value)
    if len({same(value) for value in found.values()}) > 1:  # `same`: the value a spelling means
        raise ValueError(f"{keys[0]} and {keys[1]} are both set and disagree: {found}")
    return next(iter(found.values()), None)


def _check_bool(key: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be a bool (true/false), got {value!r} ({type(value).__name__})")


def _check_chunk_size(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{key} must be a positive int, got {value!r} ({type(value).__name__})")


def _check_memory_mode(key: str, value) -> None:
    if value not in MEMORY_MODES:
        raise ValueError(f"{key} must be 'fast' or 'lean', got {value!r}")


def _logits_dtype_name(value) -> str:
    return "float32" if str(value) in _LOGITS_DTYPES + ("torch.float32",) else str(value)


def _check_logits_dtype(key: str, value) -> None:
    if isinstance(value, bool) or _logits_dtype_name(value) != "float32":
        raise ValueError(f"{key} must be null (the input dtype) or 'float32' (also 'fp32'), got {value!r}")
