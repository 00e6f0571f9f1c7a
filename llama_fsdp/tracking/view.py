"""What a person sees of the runs in MLflow's UI (3.x), decided in one place.

- **The link** (``RUNS_QUERY``): the experiment's runs page in model-training mode with the saved
  view. MLflow opens an experiment in GenAI mode otherwise, and switching modes drops the view.
- **The saved view** ``llama_fsdp`` (an experiment tag the UI reads for ``viewStateShareKey``):
  the columns, their order and widths, so that a 1600 px screen shows each run's status, method,
  trainable parameters, losses, speed, memory and duration without scrolling, its data set and
  model after them; and the charts: loss and eval loss first, the end-of-run summary as bars.
- **The shown metrics** (``SHOWN``): MLflow prints a metric's raw float (7317.475065965187) and
  counts without separators, so the table's columns are rounded copies (``tokens per sec``
  7317, ``trainable M`` 0.311) logged beside the exact metrics they come from, which stay for
  filters, the compare page and anyone reading the store. Rounded metrics, not text tags: the
  table sorts metric columns, never tag columns. A new objective adds its columns to
  ``BY_OBJECTIVE``.
- **A run's note** (the command, one override per line) and **its logged model's name**.
"""
from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ..config import metrics as m
from ..config.objectives import DPO, SFT
from ..config.status import STATUS_WORDS

EXPERIMENT_KIND = "finetuning"  # mlflow.experimentKind: a model-training experiment
VIEW = "llama_fsdp"


def view_tag(view: str) -> str:
    """The experiment tag that holds the saved view whose share key is ``view``."""
    return f"mlflow.sharedViewState.{view}"


VIEW_TAG = view_tag(VIEW)


def runs_query(view: str = VIEW) -> str:
    """The runs page's query: model-training mode and the saved view ``view``."""
    return f"workflowType=machine_learning&viewStateShareKey={view}"


RUNS_QUERY = runs_query()
STATUS_TAG = "status"  # the run's state as words: the table shows MLflow's only as an icon
BEST_POINT_TAG = "best point"  # on a sweep's parent: the point whose numbers its row shows
DIVERGED_AT_TAG = "diverged at step"  # a run the divergence guard stopped (train/divergence.py)
PRUNED_AT_TAG = "pruned at step"  # a search's trial its pruner stopped (train/pruning.py)
BEST_BY_TAG = "best by"  # on a sweep's parent: what chose it ("lowest summary/eval_loss")


@dataclass(frozen=True)
class Shown:
    """A column of rounded numbers: metric ``name`` (the column's header), ``value`` of the run's
    exact metrics, to ``digits`` significant digits."""

    name: str
    value: Callable[[Mapping[str, float]], Optional[float]]
    digits: int
    width: int  # px: the header fits


def _metric(key: str, scale: float = 1.0) -> Callable[[Mapping[str, float]], Optional[float]]:
    return lambda exact: None if exact.get(key) is None else exact[key] * scale


def _trainable_pct(exact: Mapping[str, float]) -> Optional[float]:
    """The trainable share of all parameters, adapters included (as PEFT and the plan count)."""
    trainable, total = exact.get(m.TRAINABLE_PARAMS), exact.get(m.TOTAL_PARAMS)
    return None if trainable is None or not total else 100.0 * trainable / total


TRAINABLE = (Shown("trainable M", _metric(m.TRAINABLE_PARAMS, 1e-6), 3, 90),
             Shown("trainable pct", _trainable_pct, 3, 98))
# what each training objective is judged by; a new objective (DPO: its rewards/accuracy) adds
# its columns here, and the view shows them all (a run lacking one shows "-")
BY_OBJECTIVE: dict[str, tuple[Shown, ...]] = {
    SFT: (Shown("final loss", _metric(m.SUMMARY_FINAL_LOSS), 4, 78),
          Shown("eval loss", _metric(m.SUMMARY_EVAL_LOSS), 4, 76)),
    DPO: (Shown("eval reward acc", _metric(m.SUMMARY_EVAL_REWARD_ACCURACY), 3, 116),),
}
SPEED_MEMORY = (Shown("tokens per sec", _metric(m.SUMMARY_TOKENS_PER_SEC), 4, 108),
                Shown("MFU pct", _metric(m.SUMMARY_MFU, 100.0), 3, 80),
                Shown("peak GB", _metric(m.SUMMARY_PEAK_MEMORY), 3, 74),
                Shown("planned GB", _metric(m.SUMMARY_PREDICTED_PEAK_MEMORY), 3, 92))
BASE = Shown("base M", _metric(m.BASE_PARAMS, 1e-6), 3, 72)


def _harness_score(exact: Mapping[str, float]) -> Optional[float]:
    """eval.harness's first task's headline metric (harness/<task>/<metric>, not a stderr)."""
    return next((v for k, v in exact.items()
                 if k.startswith(m.HARNESS_PREFIX) and not k.endswith("_stderr")), None)


HARNESS = Shown("harness score", _harness_score, 3, 104)
# after the first screen (1600 px holds the columns of every run; a DPO run's reward accuracy
# is the first column past it)
LATER = (*BY_OBJECTIVE[DPO], HARNESS, BASE)
SHOWN: tuple[Shown, ...] = (*TRAINABLE, *(s for cols in BY_OBJECTIVE.values() for s in cols),
                            *SPEED_MEMORY, HARNESS, BASE)


def round_to(value: float, digits: int) -> float:
    """``value`` to ``digits`` significant digits (7317.475 -> 7317, 0.0973114 -> 0.0973)."""
    return float(f"{value:.{digits}g}")


def shown_metrics(exact: Mapping[str, float]) -> dict[str, float]:
    """The table's rounded columns of a run, from its exact metrics (those it has)."""
    out = {}
    for s in SHOWN:
        value = s.value(exact)
        if value is not None and math.isfinite(value):
            out[s.name] = round_to(value, s.digits)
    return out


def _col(kind: str, key: str) -> str:
    return f"{kind}.`{key}`"


RUN_NAME, CREATED, DURATION = "attributes.`Run Name`", "runDateAndNestInfo", "duration"
# (column id, width in px), in the order shown. Run name and created (with MLflow's status icon)
# are pinned on the left; duration is always shown; the others are chosen by the view.
COLUMNS: tuple[tuple[str, int], ...] = (
    (RUN_NAME, 156), (CREATED, 132), (_col("tags", STATUS_TAG), 88),
    (_col("params", "finetune.method"), 116),
    *((_col("metrics", s.name), s.width) for s in SHOWN if s not in LATER),
    (DURATION, 68), *((_col("metrics", s.name), s.width) for s in LATER),
    (_col("tags", BEST_POINT_TAG), 120), (_col("tags", BEST_BY_TAG), 170),
    ("attributes.`Dataset`", 230), ("attributes.`Models`", 260),
    (_col("params", "model.name"), 96), (_col("tags", "precision"), 80),  # resolved, not "auto"
    (_col("tags", "strategy"), 80), (_col("tags", "world_size"), 86),
    (_col("params", "optim.name"), 92), (_col("params", "train.batch_size"), 128),
)
SELECTED = [c for c, _ in COLUMNS if c not in (RUN_NAME, CREATED, DURATION)]
POINT_TAG = "point."  # a sweep point's tag per swept key: point.<key> = its value (its parent's:
# the values swept, "1,2,4")
# MLflow 3.17's runs table at a 1600 px wide window, its sidebar open (measured in Chromium): the
# table's width, less its row-selection column and a vertical scrollbar
FIRST_SCREEN_PX = 1346 - 73 - 15
# a sweep's view makes room for its swept keys on the first screen by moving these after the
# duration, in this order (what the plan or the method fixes, before what was measured)
MAKE_ROOM = (_col("metrics", "planned GB"), _col("metrics", "trainable pct"),
             _col("metrics", "trainable M"))


def swept_column(key: str) -> tuple[str, int]:
    """The column of a swept key's values: its param (``train.batch_size``; a swept group's,
    such as finetune's method, where the view has one), else its ``point.<key>`` tag; its
    width the view's, or one its header fits in (about 8 px a character)."""
    col = GROUP_COLUMNS.get(key) or (_col("params", key) if "." in key
                                     else _col("tags", POINT_TAG + key))
    header = col.split("`")[1]
    return col, dict(COLUMNS).get(col, max(80, 8 * len(header) + 16))


GROUP_COLUMNS = {"finetune": _col("params", "finetune.method")}  # a swept group -> its column


def columns(first: tuple[str, ...] = ()) -> tuple[tuple[str, int], ...]:
    """COLUMNS with the columns of the swept keys ``first`` right after the run's name and
    start (the values the points differ in, before what they measured), and as many of
    MAKE_ROOM moved past the duration as the first screen needs to hold them."""
    lead = tuple(dict.fromkeys(swept_column(k) for k in first))
    ids = {c for c, _ in lead}
    rest = [c for c in COLUMNS[2:] if c[0] not in ids]
    later: list[tuple[str, int]] = []

    def first_screen() -> int:
        shown = [*COLUMNS[:2], *lead, *rest]
        end = [c for c, _ in shown].index(DURATION) + 1
        return sum(w for _, w in shown[:end])

    for col in MAKE_ROOM:
        if first_screen() <= FIRST_SCREEN_PX:
            break
        moved = next((c for c in rest if c[0] == col), None)
        if moved:
            rest.remove(moved)
            later.append(moved)
    at = [c for c, _ in rest].index(DURATION) + 1
    return (*COLUMNS[:2], *lead, *rest[:at], *later, *rest[at:])


# charts: (section, [(metric, chart type)]); a section's other metrics follow its listed ones
CHART_SECTIONS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    # DPO's loss has charts of its own (config/metrics.py's DPO_LOGGED_AS): beside SFT's
    # cross-entropy its ln 2 start would read as a model far better than it is
    ("Model metrics", tuple((k, "LINE") for k in (
        m.LOSS, m.EVAL_LOSS, m.DPO_LOGGED_AS[m.LOSS], m.DPO_LOGGED_AS[m.EVAL_LOSS],
        m.TOKENS_PER_SEC, m.PEAK_MEMORY, m.STEP_TIME, m.MFU, m.LR, m.GRAD_NORM))),
    ("summary", tuple((k, "BAR") for k in (
        m.SUMMARY_FINAL_LOSS, m.SUMMARY_EVAL_LOSS, m.DPO_LOGGED_AS[m.SUMMARY_FINAL_LOSS],
        m.DPO_LOGGED_AS[m.SUMMARY_EVAL_LOSS], m.SUMMARY_TOKENS_PER_SEC,
        m.SUMMARY_TOKENS_PER_SEC_PER_DEVICE, m.SUMMARY_MFU, m.SUMMARY_PEAK_MEMORY,
        m.SUMMARY_PREDICTED_PEAK_MEMORY, m.SUMMARY_STEP_TIME))),
    ("System metrics", ()),
)
_LINE = {"lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear", "range": {},
         "xAxisKey": "step", "selectedXAxisMetricKey": "", "yAxisKey": "metric",
         "yAxisExpressions": [], "ignoreOutliers": False, "useGlobalXaxisKey": True,
         "useGlobalLineSmoothing": True}


def _chart(metric: str, kind: str, section: str, deleted: bool = False) -> dict[str, Any]:
    chart = {"uuid": f"{VIEW}:{metric}", "type": kind, "runsCountToCompare": 10,
             "metricSectionId": f"{VIEW}:{section}", "deleted": deleted, "isGenerated": True,
             "metricKey": metric}
    return {**chart, **_LINE} if kind == "LINE" else chart


def chart_state() -> dict[str, Any]:
    """The chart view: sections in this order (MLflow's own puts every prefixed section, such
    as best/ and eval_exact_match/, before the loss); the shown metrics are no charts (the
    summary/ bars show the exact values)."""
    charts = [_chart(k, kind, name) for name, listed in CHART_SECTIONS for k, kind in listed]
    charts += [_chart(s.name, "BAR", "Model metrics", deleted=True) for s in SHOWN]
    sections = [{"uuid": f"{VIEW}:{name}", "name": name, "display": True, "isReordered": True,
                 "deleted": False, "isGenerated": True} for name, _ in CHART_SECTIONS]
    return {"compareRunCharts": charts, "compareRunSections": sections,
            "isAccordionReordered": True, "hideEmptyCharts": True}


def view_state(first: tuple[str, ...] = (), search: str = "") -> dict[str, Any]:
    """The saved view's state, as MLflow's UI keeps it (its ExperimentPageUIState and search
    facets): newest runs first, so a sweep's points stay under their parent. A sweep's own view
    (``sweep_view``) puts its swept keys ``first`` and shows its runs alone (``search``)."""
    cols = columns(first)
    return {"selectedColumns": [c for c, _ in cols if c not in (RUN_NAME, CREATED, DURATION)],
            "columnOrder": [c for c, _ in cols], "columnWidths": dict(cols),
            "orderByKey": "attributes.start_time", "orderByAsc": False,
            **({"searchFilter": search} if search else {}), **chart_state()}


def sweep_view(sweep_id: str, swept: list[str]) -> tuple[str, str]:
    """A sweep's own saved view, as (experiment tag, value): the experiment's view with the
    swept keys' columns first, filtered to the sweep's parent and points. Its share key is
    the sweep id, so the sweep's link (``runs_query(sweep_id)``) opens it."""
    now = int(time.time() * 1000)
    view = {"name": f"llama_fsdp: {sweep_id}", "createdAt": now, "updatedAt": now,
            "state": json.dumps(view_state(tuple(swept), f"tags.sweep_id = '{sweep_id}'"))}
    return view_tag(sweep_id), json.dumps(view)


def experiment_tags(existing: Optional[str] = None) -> dict[str, str]:
    """A model-training experiment, its description, and the saved view (``existing``: the
    view tag the experiment holds; kept as it was created, updated when the view changed)."""
    now = int(time.time() * 1000)
    created = now
    if existing:
        try:
            created = json.loads(existing).get("createdAt", now)
        except (ValueError, AttributeError):
            pass
    view = {"name": "llama_fsdp: what runs differ in", "createdAt": created, "updatedAt": now,
            "state": json.dumps(view_state())}
    return {"mlflow.experimentKind": EXPERIMENT_KIND, VIEW_TAG: json.dumps(view),
            "mlflow.note.content": "Fine-tuning runs of llama_fsdp. A sweep is one row (expand "
            "it for its points; its own numbers are its best point's). The rounded columns are "
            "copies of the exact summary/* metrics, each run's steady-state numbers."}


def view_is_current(tag: Optional[str]) -> bool:
    """Whether an experiment's view tag holds this version's view."""
    try:
        return json.loads(json.loads(tag or "")["state"]) == view_state()
    except (ValueError, KeyError, TypeError):
        return False


def status_text(mlflow_status: str) -> str:
    """A run's MLflow status as the status column says it."""
    return STATUS_WORDS.get(mlflow_status, mlflow_status.lower())


_PROGRAMS = (["python", "-m", "llama_fsdp"], ["llama-fsdp"])


def command_note(command: str, heading: str = "") -> str:
    """A run's note (markdown): the command in a code block, one argument per line, so the
    run page keeps its side panel on screen."""
    words = shlex.split(command)
    n = next((len(p) for p in _PROGRAMS if words[:len(p)] == p), 1)
    head = [shlex.quote(w) for w in words[:n]]
    args = [shlex.quote(w) for w in words[n:]]
    while args and args[0] in ("-m", "--multirun"):  # the sweep flag stays with the program
        head.append(args.pop(0))
    text = " \\\n  ".join([" ".join(head), *args])
    return (f"{heading}\n\n" if heading else "") + f"```\n{text}\n```"


_MODEL_NAME_FORBIDDEN = '/:.%"\''  # MLflow refuses these in a logged model's name


def model_name(run_name: str, sweep_id: Optional[str] = None) -> str:
    """A logged model's name: the run's name, and for a sweep point its sweep
    ("finetune=lora (sweep-2026-11-26_09-26-49-363271)"): unique, and the part that differs
    first, where the Models column has room for it."""
    name = f"{run_name} ({sweep_id})" if sweep_id else run_name
    return "".join("_" if c in _MODEL_NAME_FORBIDDEN else c for c in name).strip() or "model"
