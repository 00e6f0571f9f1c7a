"""The command line, `python -m llama_fsdp [overrides]` (or `llama-fsdp`):

    overrides checked -> Hydra composes conf/ -> the launcher of cluster.kind (launchers/)
    -> RunSpec with its placement (run/spec.py) -> plan (plan/, printed)
    -> launch (the job's once-only duties: prepare/; then the ranks) -> the report (report.py)

A sweep (``-m``) runs this once per point; multirun.py's ``SweepCallback`` makes the sweep's
parent run when it starts, collects the points' outcomes, and writes the summary when it ends.
Nothing in the library imports this module: it is the entry point only.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from ..versions import check_versions
from ..config.schema import register_configs
from ..launchers import Interrupted, LaunchError, Launcher, StoppedBeforeLaunch, launcher_for
from ..launchers.process import skip_final_collection
from .multirun import failed, finished_point, hydra_footprint, sweep_kwargs
from .overrides import command_line, override_key_problems, overridden_keys, quote_search_spaces
from ..run.ownership import RunDirBusy
from ..plan import PlanError, auto_hint, check_fits, fixes_text, make_plan, resolve_auto
from ..prepare.errors import PrepareError
from ..config.status import DIVERGED, EXIT_DIVERGED, FAILED, FINISHED, PRUNED, USER_STOPPED
from ..config.rundir import RUNS, SWEEPS, Footprint
from ..config.credentials import export_credentials
from ..run.spec import ConfigError, RunSpec, build_spec
from ..config.strategies import one_group_warning
from .report import report_lines

log = logging.getLogger("llama_fsdp")


# --- one run ----------------------------------------------------------------------------------

WORKER = "llama_fsdp.train.worker:run_worker"  # every rank's entry point, by name (no torch here)


def plan_run(cfg: DictConfig, launcher: Launcher, run_dir: str) -> tuple[RunSpec, Any]:
    """Config -> validated spec (with the launcher's placement) -> plan (printed); the plan's
    verdict is checked by the caller."""
    spec = resolve_auto(build_spec(cfg, placement=launcher.placement, output_dir=run_dir,
                                   launch_dir=Path.cwd(), **sweep_kwargs(cfg)))
    export_credentials(cfg.tracking.uri)  # for every process that talks to MLflow: inherited
    for key, value in spec.overview().items():
        log.info("%-30s %s", key, value)
    if spec.finetune.adapters and spec.model.path is None:
        log.warning("finetune=%s without model.path: the adapters train beside a random base "
                    "(set model.path to a Hugging Face directory or hub name)",
                    spec.finetune.method)
    if warning := one_group_warning(spec.sharding.strategy, spec.mesh, spec.world_size):
        log.warning("%s", warning)
    if hint := auto_hint(spec, str(cfg.sharding.strategy)):
        log.info("%s", hint)
    plan = make_plan(spec)
    log.info("plan (per device):\n%s", plan.table())
    return spec, plan


def run_one(cfg: DictConfig, launcher: Launcher, run_dir: str,
            held: contextlib.ExitStack) -> Any:
    """The whole path for one composed config (one point of a sweep): spec -> plan -> the
    launcher's launch (preparation, then the ranks) -> summary. ``held`` keeps the run directory
    owned until the caller is done with the run."""
    spec, plan = plan_run(cfg, launcher, run_dir)
    if spec.dry_run:
        if not plan.fits:
            log.warning("this run would be refused at launch: it does not fit.\n%s",
                        fixes_text(spec, plan))
        log.info("dry_run=true: nothing launched. Would run:\n%s", launcher.preview(spec))
        return None
    if finished_point(spec):
        return None
    check_fits(spec, plan)
    if problems := launcher.preflight(spec):
        raise ConfigError(problems)
    point = spec.sweep_point if spec.sweep_id else None  # a point's note: how to run it alone
    results = launcher.launch(spec, held=held, command=command_line(point=point))
    rank0 = next((r for r in results or [] if r is not None and r.rank == 0), None)
    if launcher.waits and rank0 is not None:
        log.info("done\n  %s", "\n  ".join(report_lines(spec, rank0)))
    return results


@hydra.main(config_path="pkg://llama_fsdp.conf", config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> Any:
    with contextlib.ExitStack() as held:  # the run directory stays owned to the very end
        return _run_and_report(cfg, held)


def _run_and_report(cfg: DictConfig, held: contextlib.ExitStack) -> Any:
    final_s = float(cfg.tracking.final_delivery_s)
    launched = False
    hydra_dir = hydra_footprint()
    output_dir, made = str(hydra_dir.path), hydra_dir  # Hydra's until the spec says
    try:
        launcher = launcher_for(cfg.cluster, WORKER)  # the one place the launch mode is chosen
        if not launcher.speaks:
            logging.getLogger().setLevel(logging.WARNING)  # another process speaks for the job
        output_dir = launcher.run_dir(cfg.output_dir, given="output_dir" in overridden_keys())
        if output_dir != str(hydra_dir.path):  # (before anything of this launch makes it)
            made = Footprint(output_dir)
        result = run_one(cfg, launcher, output_dir, held)
        launched = result is not None
        if launched and launcher.waits:
            launcher.close_tracking(output_dir, status=None, deadline_s=final_s)
            if any(r is not None and r.status == DIVERGED for r in result):
                return failed(EXIT_DIVERGED)  # (its report: printed with the run's)
            if any(r is not None and r.status not in (FINISHED, PRUNED) for r in result):
                sys.exit(130)  # stopped by the user (Ctrl-C), after saving when saves are on
        return result
    except (ConfigError, PlanError, PrepareError, RunDirBusy) as e:
        log.error("%s", e)
        return failed(2)
    except Interrupted as e:
        launched = True
        log.error("%s", e)
        launcher.close_tracking(output_dir, status=USER_STOPPED, deadline_s=final_s)
        sys.exit(e.exit_code)  # a stopped sweep stops whole
    except LaunchError as e:
        launched = True
        log.error("%s", e)
        launcher.close_tracking(output_dir, status=FAILED, deadline_s=final_s)
        return failed(1)
    except KeyboardInterrupt as e:  # nothing launched: nothing of this launch stays (finally)
        log.error("%s", e if isinstance(e, StoppedBeforeLaunch) else
                  "stopped by Ctrl-C before launch: nothing was launched")
        if isinstance(e, StoppedBeforeLaunch):  # the MLflow run, if it was made already
            launcher.close_tracking(output_dir, status=USER_STOPPED, deadline_s=final_s)
        sys.exit(getattr(e, "exit_code", 130))
    finally:
        if not launched:
            held.close()  # let the directory go first: a run that never started leaves nothing
            made.undo()  # of what it made; a directory that was there before stays
        if made is not hydra_dir:  # Hydra's, made but not used
            hydra_dir.undo()


def launch_dir_problems(argv: list[str]) -> list[str]:
    """Hydra writes every launch's folder under outputs/ of the folder it is launched from
    (conf/config.yaml: hydra.run.dir, hydra.sweep.dir), a dry run's too: a launch from where it
    cannot write is refused in one line, not with Hydra's traceback (unless both folders are
    given elsewhere)."""
    keys = {a.split("=", 1)[0].lstrip("+~") for a in argv}
    if {"hydra.run.dir", "hydra.sweep.dir"} <= keys:
        return []
    where = Footprint.deepest_existing(Path(RUNS))
    if os.access(where, os.W_OK):
        return []
    return [f"{where} is not writable: llama_fsdp keeps each launch's folder under {RUNS} (and "
            f"{SWEEPS}) of the folder it is launched from. Launch from a folder you may write "
            "to, or give hydra.run.dir=<a writable folder> and hydra.sweep.dir=<another>"]


def main() -> None:
    check_versions()
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    problems = override_key_problems(sys.argv[1:]) or launch_dir_problems(sys.argv[1:])
    if problems:  # before Hydra, whose message for these suggests a fix that fails too
        sys.stderr.write("invalid override(s):\n" + "".join(f"  - {p}\n" for p in problems))
        sys.exit(2)
    register_configs()
    sys.argv[1:] = quote_search_spaces(sys.argv[1:])  # hydra/sweeper=optuna's search spaces
    try:
        _hydra_main()
    finally:
        skip_final_collection()
