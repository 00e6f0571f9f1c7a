"""Stopping a run cleanly: preemption or the time limit (SIGUSR2), or the user (SIGINT).

SLURM sends SIGUSR2 to every task ``cluster.signal_delay_s`` before it preempts a job or its
time runs out; the launcher forwards a user's first Ctrl-C to every rank as SIGINT. A sharded
checkpoint is a collective, so a signal only records a request here. At the next log step the
ranks agree on it (it rides on the log step's one reduction, train/loop.py; on CUDA that is read
one step later), save a published
checkpoint together and stop: after a preemption the rank's supervisor requeues the job, which
resumes from that checkpoint (launchers/rank.py); after a user's stop the run ends, resumable
with ``resume=auto``.
"""
from __future__ import annotations

import logging
import signal
from typing import Any, Callable

from ..config.status import PREEMPTED, USER_STOPPED
from .loop import StopRequested
from ..checkpoint.state import TrainState

log = logging.getLogger(__name__)

NONE, USER, PREEMPT = 0, 1, 2
REASONS = {USER: USER_STOPPED, PREEMPT: PREEMPTED}  # the run's status when it stops


class StopSignals:
    """Records SIGUSR2 (preemption) and SIGINT (user stop) as a pending request."""

    def __init__(self) -> None:
        self.code = NONE

    def install(self) -> "StopSignals":
        signal.signal(signal.SIGUSR2, lambda *_: self._set(PREEMPT))
        signal.signal(signal.SIGINT, lambda *_: self._set(USER))
        return self

    def _set(self, code: int) -> None:
        self.code = max(self.code, code)

    def request(self) -> int:
        return self.code


def stop_handler(save: Callable[[TrainState], Any], *, save_on_user_stop: bool
                 ) -> Callable[[int, TrainState], None]:
    """The loop's ``on_stop``: save (always on preemption; on a user stop when checkpointing
    is on), then raise StopRequested on every rank."""

    def on_stop(code: int, state: TrainState) -> None:
        reason = REASONS.get(code, REASONS[PREEMPT])
        if code >= PREEMPT or save_on_user_stop:
            log.warning("%s: saving a checkpoint at step %d", reason, state.step)
            save(state)
        else:
            log.warning("%s at step %d (no checkpoint: save.every_steps=0)", reason, state.step)
        raise StopRequested(reason, state.step)

    return on_stop
