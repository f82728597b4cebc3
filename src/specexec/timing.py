"""The one clock every timing in specexec reads."""

from __future__ import annotations

import time

import torch


def clock(device: torch.device) -> float:
    """Wall-clock seconds, after the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
