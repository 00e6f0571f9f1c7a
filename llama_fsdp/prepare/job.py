"""The job's once-only duties, in order (``prepare_job``): own the run directory, stop at a
run with nothing left to train, then ``prepare``: callbacks imported, the tracking store
reached, the weights fetched, the data prepared, the plan made again with the data's records,
config.yaml written and the MLflow run created."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from ..checkpoint.layout import continued_run, retire
from ..config import recipes
from ..config.rundir import RunDir, config_digest, read_run_status, write_identity
from ..config.status import FINISHED
from ..run.checks import callback_problems
from ..run.ownership import own
from ..run.spec import RunSpec
from .data import dataset_inputs, prepare_data
from .errors import PrepareError
from .model import resolve_model
from .tracking import check_tracking, start_run

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PreparedRun:
    spec: RunSpec  # with model.path resolved to a local directory
    data_stats: dict[str, float]
    owner: Any = None  # the launch's hold on the run directory (owner.Ownership), prepare_job's


def prepare_job(spec: RunSpec, *, held: contextlib.ExitStack, command: str
                ) -> Optional[PreparedRun]:
    """The job's once-only duties before any rank trains, wherever the launcher runs them:
    own the run directory (until ``held`` closes), stop at a run that has nothing left to train
    (None), then ``prepare``."""
    owner = own_run_dir(spec, held, command)
    if finished_run(spec):
        return None
    return dataclasses.replace(prepare(spec, command=command), owner=owner)


def own_run_dir(spec: RunSpec, held: contextlib.ExitStack, command: str) -> Any:
    """Hold the run directory until ``held`` closes; say so when a dead owner's is taken over."""
    owner = held.enter_context(own(spec.output_dir, command=command))
    if owner.previous:
        log.warning("the launch that held %s before (pid %s on %s) ended without letting it go "
                    "(killed, or its host went down): taking it over%s", spec.output_dir,
                    owner.previous.get("pid"), owner.previous.get("host"),
                    "; resume=auto continues from its newest checkpoint"
                    if spec.resume == "auto" else "")
    return owner


def finished_run(spec: RunSpec) -> bool:
    """A single run launched again into its directory (resume=auto) whose last attempt finished
    every step it is asked for now: nothing to start. A larger train.max_steps trains on."""
    if spec.sweep_id is not None or spec.resume != "auto":
        return False
    status = read_run_status(spec.output_dir)
    target = spec.train.stop_after or spec.train.max_steps
    if status.get("status") != FINISHED or int(status.get("step", 0)) < target:
        return False
    if status.get("config_sha256") != config_digest(spec.config_yaml) and (
            changed := config_changes(RunDir(spec.output_dir).config, spec.config_yaml)):
        raise PrepareError(
            f"{spec.output_dir} holds a run that finished at step {status['step']} with another "
            f"config ({'; '.join(changed)}): a finished run is not trained on with another "
            "config. Give a new output_dir (or raise train.max_steps with the config it had)")
    log.info("this run finished at step %d (train.max_steps=%d) in %s: nothing to train, "
             "nothing launched. Raise train.max_steps to train on from its last checkpoint, or "
             "give a new output_dir", status["step"], spec.train.max_steps, spec.output_dir)
    return True


# what a relaunch into a finished run may change without being another run: where it writes, how
# it resumes, whether it launches, and how long it trains (that is what "finished" is judged by)
NOT_THE_RUN = ("output_dir", "resume", "dry_run", "force", "train.max_steps", "train.stop_after")


def config_changes(old_yaml: Path, new_yaml: str) -> list[str]:
    """The keys whose values differ between the run directory's config.yaml and a new launch's
    config ("key: old -> new"), but those in NOT_THE_RUN. A key left to the recipe (null) reads
    as the recipe's value on its side: lr null then lr=0.003 (the recipe's) is no change, and
    lr null then lr=0.001 reads ``train.lr: 0.003 (recipe) -> 0.001``."""
    from ..tracking import flatten

    try:
        old_cfg = OmegaConf.load(old_yaml)
    except (OSError, ValueError):
        return ["its config.yaml cannot be read"]
    new_cfg = OmegaConf.create(new_yaml)
    old, new = (flatten(OmegaConf.to_container(c)) for c in (old_cfg, new_cfg))  # type: ignore[arg-type]
    changed = [k for k in sorted(set(old) | set(new))
               if k not in NOT_THE_RUN and old.get(k) != new.get(k)]
    if not changed:
        return []
    old_values, new_values = _recipe_values(old_cfg), _recipe_values(new_cfg)

    def show(k: str, raw: dict[str, Any], recipe: dict[str, Any]) -> tuple[Any, str]:
        if raw.get(k) is None and k in recipe:
            return recipe[k], f"{recipes.show(recipe[k])} (recipe)"
        return raw.get(k), recipes.show(raw.get(k))

    out = []
    for k in changed:
        (a, a_text), (b, b_text) = show(k, old, old_values), show(k, new, new_values)
        if a != b:
            out.append(f"{k}: {a_text} -> {b_text}")
    return out


def _recipe_values(cfg: Any) -> dict[str, Any]:
    """The recipe's value of each recipe key a composed config leaves null (config/recipes.py);
    {} when the config no longer reads as the schema (an older release's run directory)."""
    from ..config.objectives import OBJECTIVES
    from ..config.schema import Config

    try:
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
        known = OBJECTIVES.get(obj.objective.name)  # type: ignore[attr-defined]
        return recipes.resolve(obj, pairs=bool(known and known.pairs))[1].values
    except Exception as e:  # noqa: BLE001 -- the raw values are shown instead
        log.debug("the recipe of %s is not known (%s): its null keys show as null", cfg, e)
        return {}


def take_the_run_dir(spec: RunSpec) -> str:
    """The run that trains in the directory now: the one its resume continues, or a new one
    (resume=retire first moves the earlier run's checkpoints aside). Recorded in
    run_identity.json, which every checkpoint it saves carries; returns its id."""
    if spec.resume == "retire" and (moved := retire(spec.output_dir)) is not None:
        log.warning("resume=retire: the earlier run's checkpoints moved to %s (nothing deleted); "
                    "this run starts at step 0", moved)
    run = continued_run(spec.resume, spec.output_dir) or uuid.uuid4().hex
    write_identity(spec.output_dir, run=run, config_yaml=spec.config_yaml)
    return run


def prepare(spec: RunSpec, *, command: str) -> PreparedRun:
    """Reach the tracking store, fetch weights, prepare the data, create the MLflow run."""
    check_callbacks(spec)
    reachable = check_tracking(spec) if spec.tracking.enabled else False
    spec = resolve_model(spec)
    data = prepare_data(spec)
    spec = replan_for_records(spec, data.stats)
    if spec.eval.every_steps:
        from ..plan.eval_cost import fit_eval

        spec, cost, left_out = fit_eval(spec, data.stats)
        log.info("plan with the data: %s%s", cost.line(spec.eval.every_steps), left_out)
    Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
    take_the_run_dir(spec)
    RunDir(spec.output_dir).config.write_text(spec.config_yaml)
    if spec.tracking.enabled:
        start_run(spec, command=command, deliver=reachable, datasets=dataset_inputs(spec, data))
    return PreparedRun(spec, data.stats)


def replan_for_records(spec: RunSpec, stats: dict[str, float]) -> RunSpec:
    """CUDA's flash varlen backward allocates per record of a micro-batch
    (plan/activations.py: varlen_backward_bytes), which the plan counts as one record per row
    until the data is known. Now it is: the spec carries the fullest micro-batch's records
    (the ``train.batch_size`` fullest rows' records: a row's padding joins its last record), the
    ranks' plan counts them, the new peak is printed where the term moves it, and a run that no
    longer fits is refused here, before any rank starts, with the plan's fixes."""
    from ..plan import PlanError, check_fits, flash_varlen_runs, make_plan

    per_row = int(stats.get("records_per_row_max", 0))
    records = int(stats.get("records_per_micro_batch_max",
                            spec.train.batch_size * per_row))
    if not records or not flash_varlen_runs(spec.model, spec.device):
        return spec
    grown = dataclasses.replace(spec, records_per_micro_batch=records)
    before, plan = make_plan(spec), make_plan(grown)
    if plan.predicted_peak_bytes >= 1.01 * before.predicted_peak_bytes:
        log.info("plan with the data: up to %d records in a micro-batch (%d in the fullest row) "
                 "grow flash varlen's backward workspace: predicted peak %.2f GB (was %.2f GB), "
                 "in %s", records, per_row, plan.predicted_peak_gb,
                 before.predicted_peak_gb, plan.peak_phase)
    if not plan.fits:
        try:
            check_fits(grown, plan)  # the fixes (or force=true's warning)
        except PlanError as e:
            raise PlanError(
                f"with the data, flash varlen's backward holds a workspace for up to {records} "
                f"records a micro-batch ({per_row} in the fullest row), and the run no "
                f"longer fits (the plan printed above counted one record per row). Rows of "
                f"fewer, longer records need less.\n{e}") from None
    return grown


def check_callbacks(spec: RunSpec) -> None:
    """train.callbacks imported here, once: a bad one is named before any rank starts."""
    if found := callback_problems(spec.train.callbacks):
        raise PrepareError("; ".join(found))

