"""Sweeps in MLflow: one parent run per `-m` sweep, one child run per point.

MLflow's convention for searches is nested runs: the runs table shows the sweep as one
expandable row. The parent is made when the sweep starts (Hydra callback), holds the swept
parameters and the command, and gets the summary (a table of the swept values against
throughput, memory and loss, and a plot) when the points are done: after a local sweep at once,
for SLURM sweeps (which return at submission) on demand:

    python -m llama_fsdp.sweep <sweep_id> [--uri URI]

A sweep started again in the same sweep directory (``hydra.sweep.dir=<dir>``, to resume or
re-run its failed points) keeps its parent run.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from .config import TrackingConfig
from .result import FINISHED, SUMMARY, SUMMARY_PREFIX, mlflow_status
from .secrets import export_credentials
from .spec import resolve_tracking_uri
from .tracking import (
    START_DELIVERY_S,
    Spool,
    deliver_pending,
    events,
    open_client,
    read_run_file,
    write_run_file,
)

log = logging.getLogger(__name__)

SUMMARY_METRICS = (SUMMARY.tokens_per_sec, SUMMARY.peak_memory_gb, SUMMARY.final_loss)
IGNORED_PARAMS = ("output_dir", "tracking.run_name")
KIND_TAG = "llama_fsdp.kind"  # "sweep" on the parent
POINT_TAG = "point."  # a child run's tag per swept key: point.<key> = its value


def sweep_id_for(sweep_dir: str) -> str:
    """A stable id from Hydra's sweep dir (outputs/sweeps/<date>/<time> -> sweep-<date>_<time>)."""
    parts = Path(sweep_dir).parts
    return "sweep-" + "_".join(parts[-2:])


def swept_keys_of(sweep_dir: str) -> Optional[list[str]]:
    """The keys the sweep in ``sweep_dir`` varies (recorded when it started)."""
    return read_run_file(sweep_dir).get("swept")


def parent_run(sweep_dir: str) -> Optional[str]:
    """The parent run id of the sweep in ``sweep_dir`` (None if none was made)."""
    return read_run_file(sweep_dir).get("run_id")


def start_parent(sweep_dir: str, *, uri: str, experiment: str, command: str,
                 swept: dict[str, str]) -> None:
    """Create the sweep's parent run (or keep the one of this sweep dir); ``swept``: the swept
    keys and their values as typed ({"train.batch_size": "1,2,4"})."""
    if read_run_file(sweep_dir).get("tracking_uri") == uri:  # started again in its own dir:
        Spool(sweep_dir).append(events.Running())  # the same parent, running again
        deliver_pending(sweep_dir, deadline_s=START_DELIVERY_S)
        return
    sweep_id = sweep_id_for(sweep_dir)
    write_run_file(sweep_dir, {"tracking_uri": uri, "swept": list(swept)})
    spool = Spool(sweep_dir)
    name = "sweep " + " ".join(f"{k}={v}" for k, v in swept.items()) if swept else sweep_id
    spool.append(events.Create(experiment, name,
                               {"sweep_id": sweep_id, KIND_TAG: "sweep",
                                "mlflow.note.content": f"```\n{command}\n```"}))
    spool.append(events.Params(dict(swept)))
    deliver_pending(sweep_dir, deadline_s=START_DELIVERY_S)


def _children(client: Any, parent_id: str) -> list[Any]:
    run = client.get_run(parent_id)
    return client.search_runs([run.info.experiment_id],
                              f"tags.`mlflow.parentRunId` = '{parent_id}'", max_results=1000)


def _latest_per_point(runs: list[Any]) -> list[Any]:
    """A point's newest run: a point run again without a checkpoint to continue from gets a new
    run (prepare.start_run); the one it replaced stays in MLflow, out of the summary."""
    newest: dict[str, Any] = {}
    for r in sorted(runs, key=lambda r: r.info.start_time or 0):
        newest[r.data.tags.get("output_dir", r.info.run_id)] = r
    return list(newest.values())


def _find_parent(client: Any, experiment: str, sweep_id: str) -> Optional[str]:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id],
                              f"tags.sweep_id = '{sweep_id}' and tags.`{KIND_TAG}` = 'sweep'")
    return runs[0].info.run_id if runs else None


def swept_keys(runs: list[Any]) -> list[str]:
    """Config keys whose values differ between the runs: what the sweep varied."""
    keys = set().union(*(r.data.params for r in runs)) if runs else set()
    varied = [k for k in keys if k not in IGNORED_PARAMS and not k.startswith("derived.")
              and len({r.data.params.get(k) for r in runs}) > 1]
    return sorted(varied)


def point_tags(values: dict[str, str]) -> dict[str, str]:
    """A sweep point's run tags: its value of each swept key (point.<key>)."""
    return {POINT_TAG + k: v for k, v in values.items()}


def _point_values(tags: dict[str, str]) -> dict[str, str]:
    return {k[len(POINT_TAG):]: v for k, v in tags.items() if k.startswith(POINT_TAG)}


def summary_rows(runs: list[Any], swept: list[str] = (),
                 refused: list[tuple[dict[str, str], int]] = ()
                 ) -> tuple[list[str], list[dict[str, Any]]]:
    """The table's columns (the keys the sweep names, and any other that differs between its
    points) and a row per point: its runs, then the points refused before they launched (no
    run; ``refused``: their values of the swept keys and their exit code)."""
    varied = swept_keys(runs)
    # a swept config group (sharding=full,grad_op) varies its keys (sharding.strategy): those
    # are the columns; a group none of whose keys differ keeps its own column
    keys = sorted(set(varied) | {k for k in swept if not any(v.startswith(k + ".") for v in varied)})

    def value(key: str, params: dict[str, Any], point: dict[str, str]) -> Any:
        """A param where the run has it; else the point's value of the key, or of the config
        group the key belongs to (a refused point has no params)."""
        if key in params:
            return params[key]
        return point.get(key, next((v for g, v in point.items() if key.startswith(g + ".")),
                                   None))

    def row(params: dict[str, Any], point: dict[str, str], metrics: dict[str, Any],
            status: str) -> dict:
        return {**{k: value(k, params, point) for k in keys},
                **{m: metrics.get(m) for m in SUMMARY_METRICS}, "status": status}

    rows = sorted((row(r.data.params, _point_values(r.data.tags), r.data.metrics, r.info.status)
                   for r in runs), key=lambda row: [str(row[k]) for k in keys])
    rows += [row({}, point, {}, f"REFUSED (exit {code})") for point, code in refused]
    return keys, rows


def _header(col: str) -> str:
    return col.removeprefix(SUMMARY_PREFIX)


def format_table(keys: list[str], rows: list[dict[str, Any]]) -> str:
    cols = [*keys, *SUMMARY_METRICS, "status"]

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))

    table = [[_header(c) for c in cols]] + [[cell(row[c]) for c in cols] for row in rows]
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
        ax.set_title(_header(metric))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summarize(sweep_id: str, *, tracking_uri: str, experiment: str,
              parent_id: Optional[str] = None,
              refused: list[tuple[str, int]] = ()) -> Optional[str]:
    """Print-ready table of a sweep's points; logged with a plot to the parent run, which ends
    FINISHED (its tag failed_points counts the points that did not finish)."""
    from mlflow.entities import Metric, RunTag

    client = open_client(tracking_uri)
    parent_id = parent_id or _find_parent(client, experiment, sweep_id)
    if parent_id is None:
        log.warning("no sweep run tagged sweep_id=%s in experiment %r", sweep_id, experiment)
        return None
    runs = _latest_per_point(_children(client, parent_id))
    if not runs and not refused:
        log.warning("sweep %s has no finished points yet", sweep_id)
        return None
    keys, rows = summary_rows(runs, list(client.get_run(parent_id).data.params), refused)
    table = format_table(keys, rows)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sweep_summary.md").write_text(f"# {sweep_id}\n\n```\n{table}\n```\n")
        plot(keys, rows, Path(tmp) / "sweep_summary.png")
        client.log_artifacts(parent_id, tmp)
    best = max((r for r in rows if r[SUMMARY.tokens_per_sec]),
               key=lambda r: r[SUMMARY.tokens_per_sec], default=None)
    now = int(time.time() * 1000)
    metrics = [Metric("points", float(len(rows)), now, 0)]
    if best is not None:
        metrics.append(Metric("best/tokens_per_sec", best[SUMMARY.tokens_per_sec], now, 0))
    failed = sum(r["status"] != mlflow_status(FINISHED) for r in rows)
    client.log_batch(parent_id, metrics=metrics, tags=[RunTag("failed_points", str(failed))])
    client.set_terminated(parent_id, status=mlflow_status(FINISHED))
    return table


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m llama_fsdp.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_id")
    p.add_argument("--uri", default=TrackingConfig.uri)
    p.add_argument("--experiment", default=TrackingConfig.experiment)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    uri = export_credentials(args.uri)  # MLflow reads them from the environment
    table = summarize(args.sweep_id, tracking_uri=resolve_tracking_uri(uri, Path.cwd()),
                      experiment=args.experiment)
    if table is None:
        raise SystemExit(1)
    log.info("%s", table)


if __name__ == "__main__":
    main()
