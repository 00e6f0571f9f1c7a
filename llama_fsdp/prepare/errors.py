"""How preparation refuses a run."""
from __future__ import annotations


class PrepareError(ValueError):
    """Input that cannot train; the message names what is wrong and the fix."""

