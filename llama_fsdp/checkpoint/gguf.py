"""A GGUF file (llama.cpp's format, as many small models ship) -> a Hugging Face directory that
``model.path`` takes: config.json, safetensors and the tokenizer with its chat template.

    python -m llama_fsdp.convert SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-Instruct

transformers reads GGUF and dequantizes its blocks (with the ``gguf`` package); this writes the
result once, so that every run after reads safetensors per shard like any other folder. Only a
Llama GGUF converts: another architecture is refused before its weights are read.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"


def is_gguf(path: Path) -> bool:
    return Path(path).is_file() and Path(path).suffix.lower() == GGUF_SUFFIX


def gguf_to_hf(file: Path, out: Path, *, dtype: Optional[str] = None,
               overwrite: bool = False) -> Path:
    """Write the HF directory ``out`` from a GGUF file (dequantized; ``dtype``: as read, fp32,
    unless given). ValueError for a file that is not a Llama's, or without the gguf package."""
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading {file} needs the gguf package (transformers reads GGUF with "
                         "it): pip install gguf")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .hf import write_hf_dir
    from .layout import dir_bytes

    file = Path(file)
    where = dict(pretrained_model_name_or_path=str(file.parent), gguf_file=file.name)
    config = AutoConfig.from_pretrained(**where)
    if config.model_type != "llama":  # (before the weights are dequantized)
        raise ValueError(f"{file} holds a {config.model_type!r} model; only Llama models train "
                         "here")
    model = AutoModelForCausalLM.from_pretrained(
        **where, dtype=getattr(torch, dtype) if dtype else None)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    config = model.config
    config.__dict__.pop("quantization_config", None)  # the weights written are dequantized
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype or "float32"
    sd = {k: v.to(getattr(torch, dtype)) if dtype else v for k, v in model.state_dict().items()}
    path = write_hf_dir(sd, Path(out), config=config, tokenizer=tokenizer, overwrite=overwrite)
    log.info("converted %s -> %s (%d tensors, %.1f MB)", file, path, len(sd),
             dir_bytes(path) / 1e6)
    return path
