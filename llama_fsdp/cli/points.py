"""What a sweep point hands back to the sweeper and the sweep's callback when it does not finish
(a grid's point and a search's trial alike: multirun.py, search.py)."""
from __future__ import annotations

import dataclasses

from ..run.spec import point_name


@dataclasses.dataclass(frozen=True)
class PointFailed:
    """What a sweep point that did not finish hands back: its values and its exit code (2: its
    config was refused before launch; 1: it failed)."""

    values: dict[str, str]
    code: int

    @property
    def name(self) -> str:
        return point_name(self.values)
