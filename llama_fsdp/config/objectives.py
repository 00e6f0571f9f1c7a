"""The training objectives (``objective=``): one table that the schema, the checks, the spec,
the planner, the MLflow view and llama_fsdp/objective/ read.

| name | what the weights train for                                          | rows hold |
|------|---------------------------------------------------------------------|-----------|
| sft  | next-token cross-entropy on the answers (objective/sft.py)          | records   |
| dpo  | Direct Preference Optimization against a reference (objective/dpo.py) | pairs     |

Torch-free: the command line checks and plans with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import metrics as m

SFT = "sft"
DPO = "dpo"
DEFAULT = SFT


@dataclass(frozen=True)
class Objective:
    name: str
    # Its rows hold preference pairs (a prompt, a chosen and a rejected answer), and the planner
    # counts a reference's forward beside the policy's.
    pairs: bool = False
    # What it logs each step beside the loss (and with "eval_" at eval steps).
    metrics: tuple[str, ...] = ()
    # Its end-of-run numbers: summary name -> the logged metric whose last value it is.
    summary: dict[str, str] = field(default_factory=dict)
    # The names MLflow gets for the generic ones (its loss: a chart of its own).
    logged_as: dict[str, str] = field(default_factory=dict)


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective(SFT),
    Objective(DPO, pairs=True, metrics=m.DPO_METRICS, summary=m.DPO_SUMMARY,
              logged_as=m.DPO_LOGGED_AS),
)}
