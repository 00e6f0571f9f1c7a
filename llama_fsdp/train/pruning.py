"""A search's trial stopped early (`-m hydra/sweeper=optuna`, hydra.sweeper.pruner): at each eval
step after step 0, rank 0 reports the trial's eval metric to the study, asks the study's pruner
whether the trial falls behind the trials before it, and every rank stops together when it
does (the answer rides on one all-reduce, as a stop request does). The run ends "pruned": its
MLflow run KILLED, its status column "pruned", never failed; the sweep tells the study the
trial was pruned (llama_fsdp/cli/search.py).

Optuna is imported here only when the run is a trial of a search with a pruner. A study that
cannot be reached is a warning: the trial runs its steps, and is told as any finished one."""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import torch

from ..config.search import SearchTrial

log = logging.getLogger(__name__)


class Pruned(Exception):
    """Raised on every rank at the eval step where the study's pruner stopped the trial."""

    def __init__(self, step: int, why: str):
        super().__init__(f"pruned at step {step}: {why}")
        self.step, self.why = step, why


class TrialReporter:
    """Rank 0's handle on its trial in the study (None where it cannot be had: the search's
    baseline, trial 0, is added to the study after it ran, and has nothing to report to)."""

    def __init__(self, trial: SearchTrial):
        self.spec, self.trial = trial, None
        try:
            self.trial = _open_trial(trial)
        except Exception as e:  # noqa: BLE001 - a study out of reach never stops training
            log.warning("trial %d cannot report to its study (%s: %s): it runs its steps, "
                        "unpruned", trial.number, type(e).__name__, str(e).splitlines()[0][:300]
                        if str(e) else "")

    def prune(self, step: int, metrics: dict[str, float]) -> Optional[str]:
        """Why the trial stops at ``step`` (its value against the pruner), or None."""
        value = metrics.get(self.spec.metric)
        if self.trial is None or step == 0 or value is None or not math.isfinite(value):
            return None
        try:
            self.trial.report(float(value), step)
            if not self.trial.should_prune():
                return None
        except Exception as e:  # noqa: BLE001
            log.warning("trial %d: reporting %s at step %d failed (%s: %s): it goes on "
                        "unpruned", self.spec.number, self.spec.metric, step, type(e).__name__,
                        str(e).splitlines()[0][:300] if str(e) else "")
            self.trial = None
            return None
        pruner = self.spec.pruner.get("_target_", "the pruner").rsplit(".", 1)[-1]
        return (f"{self.spec.metric} {value:.4f} at step {step}: the study's {pruner} stops "
                "this trial there (hydra/sweeper/pruner=none runs every trial whole)")


def _open_trial(trial: SearchTrial) -> Any:
    """The study's running trial of this number, as Optuna's Trial (report, should_prune)."""
    import optuna
    from hydra.utils import instantiate
    from optuna.trial import TrialState

    storage: Any = trial.storage
    if "://" not in storage:  # the journal file in the sweep's folder
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        storage = JournalStorage(JournalFileBackend(storage))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=trial.study, storage=storage,
                              pruner=instantiate(trial.pruner) if trial.pruner else None)
    running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
               if t.number == trial.number]
    if not running:
        log.debug("trial %d is not a running trial of study %s (the run as configured is added "
                  "after it ran): it is not pruned", trial.number, trial.study)
        return None
    return optuna.trial.Trial(study, running[0]._trial_id)


def pruning_hook(trial: Optional[SearchTrial], *, rank: int, device: torch.device,
                 last_step: int) -> Optional[Callable[[int, dict[str, float]], None]]:
    """The loop's ``on_eval`` for a trial of a search with a pruner (None otherwise): every rank
    calls it after each eval, rank 0 asks the study, and all raise Pruned together. Not at
    ``last_step``: a trial at its end has nothing left to save, and finishes (its value told)."""
    if trial is None:
        return None
    reporter = TrialReporter(trial) if rank == 0 else None

    def on_eval(step: int, metrics: dict[str, float]) -> None:
        if step >= last_step:
            return
        why = reporter.prune(step, metrics) if reporter is not None else None
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            flag = torch.tensor([1.0 if why else 0.0], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item() and why is None:
                why = "rank 0's study said so"
        if why:
            raise Pruned(step, why)

    return on_eval
