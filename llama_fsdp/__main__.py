"""`python -m llama_fsdp [overrides]`: compose -> RunSpec -> plan -> launch -> summary."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .config import register_configs
from .spec import ConfigError, RunSpec, build_spec

log = logging.getLogger("llama_fsdp")


def _sweep_id() -> Optional[str]:
    from .sweep import sweep_id_for

    hc = HydraConfig.get()
    return sweep_id_for(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None


def _prepare(cfg: DictConfig) -> RunSpec:
    """Config -> validated spec -> plan (printed) -> refused here if it cannot fit."""
    from .plan import check_fits, choose_strategy, make_plan, resolve_auto

    # cfg.output_dir is Hydra's run dir unless the user points it at an earlier run to resume.
    spec = build_spec(cfg, launch_dir=Path.cwd(), sweep_id=_sweep_id())
    if spec.strategy == "auto":
        strategy, reason = choose_strategy(spec)
        log.info("sharding=auto chose %s: %s", strategy, reason)
        spec = resolve_auto(spec)
    for key, value in spec.summary().items():
        log.info("%-30s %s", key, value)
    plan = make_plan(spec)
    log.info("plan (per device):\n%s", plan.table())
    if spec.dry_run:
        if not plan.fits:
            log.warning("this run would be refused at launch (it does not fit); see the plan")
    else:
        check_fits(spec, plan)
    return spec


def _summary(spec: RunSpec, results: list[Any]) -> None:
    r0 = next(r for r in results if r and r.get("rank") == 0)
    final = r0["final"]
    lines = [
        f"steps          {r0['steps']}",
        f"final loss     {final.get('loss', float('nan')):.4f}"
        + (f"   eval loss {final['eval_loss']:.4f}" if "eval_loss" in final else "")
        + (f"   exact match {final['eval_exact_match']:.2f}" if "eval_exact_match" in final else ""),
        f"tokens/s       {final.get('tokens_per_sec', 0):.0f} global, "
        f"{final.get('tokens_per_sec_per_device', 0):.0f} per device",
        f"peak memory    {final.get('peak_memory_gb', 0):.2f} GB (max over ranks)",
        f"run dir        {spec.output_dir}",
    ]
    if r0.get("mlflow_run_id"):
        lines.append(f"mlflow run     {r0['mlflow_run_id']} in experiment "
                     f"'{spec.tracking.experiment}' at {spec.tracking_uri}")
        if spec.tracking_uri.startswith("sqlite:///"):
            lines.append(f"compare runs   mlflow ui --backend-store-uri {spec.tracking_uri}")
    log.info("done\n  %s", "\n  ".join(lines))


def _launch_preview(spec: RunSpec) -> str:
    if spec.cluster.kind == "slurm":
        from launchers.slurm import sbatch_preview

        return sbatch_preview(spec)
    return (f"{spec.nproc_per_node} local rank process(es) via submitit's local executor, each "
            f"running llama_fsdp.worker.run_worker (backend {spec.backend}, device {spec.device})")


def run(cfg: DictConfig) -> Any:
    """The whole path for one composed config (one point of a sweep)."""
    from launchers import launch

    from .worker import run_worker

    spec = _prepare(cfg)
    if spec.dry_run:
        log.info("dry_run=true: nothing launched. Would run:\n%s", _launch_preview(spec))
        return None
    results = launch(spec, run_worker)
    if spec.cluster.kind == "local" or spec.cluster.wait:
        _summary(spec, results)
    return results


def _mark_failed(output_dir: str) -> None:
    """Ranks killed after another rank's crash cannot close their MLflow run; do it here."""
    from .tracking import mark_run_failed

    try:
        mark_run_failed(output_dir)
    except Exception as e:  # noqa: BLE001 - the launch error matters more than this
        log.warning("could not mark the MLflow run failed: %s", e)


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> Any:
    from launchers import LaunchError

    from .plan import PlanError

    try:
        return run(cfg)
    except (ConfigError, PlanError) as e:
        log.error("%s", e)
        sys.exit(2)
    except LaunchError as e:
        log.error("%s", e)
        _mark_failed(str(Path(cfg.output_dir).resolve()))
        sys.exit(1)


def main() -> None:
    register_configs()
    _hydra_main()


if __name__ == "__main__":
    main()
