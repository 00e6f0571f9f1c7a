"""Weights in and out: HF safetensors -> sharded model, DCP checkpoints (save / resume), HF export.

Three formats, three jobs:

- **HF directory** (``config.json`` + safetensors, one file or several with an index): where a
  run starts (``model.path``, a directory or a hub name) and what it exports (``hf.py``).
- **DCP checkpoint** (``<run>/checkpoints/step_000010``): all a run needs to go on, written by
  every rank in parallel and resharded on load (``dcp.py``; directory rules in ``layout.py``).
- **Export**: one process's consolidated HF directory (``<run>/export``) that
  ``LlamaForCausalLM.from_pretrained`` reads; ``python -m llama_fsdp.convert`` makes the same
  files from any DCP checkpoint.

``peft.py`` does the same jobs for a LoRA / QLoRA model (its base in per shard, NF4 included;
the PEFT adapter and the merged model out); ``state.py`` is the loop's counters a checkpoint
carries; ``convert.py`` is ``python -m llama_fsdp.convert``.

The package's names are imported on first use (PEP 562): ``layout``, ``optim_meta`` and
``pickles`` stay torch-free for run/checks.py, which checks resume targets before any process
starts without importing torch or transformers.
"""
from __future__ import annotations

from ..lazy import lazy_names

_WHERE = {
    "export_adapter": "peft", "export_merged": "peft", "load_hf_base": "peft",
    "AppState": "dcp", "Checkpointer": "dcp", "load_model_weights": "dcp",
    "read_model_state": "dcp",
    "MAX_SHARD_BYTES": "hf", "export_hf": "hf", "hf_config": "hf", "load_hf_weights": "hf",
    "write_hf_dir": "hf",
    "METADATA": "layout", "dir_bytes": "layout", "is_checkpoint": "layout",
    "latest_checkpoint": "layout", "list_checkpoints": "layout", "resolve_resume": "layout",
    "step_dir": "layout",
}
__all__ = sorted(_WHERE)


__getattr__ = lazy_names(__name__, _WHERE, globals())
