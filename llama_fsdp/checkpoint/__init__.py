"""Weights in and out: HF safetensors -> sharded model, DCP checkpoints (save / resume), HF export.

Three formats, three jobs:

- **HF directory** (``config.json`` + safetensors, one file or several with an index): where a
  run starts (``model.path``, a directory or a hub name) and what it exports (``hf.py``).
- **DCP checkpoint** (``<run>/checkpoints/step_000010``): all a run needs to go on, written by
  every rank in parallel and resharded on load (``dcp.py``; directory rules in ``layout.py``).
- **Export**: one process's consolidated HF directory (``<run>/export``) that
  ``LlamaForCausalLM.from_pretrained`` reads; ``python -m llama_fsdp.convert`` makes the same
  files from any DCP checkpoint.

``checks.py`` holds what can be checked before any process starts; ``adapters.py`` does the
same jobs for a LoRA / QLoRA model (its base in per shard, NF4 included; the PEFT adapter and
the merged model out).
"""
from .adapters import export_adapter, export_merged, load_hf_base
from .dcp import AppState, Checkpointer, load_model_weights, read_model_state
from .hf import MAX_SHARD_BYTES, export_hf, hf_config, load_hf_weights, write_hf_dir
from .layout import (
    METADATA,
    dir_bytes,
    is_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    resolve_resume,
    step_dir,
)

__all__ = ["AppState", "Checkpointer", "MAX_SHARD_BYTES", "export_adapter", "export_merged",
           "load_hf_base",
           "METADATA", "dir_bytes", "export_hf", "hf_config", "is_checkpoint",
           "latest_checkpoint", "list_checkpoints", "load_hf_weights", "load_model_weights",
           "read_model_state", "resolve_resume", "step_dir", "write_hf_dir"]
