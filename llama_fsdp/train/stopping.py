"""Stopping a run cleanly: a scheduler's warning (SIGUSR2, or SIGTERM where the launcher says
it warns), or the user (SIGINT).

SLURM sends SIGUSR2 to every task ``cluster.signal_delay_s`` before the time limit (and before a
preemption where the cluster sets ``PreemptParameters=send_user_signal``); it sends SIGTERM
before it stops a job: a preemption (then SIGKILL after the partition's GraceTime and KillWait),
an admin's requeue or a cancel (SIGKILL after KillWait). The launcher forwards a user's first
Ctrl-C to every rank as SIGINT. A sharded checkpoint is a collective, so a signal only records a
request here. At the next log step the ranks agree on it (it rides on the log step's one
reduction, train/loop.py; on CUDA that is read one step later), save a published checkpoint
together and stop. After SIGTERM they save only when the save fits in the time SLURM leaves
(``Placement.stop_warning_s``, from the partition's GraceTime and KillWait): the last save's
time (or, before any, the checkpoint's load time) against what is left; a save that cannot end
before SIGKILL is not started, and the run stops at once (the requeued job resumes from the
checkpoint before). After a preemption the rank's supervisor sees the job requeued
(launchers/rank.py), and the requeued job resumes from the newest checkpoint; after a user's
stop the run ends, resumable with ``resume=auto``.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable, Optional

from ..config.status import PREEMPTED, USER_STOPPED
from .loop import StopRequested
from ..checkpoint.state import TrainState

log = logging.getLogger(__name__)

# stop requests; the ranks agree on the largest: one rank that sees no time to save stops all
# without saving (a collective save some ranks skipped would hang)
NONE, USER, PREEMPT, PREEMPT_NOW = 0, 1, 2, 3
REASONS = {USER: USER_STOPPED, PREEMPT: PREEMPTED, PREEMPT_NOW: PREEMPTED}  # the run's status


class StopSignals:
    """Records SIGUSR2 (a scheduler's warning), SIGTERM (where ``warning_s`` says SIGKILL
    follows within that many seconds) and SIGINT (a user's stop) as a pending request.
    ``save_s``: how long a save is expected to take (None: not known)."""

    def __init__(self, warning_s: Optional[float] = None,
                 save_s: Callable[[], Optional[float]] = lambda: None) -> None:
        self.code = NONE
        self.warning_s, self.save_s = warning_s, save_s
        self.term_at: Optional[float] = None  # when SIGTERM came (time.monotonic)
        self.why = ""

    def install(self) -> "StopSignals":
        signal.signal(signal.SIGUSR2, lambda *_: self._set(PREEMPT))
        signal.signal(signal.SIGINT, lambda *_: self._set(USER))
        if self.warning_s is not None:
            signal.signal(signal.SIGTERM, lambda *_: self._term())
        return self

    def _set(self, code: int) -> None:
        self.code = max(self.code, code)

    def _term(self) -> None:
        if self.term_at is None:
            self.term_at = time.monotonic()
        self._set(PREEMPT)

    def request(self) -> int:
        """This rank's request now: after SIGTERM, PREEMPT_NOW when a save would not end
        before SLURM's SIGKILL."""
        if self.code != PREEMPT or self.term_at is None or self.warning_s is None:
            return self.code
        need, left = self.save_s(), self.warning_s - (time.monotonic() - self.term_at)
        if need is not None and need > left:
            self.why = (f"a save takes about {need:.0f} s, and SLURM kills the job "
                        f"{max(left, 0):.0f} s from now")
            return PREEMPT_NOW
        return PREEMPT


def stop_handler(save: Callable[[TrainState], Any], *, save_on_user_stop: bool,
                 why: Callable[[], str] = lambda: "") -> Callable[[int, TrainState], None]:
    """The loop's ``on_stop``: save (on a preemption's warning when the save fits; on a user
    stop when checkpointing is on), then raise StopRequested on every rank."""

    def on_stop(code: int, state: TrainState) -> None:
        reason = REASONS.get(code, REASONS[PREEMPT])
        if code == PREEMPT_NOW:
            log.warning("%s: stopping at step %d without a checkpoint (%s); the run resumes "
                        "from its newest one", reason, state.step, why() or "no time to save")
        elif code >= PREEMPT or save_on_user_stop:
            log.warning("%s: saving a checkpoint at step %d", reason, state.step)
            save(state)
        else:
            log.warning("%s at step %d (no checkpoint: save.every_steps=0)", reason, state.step)
        raise StopRequested(reason, state.step)

    return on_stop
