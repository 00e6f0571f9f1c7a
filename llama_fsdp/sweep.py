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

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

SUMMARY_METRICS = ("summary/tokens_per_sec", "summary/peak_memory_gb", "summary/final_loss")
IGNORED_PARAMS = ("output_dir", "tracking.run_name")
KIND_TAG = "llama_fsdp.kind"  # "sweep" on the parent
# Points of this process's sweep that failed (override_dirname, exit code): the sweep goes on to
# its other points and its summary, then exits with the worst code (on_multirun_end).
FAILED_POINTS: list[tuple[str, int]] = []


def sweep_id_for(sweep_dir: str) -> str:
    """A stable id from Hydra's sweep dir (outputs/sweeps/<date>/<time> -> sweep-<date>_<time>)."""
    parts = Path(sweep_dir).parts
    return "sweep-" + "_".join(parts[-2:])


def point_name(overrides: list[str], swept: Optional[list[str]] = None) -> str:
    """A child run's name: the point's values of the swept keys (all its overrides if those
    are unknown), with short keys: "batch_size=2 sharding=full"."""
    out = []
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if swept is None or key in swept:
            out.append(f"{key.split('.')[-1]}={value}")
    return " ".join(out)


def swept_keys_of(sweep_dir: str) -> Optional[list[str]]:
    """The keys the sweep in ``sweep_dir`` varies (recorded when it started)."""
    from .tracking import read_run_file

    return read_run_file(sweep_dir).get("swept")


def swept_overrides(task_overrides: list[str]) -> list[str]:
    """The overrides of a sweep command that vary (comma lists, ranges, choices)."""
    return [o for o in task_overrides if "," in o.partition("=")[2] or "range(" in o
            or "choice(" in o]


def parent_run(sweep_dir: str) -> Optional[str]:
    """The parent run id of the sweep in ``sweep_dir`` (None if none was made)."""
    from .tracking import read_run_file

    return read_run_file(sweep_dir).get("run_id")


def start_parent(sweep_dir: str, *, uri: str, experiment: str, command: str,
                 task_overrides: list[str]) -> None:
    """Create the sweep's parent run (or keep the one of this sweep dir)."""
    from .tracking import (START_DELIVERY_S, Spool, deliver_pending, events, read_run_file,
                           write_run_file)

    if read_run_file(sweep_dir).get("tracking_uri") == uri:  # started again in its own dir:
        Spool(sweep_dir).append(events.Running())  # the same parent, running again
        deliver_pending(sweep_dir, deadline_s=START_DELIVERY_S)
        return
    swept = swept_overrides(task_overrides)
    sweep_id = sweep_id_for(sweep_dir)
    write_run_file(sweep_dir, {"tracking_uri": uri,
                               "swept": [o.partition("=")[0].lstrip("+~") for o in swept]})
    spool = Spool(sweep_dir)
    spool.append(events.Create(experiment, "sweep " + " ".join(swept) if swept else sweep_id,
                               {"sweep_id": sweep_id, KIND_TAG: "sweep",
                                "mlflow.note.content": f"```\n{command}\n```"}))
    spool.append(events.Params({o.partition("=")[0]: o.partition("=")[2] for o in swept}))
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


def summary_rows(runs: list[Any], swept: list[str] = (),
                 refused: list[tuple[str, int]] = ()) -> tuple[list[str], list[dict[str, Any]]]:
    """The table's columns (the keys the sweep names, and any other that differs between its
    points) and a row per point: its runs, then the points refused before they launched (no
    run), whose values come from their names ("batch_size=0")."""
    varied = swept_keys(runs)
    swept = [k.lstrip("+~") for k in swept]
    # a swept config group (sharding=full,grad_op) varies its keys (sharding.strategy): those
    # are the columns; a group none of whose keys differ keeps its own column
    keys = sorted(set(varied) | {k for k in swept if not any(v.startswith(k + ".") for v in varied)})

    def row(params: dict[str, Any], name: str, metrics: dict[str, Any], status: str) -> dict:
        named = dict(v.partition("=")[::2] for v in name.split())  # point_name's short keys
        # a param where the run has it; else (a group's choice, a refused point) from the name
        return {**{k: params.get(k, named.get(k.split(".")[-1])) for k in keys},
                **{m: metrics.get(m) for m in SUMMARY_METRICS}, "status": status}

    rows = sorted((row(r.data.params, r.info.run_name or "", r.data.metrics, r.info.status)
                   for r in runs), key=lambda row: [str(row[k]) for k in keys])
    rows += [row({}, name, {}, f"REFUSED (exit {code})") for name, code in refused]
    return keys, rows


def _header(col: str) -> str:
    return col.removeprefix("summary/")


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

    from .tracking import open_client

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
    best = max((r for r in rows if r["summary/tokens_per_sec"]),
               key=lambda r: r["summary/tokens_per_sec"], default=None)
    now = int(time.time() * 1000)
    metrics = [Metric("points", float(len(rows)), now, 0)]
    if best is not None:
        metrics.append(Metric("best/tokens_per_sec", best["summary/tokens_per_sec"], now, 0))
    failed = sum(r["status"] != "FINISHED" for r in rows)
    client.log_batch(parent_id, metrics=metrics, tags=[RunTag("failed_points", str(failed))])
    client.set_terminated(parent_id, status="FINISHED")
    return table


class SweepSummaryCallback(Callback):
    """Hydra callback: the parent run when a multirun starts; its summary when it ends
    (local sweeps), or the command that makes it (SLURM sweeps, which return at submission)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from .__main__ import command_line
        from .spec import resolve_tracking_uri

        if not config.tracking.enabled:
            return
        start_parent(str(Path(config.hydra.sweep.dir).resolve()),
                     uri=resolve_tracking_uri(config.tracking.uri, Path.cwd()),
                     experiment=config.tracking.experiment, command=command_line(),
                     task_overrides=list(config.hydra.overrides.task))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from .spec import resolve_tracking_uri

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
                              refused=[p for p in FAILED_POINTS if p[1] == 2])
        if table:
            log.info("sweep %s summary:\n%s", sweep_id, table)
        if FAILED_POINTS:
            log.error("%d point(s) of sweep %s failed: %s; run the same command with "
                      "hydra.sweep.dir=%s to resume them", len(FAILED_POINTS), sweep_id,
                      ", ".join(name or "(no overrides)" for name, _ in FAILED_POINTS), sweep_dir)
            raise SystemExit(max(code for _, code in FAILED_POINTS))


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
