"""Import noise that says nothing about the run, dropped once per process (llama_fsdp/__init__.py
installs it before anything imports torch).

torchao (imported by the low-bit optimizers, and by transformers itself when torchao is
installed) tries to load its CUDA-only kernel libraries and logs "Failed to load ... .so" for
each on a machine without them, and registers Enums that torch >= 2.13 reports as deprecated
("... is an Enum subclass ... register_constant() ... deprecated"), and without triton (CPU-only
builds) says "Detected no triton". All are plain `logging` records; a filter on each of their
loggers drops exactly those messages and lets every other record of those loggers through.
"""
from __future__ import annotations

import logging
import warnings

# logger name -> substrings of the messages dropped
NOISE = {
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("register_constant() on Enum subclasses is deprecated",),
    # its int8 matmul kernels (which llama_fsdp never calls) need triton: CPU-only builds
    "torchao.kernel.intmm": ("Detected no triton",),
}


class _DropNoise(logging.Filter):
    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(n in message for n in self.needles)


# warnings (the warnings module) of the same kind: torch's AOTAutograd cache asks torchao's
# optimizer states for a cache hash they lack; llama_fsdp.train.optimizer keeps one inductor cache per
# optimizer, block size and rank instead (see there)
WARNINGS = (r"OptimState(8|4)bit does not implement _stable_hash_for_caching",)


def install() -> None:
    """Add the filters (once: a second call adds nothing)."""
    for message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for name, needles in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(needles))
