"""The name benchmark rows give the machine they ran on, and its free device memory."""

from __future__ import annotations

import os
import platform

import torch


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's with its core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({os.cpu_count()} cores)"


def free_memory(device: torch.device, empty_cache: bool = False) -> int | None:
    """The device's free bytes (cudaMemGetInfo) once its work is done, after the caching allocator handed back
    what it holds (`empty_cache`); None on the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    if empty_cache:
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]
