"""Accelerators by name: dense peak FLOP/s and memory, for MFU and the planner.

MFU divides achieved FLOP/s by the peak of the dtype the matmuls run in: bf16 for the ``bf16``
and ``mixed`` policies, TF32 for ``fp32`` on CUDA (enabled by the worker). Peaks are the
vendors' dense (not 2:4 sparse) tensor-core numbers for the SXM / OAM parts unless the name says
otherwise. ``cluster.peak_tflops`` and ``cluster.device_memory_gb`` override the table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Accelerator:
    key: str  # the cluster.gpu_type name
    bf16_tflops: float
    tf32_tflops: float
    memory_gb: float  # usable device memory as the driver reports it (GB = 1e9 bytes)
    names: tuple[str, ...]  # whole words of torch.cuda.get_device_name(), most specific first

    def peak_flops(self, compute_dtype: str) -> float:
        """Dense peak FLOP/s for matmuls in ``compute_dtype`` ("bfloat16"/"float16"/"float32")."""
        return (self.tf32_tflops if compute_dtype == "float32" else self.bf16_tflops) * 1e12


ACCELERATORS = (
    Accelerator("h100_pcie", 756.0, 378.0, 85.0, ("H100 PCIe",)),
    Accelerator("h100_nvl", 835.0, 417.5, 100.0, ("H100 NVL",)),
    Accelerator("h100", 989.4, 494.7, 85.0, ("H100",)),
    Accelerator("h200_nvl", 835.0, 417.5, 150.0, ("H200 NVL",)),
    Accelerator("h200", 989.4, 494.7, 150.0, ("H200",)),
    Accelerator("gh200", 989.4, 494.7, 102.0, ("GH200",)),
    Accelerator("b200", 2250.0, 1100.0, 191.0, ("B200",)),
    Accelerator("a100_40gb", 312.0, 156.0, 42.0, ("A100-SXM4-40GB", "A100-PCIE-40GB")),
    Accelerator("a100", 312.0, 156.0, 85.0, ("A100",)),
    Accelerator("l40s", 362.0, 183.0, 48.0, ("L40S",)),
    Accelerator("a10", 125.0, 62.5, 24.0, ("A10",)),
    Accelerator("l4", 121.0, 60.0, 24.0, ("L4",)),
    Accelerator("mi300x", 1307.4, 653.7, 206.0, ("MI300X",)),
    # Workstation and consumer cards. Peaks: NVIDIA's architecture whitepapers (GA102 / Ada /
    # RTX Blackwell) and datasheets (A40, L40, RTX A6000, RTX 6000 Ada), dense "FP16/BF16 Tensor
    # with FP32 accumulate": GeForce cards run it at half their FP16-accumulate rate, the pro
    # cards at full rate. Memory: the capacity torch reports (24 GiB parts show 23.6-23.7 GiB;
    # A40 and L40 keep ECC on by default, which reserves 1/16 of it).
    Accelerator("rtx3090", 71.0, 35.6, 25.4, ("RTX 3090",)),
    Accelerator("rtx4090", 165.2, 82.6, 25.4, ("RTX 4090",)),
    Accelerator("rtx5090", 209.5, 104.8, 33.6, ("RTX 5090",)),
    Accelerator("rtx_a6000", 154.8, 77.4, 51.0, ("RTX A6000",)),
    Accelerator("rtx6000_ada", 364.2, 182.1, 51.0, ("RTX 6000 Ada",)),
    Accelerator("a40", 149.7, 74.8, 47.6, ("A40",)),
    Accelerator("l40", 181.0, 90.5, 47.6, ("L40",)),
)
BY_KEY = {a.key: a for a in ACCELERATORS}
DEFAULT_GPU = "h100"  # what a SLURM GPU job is planned for when cluster.gpu_type is unset


def by_device_name(name: str) -> Optional[Accelerator]:
    """The table entry for a device name as CUDA reports it ("NVIDIA H100 80GB HBM3"), matching
    whole words so that A10 is not A100 or A10G; None if unknown."""
    for acc in ACCELERATORS:
        if any(re.search(rf"(?<![A-Za-z0-9]){re.escape(n)}(?![A-Za-z0-9])", name, re.I)
               for n in acc.names):
            return acc
    return None
