"""Sweeps in MLflow: one parent run per `-m` sweep, one child run per point.

MLflow's convention for searches is nested runs: the runs table shows the sweep as one
expandable row. The parent is made when the sweep starts (Hydra callback), holds the swept
parameters, the command and the number of points, and gets the summary: a table of the swept
values against throughput, memory and loss, a plot, and in its own row the numbers of its best
point: the finished point with the lowest eval loss, or whatever ``tracking.best_metric`` and
``tracking.best_mode`` name; without eval, the fastest point of a sweep over systems keys, else
the lowest final loss (the parent's tag ``best by`` says which). The summary is final once every
point has ended; until then it says how many have ("running 1/3"), and no point still queued or
running counts as failed. A
local sweep summarizes when its last point ends; a SLURM sweep (which returns at submission)
when the last of its jobs ends, or on demand:

    python -m llama_fsdp.sweep <sweep_id> [--uri URI]

A sweep started again in the same sweep directory (``hydra.sweep.dir=<dir>``, to resume or
re-run its failed points) keeps its parent run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from ..config import metrics as names
from ..config.schema import TrackingConfig
from ..config.status import FINISHED, MLFLOW_RUNNING, STATUSES, mlflow_status
from ..config.credentials import export_credentials
from .store import resolve_tracking_uri, ui_command
from . import (
    START_DELIVERY_S,
    Spool,
    deliver_pending,
    events,
    open_client,
    read_run_file,
    write_run_file,
)
from .view import (DIVERGED_AT_TAG, HARNESS, POINT_TAG, PRUNED_AT_TAG, STATUS_TAG, command_note,
                   status_text, sweep_view, view_tag)

log = logging.getLogger(__name__)

SUMMARY_METRICS = (names.SUMMARY_TOKENS_PER_SEC, names.SUMMARY_PEAK_MEMORY,
                   names.SUMMARY_FINAL_LOSS)
IGNORED_PARAMS = ("output_dir", "tracking.run_name", "recipe")
# where a value came from, not a value: the columns show the values in use (train.lr)
PROVENANCE = ("derived.", "source.")
KIND_TAG = "llama_fsdp.kind"  # "sweep" on the parent
POINTS_TAG = "sweep.points"  # on the parent: how many points the sweep runs
REFUSED_TAG = "sweep.refused"  # on the parent: the points refused before launch (JSON)
BEST_METRIC_TAG = "sweep.best_metric"  # on the parent: what picks its best point (Best)
BEST_MODE_TAG = "sweep.best_mode"
ENDED = frozenset(STATUSES.values())  # MLflow statuses of a run that has ended


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
                 swept: dict[str, str], points: Optional[int] = None,
                 best: Optional["Best"] = None) -> None:
    """Create the sweep's parent run (or keep the one of this sweep dir); ``swept``: the swept
    keys and their values as typed ({"train.batch_size": "1,2,4"}); ``points``: how many
    points the sweep runs (None: not known); ``best``: what picks its best point."""
    if read_run_file(sweep_dir).get("tracking_uri") == uri:  # started again in its own dir:
        Spool(sweep_dir).append(events.Running())  # the same parent, running again
        deliver_pending(sweep_dir, deadline_s=START_DELIVERY_S)
        return
    sweep_id = sweep_id_for(sweep_dir)
    write_run_file(sweep_dir, {"tracking_uri": uri, "swept": list(swept)})
    spool = Spool(sweep_dir)
    name = "sweep " + " ".join(f"{k}={v}" for k, v in swept.items()) if swept else sweep_id
    tags = {"sweep_id": sweep_id, KIND_TAG: "sweep", STATUS_TAG: status_text(MLFLOW_RUNNING),
            "mlflow.note.content": command_note(command, f"Sweep {sweep_id}:"),
            **point_tags(swept)}  # the parent's row in the swept keys' columns: "1,2,4"
    if points is not None:
        tags[POINTS_TAG] = str(points)
    tags.update((best or Best()).tags())
    # the sweep's own view (its swept keys' columns first, its runs alone): sweep_page opens it
    spool.append(events.Create(experiment, name, tags,
                               experiment_tags=dict([sweep_view(sweep_id, list(swept))])))
    spool.append(events.Params(dict(swept)))
    deliver_pending(sweep_dir, deadline_s=START_DELIVERY_S)


def sweep_page(uri: str, experiment: str, sweep_id: Optional[str] = None) -> str:
    """The runs page of the experiment the sweep is in, with the sweep's own view (the swept
    keys first, its runs alone) when the experiment holds it, else the experiment's view."""
    from . import open_client, runs_page

    exp = open_client(uri).get_experiment_by_name(experiment)
    own = bool(exp and sweep_id and view_tag(sweep_id) in exp.tags)
    return runs_page(uri, exp.experiment_id if exp else "0", view=sweep_id if own else None)


def compare_line(uri: str, page: str) -> str:
    """How to open the comparison: the whole command for a store the UI must serve (a file),
    the page alone for a server."""
    if uri.startswith(("http://", "https://")):
        return page
    return f"{ui_command(uri)}, then open {page}"


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
    varied = [k for k in keys if k not in IGNORED_PARAMS and not k.startswith(PROVENANCE)
              and len({r.data.params.get(k) for r in runs}) > 1]
    return sorted(varied)


def point_tags(values: dict[str, str]) -> dict[str, str]:
    """A sweep point's run tags: its value of each swept key (point.<key>)."""
    return {POINT_TAG + k: v for k, v in values.items()}


def _point_values(tags: dict[str, str]) -> dict[str, str]:
    return {k[len(POINT_TAG):]: v for k, v in tags.items() if k.startswith(POINT_TAG)}


def summary_rows(runs: list[Any], swept: list[str] = (),
                 refused: list[tuple[dict[str, str], int]] = (),
                 best_metric: Optional[str] = None
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

    # eval.harness's scores: a column per task and headline metric any point has
    scores = harness_columns(runs)

    def row(params: dict[str, Any], point: dict[str, str], metrics: dict[str, Any],
            status: str) -> dict:
        return {**{k: value(k, params, point) for k in keys},
                **{m: metrics.get(m) for m in (*_metric_columns(best_metric), *scores)},
                "status": status}

    # a point not ended is no failure and has no numbers yet: its row says so
    rows = sorted((row(r.data.params, _point_values(r.data.tags), names.canonical(r.data.metrics),
                       _status_cell(r)) for r in runs), key=lambda row: [str(row[k]) for k in keys])
    rows += [row({}, point, {}, f"REFUSED (exit {code})") for point, code in refused]
    return keys, rows


def _status_cell(r: Any) -> str:
    """A point's status: MLflow's, or DIVERGED with its step (a FAILED run the divergence
    guard stopped: never the best point), QUEUED OR RUNNING while it has not ended."""
    if r.info.status not in ENDED:
        return "QUEUED OR RUNNING"
    if DIVERGED_AT_TAG in r.data.tags:
        return f"DIVERGED (step {r.data.tags[DIVERGED_AT_TAG]})"
    if PRUNED_AT_TAG in r.data.tags:  # a search's trial stopped early: not failed
        return f"PRUNED (step {r.data.tags[PRUNED_AT_TAG]})"
    return r.info.status


def _header(col: str) -> str:
    return col.removeprefix(names.SUMMARY_PREFIX)


def harness_columns(runs: list[Any]) -> list[str]:
    """harness/<task>/<metric> of the runs (stderrs left out), in a stable order."""
    return sorted({k for r in runs for k in r.data.metrics
                   if k.startswith(names.HARNESS_PREFIX) and not k.endswith("_stderr")})


def _metric_columns(best_metric: Optional[str]) -> tuple[str, ...]:
    """The table's metrics: the summary's, and the one that picks the best point."""
    # (the harness score is its task's column already: harness/<task>/<metric>)
    extra = (best_metric,) if best_metric and best_metric not in (*SUMMARY_METRICS,
                                                                 HARNESS.name) else ()
    return (*SUMMARY_METRICS, *extra)


def format_table(keys: list[str], rows: list[dict[str, Any]],
                 best_metric: Optional[str] = None) -> str:
    scores = sorted({k for row in rows for k in row if k.startswith(names.HARNESS_PREFIX)}
                    - {best_metric})
    cols = [*keys, *_metric_columns(best_metric), *scores, "status"]

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


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far a sweep is: its points that ended (failed among them, refused ones included),
    those queued or running, and those not made yet (a sweep still submitting)."""

    ended: int
    failed: int
    active: int
    waiting: int

    @property
    def complete(self) -> bool:
        return self.active == 0 and self.waiting == 0

    @property
    def total(self) -> int:
        return self.ended + self.active + self.waiting

    def status(self) -> str:
        """The parent's status column: "running 1/3", "finished", "1/3 failed"."""
        if not self.complete:
            return f"running {self.ended}/{self.total}"
        return (f"{self.failed}/{self.total} failed" if self.failed
                else status_text(mlflow_status(FINISHED)))


def progress(statuses: list[str], refused: int, points: Optional[int],
             pruned: int = 0) -> Progress:
    """A sweep's progress from its point runs' MLflow statuses, its points refused before
    launch, and how many points it has (None: not known, the runs are all); ``pruned``: the
    ended runs a search's pruner stopped (KILLED, not failed)."""
    ended = [s for s in statuses if s in ENDED]
    active = len(statuses) - len(ended)
    made = len(statuses) + refused
    failed = sum(s != mlflow_status(FINISHED) for s in ended) - pruned + refused
    return Progress(ended=len(ended) + refused, failed=failed, active=active,
                    waiting=max(0, points - made) if points is not None else 0)


# Config keys (and groups) that change how fast a run trains and what it holds in memory, not what
# it is compared for: a sweep over these alone, with no eval loss, is run for speed (its best
# point is the fastest).
SYSTEMS_KEYS = ("train.batch_size", "train.compile", "sharding", "precision", "checkpointing",
                "cluster")


def systems_only(swept: Any) -> bool:
    """Whether every swept key is a systems key (or inside a systems config group)."""
    swept = list(swept)
    return bool(swept) and all(any(k == s or k.startswith(s + ".") for s in SYSTEMS_KEYS)
                               for k in swept)


@dataclasses.dataclass(frozen=True)
class Best:
    """What picks a sweep's best point: the lowest (``mode`` "min") or highest ("max") value of
    an end-of-run ``metric`` (tracking.best_metric, tracking.best_mode), among the points that
    finished: a point that failed, stopped, or has not ended yet is never the best. ``rule``:
    why this metric, when neither the sweep nor the default chose it (``for_points``)."""

    metric: str = TrackingConfig.best_metric
    mode: str = TrackingConfig.best_mode
    rule: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        return f"{'lowest' if self.mode == 'min' else 'highest'} {self.metric}"

    @classmethod
    def chosen(cls, metric: str, mode: str, harness_tasks: Any = ()) -> "Best":
        """tracking.best_metric / best_mode; left at their defaults in a sweep whose points run
        eval.harness, the highest harness score (the first task's headline metric) instead of
        the lowest eval loss: the benchmark is what the user compares then."""
        if harness_tasks and (metric, mode) == (cls.metric, cls.mode):
            return cls(HARNESS.name, "max")
        return cls(metric, mode)

    @classmethod
    def of(cls, tags: dict[str, str]) -> "Best":
        """The choice a sweep's parent run records (the defaults for a parent made before)."""
        return cls(tags.get(BEST_METRIC_TAG, cls.metric), tags.get(BEST_MODE_TAG, cls.mode))

    def tags(self) -> dict[str, str]:
        return {BEST_METRIC_TAG: self.metric, BEST_MODE_TAG: self.mode}

    def for_points(self, runs: list[Any], swept: Any = ()) -> "Best":
        """The rule that picks the best of these points. The default (the eval loss) where a
        finished point has one; else (no eval: eval.every_steps=0) the highest tokens/s where
        only systems keys were swept (``swept``: SYSTEMS_KEYS), else the lowest final loss. A
        metric the sweep named (tracking.best_metric) is kept whatever the points have."""
        if (self.metric, self.mode) != (Best.metric, Best.mode):
            return self
        if self.choose(runs) is not None:
            return self
        if systems_only(swept):
            return Best(names.SUMMARY_TOKENS_PER_SEC, "max",
                        rule="no eval loss, only systems keys swept")
        return Best(names.SUMMARY_FINAL_LOSS, "min", rule="no eval loss")

    def value(self, run: Any) -> Optional[float]:
        v = names.canonical(run.data.metrics).get(self.metric)  # (DPO's eval loss too)
        return v if v is not None and math.isfinite(v) else None

    def choose(self, runs: list[Any]) -> Optional[Any]:
        """The best finished point (of equals, the first by name: the same on every call)."""
        done = [r for r in runs if r.info.status == mlflow_status(FINISHED)
                and self.value(r) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        return min(done, key=lambda r: (sign * self.value(r), r.info.run_name or ""),
                   default=None)

    def line(self, runs: list[Any]) -> str:
        """The summary's word on it: the best point, its value and the rule that chose it, or
        why there is none."""
        best = self.choose(runs)
        if best is None:
            return f"best point: none yet (no finished point has {self.metric})"
        rule = f"; {self.rule}" if self.rule else ""
        return f"best point: {best.info.run_name} ({self}: {self.value(best):.4g}{rule})"


def best_run(runs: list[Any], best: Best = Best()) -> Optional[Any]:
    """The sweep's best point by ``best`` (lowest eval loss unless the sweep said otherwise)."""
    return best.choose(runs)


@contextlib.contextmanager
def _summary_lock(sweep_dir: Optional[str]) -> Iterator[None]:
    """One summary at a time per sweep (the last points of a SLURM sweep can end together):
    the later one reads what the earlier one could not see yet."""
    if sweep_dir is None or not Path(sweep_dir).is_dir():
        yield
        return
    from filelock import FileLock

    with FileLock(str(Path(sweep_dir) / ".summary.lock")):
        yield


def summarize(sweep_id: str, *, tracking_uri: str, experiment: str,
              parent_id: Optional[str] = None, sweep_dir: Optional[str] = None,
              refused: Optional[list[tuple[dict[str, str], int]]] = None,
              keep_refused: bool = False) -> Optional[str]:
    """Print-ready table of a sweep's points; logged with a plot to the parent run, whose row
    gets its best point's numbers. Once every point has ended the parent ends FINISHED (its
    tag failed_points counts the points that did not finish); before, it stays RUNNING and
    says how many have. ``refused``: the points refused before launch (values, exit code),
    recorded on the parent (None: those it recorded; ``keep_refused``: those it recorded and
    these, for a search, whose refused trials are not run again)."""
    from . import open_client

    client = open_client(tracking_uri)
    parent_id = parent_id or _find_parent(client, experiment, sweep_id)
    if parent_id is None:
        log.warning("no sweep run tagged sweep_id=%s in experiment %r", sweep_id, experiment)
        return None
    with _summary_lock(sweep_dir):
        parent = client.get_run(parent_id)
        recorded = [tuple(p) for p in json.loads(parent.data.tags.get(REFUSED_TAG, "[]"))]
        if refused is None:
            refused = recorded
        else:
            if keep_refused:
                refused = recorded + [p for p in map(tuple, refused) if p not in recorded]
            if refused:
                client.set_tag(parent_id, REFUSED_TAG, json.dumps(refused))
        runs = _latest_per_point(_children(client, parent_id))
        if not runs and not refused:
            log.warning("sweep %s has no points yet", sweep_id)
            return None
        points = parent.data.tags.get(POINTS_TAG)
        state = progress([r.info.status for r in runs], len(refused),
                         int(points) if points else None,
                         pruned=sum(r.info.status in ENDED and PRUNED_AT_TAG in r.data.tags
                                    for r in runs))
        best = Best.of(parent.data.tags).for_points(runs, list(parent.data.params))
        keys, rows = summary_rows(runs, list(parent.data.params), refused, best.metric)
        table = format_table(keys, rows, best.metric) + "\n" + best.line(runs)
        if not state.complete:
            table += (f"\n{state.ended} of {state.total} points ended; the summary is final "
                      f"when the last ends (or run: python -m llama_fsdp.sweep {sweep_id})")
        _log_summary(client, parent, sweep_id, table, keys, rows, state, best,
                     best.choose(runs))
    return table


def _log_summary(client: Any, parent: Any, sweep_id: str, table: str, keys: list[str],
                 rows: list[dict[str, Any]], state: Progress, by: Best,
                 best: Optional[Any]) -> None:
    """The summary on the parent: artifacts, its row's numbers (its best point's, and what
    chose it), its status; ended FINISHED once every point has."""
    from mlflow.entities import Metric, RunTag

    from .view import BEST_BY_TAG, BEST_POINT_TAG, SHOWN, STATUS_TAG

    parent_id = parent.info.run_id
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sweep_summary.md").write_text(f"# {sweep_id}\n\n```\n{table}\n```\n")
        plot(keys, rows, Path(tmp) / "sweep_summary.png")
        client.log_artifacts(parent_id, tmp)
    now = int(time.time() * 1000)
    metrics = [Metric("points", float(state.total), now, 0)]
    tags = [RunTag(STATUS_TAG, state.status()),
            RunTag(BEST_BY_TAG, f"{by} ({by.rule})" if by.rule else str(by))]
    if best is not None:
        metrics += [Metric("best/" + by.metric.removeprefix(names.SUMMARY_PREFIX),
                           by.value(best), now, 0),  # type: ignore[arg-type]
                    *(Metric(s.name, best.data.metrics[s.name], now, 0) for s in SHOWN
                      if s.name in best.data.metrics)]
        tags.append(RunTag(BEST_POINT_TAG, best.info.run_name))
    if state.complete:
        tags.append(RunTag("failed_points", str(state.failed)))
    elif "failed_points" in parent.data.tags:  # a sweep resumed: its points are not all done
        client.delete_tag(parent_id, "failed_points")
    client.log_batch(parent_id, metrics=metrics, tags=tags)
    if state.complete:
        client.set_terminated(parent_id, status=mlflow_status(FINISHED))
    elif parent.info.status != MLFLOW_RUNNING:
        client.update_run(parent_id, status=MLFLOW_RUNNING)


def point_ended(spec: Any) -> None:
    """A point of a sweep no launcher waits for (SLURM, cluster.wait=false) ended, its status
    delivered: the sweep's summary with it (final when it was the last point)."""
    if not spec.sweep_id or not spec.sweep_dir or not spec.tracking.enabled:
        return
    summarize(spec.sweep_id, tracking_uri=spec.tracking_uri, experiment=spec.tracking.experiment,
              parent_id=parent_run(spec.sweep_dir), sweep_dir=spec.sweep_dir)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m llama_fsdp.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_id")
    p.add_argument("--uri", default=TrackingConfig.uri)
    p.add_argument("--experiment", default=TrackingConfig.experiment)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    uri = resolve_tracking_uri(export_credentials(args.uri), Path.cwd())  # (MLflow reads
    table = summarize(args.sweep_id, tracking_uri=uri, experiment=args.experiment)  # them there)
    if table is None:
        raise SystemExit(1)
    log.info("%s", table)
    log.info("compare the points: %s", compare_line(uri, sweep_page(uri, args.experiment,
                                                                     args.sweep_id)))


if __name__ == "__main__":
    main()
