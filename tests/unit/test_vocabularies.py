"""Every closed vocabulary is one table, and the code reads it where it writes a word of it
(docs/architecture.md, "Closed vocabularies"): no string literal in llama_fsdp/ or launchers/
spells an objective, an attention kernel, an optimizer, a run status, a metric name or a launch
mode outside the table that owns it (docstrings aside; a word two tables share may stand in
either). The launch modes' table is tied to the launchers and to conf/cluster/."""
from __future__ import annotations

import ast
from pathlib import Path

import yaml

from llama_fsdp.config import kernels, metrics, objectives, optimizers, placement, recipes, status
from llama_fsdp.plan import phases
from llama_fsdp.tracking import events

REPO = Path(__file__).resolve().parents[2]

# the vocabularies checked, each with the module that owns it
CHECKED = {
    "llama_fsdp/config/objectives.py": set(objectives.OBJECTIVES),
    # ("auto" is every table's word for "resolved per run": precision, device, resume, format)
    "llama_fsdp/config/kernels.py": set(kernels.KERNELS) - {kernels.AUTO},
    "llama_fsdp/config/optimizers.py": set(optimizers.OPTIMIZERS),
    "llama_fsdp/config/status.py": {*status.STATUSES, *status.STATUSES.values(),
                                    *status.STATUS_WORDS.values(), status.STARTING,
                                    status.REQUEUED},
    "llama_fsdp/config/metrics.py": {v for k, v in vars(metrics).items()
                                     if k.isupper() and isinstance(v, str)}
    | set(metrics.DPO_METRICS) | set(metrics.DPO_SUMMARY),
    "llama_fsdp/config/placement.py": set(placement.LAUNCH_MODES),
}
# other tables whose words are also words of a checked one (a step's phase "loss", the spool's
# event kind "running"): they may spell them
OTHER_TABLES = {
    # the optimizer keys a recipe sets (config keys: "lr" is also a metric's name)
    "llama_fsdp/config/recipes.py": set(recipes.TRAIN_KEYS),
    "llama_fsdp/plan/phases.py": {*phases.PHASES, phases.REFERENCE},
    "llama_fsdp/tracking/events.py": {getattr(e, "KIND") for e in vars(events).values()
                                      if isinstance(getattr(e, "KIND", None), str)},
}
# other tools' words that happen to be one of ours, where they are spelled
THEIRS = {
    ("launchers/submitit_compat.py", "local"): "submitit's executor name (SUBMITIT_EXECUTOR)",
    ("llama_fsdp/prepare/data.py", "local"): "MLflow's dataset source type",
    ("llama_fsdp/train/resume.py", "lr"): "torch.optim's param group key",
}


def literals(source: str) -> list[tuple[int, str]]:
    """The string constants of a module that are not docstrings or the text of an f-string."""
    tree = ast.parse(source)
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def spellings_outside_their_tables(read=Path.read_text) -> list[str]:
    owners: dict[str, set[str]] = {}
    for table, words in CHECKED.items():
        for w in words:
            owners.setdefault(w, set()).add(table)
    for table, words in OTHER_TABLES.items():
        for w in words & set(owners):
            owners[w].add(table)
    found = []
    for path in sorted([*(REPO / "llama_fsdp").rglob("*.py"), *(REPO / "launchers").rglob("*.py")]):
        rel = str(path.relative_to(REPO))
        for line, text in literals(read(path)):
            if text in owners and rel not in owners[text] and (rel, text) not in THEIRS:
                found.append(f"{rel}:{line}: {text!r} (the table: {', '.join(sorted(owners[text]))})")
    return found


def test_no_word_of_a_vocabulary_is_spelled_outside_its_table():
    found = spellings_outside_their_tables()
    assert not found, "read these from their tables:\n  " + "\n  ".join(found)


def test_the_check_sees_a_spelled_word():
    """A positive control: an objective's name written in a module of the package is found,
    and a metric name in a launcher."""
    def planted(path: Path) -> str:
        extra = {"preference.py": 'X = "dpo"', "local.py": 'Y = {"eval_loss": 1}'}
        return path.read_text() + "\n" + extra.get(path.name, "") + "\n"

    found = spellings_outside_their_tables(read=planted)
    assert any("plan/preference.py" in f and "'dpo'" in f for f in found), found
    assert any("launchers/local.py" in f and "'eval_loss'" in f for f in found), found


def test_every_launch_mode_has_a_launcher_and_a_config_group():
    from llama_fsdp.launchers import LAUNCHERS, launcher_for
    from llama_fsdp.launchers.base import Launcher

    assert set(LAUNCHERS) == set(placement.LAUNCH_MODES)
    kinds = {yaml.safe_load(f.read_text()).get("kind", "local"): f.stem
             for f in (REPO / "conf" / "cluster").glob("*.yaml")}
    assert set(kinds) == set(placement.LAUNCH_MODES), kinds
    for mode in placement.LAUNCH_MODES:
        cls = type(launcher_for(type("C", (), {"kind": mode})()))
        assert issubclass(cls, Launcher) and cls.placement is not Launcher.placement, mode
