"""Optional native (C++) kernels, compiled on first use with this machine's compiler.

``paged_attention.cpp`` computes decode attention straight from the paged KV pool instead of
gathering every sequence's K and V into a copy first; on CPU that gather was the largest
cost of a decode step. The build (about a minute, once) goes to radixserve's cache
directory under a name that includes the CPU's features, since it is tuned for them
(``-march=native``). Anything that fails (no compiler, no ninja, an unusual CPU) leaves
``paged_ops()`` returning None and attention on its pure-PyTorch path, which gives the same
results. ``RADIXSERVE_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from radixserve.utils import cache_dir

log = logging.getLogger("radixserve")
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_loaded: dict[str, Any] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def paged_ops() -> Any | None:
    """The compiled module (``paged_scores``, ``paged_values``), or None to use PyTorch."""
    if "ops" in _loaded:
        return _loaded["ops"]
    _loaded["ops"] = None
    if os.environ.get("RADIXSERVE_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        key = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode()).hexdigest()[:12]
        name = f"radixserve_paged_attention_{key}"
        build_dir = cache_dir() / "native" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        # the venv's ninja, when the venv is not on PATH (e.g. `.venv/bin/python -m ...`)
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        if not (build_dir / f"{name}.so").exists():
            log.info("building native attention kernels (first run only, about a minute)")
        _loaded["ops"] = load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir),
                              extra_cflags=["-O3", "-march=native"], verbose=False)  # fmt: skip
    except Exception as e:  # any failure just means the PyTorch path
        log.warning("native attention kernels unavailable, using PyTorch: %s", e)
    return _loaded["ops"]
