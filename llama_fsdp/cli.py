"""The command line, `python -m llama_fsdp [overrides]` (or `llama-fsdp`):

    overrides checked -> Hydra composes conf/ -> RunSpec (spec.py) -> plan (plan/, printed)
    -> prepare (prepare.py: tracking store, weights, data, the MLflow run)
    -> launch (launchers/: local ranks or SLURM) -> summary

A sweep (``-m``) runs this once per point; ``SweepCallback`` makes the sweep's parent run when
it starts, collects the points' outcomes, and writes the summary when it ends. Nothing in the
library imports this module: it is the entry point only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from .config import Config, register_configs
from .launchers.common import skip_final_collection
from .spec import ConfigError, RunSpec, build_spec, field_type, not_a_key
from .strategies import one_group_warning

log = logging.getLogger("llama_fsdp")


# --- overrides, read with Hydra's own parser ------------------------------------------------


def parse_override(arg: str) -> Optional[Override]:
    """One command-line argument as Hydra reads it; None for what is no override (a flag)."""
    try:
        return OverridesParser.create().parse_override(arg)
    except Exception:  # noqa: BLE001 - Hydra's parser raises its own errors for non-overrides
        return None


def swept_overrides(args: list[str]) -> dict[str, str]:
    """The overrides of a sweep command that vary (comma lists, ranges, choices): key ->
    the values as typed ("1,2,4"). A list value (``cluster.setup=[a,b]``) is one value."""
    out = {}
    for arg in args:
        o = parse_override(arg)
        if o is not None and o.is_sweep_override():
            out[o.key_or_group] = ",".join(o.sweep_string_iterator())
    return out


def point_values(args: list[str], swept: Optional[list[str]]) -> dict[str, str]:
    """A sweep point's values of the swept keys (every override of the point when the swept
    keys are not known): {"train.batch_size": "2", "sharding": "full"}."""
    out = {}
    for arg in args:
        o = parse_override(arg)
        if o is None or o.is_delete() or o.is_sweep_override():
            continue
        if swept is None or o.key_or_group in swept:
            out[o.key_or_group] = o.get_value_element_as_str()
    return out


def command_line(*, drop: tuple[str, ...] = ()) -> str:
    """The command line as the user typed it (the MLflow run's description), without the
    overrides of the keys in ``drop``."""
    prog = "llama-fsdp" if Path(sys.argv[0]).name == "llama-fsdp" else "python -m llama_fsdp"
    args = [a for a in sys.argv[1:]
            if (o := parse_override(a)) is None or o.key_or_group not in drop]
    return " ".join([prog, *map(shlex.quote, args)])


def override_key_problems(args: list[str]) -> list[str]:
    """Dotted ``key=value`` overrides of the command line whose key the schema does not have,
    each with the closest valid key: Hydra refuses them too, but says only "Key 'batchsize' not
    in 'TrainConfig'" and suggests ``+train.batchsize``, which fails in turn. Keys under a field
    that is not a dataclass (a dict, a list), ``+``/``~`` overrides, config groups and
    ``hydra.*`` are left to Hydra and to ``spec.unknown_keys``."""
    out = []
    for arg in args:
        o = parse_override(arg)
        if o is None or o.is_add() or o.is_delete() or o.is_force_add():
            continue
        key = o.key_or_group
        if "." not in key or key.startswith("hydra."):
            continue
        schema: Any = Config
        parts = key.split(".")
        for i, part in enumerate(parts):
            fields = {f.name for f in dataclasses.fields(schema)}
            if part not in fields:
                if i:  # (not a root field: a config group, or Hydra's to judge)
                    out.append(not_a_key(key, ".".join(parts[:i]) + ".", fields))
                break
            schema = field_type(schema, part)
            if not dataclasses.is_dataclass(schema):
                break
    return out


# --- one run ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PointFailed:
    """What a sweep point that did not finish hands back: its values and its exit code (2: its
    config was refused before launch; 1: it failed)."""

    values: dict[str, str]
    code: int

    @property
    def name(self) -> str:
        from .spec import point_name

        return point_name(self.values)


def _sweep_kwargs() -> dict[str, Any]:
    """build_spec's sweep arguments for a point of a `-m` sweep (nothing for a single run)."""
    from .sweep import swept_keys_of, sweep_id_for

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return {}
    sweep_dir = str(Path(hc.sweep.dir).resolve())
    return {"sweep_id": sweep_id_for(sweep_dir), "sweep_dir": sweep_dir,
            "sweep_point": point_values(list(hc.overrides.task), swept_keys_of(sweep_dir))}


def run_dir_of(cfg: DictConfig) -> str:
    """The run directory: Hydra's run dir (outputs/runs/<date>/<time>) unless output_dir= points
    elsewhere (an earlier run, to resume it). Under cluster=torchrun every process of the job
    and every restart must agree on it, and Hydra's dir is made per process at its start time:
    output_dir= as given, else outputs/runs/torchrun-<torchrun's run id>."""
    from .launchers.torchrun import job_run_id

    if cfg.cluster.kind != "torchrun" or "output_dir" in _overridden_keys():
        return str(Path(cfg.output_dir).resolve())
    if (run_id := job_run_id()) is None:
        raise ConfigError(["cluster=torchrun without a torchrun run id (TORCHELASTIC_RUN_ID; a "
                           "launch by environment variables, as Kubernetes operators do it, has "
                           "none) needs a run directory every process and restart agrees on: "
                           "give torchrun --rdzv-id=<name> (outputs/runs/torchrun-<name>) or "
                           "output_dir=<dir>"])
    return str((Path.cwd() / "outputs" / "runs" / f"torchrun-{run_id}").resolve())


def _overridden_keys() -> set[str]:
    return {o.key_or_group for a in HydraConfig.get().overrides.task
            if (o := parse_override(a)) is not None}


def plan_run(cfg: DictConfig) -> tuple[RunSpec, Any]:
    """Config -> validated spec -> plan (printed); the plan's verdict is checked by the caller."""
    from .launchers.torchrun import restart_count
    from .plan import make_plan, resolve_auto

    spec = resolve_auto(build_spec(cfg, output_dir=run_dir_of(cfg), launch_dir=Path.cwd(),
                                   **_sweep_kwargs()))
    if spec.cluster.kind == "torchrun" and (restart := restart_count()):
        # torchrun restarted the job's processes: go on from the newest checkpoint
        spec = dataclasses.replace(spec, resume="auto", restart=restart)
    for key, value in spec.summary().items():
        log.info("%-30s %s", key, value)
    if warning := one_group_warning(spec.sharding.strategy, spec.mesh, spec.world_size):
        log.warning("%s", warning)
    plan = make_plan(spec)
    log.info("plan (per device):\n%s", plan.table())
    return spec, plan


def summary_lines(spec: RunSpec, rank0: Any) -> list[str]:
    """The summary printed when a run ends, from rank 0's result."""
    s, final = rank0.summary, rank0.final
    lines = [f"status         {rank0.status}", f"steps          {rank0.steps}"]
    if "loss" in final:
        lines.append(f"final loss     {final['loss']:.4f}"
                     + (f"   eval loss {final['eval_loss']:.4f}" if "eval_loss" in final else "")
                     + (f"   exact match {final['eval_exact_match']:.2f}"
                        if "eval_exact_match" in final else ""))
    if "eval_rewards/accuracy" in final:  # objective=dpo: how often held-out pairs agree
        lines.append(f"rewards        held-out accuracy {final['eval_rewards/accuracy']:.2f} "
                     f"(chance 0.5), margin {final['eval_rewards/margin']:.3f}")
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
    if rank0.status != "finished" and rank0.checkpoints:
        lines.append(f"continue with  {command_line(drop=('output_dir', 'resume'))} "
                     f"output_dir={spec.output_dir} resume=auto")
    elif rank0.status != "finished":
        lines.append("no checkpoint  none was saved (save.every_steps=0), so this run cannot be "
                     "continued from where it stopped. Set save.every_steps=N to make a stopped "
                     "run resumable")
    if rank0.mlflow_run_id:
        from .tracking import read_run_file, runs_page

        lines.append(f"mlflow run     {rank0.mlflow_run_id} in experiment "
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


def finished_point(spec: RunSpec) -> bool:
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


def finished_run(spec: RunSpec) -> bool:
    """A single run launched again into its directory (resume=auto) whose last attempt finished
    every step it is asked for now: nothing to start. A larger train.max_steps trains on."""
    from .rundir import read_run_status

    if spec.sweep_id is not None or spec.resume != "auto":
        return False
    status = read_run_status(spec.output_dir)
    target = spec.train.stop_after or spec.train.max_steps
    if status.get("status") != "finished" or int(status.get("step", 0)) < target:
        return False
    log.info("this run finished at step %d (train.max_steps=%d) in %s: nothing to train, "
             "nothing launched. Raise train.max_steps to train on from its last checkpoint, or "
             "give a new output_dir", status["step"], spec.train.max_steps, spec.output_dir)
    return True


def run_one(cfg: DictConfig, held: contextlib.ExitStack) -> Any:
    """The whole path for one composed config (one point of a sweep); ``held`` keeps the run
    directory owned until the caller is done with the run."""
    from .launchers import launch, preflight
    from .plan import check_fits, fixes_text
    from .prepare import prepare

    spec, plan = plan_run(cfg)
    if not spec.dry_run and finished_point(spec):
        return None
    if spec.dry_run:
        if not plan.fits:
            log.warning("this run would be refused at launch: it does not fit.\n%s",
                        fixes_text(spec, plan))
        log.info("dry_run=true: nothing launched. Would run:\n%s", _launch_preview(spec))
        return None
    check_fits(spec, plan)
    if spec.cluster.kind == "torchrun":
        return _run_torchrun_rank(spec, held)
    problems = preflight(spec)
    if problems:
        raise ConfigError(problems)
    owner = _own(spec, held)
    if finished_run(spec):
        return None
    prepared = prepare(spec, command=command_line())
    results = launch(prepared.spec, "llama_fsdp.worker:run_worker",
                     on_submitted=owner.slurm_job)
    if spec.cluster.kind == "local" or spec.cluster.wait:
        rank0 = next(r for r in results if r is not None and r.rank == 0)
        log.info("done\n  %s", "\n  ".join(summary_lines(spec, rank0)))
    return results


def _own(spec: RunSpec, held: contextlib.ExitStack) -> Any:
    """Hold the run directory until ``held`` closes; say so when a dead owner's is taken over."""
    from .owner import own

    owner = held.enter_context(own(spec.output_dir, command=command_line()))
    if owner.previous:
        log.warning("the launch that held %s before (pid %s on %s) ended without letting it go "
                    "(killed, or its host went down): taking it over%s", spec.output_dir,
                    owner.previous.get("pid"), owner.previous.get("host"),
                    "; resume=auto continues from its newest checkpoint"
                    if spec.resume == "auto" else "")
    return owner


def _run_torchrun_rank(spec: RunSpec, held: contextlib.ExitStack) -> Optional[list[Any]]:
    """cluster=torchrun: this process is a rank. The once-per-job duties run inside the job
    (launchers/torchrun.py): every node's first rank prepares its node, global rank 0 the job;
    then every rank trains. Returns this rank's result (None: nothing to train)."""
    from .launchers.common import worker_env
    from .launchers.torchrun import NothingToTrain, once_per_job
    from .prepare import check_data, prepare, resolve_model
    from .worker import run_worker

    if spec.sweep_id is not None:
        raise ConfigError(["sweeps (-m) do not run under cluster=torchrun, which starts the "
                           "processes of one run: start one torchrun job per point, or sweep "
                           "with cluster=local or cluster=slurm"])
    command = command_line()

    def job() -> Optional[str]:
        _own(spec, held)
        if finished_run(spec):
            return "finished"
        prepare(spec, command=command)
        return None

    def prepared(s: RunSpec, env: Any) -> RunSpec:
        if once_per_job(env, node=lambda: check_data(resolve_model(s)), job=job):
            raise NothingToTrain()
        with _hub_offline():  # the node's first rank fetched what a hub name needs
            s = resolve_model(s)
        os.environ.update(_hub_offline.VARS)  # from here on, as a launched rank: no hub
        return s

    # what the other launchers export to their ranks, but the allocator's settings, which act
    # only from a process's start (torchrun's environment is the user's to give)
    exported = worker_env(spec.output_dir, spec.device, environ={})
    os.environ.update({k: v for k, v in exported.items()
                       if not k.startswith("MALLOC_") and k not in _hub_offline.VARS})

    try:
        result = run_worker(spec, prepare=prepared)
    except NothingToTrain:
        return None
    if result.rank == 0:
        log.info("done\n  %s", "\n  ".join(summary_lines(spec, result)))
    return [result]


class _HubOffline:
    """Hugging Face hub access off while the block runs (what is needed is in the cache)."""

    VARS = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    @contextlib.contextmanager
    def __call__(self) -> Any:
        from .launchers.common import scoped_environ

        with scoped_environ(self.VARS):
            yield


_hub_offline = _HubOffline()


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
    from .owner import LOCK

    if [p.name for p in path.iterdir()] == [LOCK] if path.is_dir() else False:
        (path / LOCK).unlink(missing_ok=True)  # a launch refused after it took the directory
    for d in chain:
        try:
            d.rmdir()
        except OSError:
            return


def _waits_for_ranks(cfg: DictConfig) -> bool:
    """Whether this process saw the ranks end (and so closes the run's tracking): a local
    launch, a SLURM launch that waits, rank 0 of a torchrun job."""
    from .launchers.torchrun import rank

    match cfg.cluster.kind:
        case "local":
            return True
        case "torchrun":
            return rank() == 0
    return bool(cfg.cluster.wait)


def _failed(code: int) -> Optional[PointFailed]:
    """End a single run with ``code``; a sweep point hands its failure back instead, and the
    sweep goes on to its other points (SweepCallback collects it)."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return PointFailed(_sweep_kwargs()["sweep_point"], code)
    sys.exit(code)


@hydra.main(config_path="pkg://llama_fsdp.conf", config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> Any:
    with contextlib.ExitStack() as held:  # the run directory stays owned to the very end
        return _run_and_report(cfg, held)


def _run_and_report(cfg: DictConfig, held: contextlib.ExitStack) -> Any:
    from .launchers import Interrupted, LaunchError
    from .owner import RunDirBusy
    from .plan import PlanError
    from .prepare import PrepareError

    from .launchers.torchrun import rank

    if cfg.cluster.kind == "torchrun" and rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 speaks for the job
    final_s = float(cfg.tracking.final_delivery_s)
    launched = False
    output_dir = str(Path(cfg.output_dir).resolve())  # Hydra's until the spec says
    try:
        output_dir = run_dir_of(cfg)
        result = run_one(cfg, held)
        launched = result is not None
        if launched and _waits_for_ranks(cfg):
            _finish_tracking(output_dir, status="", deadline_s=final_s)
            if any(r is not None and r.status != "finished" for r in result):
                sys.exit(130)  # stopped by the user (Ctrl-C), after saving when saves are on
        return result
    except (ConfigError, PlanError, PrepareError, RunDirBusy) as e:
        log.error("%s", e)
        return _failed(2)
    except Interrupted as e:
        launched = True
        log.error("%s", e)
        _finish_tracking(output_dir, status="KILLED", deadline_s=final_s)
        sys.exit(e.exit_code)  # a stopped sweep stops whole
    except LaunchError as e:
        launched = True
        log.error("%s", e)
        _finish_tracking(output_dir, status="FAILED", deadline_s=final_s)
        return _failed(1)
    finally:
        if not launched:
            held.close()  # let the directory go first: a run that never started leaves nothing
            _remove_if_empty(output_dir)
        if str(Path(cfg.output_dir).resolve()) != output_dir:  # Hydra's, made but not used
            _remove_if_empty(str(Path(cfg.output_dir).resolve()))


# --- sweeps -----------------------------------------------------------------------------------


class SweepCallback(Callback):
    """Hydra callback of a multirun: the parent run when it starts; each point's outcome as it
    ends; the summary when the sweep ends (local sweeps), or the command that makes it (SLURM
    sweeps, which return at submission). A sweep with failed points exits with the worst code
    once every point had its turn."""

    def __init__(self) -> None:
        self.failed: list[PointFailed] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from .spec import resolve_tracking_uri
        from .sweep import start_parent

        if not config.tracking.enabled:
            return
        start_parent(str(Path(config.hydra.sweep.dir).resolve()),
                     uri=resolve_tracking_uri(config.tracking.uri, Path.cwd()),
                     experiment=config.tracking.experiment, command=command_line(),
                     swept=swept_overrides(list(config.hydra.overrides.task)))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        outcome = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        if isinstance(outcome, PointFailed):
            self.failed.append(outcome)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from .spec import resolve_tracking_uri
        from .sweep import parent_run, summarize, sweep_id_for

        sweep_dir = str(Path(config.hydra.sweep.dir).resolve())
        sweep_id = sweep_id_for(sweep_dir)
        uri = resolve_tracking_uri(config.tracking.uri, Path.cwd())
        if not config.tracking.enabled:
            table = None
        elif config.cluster.kind == "slurm" and not config.cluster.wait:
            table = None
            log.info("sweep %s submitted; when its jobs finish: python -m llama_fsdp.sweep %s "
                     "--uri %s", sweep_id, sweep_id, uri)
        else:
            # a point refused before launch (exit 2: its config) has no run: a row of its own
            table = summarize(sweep_id, tracking_uri=uri, experiment=config.tracking.experiment,
                              parent_id=parent_run(sweep_dir),
                              refused=[(p.values, p.code) for p in self.failed if p.code == 2])
        if table:
            log.info("sweep %s summary:\n%s", sweep_id, table)
        if self.failed:
            log.error("%d point(s) of sweep %s failed: %s; run the same command with "
                      "hydra.sweep.dir=%s to resume them", len(self.failed), sweep_id,
                      ", ".join(p.name or "(no overrides)" for p in self.failed), sweep_dir)
            raise SystemExit(max(p.code for p in self.failed))


def main() -> None:
    from .compat import check_versions

    check_versions()
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    problems = override_key_problems(sys.argv[1:])
    if problems:  # before Hydra, whose message for these suggests a fix that fails too
        sys.stderr.write("invalid override(s):\n" + "".join(f"  - {p}\n" for p in problems))
        sys.exit(2)
    register_configs()
    try:
        _hydra_main()
    finally:
        skip_final_collection()
