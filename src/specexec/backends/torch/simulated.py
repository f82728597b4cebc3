"""Simulated offloading, for machines without a GPU: a forward hook on the top-level model makes each
forward last at least (streamed weight bytes) / (GB/s), so the engine's and benchmarks' wall-clock timings
show what streaming the weights at that bandwidth would cost. Such timings are simulations, not
measurements, and the handle's `label` says so; `offload.offload_label` reports it next to real offloading.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from specexec.backends.torch.layers import OffloadError, weight_bytes
from specexec.sizes import format_bytes
from specexec.timing import clock


class SimulatedOffload:
    """Makes each forward of a model take at least `bytes_per_pass / gbps` seconds; see `simulate_offload`."""

    def __init__(self, model: nn.Module, gbps: float, bytes_per_pass: int) -> None:
        self.model = model
        self.gbps = gbps
        self.bytes_per_pass = bytes_per_pass
        self.seconds_per_pass = bytes_per_pass / (gbps * 1e9)
        self.calls = 0
        self.slept_seconds = 0.0  # added on top of the measured compute
        self._starts: list[float] = []  # a stack, in case a forward re-enters the model
        cuda = [p.device for p in model.parameters() if p.device.type == "cuda"]
        self._device = cuda[0] if cuda else torch.device("cpu")
        self._handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]
        model.__dict__["_specexec_simulated"] = self  # read by `offload_label`, not tracked by nn.Module

    @property
    def label(self) -> str:
        return (
            f"simulated offload: {format_bytes(self.bytes_per_pass)} streamed per target forward at "
            f"{self.gbps:g} GB/s (>= {self.seconds_per_pass * 1e3:.1f} ms per forward)"
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.model.__dict__.pop("_specexec_simulated", None)

    def __enter__(self) -> SimulatedOffload:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _before(self, module, args) -> None:
        self._starts.append(clock(self._device))

    def _after(self, module, args, output) -> None:
        start = self._starts.pop()
        if self._starts:  # an inner call: the outermost one is charged
            return
        rest = self.seconds_per_pass - (clock(self._device) - start)
        self.calls += 1
        if rest > 0:
            time.sleep(rest)
            self.slept_seconds += rest


def simulate_offload(model: nn.Module, gbps: float, bytes_per_pass: int | None = None) -> SimulatedOffload:
    """Charge every forward of `model` max(measured compute, bytes_per_pass / gbps GB/s) of wall-clock time.

    bytes_per_pass defaults to `weight_bytes(model)`. The handle's `remove()` (or leaving it as a
    context manager) restores the model; its `label` says what is simulated. Timings taken with it on
    are simulations, not measurements.
    """
    if not gbps > 0 or not math.isfinite(gbps):
        raise OffloadError(f"simulated offload bandwidth must be a positive number of GB/s, got {gbps}")
    return SimulatedOffload(model, gbps, weight_bytes(model) if bytes_per_pass is None else bytes_per_pass)
