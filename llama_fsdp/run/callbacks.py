"""train.callbacks: "module:attr" step-hook factories, resolved the same way in the driver
(before launch, so a bad one is named in seconds: prepare.check_callbacks) and on every rank
(worker.load_callbacks)."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def resolve(path: str) -> Callable[..., Any]:
    """The factory ``path`` names; ValueError saying what is wrong with it and the fix."""
    module, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"train.callbacks: {path!r} cannot be imported ({type(e).__name__}: "
                         f"{e}): make {module!r} importable here and on every node (it is on "
                         "PYTHONPATH, or installed)") from None
    except AttributeError:
        raise ValueError(f"train.callbacks: module {module!r} has no {attr!r}") from None
    if not callable(factory):
        raise ValueError(f"train.callbacks: {path!r} is a {type(factory).__name__}, not a "
                         "factory (called as factory(rank=, world_size=, output_dir=))")
    return factory


def problems(paths: list[str]) -> list[str]:
    """Each callback that cannot be resolved, with why (its module is imported: its top-level
    code runs here as it will on the ranks)."""
    out = []
    for path in paths:
        try:
            resolve(path)
        except Exception as e:  # noqa: BLE001 - a module that raises on import is a bad one too
            out.append(str(e) if isinstance(e, ValueError) else
                       f"train.callbacks: importing {path!r} raised {type(e).__name__}: {e}")
    return out
