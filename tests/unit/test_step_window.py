"""A log window's time (train/loop.py ``_Window``): on CUDA the device's, between the events
queued at its start and behind its log step, whatever the host's clock says; elsewhere the
host's. The events stand in for CUDA's (no GPU here): the first GPU run with offloaded
activations timed its last step from the host clock at 2.4 ms for 65,536 tokens, because the
host had waited for that step's work while it queued it (benchmarks/gpu.md)."""
from __future__ import annotations

import pytest
import torch

from llama_fsdp.train.loop import _Window, step_metrics


class _Event:
    """What ``_Window`` reads of a CUDA event: ``elapsed_time`` in ms to a later one."""

    def __init__(self, at_ms: float):
        self.at_ms = at_ms

    def elapsed_time(self, later: "_Event") -> float:
        return later.at_ms - self.at_ms


def test_the_host_clock_without_events():
    w = _Window.open(torch.device("cpu"), start=100.0)
    assert w.begun is None
    w.excluded = 2.0
    assert w.seconds(now=110.0) == pytest.approx(8.0)


def test_cuda_windows_take_the_devices_interval_not_the_hosts():
    # the host read the window 1 ms after it opened (it had blocked while queueing the step),
    # the device ran the step for 20 s: 20 s it is
    w = _Window(start=100.0, steps=1, tokens=65536, begun=_Event(0.0), ended=_Event(20_000.0))
    assert w.seconds(now=100.001) == pytest.approx(20.0)
    w.excluded = 5.0  # an eval or a save in between, on the host's clock
    assert w.seconds(now=100.001) == pytest.approx(15.0)
    out = step_metrics(loss=1.0, grad_norm=1.0, lr=1e-4, window=w, now=100.001, world=1,
                       mem={}, flops_per_token=1e9, peak_flops=1e15)
    assert out["tokens_per_sec"] == pytest.approx(65536 / 15.0)
    assert out["step_time_s"] == pytest.approx(15.0)
    assert out["mfu"] == pytest.approx(1e9 * 65536 / 15.0 / 1e15)


def test_an_open_window_without_its_end_event_uses_the_host_clock():
    w = _Window(start=10.0, begun=_Event(0.0))  # not yet logged: no end event
    assert w.seconds(now=13.0) == pytest.approx(3.0)
