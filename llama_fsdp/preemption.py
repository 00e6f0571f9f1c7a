"""Preemption and time limits: save a checkpoint, then let submitit requeue the job.

SLURM sends SIGUSR2 to every task some time before it preempts a job or its time runs out
(submitit asks for it with `--signal=USR2@<delay>`). submitit's own handler requeues from rank
0 at once, mid-step; a sharded checkpoint is a collective, so here the signal only raises a
flag. At the next step boundary all ranks agree (one all-reduce), save together, and only then
is submitit's handler called: rank 0 requeues the job, whose new run resumes (resume=auto)
from the checkpoint just written.
"""
from __future__ import annotations

import logging
import signal
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

PREEMPT_SIGNALS = (signal.SIGUSR2,)


class Preempted(Exception):
    """Raised on every rank after the preemption checkpoint was written."""


class PreemptionWatcher:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._frame: Any = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "PreemptionWatcher":
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum, self._frame = signum, frame

    def requested(self, device: torch.device) -> bool:
        """True on every rank if any rank got the signal (a collective: call it on all ranks)."""
        flag = torch.tensor([1.0 if self.signum is not None else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and self.signum is None:
            self.signum = int(PREEMPT_SIGNALS[0])
        return flag.item() > 0

    def hand_over(self) -> None:
        """Let submitit requeue (rank 0 requeues and exits; other ranks return here)."""
        previous = self._previous.get(self.signum or PREEMPT_SIGNALS[0])
        if callable(previous):
            previous(self.signum, self._frame)

    def step_hook(self, device: torch.device, save: Callable[[Any], None]) -> Callable[[Any], None]:
        """A LoopContext.on_step_end hook: on a preemption signal, save, requeue, stop."""

        def hook(state: Any) -> None:
            if not self.requested(device):
                return
            log.warning("preemption signal: saving a checkpoint at step %d, then requeueing",
                        state.step)
            save(state)
            if dist.is_initialized():
                dist.barrier()
            self.hand_over()
            raise Preempted(f"preempted after step {state.step}; checkpoint saved, job requeued")

        return hook
