"""Every command in the ```bash blocks of README.md and docs/ has an entry in the registry of
tests/docs_commands.py saying how a test runs it, and every entry names a command still in the
docs: a new or edited example cannot slip through untested, and no stale entry stays. That the
named test really executes its entry's command is checked where it runs, at the end of the
session (tests/integration/conftest.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import docs_commands as docs

HOW_TO_ADD = """\
Add an entry to REGISTRY in tests/docs_commands.py, keyed by the command exactly as shown
(backslash continuations joined, the # comment dropped, blanks collapsed), e.g.

    {command!r}: Entry(
        "<id>", f"{{LOCAL}}::test_<name>",
        "<what runs, and what the test checks that a user would notice>",
        (SHRINK, Replace("<text in the command>", "<what runs instead>", "<why>"), ...)),

with every change to the command stated (Append / Replace / Env, each with its reason), and a
test in tests/integration/test_docs_commands.py (test_slurm_docs_commands.py for the SLURM
cluster) that runs it through docs.command("<id>") and checks what a user would see. An edited
example: change the key of its entry to the new command."""


def test_the_docs_have_commands():
    commands = docs.doc_commands()
    assert len(commands) >= 20
    files = {c.file for c in commands}
    assert "README.md" in files and "docs/data.md" in files


def test_every_docs_command_has_an_entry():
    missing = [c for c in docs.doc_commands() if c.command not in docs.REGISTRY]
    assert not missing, (
        "docs command(s) that no test runs:\n"
        + "\n".join(f"  {c.file}:{c.line}: {c.command}" for c in missing) + "\n"
        + HOW_TO_ADD.format(command=missing[0].command))


def test_every_entry_is_a_docs_command():
    in_docs = {c.command for c in docs.doc_commands()}
    stale = [cmd for cmd in docs.REGISTRY if cmd not in in_docs]
    assert not stale, (
        "registry entries whose command is not in README.md or docs/*.md any more (edited or "
        "removed: change the entry's key to the command as the docs now have it, or remove the "
        "entry and its test):\n" + "\n".join(f"  {cmd}" for cmd in stale))


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("cmd", list(docs.REGISTRY), ids=[e.id for e in docs.REGISTRY.values()])
def test_entry_names_its_test_and_its_changes_apply(cmd):
    e = docs.REGISTRY[cmd]
    file, _, function = e.test.partition("::")
    assert function in _test_functions(docs.REPO / file), f"{e.id}: no test {e.test}"
    assert file.startswith("tests/integration/"), e.test
    placeholders = {k: f"<{k}>" for k in ("bin", "python", "venv", "work", "repo", "hub",
                                          "models", "port", "ui_port", "run_dir", "preset",
                                          "state_dir")}
    command, env = docs.apply(cmd, e, **placeholders)  # each Replace finds its text once
    for c in e.changes:
        assert c.why.strip(), f"{e.id}: a change without its reason"
    assert command != cmd or env or not e.changes


def test_ids_are_unique():
    ids = [e.id for e in docs.REGISTRY.values()]
    assert len(ids) == len(set(ids))


def test_extraction():
    text = """
```bash
# a comment line
make run     # trailing comment
python -m x a=1 \\
    b='c  d'   c="# not a comment"  # comment

```
```
not bash
```
"""
    assert docs.commands_in(text) == [(4, "make run"),
                                      (5, "python -m x a=1 b='c  d' c=\"# not a comment\"")]
