"""Value checks of the engine options, each raising a ``ValueError`` that names the option,
and ``parse_bytes`` for memory sizes given as text (``"2GiB"``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kb": 10**3, "kib": 2**10,
    "m": 2**20, "mb": 10**6, "mib": 2**20,
    "g": 2**30, "gb": 10**9, "gib": 2**30,
}  # fmt: skip


def parse_bytes(value: int | str, name: str | None = None) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        where = f"{name}: " if name else ""
        raise ValueError(f"{where}cannot read {value!r} as a memory size (examples: 2GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def check_int(name: str, value: Any, low: int) -> None:
    """``value`` is an int (not a bool) of at least ``low``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= low:
        return
    if low == 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if low == 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}: {name} must be one of {tuple(choices)}")


def check_endpoint(name: str, value: str | None, pattern: str, example: str) -> None:
    if value is not None and not re.fullmatch(pattern, value):
        raise ValueError(f"{name} must look like {example}, got {value!r}")


def check_float_layers(value: str, kv_cache_dtype: str) -> None:
    """``kv_float_layers``: ``auto``, ``none`` or comma-separated layer indices, the last only
    with ``kv_cache_dtype int8`` (a float pool has no layers to keep apart)."""
    if value in ("auto", "none"):
        return
    parts = value.split(",") if isinstance(value, str) else [None]
    if not all(isinstance(p, str) and p.strip().isdigit() for p in parts):
        raise ValueError(f"kv_float_layers must be auto, none or layer indices such as 0,1,8; "
                         f"got {value!r}")  # fmt: skip
    if kv_cache_dtype != "int8":
        raise ValueError("kv_float_layers lists layers to keep out of an int8 KV cache: it "
                         "needs kv_cache_dtype int8")  # fmt: skip
