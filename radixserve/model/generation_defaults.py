"""Default sampling parameters a model's authors recommend, read from the model itself.

Where they come from, first found wins:
  1. a Hugging Face directory's ``generation_config.json`` (``temperature``, ``top_p``,
     ``top_k``, ``min_p``, ``repetition_penalty``; ``do_sample: false`` means greedy);
  2. a GGUF file's ``general.sampling.*`` metadata (written by recent llama.cpp converters);
  3. ``FAMILY_RECOMMENDATIONS``: the published recommendation of the model's family, matched
     on the GGUF ``general.basename`` / ``general.name`` or the file or directory name.
A model with none of these gets the API's own defaults (an empty dict). The server lets
``--default-sampling`` override single values, and a request's own values always win.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HF_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}

# (pattern on the model's family name, values, where they were published)
FAMILY_RECOMMENDATIONS: list[tuple[str, dict[str, Any], str]] = [
    (r"smollm2", {"temperature": 0.2, "top_p": 0.9}, "the SmolLM2 model card"),
    (
        r"qwen2\.5",
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
        "Qwen2.5-Instruct's generation_config.json",
    ),
    (
        r"llama[-_ ]?3",
        {"temperature": 0.6, "top_p": 0.9},
        "Llama 3 Instruct's generation_config.json",
    ),
]


@dataclass
class GenerationDefaults:
    values: dict[str, Any] = field(default_factory=dict)
    source: str = "the API defaults"

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.values.items())) or "none"
        return f"{shown} (from {self.source})"


def generation_defaults(path: Path) -> GenerationDefaults:
    """What ``path`` (a .gguf file or an HF directory) recommends; never raises on bad
    metadata (a default is a convenience, not a reason to refuse a model)."""
    if path.is_dir():
        found = _from_generation_config(path / "generation_config.json")
        if found is not None:
            return GenerationDefaults(found, "generation_config.json")
        return _from_family([path.name])
    names = [path.stem]
    try:
        meta = _gguf_metadata(path)
    except Exception:  # noqa: BLE001 - unreadable metadata only loses the recommendation
        meta = {}
    found = {GGUF_KEYS[k]: v for k, v in meta.items() if k in GGUF_KEYS}
    if found:
        return GenerationDefaults(_clean(found), "the GGUF file's general.sampling metadata")
    names = [str(meta.get(k, "")) for k in ("general.basename", "general.name")] + names
    return _from_family(names)


def _clean(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key] = int(value) if key == "top_k" else round(float(value), 6)
    return out


def _from_generation_config(file: Path) -> dict[str, Any] | None:
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    values = _clean({k: cfg[k] for k in HF_KEYS if k in cfg})
    if cfg.get("do_sample") is False:
        values = {"temperature": 0.0}  # transformers ignores the sampling knobs then
    return values or None


def _from_family(names: list[str]) -> GenerationDefaults:
    for pattern, values, source in FAMILY_RECOMMENDATIONS:
        if any(re.search(pattern, name, re.IGNORECASE) for name in names if name):
            return GenerationDefaults(dict(values), source)
    return GenerationDefaults()


_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """The scalar metadata of a GGUF file, read from its header alone (gguf's reader parses
    every tokenizer array in Python, which takes seconds); arrays are skipped."""
    wanted = {*GGUF_KEYS, "general.basename", "general.name"}
    out: dict[str, Any] = {}
    with path.open("rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def string() -> str:
            return f.read(read("Q")).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            if kind in _SCALARS:
                return read(_SCALARS[kind])
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, count = read("I"), read("Q")
                if item in _SCALARS:
                    f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
                else:
                    for _ in range(count):
                        value(item)
                return None
            raise ValueError(f"unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = read("I")
        count_fmt = "I" if version == 1 else "Q"
        read(count_fmt)  # tensor count
        for _ in range(read(count_fmt)):
            key = string()
            v = value(read("I"))
            if key in wanted:
                out[key] = v
                if len(out) == len(wanted):
                    break
    return out
