"""Sweep summaries: every run of a `-m` sweep carries the tag `sweep_id`; this gathers them.

After a local sweep the Hydra callback prints and logs the summary; for SLURM sweeps (which
return at submission) run it on demand: `python -m llama_fsdp.sweep <sweep_id> [--uri URI]`.
The summary is a table of the swept values against tokens/s, peak memory and final loss, and
a plot, logged as artifacts of a `sweep-summary` run in the same experiment.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

SUMMARY_METRICS = ("tokens_per_sec", "peak_memory_gb", "loss")
IGNORED_PARAMS = ("output_dir", "tracking.run_name")


def sweep_id_for(sweep_dir: str) -> str:
    """A stable id from Hydra's sweep dir (outputs/sweeps/<date>/<time> -> sweep-<date>_<time>)."""
    parts = Path(sweep_dir).parts
    return "sweep-" + "_".join(parts[-2:])


def _runs(client: Any, experiment: str, sweep_id: str) -> list[Any]:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{sweep_id}'",
                              max_results=1000)
    return [r for r in runs if r.data.tags.get("llama_fsdp.kind") != "sweep-summary"]


def swept_keys(runs: list[Any]) -> list[str]:
    """Config keys whose values differ between the runs: what the sweep varied."""
    keys = set().union(*(r.data.params for r in runs)) if runs else set()
    varied = [k for k in keys if k not in IGNORED_PARAMS and not k.startswith("derived.")
              and len({r.data.params.get(k) for r in runs}) > 1]
    return sorted(varied)


def summary_rows(runs: list[Any]) -> tuple[list[str], list[dict[str, Any]]]:
    keys = swept_keys(runs)
    rows = []
    for r in sorted(runs, key=lambda r: [r.data.params.get(k, "") for k in keys]):
        row = {k: r.data.params.get(k) for k in keys}
        row.update({m: r.data.metrics.get(m) for m in SUMMARY_METRICS})
        row["status"] = r.info.status
        rows.append(row)
    return keys, rows


def format_table(keys: list[str], rows: list[dict[str, Any]]) -> str:
    cols = [*keys, *SUMMARY_METRICS, "status"]
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))
    table = [cols] + [[cell(row[c]) for c in cols] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(keys: list[str], rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [", ".join(f"{k.split('.')[-1]}={row[k]}" for k in keys) or "run" for row in rows]
    fig, axes = plt.subplots(1, len(SUMMARY_METRICS), figsize=(5 * len(SUMMARY_METRICS), 4))
    for ax, metric in zip(axes, SUMMARY_METRICS):
        ax.bar(range(len(rows)), [row[metric] or 0.0 for row in rows])
        ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_title("final loss" if metric == "loss" else metric)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summarize(sweep_id: str, *, tracking_uri: str, experiment: str) -> Optional[str]:
    """Print-ready table of a sweep; also logged with a plot to a `sweep-summary` run."""
    from .tracking import open_client

    client = open_client(tracking_uri)
    runs = _runs(client, experiment, sweep_id)
    if not runs:
        log.warning("no MLflow runs tagged sweep_id=%s in experiment %r", sweep_id, experiment)
        return None
    keys, rows = summary_rows(runs)
    table = format_table(keys, rows)
    exp = client.get_experiment_by_name(experiment)
    summary = client.create_run(exp.experiment_id, run_name=f"{sweep_id}-summary",
                                tags={"sweep_id": sweep_id, "llama_fsdp.kind": "sweep-summary"})
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sweep_summary.md").write_text(f"# {sweep_id}\n\n```\n{table}\n```\n")
        plot(keys, rows, Path(tmp) / "sweep_summary.png")
        client.log_artifacts(summary.info.run_id, tmp)
    client.set_terminated(summary.info.run_id)
    return table


class SweepSummaryCallback(Callback):
    """Hydra callback: after a multirun, summarize the runs it made (local sweeps wait)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from .spec import resolve_tracking_uri

        if not config.tracking.enabled:
            return
        sweep_id = sweep_id_for(config.hydra.sweep.dir)
        uri = resolve_tracking_uri(config.tracking.uri, Path.cwd())
        if config.cluster.kind == "slurm" and not config.cluster.wait:
            log.info("sweep %s submitted; when its jobs finish: python -m llama_fsdp.sweep %s "
                     "--uri %s", sweep_id, sweep_id, uri)
            return
        table = summarize(sweep_id, tracking_uri=uri, experiment=config.tracking.experiment)
        if table:
            log.info("sweep %s summary:\n%s", sweep_id, table)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m llama_fsdp.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_id")
    p.add_argument("--uri", default="sqlite:///outputs/mlflow.db")
    p.add_argument("--experiment", default="llama_fsdp")
    args = p.parse_args(argv)
    from .spec import resolve_tracking_uri

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    table = summarize(args.sweep_id, tracking_uri=resolve_tracking_uri(args.uri, Path.cwd()),
                      experiment=args.experiment)
    if table is None:
        raise SystemExit(1)
    log.info("%s", table)


if __name__ == "__main__":
    main()
