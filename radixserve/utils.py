"""Small helpers with no better home: memory probes for sizing the KV pool."""

from __future__ import annotations

import os

import torch

CPU_KV_SHARE = 0.25  # of available RAM
CPU_KV_MAX_BYTES = 4 * 2**30
GPU_KV_SHARE = 0.6  # of free device memory, after the weights are loaded


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
