"""A ``-m`` sweep as Hydra runs it: each point's sweep arguments, a point skipped because it
finished in an earlier run of the sweep, a point's failure handed back instead of ending the
process, and ``SweepCallback`` (conf/config.yaml names it), which makes the sweep's parent run
when it starts, collects the points' outcomes and writes the summary when it ends (tracking/sweep.py
holds the MLflow side)."""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ..launchers import launcher_for
from .overrides import command_line, point_values, shown_override, swept_overrides, sweep_size
from .points import PointFailed
from .search import SearchError, is_search, search_plan, search_trial
from ..config.status import EXIT_DIVERGED, FINISHED
from ..config.rundir import Footprint, config_digest, read_run_status, unwritable
from ..config.credentials import export_credentials, redact
from ..run.spec import RunSpec
from ..tracking.store import resolve_tracking_uri
from ..tracking.sweep import (
    Best,
    compare_line,
    parent_run,
    start_parent,
    summarize,
    sweep_id_for,
    sweep_page,
    swept_keys_of,
)

log = logging.getLogger("llama_fsdp")


def sweep_kwargs(config: Optional[DictConfig] = None) -> dict[str, Any]:
    """build_spec's sweep arguments for a point of a `-m` sweep (nothing for a single run); a
    search's trial with its study (given the job's ``config``)."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return {}
    sweep_dir = str(Path(hc.sweep.dir).resolve())
    out = {"sweep_id": sweep_id_for(sweep_dir), "sweep_dir": sweep_dir,
           "sweep_point": point_values(list(hc.overrides.task), swept_keys_of(sweep_dir))}
    if config is not None and (trial := search_trial(config, hc)) is not None:
        out["trial"] = trial
    return out


def finished_point(spec: RunSpec) -> bool:
    """A sweep started again in its directory (to resume its failed points) skips a point
    whose run finished with this same config: it would train again from step 0 when it saved
    no checkpoint, or start only to find nothing to train."""
    if spec.sweep_id is None:
        return False
    status = read_run_status(spec.output_dir)
    done = (status.get("status") == FINISHED
            and status.get("config_sha256") == config_digest(spec.config_yaml))
    if done:
        log.info("point %s finished in an earlier run of this sweep (%s): skipped",
                 spec.run_name, spec.output_dir)
    return done


def failed(code: int) -> Optional[PointFailed]:
    """End a single run with ``code``; a sweep point hands its failure back instead, and the
    sweep goes on to its other points (SweepCallback collects it)."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return PointFailed(sweep_kwargs()["sweep_point"], code)
    sys.exit(code)


class SweepCallback(Callback):
    """Hydra callback: before a run, which parents of its directory exist (Hydra makes them,
    and a run that does not launch removes what was made); of a multirun: the parent run when
    it starts; each point's outcome as it ends; the summary when the sweep ends (local sweeps),
    or the command that makes it (SLURM sweeps, which return at submission). A sweep with
    failed points exits with the worst code once every point had its turn."""

    def __init__(self) -> None:
        self.failed: list[PointFailed] = []

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_unwritable(config, "hydra.run.dir", config.hydra.run.dir)
        _HYDRA_DIR_EXISTED["dir"] = _hydra_made_below(_raw(config.hydra.run, "dir"))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_unwritable(config, "hydra.sweep.dir", config.hydra.sweep.dir)
        _HYDRA_DIR_EXISTED["dir"] = _hydra_made_below(_raw(config.hydra.sweep, "dir"))
        if not is_search(config):  # (a search says what it launches, trial by trial)
            say_what_launching_means(launcher_for(config.cluster))
        _credentials_to_environ(config)
        task = list(config.hydra.overrides.task)
        swept, points = swept_overrides(task), sweep_size(task)
        if is_search(config):  # hydra/sweeper=optuna: its searched keys, its trials
            try:
                swept, points = search_plan(config, task)
            except SearchError as e:  # before the parent run, before any trial
                log.error("%s", e)
                raise SystemExit(2)
        if not config.tracking.enabled or config.dry_run:  # a dry run records nothing
            return
        start_parent(str(Path(config.hydra.sweep.dir).resolve()),
                     uri=resolve_tracking_uri(config.tracking.uri, Path.cwd()),
                     experiment=config.tracking.experiment, command=command_line(),
                     swept=swept, points=points,
                     best=Best.chosen(config.tracking.best_metric, config.tracking.best_mode,
                                      config.eval.harness.tasks))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        outcome = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        if isinstance(outcome, PointFailed):
            self.failed.append(outcome)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = str(Path(config.hydra.sweep.dir).resolve())
        sweep_id = sweep_id_for(sweep_dir)
        uri = resolve_tracking_uri(config.tracking.uri, Path.cwd())
        table = None
        if config.dry_run:
            _undo_sweep_dir(Path(sweep_dir))
            log.info("dry_run=true: the sweep's points were planned; nothing launched, no "
                     "MLflow run and no sweep folder made")
        elif config.tracking.enabled:
            # a point refused before launch (exit 2: its config) has no run: a row of its own.
            # The points of a SLURM sweep that returns at submission are queued or running: the
            # summary says so, and the last of them to end completes it
            refused = [(p.values, p.code) for p in self.failed if p.code == 2]
            table = summarize(sweep_id, tracking_uri=uri, experiment=config.tracking.experiment,
                              parent_id=parent_run(sweep_dir), sweep_dir=sweep_dir,
                              # a resumed search runs no told trial again: its refused stay
                              refused=refused, keep_refused=is_search(config))
        if table:
            # the whole command, as a single run's report gives it: the page needs the server
            log.info("sweep %s summary:\n%s\ncompare the points: %s", sweep_id, table,
                     compare_line(uri, sweep_page(uri, config.tracking.experiment, sweep_id)))
        if config.tracking.enabled and not config.dry_run and returns_at_submission(config):
            log.info("sweep %s submitted: the last of its jobs to end completes its summary; "
                     "to see it before: python -m llama_fsdp.sweep %s --uri %s", sweep_id,
                     sweep_id, uri)
        diverged = [p for p in self.failed if p.code == EXIT_DIVERGED]
        if diverged:  # the same command would only diverge again
            log.error("%d point(s) of sweep %s diverged: %s (each run's diverged.txt has its "
                      "report); they are never its best point", len(diverged), sweep_id,
                      ", ".join(p.name or "(no overrides)" for p in diverged))
        if failed := [p for p in self.failed if p.code != EXIT_DIVERGED]:
            log.error("%d point(s) of sweep %s failed: %s; run the same command with "
                      "hydra.sweep.dir=%s to resume them", len(failed), sweep_id,
                      ", ".join(p.name or "(no overrides)" for p in failed), sweep_dir)
        if self.failed:
            raise SystemExit(max(p.code for p in self.failed))


HYDRA_LAUNCHER_LOG = "hydra._internal.core_plugins.basic_launcher"  # Hydra's own launcher
_LAUNCHING = re.compile(r"Launching (\d+) jobs locally$")


class _LaunchingNote(logging.Filter):
    """Hydra's "Launching N jobs locally", said as the run's launcher does it (a SLURM sweep
    submits its points as jobs)."""

    def __init__(self, note: Any) -> None:
        super().__init__()
        self.note = note

    def filter(self, record: logging.LogRecord) -> bool:
        m = _LAUNCHING.match(record.getMessage())
        if m:
            record.msg, record.args = self.note(int(m.group(1))), ()
        return True


def returns_at_submission(config: DictConfig) -> bool:
    """Whether the sweep ends before its points do (SLURM jobs submitted, cluster.wait=false);
    never a search, which waits for each trial's result (search.waited)."""
    return not is_search(config) and not launcher_for(config.cluster).waits


def say_what_launching_means(launcher: Any) -> None:
    """Hydra's launcher logs "Launching N jobs locally" for every sweep; where the run's
    launcher does something else with the points, that is what the line says."""
    hydra_log = logging.getLogger(HYDRA_LAUNCHER_LOG)
    for f in [f for f in hydra_log.filters if isinstance(f, _LaunchingNote)]:
        hydra_log.removeFilter(f)
    if launcher.sweep_note(1) is not None:
        hydra_log.addFilter(_LaunchingNote(launcher.sweep_note))


def _refuse_unwritable(config: DictConfig, key: str, hydra_dir: str) -> None:
    """Hydra makes its run (sweep) folder right after this callback, and output_dir is made
    before the job's data, ranks and MLflow run: a folder that cannot be made is said in one
    line now (exit 2), not with Hydra's OSError traceback, nor after the plan."""
    problems = [unwritable(key, hydra_dir, f"{key}=<a folder you may write>")]
    given = _raw(config, "output_dir")  # a folder of its own, else Hydra's (checked above)
    if "${" not in given:
        problems.append(unwritable("output_dir", given, "output_dir=<a folder you may write>"))
    if problems := [p for p in problems if p is not None]:  # (before the job's logging: the
        sys.stderr.write("".join(f"{p}\n" for p in problems))  # CLI's own stream, as main's)
        raise SystemExit(2)


# The deepest directory of Hydra's run (or sweep) directory that existed before Hydra made it,
# recorded by SweepCallback.on_run_start / on_multirun_start (before Hydra's mkdir).
_HYDRA_DIR_EXISTED: dict[str, Path] = {}


def _hydra_made_below(pattern: str) -> Path:
    """Where the directories Hydra makes from a run / sweep dir ``pattern`` begin: its parts
    from the first interpolation on (``${now:...}``: made per launch, also by a sibling process
    of the same torchrun job) are Hydra's; of its fixed prefix (outputs/runs), what does not
    exist yet."""
    fixed = []
    for part in Path(pattern).parts:
        if "${" in part:
            break
        fixed.append(part)
    return Footprint.deepest_existing(Path(*fixed) if fixed else Path.cwd())


def _undo_sweep_dir(sweep_dir: Path) -> None:
    """A dry-run sweep's folder, when this launch made it: Hydra's multirun.yaml removed, then
    the empty directories made (a folder that was there before is left as it is)."""
    existed = _HYDRA_DIR_EXISTED.get("dir", sweep_dir)
    if existed == sweep_dir or existed not in sweep_dir.parents:
        return
    (sweep_dir / "multirun.yaml").unlink(missing_ok=True)
    Footprint(sweep_dir, existed=existed).undo()


def hydra_footprint() -> Footprint:
    """Hydra's run directory of this job, and which of its parents Hydra made."""
    hydra_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    existed = _HYDRA_DIR_EXISTED.get("dir", hydra_dir)  # unknown: remove nothing above it
    return Footprint(hydra_dir, existed=existed)


def _raw(node: DictConfig, key: str) -> str:
    """A config value as written, its interpolations unresolved."""
    return str(OmegaConf.to_container(node, resolve=False)[key])


def _credentials_to_environ(config: DictConfig) -> None:
    """A sweep's tracking URI without its credentials, in the config the sweeper saves
    (multirun.yaml) and composes every point from (its task overrides); the credentials in
    this process's environment, which the points (and their ranks, and their SLURM jobs)
    inherit."""
    try:
        given = config.tracking.uri
        clean = export_credentials(given)
    except ValueError:  # a secret MLflow cannot take from the environment: every point says so
        return
    with read_write(config), open_dict(config):
        config.tracking.uri = clean
        config.hydra.overrides.task = [shown_override(a) for a in config.hydra.overrides.task]
        config.hydra.job.override_dirname = redact(
            config.hydra.job.override_dirname.replace(given, clean))
