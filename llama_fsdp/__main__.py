"""`python -m llama_fsdp [overrides]` (or `llama-fsdp`): compose -> RunSpec -> plan -> prepare
-> launch -> summary."""
from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .config import register_configs
from .launchers.common import skip_final_collection
from .spec import ConfigError, RunSpec, build_spec
from .strategies import one_group_warning

log = logging.getLogger("llama_fsdp")


def _sweep() -> dict[str, Any]:
    """build_spec's sweep arguments for a point of a `-m` sweep (nothing for a single run)."""
    from .sweep import point_name, swept_keys_of, sweep_id_for

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return {}
    sweep_dir = str(Path(hc.sweep.dir).resolve())
    return {"sweep_id": sweep_id_for(sweep_dir), "sweep_dir": sweep_dir,
            "point": point_name(list(hc.overrides.task), swept_keys_of(sweep_dir))}


def command_line(*, drop: tuple[str, ...] = ()) -> str:
    """The command line as the user typed it (the MLflow run's description), without the
    overrides of the keys in ``drop``."""
    prog = "llama-fsdp" if Path(sys.argv[0]).name == "llama-fsdp" else "python -m llama_fsdp"
    args = [a for a in sys.argv[1:] if a.split("=", 1)[0].lstrip("+~") not in drop]
    return " ".join([prog, *map(shlex.quote, args)])


def plan_run(cfg: DictConfig) -> tuple[RunSpec, Any]:
    """Config -> validated spec -> plan (printed); the plan's verdict is checked by the caller."""
    from .plan import make_plan, resolve_auto

    # cfg.output_dir is Hydra's run dir unless the user points it at an earlier run to resume.
    spec = resolve_auto(build_spec(cfg, launch_dir=Path.cwd(), **_sweep()))
    for key, value in spec.summary().items():
        log.info("%-30s %s", key, value)
    if warning := one_group_warning(spec.sharding.strategy, spec.mesh, spec.world_size):
        log.warning("%s", warning)
    plan = make_plan(spec)
    log.info("plan (per device):\n%s", plan.table())
    return spec, plan


def summary_lines(spec: RunSpec, r0: Any) -> list[str]:
    s, final = r0.summary, r0.final
    lines = [f"status         {r0.status}", f"steps          {r0.steps}"]
    if "loss" in final:
        lines.append(f"final loss     {final['loss']:.4f}"
                     + (f"   eval loss {final['eval_loss']:.4f}" if "eval_loss" in final else "")
                     + (f"   exact match {final['eval_exact_match']:.2f}"
                        if "eval_exact_match" in final else ""))
    if "summary/tokens_per_sec" in s:
        lines.append(f"tokens/s       {s['summary/tokens_per_sec']:.0f} global, "
                     f"{s['summary/tokens_per_sec_per_device']:.0f} per device (median of the "
                     "steady steps)" + (f", MFU {s['summary/mfu']:.1%}" if "summary/mfu" in s
                                        else ""))
    if "summary/peak_memory_gb" in s:
        what = ("CUDA allocated" if spec.device == "cuda" else "process RSS, runtime included")
        lines.append(f"peak memory    {s['summary/peak_memory_gb']:.2f} GB ({what}, max over "
                     f"ranks; the plan's tensors {s['summary/predicted_peak_memory_gb']:.2f} GB)")
    lines.append(f"run dir        {spec.output_dir}")
    if r0.status != "finished" and r0.checkpoints:
        lines.append(f"continue with  {command_line(drop=('output_dir', 'resume'))} "
                     f"output_dir={spec.output_dir} resume=auto")
    elif r0.status != "finished":
        lines.append("no checkpoint  none was saved (save.every_steps=0), so this run cannot be "
                     "continued from where it stopped. Set save.every_steps=N to make a stopped "
                     "run resumable")
    if r0.mlflow_run_id:
        from .tracking import read_run_file, runs_page

        lines.append(f"mlflow run     {r0.mlflow_run_id} in experiment "
                     f"'{spec.tracking.experiment}' at {spec.tracking_uri}")
        page = runs_page(spec.tracking_uri, read_run_file(spec.output_dir).get("experiment_id", "0"))
        if spec.tracking_uri.startswith("sqlite:///"):
            lines.append(f"compare runs   mlflow ui --backend-store-uri {spec.tracking_uri}, then "
                         f"open {page}")
        else:
            lines.append(f"compare runs   {page}")
    return lines


def _launch_preview(spec: RunSpec) -> str:
    if spec.cluster.kind == "slurm":
        from .launchers.slurm import sbatch_preview

        return sbatch_preview(spec)
    return (f"{spec.nproc_per_node} local rank process(es) via submitit's local executor, each "
            f"running llama_fsdp.worker.run_worker (backend {spec.backend}, device {spec.device})")


def _finished_point(spec: RunSpec) -> bool:
    """A sweep started again in its directory (to resume its failed points) skips a point
    whose run finished with this same config: it would train again from step 0 when it saved
    no checkpoint, or start only to find nothing to train."""
    from .rundir import config_digest, read_run_status

    if spec.sweep_id is None:
        return False
    status = read_run_status(spec.output_dir)
    done = (status.get("status") == "finished"
            and status.get("config_sha256") == config_digest(spec.config_yaml))
    if done:
        log.info("point %s finished in an earlier run of this sweep (%s): skipped",
                 spec.run_name, spec.output_dir)
    return done


def run(cfg: DictConfig) -> Any:
    """The whole path for one composed config (one point of a sweep)."""
    from .launchers import launch, preflight
    from .plan import check_fits, fixes_text
    from .prepare import prepare

    spec, plan = plan_run(cfg)
    if not spec.dry_run and _finished_point(spec):
        return None
    if spec.dry_run:
        if not plan.fits:
            log.warning("this run would be refused at launch: it does not fit.\n%s",
                        fixes_text(spec, plan))
        log.info("dry_run=true: nothing launched. Would run:\n%s", _launch_preview(spec))
        return None
    check_fits(spec, plan)
    problems = preflight(spec)
    if problems:
        raise ConfigError(problems)
    prepared = prepare(spec, command=command_line())
    results = launch(prepared.spec, "llama_fsdp.worker:run_worker")
    if spec.cluster.kind == "local" or spec.cluster.wait:
        r0 = next(r for r in results if r is not None and r.rank == 0)
        log.info("done\n  %s", "\n  ".join(summary_lines(spec, r0)))
    return results


def _finish_tracking(output_dir: str, status: str, deadline_s: float) -> None:
    """After the ranks are gone: deliver what rank 0 could not, and close a run the ranks
    could not close (killed, crashed)."""
    from .rundir import RunDir
    from .tracking import close_run, deliver_pending, read_run_file

    if not RunDir(output_dir).tracking.is_dir():
        return
    info = read_run_file(output_dir)
    left = (close_run(output_dir, status, deadline_s=deadline_s) if status
            else deliver_pending(output_dir, deadline_s=deadline_s))
    if left:
        log.warning("%d bytes of tracking events are not in MLflow yet (%s does not answer); "
                    "deliver them with: python -m llama_fsdp.tracking %s", left,
                    info.get("tracking_uri"), output_dir)


def _remove_if_empty(output_dir: str) -> None:
    """Hydra made the run directory (and its parents); a run that did not launch leaves nothing
    behind. rmdir removes only empty directories, so nothing of a user's is ever deleted; it
    climbs to the working directory for a relative run dir (outputs/runs/<date>/<time>), and two
    levels for one elsewhere."""
    path = Path(output_dir).absolute()
    cwd = Path.cwd().absolute()
    chain = [path, *path.parents]
    chain = ([d for d in chain if d != cwd and cwd in d.parents] if cwd in path.parents
             else chain[:2])
    for d in chain:
        try:
            d.rmdir()
        except OSError:
            return


def _exit(code: int) -> None:
    """End a single run with ``code``; in a sweep, record the point's failure and go on."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        from .sweep import FAILED_POINTS

        FAILED_POINTS.append((_sweep()["point"], code))
        return
    sys.exit(code)


@hydra.main(config_path="pkg://llama_fsdp.conf", config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> Any:
    from .launchers import Interrupted, LaunchError
    from .plan import PlanError
    from .prepare import PrepareError

    output_dir = str(Path(cfg.output_dir).resolve())
    final_s = float(cfg.tracking.final_delivery_s)
    launched = False
    try:
        result = run(cfg)
        launched = result is not None
        if launched and (cfg.cluster.kind == "local" or cfg.cluster.wait):
            _finish_tracking(output_dir, status="", deadline_s=final_s)
            if any(r is not None and r.status != "finished" for r in result):
                sys.exit(130)  # stopped by the user (Ctrl-C), after saving when saves are on
        return result
    except (ConfigError, PlanError, PrepareError) as e:
        log.error("%s", e)
        _exit(2)
    except Interrupted as e:
        launched = True
        log.error("%s", e)
        _finish_tracking(output_dir, status="KILLED", deadline_s=final_s)
        sys.exit(e.exit_code)  # a stopped sweep stops whole
    except LaunchError as e:
        launched = True
        log.error("%s", e)
        _finish_tracking(output_dir, status="FAILED", deadline_s=final_s)
        _exit(1)
    finally:
        if not launched:
            _remove_if_empty(output_dir)
    return None


def main() -> None:
    from .compat import check_versions

    check_versions()
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    from .spec import override_key_problems

    problems = override_key_problems(sys.argv[1:])
    if problems:  # before Hydra, whose message for these suggests a fix that fails too
        sys.stderr.write("invalid override(s):\n" + "".join(f"  - {p}\n" for p in problems))
        sys.exit(2)
    register_configs()
    try:
        _hydra_main()
    finally:
        skip_final_collection()


if __name__ == "__main__":
    main()
