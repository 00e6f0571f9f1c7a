"""Imports run one way (docs/architecture.md): the package's folders are its stages, in the order
``FOLDERS`` lists them, and no folder imports one above it; no two parts import each other, even
through deferred (function-level) or type-only imports; the command line, config/, run/ and
plan/ never import model/, train/ or torch; the root holds at most ``MAX_ROOT_MODULES``.

A part is a top-level module of llama_fsdp, or a subpackage as a whole (config/, plan/, ...,
launchers/). Run as a script for the counts docs and notes cite:

    python tests/unit/test_imports.py [checkout]

prints the import circles between modules, the circles between parts with the fewest arrows
that close them ("arrows back up"), and the function-level imports (in all, and in cli.py).
"""
from __future__ import annotations

import ast
import collections
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KNOWN_CIRCLES: list[set[str]] = []  # (none: a circle found fails)

# The folders, lowest first: each imports only those before it (and the root's leaves).
FOLDERS = ("config", "data", "tracking", "model", "checkpoint", "harness", "run", "plan",
           "objective", "prepare", "train", "launchers", "cli")
# Modules at the root: the package's plumbing (lazy, versions, import_noise), below every folder,
# and its commands (python -m llama_fsdp[.convert|.sweep|...]), above them.
ROOT_LEAVES = ("lazy", "versions", "import_noise")
MAX_ROOT_MODULES = 12
# Never imported by these, at any depth of a function: what the command line needs to check and
# plan a run in well under a second (tests/unit/test_cli_imports.py runs it).
TORCH_FREE = ("cli", "config", "run", "plan")
HEAVY = ("model", "train")


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file; launchers/ is installed as llama_fsdp.launchers."""
    out = {}
    for base, pkg in (("llama_fsdp", "llama_fsdp"), ("launchers", "llama_fsdp.launchers")):
        for f in (root / base).rglob("*.py"):
            parts = [p for p in f.relative_to(root / base).with_suffix("").parts
                     if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _targets(mods: dict[str, Path], current: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = current if mods[current].name == "__init__.py" else current.rsplit(".", 1)[0]
        for _ in range(max(node.level - 1, 0)):
            base = base.rsplit(".", 1)[0]
        mod = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
        names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
    out = []
    for name in names:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in mods and name != current:
            out.append(name)
    return out


def import_graph(root: Path) -> tuple[dict[str, set[str]], collections.Counter]:
    """Every import between the package's modules (deferred and type-only ones too), and the
    function-level imports of each module (of anything)."""
    mods = modules(root)
    edges: dict[str, set[str]] = collections.defaultdict(set)
    deferred: collections.Counter = collections.Counter()

    def walk(mod: str, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                deferred[mod] += inside
                edges[mod].update(_targets(mods, mod, child))
            walk(mod, child, inside)

    for mod, path in mods.items():
        walk(mod, ast.parse(path.read_text()), False)
    return edges, deferred


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected sets of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while (w := stack.pop()) != v:
                comp.add(w)
            out.append(comp | {v})

    sys.setrecursionlimit(10_000)
    for v in sorted({*edges, *itertools.chain(*edges.values())}):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def part(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def part_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = collections.defaultdict(set)
    for a, targets in edges.items():
        out[part(a)].update(part(b) for b in targets if part(b) != part(a))
    return out


def arrows_back_up(parts: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The fewest arrows between parts whose removal leaves no circle."""
    inner = [(a, b) for a, targets in parts.items() for b in targets
             if any({a, b} <= c for c in circles(parts))]
    for k in range(len(inner) + 1):
        for cut in itertools.combinations(inner, k):
            if not circles({a: {b for b in t if (a, b) not in cut} for a, t in parts.items()}):
                return list(cut)
    return inner


def test_no_two_parts_of_the_package_import_each_other():
    parts = part_graph(import_graph(ROOT)[0])
    found = circles(parts)
    assert not found, (f"parts that import each other: {found}; the arrows to turn around or "
                       f"cut: {arrows_back_up(parts)}")


def test_no_two_modules_import_each_other():
    found = [c for c in circles(import_graph(ROOT)[0]) if c not in KNOWN_CIRCLES]
    assert not found, f"modules that import each other (a deferred import counts): {found}"


def _folder(mod: str) -> str:
    """The folder of a module (llama_fsdp.<folder>.x), or "" for a root module."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or mod.removeprefix("llama_fsdp.") in FOLDERS else ""


def test_the_folders_are_the_stages_and_none_imports_one_above_it():
    edges = import_graph(ROOT)[0]
    mods = modules(ROOT)
    folders = {_folder(m) for m in mods} - {""}
    assert folders == set(FOLDERS), f"folders not in FOLDERS (or gone): {folders ^ set(FOLDERS)}"
    wrong = []
    for a, targets in edges.items():
        fa = _folder(a)
        for b in targets:
            fb = _folder(b)
            leaf = b.rsplit(".", 1)[-1] in ROOT_LEAVES and fb == ""
            if fa and fb and FOLDERS.index(fb) > FOLDERS.index(fa):
                wrong.append(f"{a} -> {b} ({fb}/ is above {fa}/)")
            elif fa and not fb and not leaf and b != "llama_fsdp":
                wrong.append(f"{a} -> {b} (a command at the root)")
    assert not wrong, "imports running up the folders:\n  " + "\n  ".join(sorted(wrong))


def _imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_the_command_line_config_run_and_plan_never_import_the_model_the_trainer_or_torch():
    edges = import_graph(ROOT)[0]
    mods = modules(ROOT)
    wrong = []
    for mod, path in mods.items():
        if _folder(mod) not in TORCH_FREE:
            continue
        wrong += [f"{mod} -> {b}" for b in edges.get(mod, ()) if _folder(b) in HEAVY]
        wrong += [f"{mod} imports {n}" for n in _imports_of(path)
                  if n.split(".")[0] == "torch"]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_root_holds_few_modules():
    root = sorted(p.name for p in (ROOT / "llama_fsdp").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    edges, deferred = import_graph(root)
    parts = part_graph(edges)
    print("import circles between modules:", circles(edges))
    print("circles between parts:", circles(parts))
    print("arrows back up:", arrows_back_up(parts))
    print("function-level imports:", sum(deferred.values()),
          "(cli.py:", deferred["llama_fsdp.cli.command"], ")")
