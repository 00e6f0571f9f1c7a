"""The launchers, one per ``cluster.kind`` (base.py says what each answers): the command line
asks ``launcher_for`` once and never branches on the kind itself.

The package's names are imported on first use (PEP 562): a rank supervisor, which imports
launchers/rank.py, does not load the launchers, the preparation and the tracking they use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..config.placement import LOCAL, SLURM, TORCHRUN
from ..lazy import lazy_names

if TYPE_CHECKING:
    from .base import Launcher

# cluster.kind (config/placement.py's LAUNCH_MODES) -> "module:class" of its launcher
LAUNCHERS = {LOCAL: "local:LocalLauncher", SLURM: "slurm:SlurmLauncher",
             TORCHRUN: "torchrun:TorchrunLauncher"}

_WHERE = {"Launcher": "base", "Entry": "process", "Interrupted": "errors",
          "LaunchError": "errors", "RankFailure": "errors", "StoppedBeforeLaunch": "errors"}
__all__ = sorted([*_WHERE, "LAUNCHERS", "launcher_for"])


def launcher_for(cluster: Any, entry: str = "") -> Launcher:
    """The launcher of ``cluster.kind`` (the config's cluster node), whose ranks run ``entry``
    ("module:function": the launching process need not import it; without one, a launcher
    that only answers questions, as whether it waits)."""
    if cluster.kind not in LAUNCHERS:
        from ..run.spec import ConfigError

        raise ConfigError([f"cluster.kind={cluster.kind!r} is not one of "
                           f"{', '.join(LAUNCHERS)}"])
    module, _, name = LAUNCHERS[cluster.kind].partition(":")
    return getattr(importlib.import_module(f".{module}", __name__), name)(cluster, entry)


__getattr__ = lazy_names(__name__, _WHERE, globals())
