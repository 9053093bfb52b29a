"""`FusedCEConfig`: the two `megatron_cfg` switches, read the way NeMo-RL users write them."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

# (canonical key, NeMo-RL's newer alias) for each field.
_ENABLED_KEYS = ("use_linear_ce_fusion_loss", "use_fused_linear_logprobs")
_CHUNK_KEYS = ("linear_ce_fusion_chunk_size", "fused_linear_logprobs_chunk_size")

DEFAULT_CHUNK_SIZE = 256


@dataclass(frozen=True)
class FusedCEConfig:
    """Whether the fused log-prob path is on, and how many tokens each chunk of logits covers.

    `chunk_size` bounds the transient logits of one chunk to `chunk_size x V/TP` elements.
    """

    enabled: bool = False
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self):
        _check_bool("enabled", self.enabled)
        _check_chunk_size("chunk_size", self.chunk_size)

    @classmethod
    def from_megatron_cfg(cls, cfg: Optional[Mapping]) -> "FusedCEConfig":
        """Read `use_linear_ce_fusion_loss` / `linear_ce_fusion_chunk_size` (or the aliases
        `use_fused_linear_logprobs` / `fused_linear_logprobs_chunk_size`) from a `megatron_cfg`
        mapping. Other keys are ignored; a missing key keeps its default; a null chunk size means
        the default. A wrong type, or an alias that contradicts its canonical key, raises
        `ValueError` naming the key.
        """
        if cfg is None:
            return cls()
        if not isinstance(cfg, Mapping):
            raise ValueError(f"megatron_cfg must be a mapping, got {type(cfg).__name__}")
        enabled = _read(cfg, _ENABLED_KEYS, _check_bool)
        chunk_size = _read(cfg, _CHUNK_KEYS, _check_chunk_size)
        return cls(
            enabled=False if enabled is None else bool(enabled),
            chunk_size=DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size),
        )


def _read(cfg: Mapping, keys: tuple, check) -> Any:
    found = {key: cfg[key] for key in keys if key in cfg and cfg[key] is not None}
    for key, value in found.items():
        check(key, value)
    if len(set(found.values())) > 1:
        raise ValueError(f"{keys[0]} and {keys[1]} are both set and disagree: {found}")
    return next(iter(found.values()), None)


def _check_bool(key: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be a bool (true/false), got {value!r} ({type(value).__name__})")


def _check_chunk_size(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{key} must be a positive int, got {value!r} ({type(value).__name__})")
