"""checkpointing.offload: what activation checkpointing keeps of each wrapped layer (its input,
which the non-reentrant checkpoint saves as a saved tensor) lives in pinned host memory from the
layer's forward to its backward.

Saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, as
``torch.autograd.graph.save_on_cpu`` and torchtune's activation offloading use them) are active
only around a checkpointed layer's call, so they see exactly what the checkpoint keeps: inside
the layer the checkpoint's own hooks take over. On CUDA each tensor is copied to pinned memory
on a side stream (the device copy is released once that copy is done), and in backward it is
brought back on the side stream; while a layer is recomputed, the input of the layer before it
is already on its way back. On CPU the hooks make a plain copy: the same path, the same values,
and nothing saved (a CPU run's activations are host memory already).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..config.schema import CheckpointingConfig


@dataclass(eq=False)
class _Packed:
    """One saved tensor, offloaded: its host copy, and its way back to the device. Compared by
    identity (``unpack`` finds it in the waiting list): a dataclass's field-wise ``==`` compares
    the tensors, which raises for any of more than one element (the first CUDA run of
    checkpointing.offload, 8B QLoRA at 65,536 tokens on an H200, failed so in backward)."""

    host: torch.Tensor
    device: torch.device
    back: Optional[torch.Tensor] = None  # on the device again (prefetched), not yet used
    ready: Any = None  # the side stream's event after ``back`` was copied


class ActivationOffload:
    """The saved-tensor hooks of checkpointing.offload for one model (``attach``)."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self.stream = torch.cuda.Stream() if self.cuda else None
        self._waiting: list[_Packed] = []  # offloaded, not yet unpacked: forward order
        self._active: list[Any] = []  # the hooks contexts entered (one per layer call)

    # --- the hooks ---------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        if t.numel() == 0:  # torch 2.11's checkpoint saves an empty placeholder per layer
            return t
        if not self.cuda:
            host = torch.empty_like(t)
            host.copy_(t)
            return _Packed(host, t.device)
        if t.device.type != "cuda":
            return t
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the device copy is freed once the side stream is done
        packed = _Packed(host, t.device)
        self._waiting.append(packed)
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if not self.cuda:
            return packed.host
        if packed.back is None:
            self._bring_back(packed)
        current = torch.cuda.current_stream()
        current.wait_event(packed.ready)
        t, packed.back = packed.back, None
        t.record_stream(current)
        if packed in self._waiting:
            self._waiting.remove(packed)
        if self._waiting:  # the next one backward will need: the layer before this one's
            self._bring_back(self._waiting[-1])
        return t

    def _bring_back(self, packed: _Packed) -> None:
        if packed.back is not None:
            return
        with torch.cuda.stream(self.stream):
            packed.back = packed.host.to(packed.device, non_blocking=True)
            packed.ready = self.stream.record_event()

    # --- around each checkpointed layer ----------------------------------------------------------

    def enter(self, module: nn.Module, args: Any) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._active.append(hooks)

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._active.pop().__exit__(None, None, None)


def attach(layers: nn.ModuleList, ac: CheckpointingConfig, *, device_type: str) -> int:
    """checkpointing.offload: hooks on the checkpointed layers (the outermost module in
    ``layers``: compiled or sharded, the hooks run outside both); how many were hooked."""
    if not ac.offload:
        return 0
    offload = ActivationOffload(device_type)
    wrapped = ac.wrapped_layers(len(layers))
    for i in wrapped:
        layers[i].register_forward_pre_hook(offload.enter)
        layers[i].register_forward_hook(offload.exit, always_call=True)
    return len(wrapped)
