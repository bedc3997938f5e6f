"""Optional native (C++) CPU kernels, compiled on first use with this machine's compiler.

One extension module built from ``csrc/``:

- ``flash_attention.cpp``: attention of a step's rows (prompt chunks, decode tokens, window
  layers) straight from the paged KV pool in any KV format, tiled flash-attention style
  (``flash_attention``; ``flash_i8.cpp``: integer dot products for int8 keys);
  ``encode_kv_i8``: int8 KV rows.
- ``quant_gemm.cpp``: matmuls with weights kept block-quantized (Q8_0, Q4_1; GGUF's block
  formats through ``block_formats.cpp``) or dense float (``QWeight``, ``qgemm``,
  ``dequantize``); ``lane_gemm.cpp``: their batched path (8+ rows); ``int8_lanes.cpp`` and
  ``int8_few_rows.cpp``: the same with x rounded to int8 (8+ rows, and 1-7 rows of GGUF's
  Q5 / K-quant formats).
- ``decoder.cpp``: the whole layer stack for a batch of decode tokens in one call
  (``Decoder``), so a decode step pays no per-op Python dispatch.

The build (a minute or two, once) goes to radixserve's cache directory under a name that
includes the sources' hash and the CPU's features, since it is tuned for them
(``-march=native``; the AVX-512 / AVX2 code paths are chosen at compile time, with plain
C++ twins for other CPUs; ``RADIXSERVE_NATIVE_ISA=avx2`` or ``portable`` builds the AVX2-only
or plain C++ paths instead, so that a machine can test the paths of CPUs older than itself;
``-fopenmp``, without which ATen's inline ``parallel_for`` runs every kernel on
one thread); a module of that name already built is imported directly. Anything that fails
(no compiler, no ninja, an unusual CPU) leaves ``paged_ops()`` returning None and every
caller on its pure-PyTorch path, which computes the same function. ``RADIXSERVE_NATIVE=0``
turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from radixserve.utils import cache_dir

log = logging.getLogger("radixserve")
CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "bindings.cpp",
    "flash_attention.cpp",
    "flash_i8.cpp",
    "quant_gemm.cpp",
    "block_formats.cpp",
    "lane_gemm.cpp",
    "int8_lanes.cpp",
    "int8_few_rows.cpp",
    "rowwise.cpp",
    "decoder.cpp",
)
HEADERS = ("kernels.h", "flash.h")
# -fopenmp: at::parallel_for is inline OpenMP in ATen's headers, so without it every kernel
# runs on one thread; the module then shares libtorch's OpenMP runtime (same soname, loaded)
CFLAGS = ("-O3", "-fopenmp")
# RADIXSERVE_NATIVE_ISA: the instruction sets the build may use
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-march=haswell",),
             "portable": ("-march=x86-64", "-mtune=generic")}  # fmt: skip
LDFLAGS = ("-fopenmp",)
STALE_LOCK_S = 900.0
_loaded: dict[str, Any] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _drop_stale_lock(lock: Path) -> None:
    """A build killed midway leaves torch's lock file, and every later build would wait for it
    forever; no build takes anywhere near STALE_LOCK_S, so an older lock is dead."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing the lock of an abandoned native build: %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


def _import_built(name: str, path: Path) -> Any:
    import importlib.util

    import torch  # noqa: F401  (libtorch's symbols, before the extension needs them)

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paged_ops() -> Any | None:
    """The compiled module, or None to use PyTorch."""
    if "ops" in _loaded:
        return _loaded["ops"]
    _loaded["ops"] = None
    if os.environ.get("RADIXSERVE_NATIVE", "1") == "0":
        return None
    isa = os.environ.get("RADIXSERVE_NATIVE_ISA", "native")
    if isa not in ISA_FLAGS:
        known = ", ".join(ISA_FLAGS)
        log.warning("RADIXSERVE_NATIVE_ISA=%s is not one of %s: using native", isa, known)
        isa = "native"
    cflags = (*CFLAGS, *ISA_FLAGS[isa])
    try:
        from torch.utils.cpp_extension import load

        digest = hashlib.sha256(" ".join((_cpu_flags(), *cflags, *LDFLAGS)).encode())
        for file in (*SOURCES, *HEADERS):
            digest.update((CSRC / file).read_bytes())
        name = f"radixserve_native_{digest.hexdigest()[:12]}"
        build_dir = cache_dir() / "native" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(build_dir / "lock")
        # the venv's ninja, when the venv is not on PATH (e.g. `.venv/bin/python -m ...`)
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        built = build_dir / f"{name}.so"
        if built.exists():  # the name pins sources and CPU: no ninja run (file times differ
            _loaded["ops"] = _import_built(name, built)  # after a checkout) nor build lock
            return _loaded["ops"]
        log.info("building native CPU kernels (first run only, a minute or two)")
        sources = [str(CSRC / file) for file in SOURCES]
        _loaded["ops"] = load(name=name, sources=sources, build_directory=str(build_dir),
                              extra_cflags=list(cflags), extra_ldflags=list(LDFLAGS),
                              verbose=False)  # fmt: skip
    except Exception as e:  # any failure just means the PyTorch path
        log.warning("native CPU kernels unavailable, using PyTorch: %s", e)
    return _loaded["ops"]
