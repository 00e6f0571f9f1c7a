"""llama_fsdp: Hydra-composed FSDP2 fine-tuning of Llama 3 models, tracked in MLflow.

Installed, the package carries its config groups and launchers (``llama_fsdp.conf``,
``llama_fsdp.launchers``: pyproject.toml maps the checkout's ``conf/`` and ``launchers/`` in).
A checkout used without installing (``PYTHONPATH=<checkout>``, as on a machine that cannot
download: scripts/gpu_check.sh) finds them beside the package through the finder below,
consulted only after every other one has failed (an installed or editable package wins).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.dirname(_HERE)
_MAPPED = {f"{__name__}.launchers": "launchers", f"{__name__}.conf": "conf"}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """``llama_fsdp.launchers`` and ``llama_fsdp.conf`` from a source checkout's folders."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - the finder protocol
        folder = _MAPPED.get(fullname)
        if folder is None:
            return None
        root = os.path.join(_CHECKOUT, folder)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(root, "__init__.py"), submodule_search_locations=[root])


def _in_checkout() -> bool:
    return (not os.path.isdir(os.path.join(_HERE, "launchers"))
            and os.path.isfile(os.path.join(_CHECKOUT, "pyproject.toml"))
            and all(os.path.isfile(os.path.join(_CHECKOUT, f, "__init__.py"))
                    for f in _MAPPED.values()))


if _in_checkout() and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutFinder())

from . import import_noise as _quiet  # noqa: E402

_quiet.install()
