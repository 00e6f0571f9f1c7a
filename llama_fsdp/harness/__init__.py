"""EleutherAI's lm-evaluation-harness on a run's trained weights (``eval.harness``), and the
commands that evaluate and talk to a finished run (``python -m llama_fsdp.evaluate`` and
``python -m llama_fsdp.generate``).

The harness runs lm-eval's own ``simple_evaluate`` over an ``HFLM`` that wraps the model loaded
from the run's HF export (for LoRA / QLoRA: the merged export), in the process of rank 0 after
the export is written: the same weights a user gets, scored by the same code ``lm_eval --model
hf`` runs on them (tests/integration/test_harness.py holds the two equal). Why the export, not
a model gathered in memory: every run that evaluates writes it anyway (it is what is scored and
shipped), the export is what lm-eval loads the same way from the command line, and loading it
costs a fixed few seconds next to the harness itself (benchmarks/harness.md).

The bundled task ``llama_fsdp_synthetic`` (tasks/) scores the embedded default data offline.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import logging
import math
import os
import socket
from pathlib import Path
from typing import Any, Iterator, Optional

log = logging.getLogger("llama_fsdp.harness")

TASKS_DIR = Path(__file__).parent / "tasks"  # the bundled task(s), always on the search path
BUNDLED_TASK = "llama_fsdp_synthetic"
LOCAL_REAL_TASK = "llama_fsdp_mmlu_dev"  # real questions, offline (tasks/mmlu_dev.py)
EXTRA_HINT = "pip install 'llama_fsdp[eval]' (or pip install lm-eval)"
from ..config.metrics import HARNESS_PREFIX as PREFIX  # harness/<task>/<metric>[_stderr]
RESULTS_FILE = "results.json"
NOT_SCORES = frozenset({"alias", "sample_len", "samples"})  # lm-eval's bookkeeping in results
HUB = ("huggingface.co", 443)
# lm-eval's dataset builders that read local files (dataset_kwargs.data_files) rather than a
# dataset on the hub
LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas"})
MAX_BOOTSTRAP_ITERS = 100_000  # lm-eval's default: a stderr needs no more


def lm_eval_installed() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def search_path(include_path: Optional[str]) -> list[str]:
    """The task folders lm-eval searches besides its own: ours, then the user's."""
    return [str(TASKS_DIR)] + ([str(Path(include_path).expanduser())] if include_path else [])


def sandbox_templates() -> None:
    """lm-eval renders a task YAML's templates (doc_to_text, doc_to_target, ...) with a plain
    Jinja environment, where ``{{ cycler.__init__.__globals__.os.system(...) }}`` runs Python:
    a task folder without a single ``!function`` could run code. Its environment is replaced
    by Jinja's sandbox with the same settings and filters (a template reaching Python's
    internals raises SecurityError; every template lm-eval ships renders as before)."""
    from jinja2.sandbox import SandboxedEnvironment
    import lm_eval.utils as lm_utils

    if isinstance(lm_utils.env, SandboxedEnvironment):
        return
    old = lm_utils.env
    env = SandboxedEnvironment(loader=old.loader, undefined=old.undefined,
                               keep_trailing_newline=old.keep_trailing_newline)
    env.filters.update(old.filters)
    lm_utils.env = env


def task_manager(include_path: Optional[str], names: list[str] = ()) -> Any:
    """lm-eval's TaskManager over our tasks and ``include_path``; lm-eval's own (some 15,000
    names, 5 to 15 s to index) only when a name is not found in those folders. Templates render
    in Jinja's sandbox (sandbox_templates)."""
    from lm_eval.tasks import TaskManager

    sandbox_templates()

    paths = search_path(include_path)
    if names:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    return TaskManager(include_path=paths)


def _leaf_entries(tm: Any, name: str, seen: set[str]) -> list[tuple[str, Any]]:
    """(task, lm-eval's index entry) of the leaf tasks under ``name`` (a task, group or tag)."""
    if name in seen:
        return []
    seen.add(name)
    entry = tm.task_index.get(name)
    if entry is None:
        return []
    kind = getattr(entry.kind, "name", str(entry.kind)).upper()
    if kind == "TAG":
        return [p for t, e in tm.task_index.items() if name in (e.tags or ())
                for p in _leaf_entries(tm, t, seen)]
    if kind == "GROUP":
        subs = dict(entry.cfg or {}).get("task") or []
        return [p for s in (subs if isinstance(subs, list) else [subs])
                for p in _leaf_entries(tm, s if isinstance(s, str) else s.get("task", ""), seen)]
    return [(name, entry)]


def _task_config(entry: Any) -> dict[str, Any]:
    """A leaf task's YAML, its includes merged, read without running any of its code."""
    cfg = dict(entry.cfg or {})
    if entry.yaml_path is not None:
        from .task_files import read_task_yaml

        try:
            cfg = {**read_task_yaml(Path(entry.yaml_path)), **cfg}
        except Exception:  # an unreadable YAML: lm-eval says so when it loads the task
            pass
    return cfg


def _dataset_paths(tm: Any, name: str, seen: set[str]) -> list[tuple[str, Optional[str]]]:
    """(task, dataset_path) of the leaf tasks under ``name``; None for a task that builds its
    documents itself (custom_dataset) or reads local files."""
    out: list[tuple[str, Optional[str]]] = []
    for task, entry in _leaf_entries(tm, name, seen):
        cfg = _task_config(entry)
        path = cfg.get("dataset_path")
        if (cfg.get("custom_dataset") or path is None or path in LOCAL_BUILDERS
                or Path(str(path)).expanduser().exists()):
            out.append((task, None))
        else:
            out.append((task, str(path)))
    return out


def _missing_files(tm: Any, names: list[str]) -> list[str]:
    """One line per requested task whose local data files are not there, or whose templates
    reach Python's internals (refused by the sandbox they render in: sandbox_templates)."""
    from .task_files import missing_data_files, unsafe_templates

    out = []
    for n in names:
        for task, entry in _leaf_entries(tm, n, set()):
            if unsafe := unsafe_templates(_task_config(entry)):
                out.append(f"eval.harness.tasks: {task}'s templates reach Python's internals "
                           f"({'; '.join(unsafe)}, in {entry.yaml_path or 'its config'}): "
                           "lm-eval's templates are rendered in Jinja's sandbox, which refuses "
                           "them; a task's prompt needs only its document's fields")
            if missing := missing_data_files(_task_config(entry)):
                out.append(f"eval.harness.tasks: {task} reads {', '.join(missing)}, which "
                           f"does not exist (dataset_kwargs.data_files in "
                           f"{entry.yaml_path or 'its config'}): write the file there, or fix "
                           "the path (a relative one is read from the folder the run starts in)")
    return out


def hub_reachable(timeout_s: float = 2.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    try:
        with socket.create_connection(HUB, timeout=timeout_s):
            return True
    except OSError:
        return False


def _cached(dataset: str) -> bool:
    """Whether the datasets cache or the hub cache holds a copy of ``dataset``."""
    try:
        from datasets import config as dconfig
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return False
    flat = dataset.replace("/", "___")
    roots = [Path(dconfig.HF_DATASETS_CACHE), Path(HF_HUB_CACHE)]
    names = [flat, f"datasets--{dataset.replace('/', '--')}"]
    return any((r / n).exists() for r in roots for n in names)


def harness_problems(h: Any, *, include_key: str = "eval.harness.include_path",
                     consent: str = "eval.harness.trust_task_code=true") -> list[str]:
    """``eval.harness`` refused before launch: lm-eval missing, an unknown task (with the
    closest names), a task whose data is on the hub when the hub is out of reach, a local data
    file that is not there, a task folder's Python without consent (``h.trust_task_code``;
    ``include_key`` and ``consent`` name the folder and the consent as the caller's user gives
    them: evaluate's --include-path and --trust-task-code)."""
    problems = []
    bounds = (("eval.harness.num_fewshot", h.num_fewshot, 0), ("eval.harness.batch_size",
              h.batch_size, 1), ("eval.harness.every_steps", h.every_steps, 0),
              ("eval.harness.max_length", h.max_length, 1), ("eval.harness.bootstrap_iters",
                                                             h.bootstrap_iters, 0))
    for key, value, low in bounds:
        if value is not None and value < low:
            problems.append(f"{key}={value} must be >= {low}")
    if h.bootstrap_iters is not None and h.bootstrap_iters > MAX_BOOTSTRAP_ITERS:
        problems.append(f"eval.harness.bootstrap_iters={h.bootstrap_iters} is above "
                        f"{MAX_BOOTSTRAP_ITERS} (lm-eval's default): resamples for a stderr, "
                        "each a pass over the scores; more only takes longer (0: no stderr)")
    if h.limit is not None and not (h.limit > 0 and math.isfinite(h.limit)):
        problems.append(f"eval.harness.limit={h.limit} must be > 0 and finite: documents per "
                        "task (a fraction of them below 1), or null for every document")
    if not h.tasks:
        return problems
    if h.include_path and not Path(h.include_path).expanduser().is_dir():
        problems.append(f"eval.harness.include_path={h.include_path} is not a folder (a folder "
                        "of lm-eval task YAMLs)")
        return problems
    from .task_files import task_code_problem

    if code := task_code_problem(h.include_path, trusted=h.trust_task_code, key=include_key,
                                 consent=consent):
        return problems + [code]
    if not lm_eval_installed():
        return problems + [f"eval.harness.tasks={list(h.tasks)} needs lm-evaluation-harness, "
                           f"which is not installed: {EXTRA_HINT}"]
    names = [str(t) for t in h.tasks]
    tm = task_manager(h.include_path, names)
    known = tm.all_tasks
    for n in names:
        if n not in known:
            close = difflib.get_close_matches(n, known, n=5, cutoff=0.6)
            problems.append(f"eval.harness.tasks: no lm-eval task {n!r}"
                            + (f"; the closest: {', '.join(close)}" if close else "")
                            + "; your own tasks: eval.harness.include_path=<folder of task "
                              "YAMLs>")
    problems += _missing_files(tm, [n for n in names if n in known])
    hub = [(t, p) for n in names if n in known
           for t, p in _dataset_paths(tm, n, set()) if p is not None and not _cached(p)]
    if hub and not hub_reachable():
        shown = ", ".join(f"{t} ({p})" for t, p in hub[:5]) + (" ..." if len(hub) > 5 else "")
        problems.append(f"eval.harness.tasks: {shown} read their documents from the Hugging "
                        "Face hub, which is out of reach from here and has no copy in the "
                        "datasets cache: run where the hub answers (or fill the cache there "
                        "first), or give a task whose YAML reads local files "
                        "(dataset_path: json) with eval.harness.include_path=<its folder>; "
                        f"{BUNDLED_TASK} is bundled and runs offline")
    return problems


# --- running it ------------------------------------------------------------------------------


def load_model(model_dir: Path, *, device: str, dtype: Optional[Any] = None) -> tuple[Any, Any]:
    """An HF directory's model and tokenizer (never running code from the folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or "auto",
                                                 trust_remote_code=False)
    model.to(torch.device(device)).eval()
    from ..model import cpu_gemm
    cpu_gemm.install(device, model.dtype)
    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    return model, tok


def evaluate(model_dir: Path, h: Any, *, device: str, seed: int = 0) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on the HF directory's model, in this process: its results
    dict (``results``, ``n-shot``, ``configs``, ``versions``, ...)."""
    with _quiet_and_own_rng():
        return _evaluate(model_dir, h, device=device, seed=seed)


@contextlib.contextmanager
def _quiet_and_own_rng() -> Iterator[None]:
    """lm-eval seeds Python's, NumPy's and torch's generators and logs each step at INFO: a
    run's generators come back as they were (training goes on the same after a harness every N
    steps), and lm-eval says only warnings (its custom_dataset notice left out)."""
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state()
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    notice = _DropCustomDatasetNotice()
    logging.getLogger("lm_eval.api.task").addFilter(notice)
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]
                                   if torch.cuda.is_available() else []):
            yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        logger.setLevel(level)
        logging.getLogger("lm_eval.api.task").removeFilter(notice)


class _DropCustomDatasetNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def _evaluate(model_dir: Path, h: Any, *, device: str, seed: int) -> dict[str, Any]:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    model, tok = load_model(model_dir, device=device)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=h.batch_size, device=device,
              max_length=h.max_length, add_bos_token=True)
    tasks = [str(t) for t in h.tasks]
    out = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=h.num_fewshot, limit=h.limit,
        task_manager=task_manager(h.include_path, tasks), log_samples=False,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed, bootstrap_iters=h.bootstrap_iters)
    del model, lm
    return out


def metrics(results: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics of lm-eval's results: harness/<task>/<metric> and its _stderr (the filter
    name after lm-eval's comma dropped when it is 'none')."""
    out: dict[str, float] = {}
    for task, values in (results.get("results") or {}).items():
        for key, v in values.items():
            if key in NOT_SCORES or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            metric, _, flt = key.partition(",")
            name = metric if flt in ("", "none") else f"{metric}_{flt}"
            if math.isfinite(float(v)):
                out[f"{PREFIX}{task}/{name}"] = float(v)
    return out


def headline(results: dict[str, Any]) -> dict[str, float]:
    """One number per task (its first metric that is not a stderr): what summaries show."""
    return headline_of(metrics(results))


def headline_of(found: dict[str, float]) -> dict[str, float]:
    """``headline`` of metrics already flattened (harness/<task>/<metric>)."""
    out: dict[str, float] = {}
    for key, v in found.items():
        task = key.rsplit("/", 1)[0]
        if not key.endswith("_stderr") and task not in {k.rsplit("/", 1)[0] for k in out}:
            out[key] = v
    return out


def unused(path: Path) -> Path:
    """``path``, or the first of path-1, path-2, ... that does not exist (never overwritten)."""
    n = 0
    while (cand := path if n == 0 else path.with_name(f"{path.stem}-{n}{path.suffix}")).exists():
        n += 1
    return cand


def write_results(results: dict[str, Any], where: Path, *, exclusive: bool = False) -> Path:
    """lm-eval's results JSON (the samples left out), as ``lm_eval --output_path`` writes it;
    ``exclusive``: into a new file only (a file that appeared meanwhile keeps its bytes, and the
    results take the next free name beside it). Returns where it went."""
    from lm_eval.utils import handle_non_serializable

    where.parent.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in results.items() if k != "samples"}
    text = json.dumps(keep, indent=2, default=handle_non_serializable, ensure_ascii=False)
    if not exclusive:
        where.write_text(text)
        return where
    while True:
        try:
            with open(where, "x", encoding="utf-8") as f:
                f.write(text)
            return where
        except FileExistsError:
            where = unused(where)


def describe(results: dict[str, Any]) -> str:
    """One line per task for the console: task, metric, value (+- stderr)."""
    found = metrics(results)
    lines = []
    for key, v in headline(results).items():
        err = found.get(f"{key}_stderr")
        lines.append(f"{key[len(PREFIX):]} {v:.4f}" + (f" (+- {err:.4f})" if err is not None
                                                       else ""))
    return "; ".join(lines)
