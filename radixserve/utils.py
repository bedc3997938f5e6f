"""Small helpers with no better home: memory probes for sizing the KV pool, the cache dir, and
the check that the optional plotting package is installed."""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path

import torch

CPU_KV_SHARE = 0.25  # of available RAM
CPU_KV_MAX_BYTES = 4 * 2**30
GPU_KV_SHARE = 0.6  # of free device memory, after the weights are loaded
HOST_KV_DEVICE_MULTIPLE = 8  # a default host tier holds this many device pools ...
HOST_KV_MIN_BYTES = 4 * 2**30  # ... and at least this much ...
HOST_KV_SHARE = 0.5  # ... but no more than this share of the RAM available now


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_kv_cache_bytes(device: str) -> int:
    """A KV budget that leaves room for everything else: a share of what is free now."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free * GPU_KV_SHARE)
    return int(min(CPU_KV_MAX_BYTES, available_ram_bytes() * CPU_KV_SHARE))


def default_host_kv_bytes(device_pool_bytes: int) -> int:
    """The host tier's size when only a storage tier was asked for: enough to keep what many
    device pools evicted (the host tier's job is the live working set the device cannot
    hold), within a share of the free RAM. Memory is committed only as pages are used."""
    want = max(HOST_KV_DEVICE_MULTIPLE * device_pool_bytes, HOST_KV_MIN_BYTES)
    return int(min(want, available_ram_bytes() * HOST_KV_SHARE))


def cache_dir() -> Path:
    """Where radixserve keeps files it can rebuild (tokenizers built from GGUF, kernels):
    ``$RADIXSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/radixserve`` or ``~/.cache/radixserve``."""
    root = os.environ.get("RADIXSERVE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "radixserve"


PLOT_EXTRA = "plots need matplotlib: pip install 'radixserve[plot]'"


def plots_available() -> bool:
    """Whether matplotlib (the ``plot`` extra) is installed; modules that draw import it lazily."""
    return importlib.util.find_spec("matplotlib") is not None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the machine line of a figure."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
