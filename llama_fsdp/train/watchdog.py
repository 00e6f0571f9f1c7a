"""Hangs named, not waited out: from the first step on a collective slower than
cluster.train_timeout_s fails the process group, and a step that outlives it leaves every
thread's stack in <run>/hang/rank<r>.txt (NCCL's flight recorder adds the collectives' view on
CUDA: launchers/environment.py)."""
from __future__ import annotations

import datetime
import faulthandler
from typing import Any

from ..config.rundir import RunDir
from ..run.spec import RunSpec


def set_train_timeout(spec: RunSpec) -> None:
    """From the first step on, a collective slower than cluster.train_timeout_s is a hang."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=spec.cluster.train_timeout_s), None)


class HangWatch:
    """Every thread's stack to <run>/hang/rank<r>.txt when a step outlives the training
    timeout (NCCL's flight recorder adds the collectives' view on CUDA: launchers/environment.py)."""

    def __init__(self, spec: RunSpec, rank: int):
        self._path = RunDir(spec.output_dir).hang_file(rank)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._path.open("a")  # faulthandler writes to an open file
        self._timeout = spec.cluster.train_timeout_s + 30

    def arm(self, _state: Any = None) -> None:
        faulthandler.dump_traceback_later(self._timeout, repeat=False, file=self._file)

    def close(self) -> None:
        """Disarm; a run that never hung leaves no empty files behind."""
        faulthandler.cancel_dump_traceback_later()
        self._file.close()
        if self._path.stat().st_size == 0:
            self._path.unlink(missing_ok=True)
            try:
                self._path.parent.rmdir()  # the last rank out, if nothing else is there
            except OSError:
                pass
