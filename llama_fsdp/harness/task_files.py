"""What a folder of lm-eval task YAMLs would run and read, found before anything runs.

A task YAML may name Python with ``!function utils.process_docs``: lm-eval imports the
folder's ``utils.py`` (runs it) when it loads the task, on rank 0 in training and in
``evaluate``. As with a model folder's ``auto_map`` code (config/hf_dir.py), that is never
done without a word: ``task_code_problem`` names the files that would run and refuses them
unless the user consented (``eval.harness.trust_task_code=true``; evaluate's
``--trust-task-code``). YAMLs without ``!function`` need no consent. The YAMLs are read here
with a loader of our own that records ``!function`` and runs nothing.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import yaml

log = logging.getLogger("llama_fsdp.harness")

YAML_SUFFIXES = (".yaml", ".yml")
CONSENT_KEY = "eval.harness.trust_task_code"  # training's switch; evaluate: --trust-task-code


class TaskFunction(str):
    """A ``!function`` value: the dotted name of Python a task would import."""


class _Loader(yaml.SafeLoader):
    """YAML as lm-eval writes it, with ``!function`` kept as a name and other tags as text."""


_Loader.add_constructor("!function", lambda loader, node: TaskFunction(
    loader.construct_scalar(node)))
_Loader.add_multi_constructor("!", lambda loader, suffix, node: (
    loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else None))


def read_task_yaml(path: Path, _seen: Optional[set[Path]] = None) -> dict[str, Any]:
    """A task YAML with its ``include``s merged (its own keys win), as lm-eval reads it, with
    ``!function`` values as TaskFunction; raises OSError / yaml.YAMLError / ValueError."""
    path = Path(path).expanduser().resolve()
    seen = _seen if _seen is not None else set()
    if path in seen:
        raise ValueError(f"{path}: an include cycle")
    seen.add(path)
    cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 (safe)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a YAML {type(cfg).__name__}, not a task's mapping")
    includes = cfg.pop("include", None)
    merged: dict[str, Any] = {}
    for inc in (includes if isinstance(includes, list) else [includes] if includes else []):
        merged.update(read_task_yaml(path.parent / str(inc), seen))
    return {**merged, **cfg}


def _functions(value: Any) -> list[TaskFunction]:
    if isinstance(value, TaskFunction):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _functions(v)]
    if isinstance(value, list):
        return [f for v in value for f in _functions(v)]
    return []


def task_code(folder: Path) -> dict[Path, list[str]]:
    """The Python each task YAML under ``folder`` names with ``!function``: the file lm-eval
    would run (the .py beside the YAML) or, where there is none, the module it would import."""
    out: dict[Path, list[str]] = {}
    for f in sorted(p for p in Path(folder).expanduser().rglob("*") if p.suffix in YAML_SUFFIXES):
        try:
            cfg = read_task_yaml(f)
        except (OSError, ValueError, yaml.YAMLError, RecursionError):
            continue  # (lm-eval skips a YAML it cannot read; so does the task lookup)
        runs = []
        for fn in _functions(cfg):
            module = fn.rpartition(".")[0]
            local = f.parent / f"{module.replace('.', '/')}.py"
            runs.append(str(local) if local.is_file() else f"module {module}")
        if runs:
            out[f] = sorted(set(runs))
    return out


def task_code_problem(folder: Optional[str], *, trusted: bool, key: str,
                      consent: str = CONSENT_KEY + "=true") -> Optional[str]:
    """Why the task folder ``folder`` (given as ``key``) is refused: its YAMLs name Python
    that lm-eval would run, and the user did not consent (``consent``). With consent the
    files are named in a warning and run. None: nothing to run, or consented."""
    if not folder or not Path(folder).expanduser().is_dir():
        return None
    found = task_code(Path(folder))
    if not found:
        return None
    files = sorted({r for runs in found.values() for r in runs})
    yamls = ", ".join(str(p) for p in list(found)[:3]) + (" ..." if len(found) > 3 else "")
    shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
    if trusted:
        log.warning("%s=%s: lm-eval will run the task folder's Python: %s (%s)", key, folder,
                    shown, consent)
        return None
    return (f"{key}={folder}: its task YAMLs ({yamls}) name Python with !function, which "
            f"lm-eval would import and run: {shown}. Read it, then consent with {consent}, "
            "or use task YAMLs without !function")


def missing_data_files(cfg: dict[str, Any]) -> list[str]:
    """The local files a task's ``dataset_kwargs.data_files`` names that do not exist (as
    written; relative ones from the current folder, as datasets reads them). URLs and glob
    patterns are left to datasets."""
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") if isinstance(
        cfg.get("dataset_kwargs"), dict) else None
    if isinstance(files, dict):
        named = [f for v in files.values() for f in (v if isinstance(v, list) else [v])]
    else:
        named = files if isinstance(files, list) else [files] if files else []
    return [str(f) for f in named if isinstance(f, str) and "://" not in f
            and not any(c in f for c in "*?[") and not Path(f).expanduser().exists()]


def _strings(value: Any, key: str = "") -> list[tuple[str, str]]:
    """(key, text) of every string in a task config, nested keys dotted."""
    if isinstance(value, str) and not isinstance(value, TaskFunction):
        return [(key, value)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(v, f"{key}.{k}" if key else k)]
    if isinstance(value, (list, tuple)):
        return [s for i, v in enumerate(value) for s in _strings(v, f"{key}[{i}]")]
    return []


def unsafe_templates(cfg: dict[str, Any]) -> list[str]:
    """The Jinja templates of a task config (doc_to_text, doc_to_target, ...) that reach
    Python's dunder attributes (``__globals__``, ``__class__``: how a template escapes to
    Python; Jinja's sandbox refuses them), as ``key: attribute``. lm-eval renders them in a sandbox here
    (harness.sandbox_templates); this says so before a run, not as an error after training."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import SandboxedEnvironment

    env = SandboxedEnvironment()
    out = []
    for key, text in _strings(cfg):
        if "{{" not in text and "{%" not in text:
            continue
        try:
            tree = env.parse(text)
        except TemplateSyntaxError:
            continue  # (lm-eval says so when it renders it)
        names = [n.attr for n in tree.find_all(nodes.Getattr)]
        names += [n.arg.value for n in tree.find_all(nodes.Getitem)
                  if isinstance(n.arg, nodes.Const) and isinstance(n.arg.value, str)]
        if bad := sorted({a for a in names if a.startswith("__")}):  # (a field "_id" is fine)
            out.append(f"{key}: {', '.join(bad)}")
    return out
