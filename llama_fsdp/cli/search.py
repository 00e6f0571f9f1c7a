"""`-m hydra/sweeper=optuna`: a search where the basic sweeper runs a grid (config/search.py has
its keys). Each trial is a sweep point, launched through Hydra's launcher as a grid's points
are: the same parent run, a child run per trial, the saved view with the searched keys first,
the summary with its best point (multirun.SweepCallback). Optuna's ask-and-tell API picks the
values; the study lives in the sweep's folder, so the same command (with
``hydra.sweep.dir=<its folder>``) resumes it without running a told trial again.

What each trial tells the study: the objective (tracking.best_metric / best_mode, read from the
point's MLflow run) when it finished; FAIL when it diverged (exit 3), was refused (exit 2),
failed, or has no value of the metric; a trial left running by an interrupted sweep is told
FAIL when the sweep resumes and asked again with the same values (or told its value, when its
run had finished). Optuna is imported only here, when a search runs."""
from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobStatus
from omegaconf import DictConfig, OmegaConf

from ..config import metrics as names
from ..config.search import (NO_PRUNER, SEARCH_CHART, SEARCH_TABLE, STUDY_FILE, SWEEPER_TARGET,
                             SearchTrial)
from ..config.status import (DIVERGED, EXIT_DIVERGED, FINISHED, MLFLOW_FAILED, PRUNED,
                             STATUS_WORDS, mlflow_status)
from ..launchers import launcher_for
from ..tracking import open_client, read_run_file
from ..tracking.store import resolve_tracking_uri
from ..tracking.sweep import Best, parent_run, sweep_id_for
from ..tracking.view import DIVERGED_AT_TAG, PRUNED_AT_TAG
from .overrides import rerun_command
from .points import PointFailed

log = logging.getLogger("llama_fsdp")

DIRECTIONS = {"min": "minimize", "max": "maximize"}  # tracking.best_mode -> Optuna's
OUTCOME = "outcome"  # a trial's user attribute: how its point ended (finished, diverged, ...)
FAILED = STATUS_WORDS[MLFLOW_FAILED]  # a trial's outcome words are the runs table's
OUTCOMES = {"COMPLETE": FINISHED, "FAIL": "interrupted", "PRUNED": PRUNED}  # told by number
RUN_DIR = "run_dir"  # a trial's user attribute: its point's run directory
BASELINE = "baseline"  # a trial's user attribute: the run as configured (trial 0)
BASELINE_NAME = "as configured"  # its MLflow run's name (a point's is its searched values)
EXAMPLE = "'hydra.sweeper.params.train.lr=tag(log, interval(1e-4, 1e-2))'"


class SearchError(ValueError):
    """A search that cannot start: what is wrong and the fix, in one line."""


def is_search(config: DictConfig) -> bool:
    """Whether the sweep's sweeper is this one (hydra/sweeper=optuna)."""
    return OmegaConf.select(config, "hydra.sweeper._target_") == SWEEPER_TARGET


def _flat(params: Any, prefix: str = "") -> dict[str, str]:
    """hydra.sweeper.params as dotted keys: the command line's
    hydra.sweeper.params.train.lr=... nests (train: {lr: ...}); a YAML key may be dotted."""
    out = {}
    for k, v in (params or {}).items():
        if isinstance(v, (dict, DictConfig)):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


@dataclasses.dataclass
class SearchSpace:
    """The searched keys (key -> Hydra's sweep override, and as typed) and the overrides every
    trial gets as given."""

    searched: dict[str, Override]
    typed: dict[str, str]
    fixed: list[str]

    @classmethod
    def of(cls, params: Any, arguments: list[str]) -> "SearchSpace":
        """hydra.sweeper.params, then the command line's overrides (a sweep override there,
        train.lr=choice(...), is searched too; a later one wins)."""
        given = [f"{k}={v}" for k, v in _flat(params).items()] + list(arguments)
        searched: dict[str, Override] = {}
        typed: dict[str, str] = {}
        fixed: dict[str, str] = {}
        for arg, o in zip(given, OverridesParser.create().parse_overrides(given)):
            key = o.key_or_group
            searched.pop(key, None), typed.pop(key, None), fixed.pop(key, None)
            if o.is_sweep_override():
                searched[key], typed[key] = o, arg.split("=", 1)[1]
            else:
                fixed[key] = arg
        return cls(searched, typed, list(fixed.values()))

    def distributions(self) -> dict[str, Any]:
        """Optuna's distribution of each searched key."""
        return {k: _distribution(k, o) for k, o in self.searched.items()}


def _distribution(key: str, o: Override) -> Any:
    """interval -> float (int with tag(int)), log-scaled with tag(log); choice and range ->
    categorical, their values as typed."""
    from optuna.distributions import (CategoricalDistribution, FloatDistribution,
                                      IntDistribution)

    if o.is_interval_sweep():
        v = o.value()
        log_scale = "log" in v.tags
        if log_scale and v.start <= 0:
            raise SearchError(f"{key}: a log interval must start above 0, not {v.start}")
        if v.start >= v.end:
            raise SearchError(f"{key}: interval({v.start}, {v.end}) is empty: give (low, high)")
        if "int" in v.tags:
            return IntDistribution(int(v.start), int(v.end), log=log_scale)
        return FloatDistribution(float(v.start), float(v.end), log=log_scale)
    return CategoricalDistribution(list(o.sweep_string_iterator()))


def shown(value: Any) -> str:
    """A sampled value as the trial's override: floats to 4 significant digits (the run's name
    and the rerun command stay readable; a search does not resolve finer)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def objective(config: DictConfig) -> Best:
    """What the study optimizes: the sweep's best metric (tracking.best_metric / best_mode, the
    harness score with eval.harness); at the default, without eval (eval.every_steps=0), the
    final training loss, as the summary's best point then."""
    best = Best.chosen(config.tracking.best_metric, config.tracking.best_mode,
                       config.eval.harness.tasks)
    if best == Best() and not config.eval.every_steps:
        return Best(names.SUMMARY_FINAL_LOSS, "min", rule="no eval loss")
    return best


def pruned_metric(config: DictConfig) -> tuple[Optional[str], str]:
    """The eval metric a trial reports at its eval steps for pruning (the objective's, as each
    eval logs it), or None and why trials are not pruned."""
    best = objective(config)
    metric = best.metric.removeprefix(names.SUMMARY_PREFIX)
    if not config.eval.every_steps:
        return None, "no eval during a trial (eval.every_steps=0)"
    if not metric.startswith(names.EVAL_PREFIX):
        return None, (f"the objective, {best.metric}, is known only when a trial ends (prune "
                      f"on eval: tracking.best_metric={names.SUMMARY_EVAL_LOSS})")
    return metric, ""


def prunes(pruner: Any) -> bool:
    """Whether a pruner (its config, or the object Hydra made of it) can stop a trial."""
    if pruner is None:
        return False
    target = (pruner.get("_target_") if isinstance(pruner, (dict, DictConfig))
              else f"{type(pruner).__module__}.{type(pruner).__name__}")
    return str(target).rsplit(".", 1)[-1] != NO_PRUNER.rsplit(".", 1)[-1]


def search_trial(config: DictConfig, hydra: Any) -> Optional[SearchTrial]:
    """A trial's handle on its study (RunSpec.trial), from its job's config and Hydra's
    (``hydra``: HydraConfig.get()): None unless the sweep is a search with a pruner and the
    objective is an eval metric."""
    s = hydra.sweeper
    if OmegaConf.select(s, "_target_") != SWEEPER_TARGET or not prunes(s.get("pruner")):
        return None
    metric, _ = pruned_metric(config)
    if metric is None:
        return None
    sweep_dir = Path(hydra.sweep.dir).resolve()
    return SearchTrial(
        storage=s.storage or str(sweep_dir / STUDY_FILE),
        study=s.study_name or sweep_id_for(str(sweep_dir)), number=int(hydra.job.num),
        metric=metric, direction=s.direction or DIRECTIONS[objective(config).mode],
        pruner=OmegaConf.to_container(s.pruner, resolve=True))


def search_plan(config: DictConfig, arguments: list[str]) -> tuple[dict[str, str], int]:
    """The searched keys as typed and the number of trials, for the parent run; every problem
    of the search's config, before anything is made (SearchError)."""
    s = config.hydra.sweeper
    space = SearchSpace.of(s.params, arguments)
    problems = []
    if not space.searched:
        problems.append(f"hydra/sweeper=optuna has nothing to search: give a search space, "
                        f"e.g. {EXAMPLE}")
    if s.n_trials < 1 or s.n_jobs < 1:
        problems.append(f"hydra.sweeper.n_trials={s.n_trials}, n_jobs={s.n_jobs}: both must "
                        "be at least 1")
    if s.direction not in (None, *DIRECTIONS.values()):
        problems.append(f"hydra.sweeper.direction={s.direction}: minimize, maximize, or null "
                        "(tracking.best_mode's)")
    if not config.tracking.enabled:
        problems.append("hydra/sweeper=optuna reads each trial's result from its MLflow run: "
                        "drop tracking.enabled=false")
    if config.dry_run:
        problems.append("a search needs each trial's result: drop dry_run=true (a single run "
                        "with dry_run=true prints the plan)")
    try:
        space.distributions()
    except SearchError as e:
        problems.append(str(e))
    if problems:
        raise SearchError("; ".join(problems))
    return space.typed, int(s.n_trials)


def _storage(storage: Optional[str], sweep_dir: Path) -> Any:
    """The storage given, else a journal file in the sweep's folder (no database to set up;
    safe for several processes on one file system)."""
    if storage:
        return storage
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(sweep_dir / STUDY_FILE)))


def run_search(sweeper: Any, arguments: list[str]) -> list[Any]:
    """The sweeper's sweep(): ask n_jobs trials, launch them as sweep points, tell each its
    outcome, until the study holds n_trials told trials; then the trials, the best one as the
    command that reruns it, and a chart on the parent run."""
    import optuna

    config = sweeper.config
    sweep_dir = Path(config.hydra.sweep.dir).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, sweep_dir / "multirun.yaml")
    space = SearchSpace.of(sweeper.params, arguments)
    dists, best = space.distributions(), objective(config)
    uri = resolve_tracking_uri(config.tracking.uri, Path.cwd())
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep says what it does
    study = optuna.create_study(
        storage=_storage(sweeper.storage, sweep_dir),
        study_name=sweeper.study_name or sweep_id_for(str(sweep_dir)),
        sampler=sweeper.sampler, pruner=sweeper.pruner, load_if_exists=True,
        direction=sweeper.direction or DIRECTIONS[best.mode])
    if prunes(sweeper.pruner):
        metric, why_not = pruned_metric(config)
        log.info("pruning: %s", f"{type(sweeper.pruner).__name__} on {metric} at each eval "
                 f"step after step 0 and before the last (hydra/sweeper/pruner=none: off)" if metric else
                 f"off: {why_not}")
    client = open_client(uri)
    _settle_interrupted(study, best, client)
    returns = []
    if sweeper.baseline and not study.trials:  # (a resumed study has it, or its trials)
        returns.append(_baseline(sweeper, study, space, dists, best, client, sweep_dir))
    while (left := sweeper.n_trials - len(_counted(study))) > 0:
        trials = [study.ask(dists) for _ in range(min(sweeper.n_jobs, left))]
        together = at_once(config, len(trials))
        batch = []
        for t in trials:
            t.set_user_attr(RUN_DIR, str(sweep_dir / str(t.number)))
            batch.append(waited(config, [*space.fixed,
                                         *(f"{k}={shown(t.params[k])}" for k in dists)],
                                together=together))
        log.info("trial(s) %s of %d: %s", ", ".join(str(t.number) for t in trials),
                 sweeper.n_trials, "; ".join(" ".join(f"{k}={shown(t.params[k])}" for k in dists)
                                             for t in trials))
        sweeper.validate_batch_is_legal(batch)
        results = _launch(sweeper.launcher, batch, [t.number for t in trials])
        if together:
            _await_jobs(trials, results, client)
        told = [_tell(study, t, *_outcome(jr, Path(t.user_attrs[RUN_DIR]), best, client))
                for t, jr in zip(trials, results)]
        returns.append(results)
        if any(told):
            log.info("the sampler has tried every point of the search space: the search ends "
                     "at %d trials", len(_counted(study)))
            break
    report(study, list(dists), best, client, parent_run(str(sweep_dir)))
    return returns


WAIT = "cluster.wait"  # a trial of a batch submitted at once: its job is not waited for alone
AWAIT_POLL_S = 5.0  # how often the search asks whether the batch's jobs have ended
GONE_GRACE_S = 60.0  # a job SLURM no longer queues or runs, and whose run has not ended: its
# rank 0 may still be delivering the run's end (tracking.final_delivery_s); after this, failed


def waited(config: DictConfig, overrides: list[str], *, together: bool = False) -> list[str]:
    """A trial's overrides with how its launch waits: a search needs each trial's result, so
    a trial alone is waited for (cluster.wait=true, whatever the cluster's default: SLURM's is
    to return at submission), and a trial of a batch run at once is not (the search waits for
    the batch: _await_jobs)."""
    mine = [a for a in overrides if a.split("=", 1)[0].lstrip("+") != WAIT]
    if together:
        return [*mine, f"{WAIT}=false"]
    return mine if launcher_for(config.cluster).waits else [*mine, f"{WAIT}=true"]


def at_once(config: DictConfig, n: int) -> bool:
    """Whether ``n`` trials asked together run at once: as SLURM jobs submitted together (each
    with cluster.wait=false) and waited for together; on one machine they run one after
    another."""
    from ..config.placement import SLURM

    return n > 1 and config.cluster.kind == SLURM


def _await_jobs(trials: list[Any], results: list[Any], client: Any) -> None:
    """Wait until each submitted trial's run has ended (its MLflow status), or its SLURM job is
    gone without ending it (then it is told failed, as any run that did not finish)."""
    from ..run.ownership import detached_job
    from ..tracking.sweep import ENDED

    pending = {t.number: Path(t.user_attrs[RUN_DIR]) for t, jr in zip(trials, results)
               if jr.status == JobStatus.COMPLETED and not isinstance(jr.return_value,
                                                                      PointFailed)}
    jobs = {n: detached_job(str(d))[0] for n, d in pending.items()}
    log.info("trials %s: SLURM jobs %s run at once; waiting for them to end",
             ", ".join(map(str, pending)), ", ".join(str(j) for j in jobs.values()))
    gone: dict[int, float] = {}
    while pending:
        for n, run_dir in list(pending.items()):
            run_id = read_run_file(run_dir).get("run_id")
            if run_id and client.get_run(run_id).info.status in ENDED:
                pending.pop(n)
                continue
            if detached_job(str(run_dir))[1] is not None:  # queued or running
                gone.pop(n, None)
                continue
            since = gone.setdefault(n, time.monotonic())
            if time.monotonic() - since > GONE_GRACE_S:
                log.warning("trial %d: SLURM job %s is over and its run did not end: told "
                            "failed (its log: %s)", n, jobs[n], run_dir / "submitit")
                pending.pop(n)
        if pending:
            time.sleep(AWAIT_POLL_S)


def _baseline(sweeper: Any, study: Any, space: SearchSpace, dists: dict[str, Any], best: Best,
              client: Any, sweep_dir: Path) -> list[Any]:
    """Trial 0: the run as configured, the searched keys at the recipe's or the config's values,
    so that the search is held to what the command would run without it. Its values are read
    back from its MLflow run and the trial added to the study (FAIL without a value, as any)."""
    from optuna.trial import TrialState, create_trial

    run_dir = sweep_dir / "0"
    log.info("trial 0 of %d: the run as configured (%s as the recipe or the config has it)",
             sweeper.n_trials, ", ".join(dists))
    named = any(a.split("=", 1)[0].lstrip("+") == "tracking.run_name" for a in space.fixed)
    overrides = waited(sweeper.config, space.fixed
                       + ([] if named else [f"tracking.run_name='{BASELINE_NAME}'"]))
    results = list(sweeper.launcher.launch([overrides], initial_job_idx=0))
    value, outcome = _outcome(results[0], run_dir, best, client)
    params = _values_used(run_dir, dists, client)
    if params is None:  # still trial 0 (its folder is 0), told FAIL: Optuna takes no value
        log.warning("trial 0 (the run as configured) is outside the search space: its values "
                    "of %s are not in it; the study has it as failed", ", ".join(dists))
        params, value, outcome = {}, None, "outside the space"
    study.add_trial(create_trial(
        params=params, distributions={k: dists[k] for k in params}, value=value,
        state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
        user_attrs={OUTCOME: outcome, RUN_DIR: str(run_dir), BASELINE: True}))
    return results


def _values_used(run_dir: Path, dists: dict[str, Any], client: Any) -> Optional[dict[str, Any]]:
    """The searched keys' values a point ran with (its MLflow params), as Optuna's
    distributions hold them; {} for a point that never ran (refused); None when one is not
    in the space."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    run_id = read_run_file(run_dir).get("run_id")
    if run_id is None:
        return {}
    params = client.get_run(run_id).data.params
    out: dict[str, Any] = {}
    for key, d in dists.items():
        if key not in params:
            return None
        raw = params[key]
        if isinstance(d, CategoricalDistribution):
            match = [c for c in d.choices if str(c) == raw or _same_number(c, raw)]
            if not match:
                return None
            out[key] = match[0]
            continue
        v = (int if isinstance(d, IntDistribution) else float)(float(raw))
        if not d.low <= v <= d.high:
            return None
        out[key] = v
    return out


def _same_number(a: Any, b: str) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _launch(launcher: Any, batch: list[list[str]], numbers: list[int]) -> list[Any]:
    """The batch through Hydra's launcher, each trial's job number its trial number (its folder
    in the sweep's: hydra.sweep.subdir); trials not numbered in a row go one at a time."""
    if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return list(launcher.launch(batch, initial_job_idx=numbers[0]))
    return [r for b, n in zip(batch, numbers) for r in launcher.launch([b], initial_job_idx=n)]


def _told(study: Any) -> list[Any]:
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                    TrialState.FAIL))


def _counted(study: Any) -> list[Any]:
    """The trials that count toward n_trials: every told one but the interrupted (asked again)."""
    return [t for t in _told(study) if outcome_of(t) != "interrupted"]


def _tell(study: Any, trial: Any, value: Optional[float], outcome: str) -> bool:
    """A trial's value, or FAIL (never a value) with how it ended. A trial settled after an
    interruption is told by number: its outcome is its state's (OUTCOMES). True when the
    sampler has nothing left to ask (a brute-force or grid sampler that tried every point
    calls Study.stop, which Optuna allows only inside optimize(); the trial is told first)."""
    from optuna.trial import TrialState

    if not isinstance(trial, int):
        trial.set_user_attr(OUTCOME, outcome)
    try:
        if outcome == PRUNED:  # its value: the last it reported (train/pruning.py)
            study.tell(trial, state=TrialState.PRUNED)
        elif value is None:
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, value)
    except RuntimeError as e:  # (optuna 5.0: study/_tell.py stores the trial in a finally)
        if "Study.stop" not in str(e):
            raise
        return True
    return False


def outcome_of(t: Any) -> str:
    """How a told trial ended: its own word, else its state's (a trial told by number after
    an interrupted sweep: finished, or interrupted)."""
    return t.user_attrs.get(OUTCOME, OUTCOMES.get(t.state.name, t.state.name.lower()))


def _outcome(jr: Any, run_dir: Path, best: Best, client: Any) -> tuple[Optional[float], str]:
    """A launched trial's value and outcome: finished (its value), or why it has none."""
    if jr.status != JobStatus.COMPLETED:
        return None, FAILED
    ret = jr.return_value
    if isinstance(ret, PointFailed):
        return None, {2: "refused", EXIT_DIVERGED: DIVERGED}.get(ret.code, FAILED)
    return _point_value(run_dir, best, client)


def _point_value(run_dir: Path, best: Best, client: Any) -> tuple[Optional[float], str]:
    """The objective of a point that ran, from its MLflow run (a point skipped because it
    finished in an earlier run of the sweep too)."""
    run_id = read_run_file(run_dir).get("run_id")
    if run_id is None:
        return None, "no run"
    run = client.get_run(run_id)
    if run.info.status != mlflow_status(FINISHED):  # (a trial not waited for: its run says)
        return None, (PRUNED if PRUNED_AT_TAG in run.data.tags else
                      DIVERGED if DIVERGED_AT_TAG in run.data.tags else FAILED)
    value = best.value(run)
    if value is None or not math.isfinite(value):
        return None, f"no {best.metric}"
    return value, FINISHED


def _settle_interrupted(study: Any, best: Best, client: Any) -> None:
    """Trials an interrupted run of this sweep left running: told their value when their point
    finished after all; else told FAIL (interrupted) and asked again with the same values."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        run_dir = t.user_attrs.get(RUN_DIR)
        value, how = _point_value(Path(run_dir), best, client) if run_dir else (None, "")
        if how == PRUNED:
            log.info("trial %d was pruned before the sweep was interrupted: told so", t.number)
            _tell(study, t.number, None, PRUNED)
            continue
        if value is not None:
            log.info("trial %d finished before the sweep was interrupted: told its value",
                     t.number)
            _tell(study, t.number, value, FINISHED)
            continue
        log.info("trial %d was interrupted: it runs again (%s)", t.number,
                 " ".join(f"{k}={shown(v)}" for k, v in t.params.items()))
        _tell(study, t.number, None, "interrupted")
        study.enqueue_trial(t.params)


def trials_table(study: Any, keys: list[str], best: Best) -> str:
    """The trials in order: their searched values, the objective, how each ended."""
    header = ["trial", *keys, best.metric.removeprefix(names.SUMMARY_PREFIX), "outcome"]
    rows = [[str(t.number), *(shown(t.params.get(k, "-")) for k in keys),
             f"{t.value:.4g}" if t.value is not None else "-",
             outcome_of(t)] for t in _told(study)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
             for r in [header, ["-" * w for w in widths], *rows]]
    return "\n".join(lines)


def best_trial(study: Any) -> Optional[Any]:
    """The best finished trial (None: none finished)."""
    from optuna.trial import TrialState

    return study.best_trial if study.get_trials(states=(TrialState.COMPLETE,)) else None


def report(study: Any, keys: list[str], best: Best, client: Any,
           parent_id: Optional[str]) -> None:
    """The trials, the best one and the command that reruns it; the table and a chart of the
    objective against trials on the parent run."""
    table = trials_table(study, keys, best)
    top = best_trial(study)
    if top is None:
        line = f"best trial: none (no trial finished with {best.metric})"
    else:
        values = {k: shown(top.params[k]) for k in keys}
        line = (f"best trial: {top.number} ({best}: {top.value:.4g})\n"
                f"  run it alone: {rerun_command(values)}")
    log.info("search %s, %d trials:\n%s\n%s", study.study_name, len(_told(study)), table, line)
    if parent_id is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SEARCH_TABLE).write_text(
            f"# {study.study_name}\n\n```\n{table}\n{line}\n```\n")
        chart(study, best, Path(tmp) / SEARCH_CHART)
        client.log_artifacts(parent_id, tmp)


def chart(study: Any, best: Best, path: Path) -> Path:
    """The objective of each trial, the best so far as a line, trials without a value as
    crosses on the axis with how they ended."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from optuna.trial import TrialState

    trials = _told(study)  # (a pruned trial's value is where it stopped: a cross, as a failure)
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([t.number for t in done], [t.value for t in done], "o", label="trial")
    so_far, pick = [], min if best.mode == "min" else max
    for t in done:
        so_far.append(pick([so_far[-1], t.value]) if so_far else t.value)
    ax.step([t.number for t in done], so_far, where="post", label="best so far")
    floor = min((t.value for t in done), default=0.0)
    for t in (t for t in trials if t not in done):
        ax.plot(t.number, floor, "x", color="red")
        ax.annotate(outcome_of(t), (t.number, floor), fontsize=7,
                    rotation=45, color="red")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("trial")
    ax.set_ylabel(best.metric.removeprefix(names.SUMMARY_PREFIX))
    ax.set_title(f"{study.study_name}: {best}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
