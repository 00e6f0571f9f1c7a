"""A package's names imported on first use (PEP 562): ``__getattr__ = lazy_names(__name__,
WHERE, globals())``, where WHERE maps each name to the submodule that defines it."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_names(package: str, where: Mapping[str, str],
               namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's module ``__getattr__``: a name of ``where`` is imported from its submodule
    the first time it is read, and kept in ``namespace`` (the package's globals) after."""
    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where[name]}", package), name)
        namespace[name] = value
        return value
    return __getattr__
