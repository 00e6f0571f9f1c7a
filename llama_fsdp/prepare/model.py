"""The weights a run starts from, on local disk before any rank starts."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from ..config.hf_dir import model_file_problems, resolve_hf_dir
from ..run.spec import RunSpec
from .errors import PrepareError

log = logging.getLogger(__name__)


def resolve_model(spec: RunSpec) -> RunSpec:
    """model.path as a local directory: a hub name is downloaded here, once."""
    path = spec.model.path
    if not path or Path(path).expanduser().is_dir():
        return spec
    log.info("downloading %s (config, safetensors, tokenizer) ...", path)
    local = resolve_hf_dir(path)
    if problems := model_file_problems(local):  # a damaged download: named before launch
        raise PrepareError("model.path: " + "; ".join(problems))
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=str(local)))

