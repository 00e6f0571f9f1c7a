"""The optimizers (``optim=``): one table that config, validation, the spec, the checkpoint's
optimizer record and train/optimizer.py read.

| name      | moments (exp_avg, exp_avg_sq)                                  | default block |
|-----------|----------------------------------------------------------------|---------------|
| adamw     | in the parameters' dtype (torch's AdamW)                       | -             |
| adamw8bit | 8-bit codes with an fp32 scale per block (torchao's AdamW8bit) | 256           |
| adamw4bit | 4-bit codes with an fp32 scale per block (torchao's AdamW4bit) | 128           |

Torch-free: the command line checks and plans with it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Optimizer:
    name: str
    moment_bits: int  # 0: the parameters' dtype; 8 or 4: torchao's low-bit codes
    default_block: int = 0  # elements per scale of low-bit moments (torchao's defaults)

    @property
    def lowbit(self) -> bool:
        return self.moment_bits > 0


OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("adamw", 0),
    Optimizer("adamw8bit", 8, default_block=256),
    Optimizer("adamw4bit", 4, default_block=128),
)}
DEFAULT = "adamw"
