"""DCP checkpoint -> Hugging Face directory, on one process (no process group, no GPU).

    python -m llama_fsdp.convert outputs/runs/<day>/<time>/checkpoints/step_000060 hf_out
    python -m llama_fsdp.convert outputs/runs/<day>/<time> hf_out          # its newest checkpoint
    python -m llama_fsdp.convert CKPT hf_out --config <run>/config.yaml --dtype bfloat16
    python -m llama_fsdp.convert SmolLM2-135M-Instruct.Q4_1.gguf hf_out   # a GGUF file (gguf.py)

The result is what ``save.export_hf=true`` writes at the end of a run (safetensors,
config.json, tokenizer files) and loads with ``LlamaForCausalLM.from_pretrained(hf_out)``.
config.json and the tokenizer come from the checkpoint's ``hf/`` folder; for checkpoints
without one, from the run's config.yaml (``--config``, else ``<run>/config.yaml``).
The whole model is read into this process's memory (that is the point of consolidating).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from . import MAX_SHARD_BYTES, dir_bytes, read_model_state, resolve_resume, write_hf_dir
from ..config.rundir import HF_META, RunDir
from ..config.precision import DTYPE_BYTES
from .gguf import gguf_to_hf, is_gguf

log = logging.getLogger("llama_fsdp.checkpoint.convert")


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def _config_from_run_yaml(path: Path):
    """The HF config of the model node of a run's (resolved) config.yaml."""
    from omegaconf import OmegaConf

    from ..config.schema import model_config_from_node
    from ..model.llama import llama_config

    node = OmegaConf.load(path)
    if "model" not in node:
        raise ValueError(f"{path} has no model section: pass a run's config.yaml")
    cfg = llama_config(model_config_from_node(node.model))
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.use_cache = True
    return cfg


def _meta_dir(checkpoint: Path, config_yaml: Optional[Path], work: Path) -> Path:
    """A scratch copy of the checkpoint's hf/ folder (config.json + tokenizer files), its
    config.json replaced by the one of ``config_yaml`` when given or when it has none."""
    meta = checkpoint / HF_META
    work.mkdir(parents=True, exist_ok=True)
    if meta.is_dir():
        for f in meta.iterdir():
            if f.is_file():
                (work / f.name).write_bytes(f.read_bytes())
    if config_yaml is None and (work / "config.json").is_file():
        return work
    if config_yaml is None:
        config_yaml = RunDir(checkpoint.parent.parent).config
        if not config_yaml.is_file():
            raise FileNotFoundError(f"{checkpoint} has no {HF_META}/config.json and "
                                    f"{config_yaml} does not exist: pass --config "
                                    "<run>/config.yaml")
    _config_from_run_yaml(config_yaml).to_json_file(str(work / "config.json"), use_diff=False)
    return work


def convert(checkpoint: Path, out: Path, *, config_yaml: Optional[Path] = None,
            dtype: Optional[str] = None, max_shard_bytes: int = MAX_SHARD_BYTES,
            overwrite: bool = False) -> Path:
    """Write the HF directory ``out`` from a DCP checkpoint (or a run dir's newest one). An
    existing ``out`` is replaced only with ``overwrite``, or when it is empty or an earlier
    export of llama_fsdp's."""
    ckpt = resolve_resume(str(checkpoint), checkpoint, named="")
    assert ckpt is not None
    sd = read_model_state(ckpt)
    from ..model.lora import is_adapter

    if all(is_adapter(k) for k in sd):
        raise ValueError(
            f"{ckpt} holds LoRA adapters only (finetune=lora / qlora checkpoints leave out the "
            "frozen base): the run's export/ folder is its PEFT adapter, which "
            "peft.PeftModel.from_pretrained loads onto the base; finetune.export_merged=true "
            "also writes the merged model (export_merged/)")
    with tempfile.TemporaryDirectory() as tmp:
        meta = _meta_dir(ckpt, config_yaml, Path(tmp) / "meta")
        if dtype is not None:
            sd = {k: v.to(getattr(torch, dtype)) for k, v in sd.items()}
            cfg = json.loads((meta / "config.json").read_text())
            cfg["dtype"] = dtype
            (meta / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        path = write_hf_dir(sd, out, meta_dir=meta, max_shard_bytes=max_shard_bytes,
                            overwrite=overwrite)
    log.info("converted %s -> %s (%d tensors, %.1f MB)", ckpt, path, len(sd),
             dir_bytes(path) / 1e6)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_fsdp.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path,
                   help="a DCP checkpoint dir (step_N), a run dir, or a Llama's .gguf file")
    p.add_argument("out", type=Path, help="the HF directory to write (must not exist, "
                   "unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output directory")
    p.add_argument("--config", type=Path, default=None,
                   help="the run's config.yaml, for checkpoints without an hf/ folder")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="cast the weights (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB", help="per safetensors file (e.g. 2GB)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.out.exists() and not args.out.is_dir():
        log.error("%s is a file, not a directory: name a new directory for the HF model", args.out)
        return 2
    if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
        log.error("%s exists and is not empty: choose another output directory, or pass "
                  "--overwrite to replace it", args.out)
        return 2
    try:
        if is_gguf(args.checkpoint):
            gguf_to_hf(args.checkpoint, args.out, dtype=args.dtype, overwrite=args.overwrite)
        else:
            convert(args.checkpoint, args.out, config_yaml=args.config, dtype=args.dtype,
                    max_shard_bytes=_parse_size(args.max_shard_size), overwrite=args.overwrite)
    except (FileNotFoundError, ValueError) as e:
        log.error("%s", e)
        return 2
    except OSError as e:  # a folder that cannot be written: said in one line
        log.error("cannot write %s: %s (%s)", e.filename or args.out, e.strerror or e,
                  type(e).__name__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
