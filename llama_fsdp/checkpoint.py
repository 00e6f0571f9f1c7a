"""Weights in and out: HF safetensors -> sharded model, DCP checkpoints (save / resume), HF export.

Three formats, three jobs:

- **HF directory** (``config.json`` + safetensors, one file or several with an index): where a
  run starts (``model.path``, a directory or a hub name) and what it exports. A sharded model
  reads it through DCP's ``HuggingFaceStorageReader``: each rank asks only for the rows its
  FSDP2 shards hold and the reader copies ``safe_open(...).get_slice(name)[rows]`` into them,
  so no rank ever holds a full model (or even a full tensor).
- **DCP checkpoint** (``<run>/checkpoints/step_000010``): all a run needs to go on (model,
  optimizer, LR scheduler, counters, loader position, RNG), written by every rank in parallel
  and resharded on load (2 ranks -> 4 ranks hybrid works).
- **Export**: one process's consolidated HF directory (``<run>/export``) that
  ``LlamaForCausalLM.from_pretrained`` reads; ``python -m llama_fsdp.convert`` makes the same
  files from any DCP checkpoint.

Saves are write-then-publish: ranks write ``step_N.tmp``; after every rank has finished, rank 0
renames it to ``step_N``. Only directories named ``step_N`` that hold DCP's ``.metadata`` count
as checkpoints, so a run killed mid-save leaves the previous one to resume from. Nothing here
unpickles beyond ``torch.load(weights_only=True)``; weights outside DCP are safetensors.
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from .config import Config, ModelConfig, SaveConfig

if TYPE_CHECKING:
    from .train import TrainState

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # under the run's output dir
EXPORT = "export"  # the consolidated HF directory of a run
HF_META = "hf"  # inside a DCP checkpoint: config.json (+ tokenizer) for convert / export
METADATA = ".metadata"  # DCP writes it last, on rank 0: its presence marks a complete write
TMP_SUFFIX = ".tmp"
_STEP_RE = re.compile(r"^step_(\d{6,})$")
# Test-only fault injection: every rank exits while saving this step, after writing its data
# files and before DCP's metadata and the publish (what a kill during a save leaves behind).
FAULT_ENV = "LLAMA_FSDP_FAULT_SAVE_STEP"
FAULT_EXIT_CODE = 86
MAX_SHARD_BYTES = 5 * 1024**3  # export shards, as transformers' save_pretrained


# --- checkpoint directories ----------------------------------------------------------------------

def step_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step_{step:06d}"


def is_checkpoint(path: Path) -> bool:
    """A published, complete DCP checkpoint (not a ``.tmp`` left by an interrupted save)."""
    return bool(_STEP_RE.match(path.name)) and (path / METADATA).is_file()


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(_STEP_RE.match(p.name).group(1)), p) for p in root.iterdir()  # type: ignore[union-attr]
             if is_checkpoint(p)]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str, output_dir: str | Path) -> Optional[Path]:
    """``auto``: newest checkpoint of this run (or None); ``none``: None; else a checkpoint
    directory, or a run directory whose newest checkpoint is taken."""
    match resume:
        case "none":
            return None
        case "auto":
            return latest_checkpoint(output_dir)
    path = Path(resume).expanduser().resolve()
    if is_checkpoint(path) or (path / METADATA).is_file():
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise FileNotFoundError(f"resume={resume}: neither a DCP checkpoint (no {METADATA}) nor a "
                                f"run directory with complete checkpoints under {CHECKPOINTS}/")
    return newest


def expired(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Complete checkpoints older than the newest ``keep_last`` (what retention deletes)."""
    return [p for _, p in list_checkpoints(output_dir)[:-keep_last]] if keep_last > 0 else []


def interrupted(output_dir: str | Path) -> list[Path]:
    """``step_N.tmp`` directories: saves that never completed (never read, deleted on save)."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"step_*{TMP_SUFFIX}")
                  if _STEP_RE.match(p.name[: -len(TMP_SUFFIX)]))


def _remove(path: Path, root: Path) -> None:
    """Delete a checkpoint directory, refusing anything that is not directly under root."""
    if path.parent.resolve() != root.resolve():
        raise RuntimeError(f"refusing to delete {path}: not inside {root}")
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- validation at spec time (no process group) --------------------------------------------------

# ModelConfig field -> config.json key (missing keys take LlamaConfig's defaults).
_HF_FIELDS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
              "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
              "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
              "tie_word_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta",
              "rms_norm_eps": "rms_norm_eps"}
_HF_DEFAULTS = {"tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def hf_shape(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json in ModelConfig's terms (old top-level rope keys and transformers 5's
    ``rope_parameters`` both understood)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    out = {field: hf.get(key, _HF_DEFAULTS.get(field)) for field, key in _HF_FIELDS.items()}
    if out["num_kv_heads"] is None:
        out["num_kv_heads"] = out["num_heads"]
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    kind = rope.get("rope_type") or rope.get("type") or "default"
    out["rope_scaling"] = None if kind == "default" else {
        "rope_type": kind, **{k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings") if k in rope}}
    return out


def _model_shape(m: Any) -> dict[str, Any]:
    """ModelConfig (or a preset's YAML node) in the same terms as hf_shape."""
    get = (lambda k, d=None: m.get(k, d)) if isinstance(m, dict) else (lambda k, d=None: getattr(m, k, d))
    out = {f: get(f, _HF_DEFAULTS.get(f)) for f in _HF_FIELDS}
    rs = get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        rs = {k: getattr(rs, k) for k in ("rope_type", "factor", "low_freq_factor",
                                          "high_freq_factor", "original_max_position_embeddings")}
    out["rope_scaling"] = dict(rs) if rs else None
    return out


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) > 1e-9 * max(1.0, abs(float(a)))
        except (TypeError, ValueError):
            return True
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) & set(b)
        return any(_differs(a[k], b[k]) for k in keys) or a.get("rope_type") != b.get("rope_type")
    return a != b


def shape_diff(m: ModelConfig | dict, hf: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (model group value, config.json value)} for every field that differs."""
    ours, theirs = _model_shape(m), hf_shape(hf)
    return {k: (ours[k], theirs[k]) for k in ours if _differs(ours[k], theirs[k])}


def _presets() -> dict[str, dict]:
    root = Path(__file__).resolve().parents[1] / "conf" / "model"
    if not root.is_dir():
        return {}
    from omegaconf import OmegaConf

    out = {}
    for f in sorted(root.glob("*.yaml")):
        node = OmegaConf.load(f)
        node.pop("defaults", None)  # type: ignore[union-attr]
        try:  # unset fields take the schema's defaults, as at compose time
            out[f.stem] = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                                                 node))
        except Exception:  # noqa: BLE001 - a broken preset is reported by compose, not here
            continue
    return out


def _override(field: str, value: Any) -> str:
    if field == "rope_scaling":
        return "model.rope_scaling=null" if value is None else (
            "model.rope_scaling={" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}")
    return f"model.{field}={str(value).lower() if isinstance(value, bool) else value}"


def suggest_model_option(hf: dict[str, Any]) -> str:
    """The model= option (plus overrides) whose shape equals a config.json."""
    shape = {"hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
             "vocab_size"}
    best = None
    for name, node in _presets().items():
        diff = shape_diff(node, hf)
        if not shape & set(diff) and (best is None or len(diff) < len(best[1])):
            best = (name, diff)
    if best is not None:
        return " ".join([f"model={best[0]}", *(_override(k, v[1]) for k, v in best[1].items())])
    return " ".join(_override(k, v) for k, v in hf_shape(hf).items() if v is not None)


def _local_hf_problems(path: Path) -> list[str]:
    if not (path / "config.json").is_file():
        return [f"model.path={path} has no config.json: point it at a Hugging Face model "
                "directory (config.json + *.safetensors) or a hub name"]
    if not any(path.glob("*.safetensors")):
        return [f"model.path={path} has no *.safetensors files (only safetensors weights are "
                "read; convert .bin checkpoints with transformers' save_pretrained first)"]
    return []


def model_path_problems(m: ModelConfig) -> list[str]:
    """model.path must be an HF Llama directory or hub name whose config.json matches the group."""
    if not m.path:
        return []
    local = Path(m.path).expanduser()
    if local.is_dir():
        problems = _local_hf_problems(local)
        if problems:
            return problems
        hf = json.loads((local / "config.json").read_text())
    elif local.exists() or m.path.startswith((".", "/", "~")) or m.path.count("/") != 1:
        return [f"model.path={m.path} is neither a directory nor a hub name (org/name)"]
    else:
        try:
            from huggingface_hub import hf_hub_download

            hf = json.loads(Path(hf_hub_download(m.path, "config.json")).read_text())
        except Exception as e:  # noqa: BLE001 - any hub failure is a config problem to report
            return [f"model.path={m.path}: not a local directory, and the hub lookup of its "
                    f"config.json failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"]
    if hf.get("model_type", "llama") != "llama":
        return [f"model.path={m.path} is a {hf.get('model_type')!r} model; only Llama loads here"]
    diff = shape_diff(m, hf)
    if not diff:
        return []
    fields = ", ".join(f"{k}: model.{k}={ours} but config.json has {theirs}"
                       for k, (ours, theirs) in diff.items())
    return [f"model={m.name} does not match model.path={m.path} ({fields}): use "
            f"{suggest_model_option(hf)}"]


def checkpoint_problems(cfg: Config) -> list[str]:
    """Everything about weights in and out that can be wrong before any process starts."""
    problems = model_path_problems(cfg.model)
    if cfg.resume not in ("auto", "none") and Path(cfg.resume).exists():
        try:
            resolve_resume(cfg.resume, cfg.output_dir)
        except FileNotFoundError as e:
            problems.append(f"{e}: use resume=auto, resume=none or a checkpoint directory")
    s, stop = cfg.save, cfg.train.stop_after
    if s.async_save and s.full_state_dict:
        problems.append("save.async_save=true with save.full_state_dict=true: the full state dict "
                        "is gathered and written by rank 0 synchronously; drop one of them")
    if stop is not None and not 1 <= stop <= cfg.train.max_steps:
        problems.append(f"train.stop_after={stop} must be in [1, train.max_steps="
                        f"{cfg.train.max_steps}] (or null)")
    return problems


# --- HF weights in -------------------------------------------------------------------------------

def resolve_hf_dir(path: str) -> Path:
    """A local HF directory as is; a hub name through snapshot_download (rank 0 first, so the
    other ranks find it in a shared cache). Only json, safetensors and tokenizer files."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    def fetch() -> Path:
        return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors",
                                                            "tokenizer*"]))

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return fetch()
    if dist.get_rank() == 0:
        out = fetch()
    dist.barrier()
    if dist.get_rank() != 0:
        out = fetch()
    return out


def _unique_state(sd: dict[str, Any]) -> dict[str, Any]:
    """Drop aliases (a tied lm_head is the embedding): HF files hold the tensor once."""
    from torch.distributed.tensor import DTensor

    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for k, v in sd.items():
        local = v.to_local() if isinstance(v, DTensor) else v
        key = (local.data_ptr(), tuple(v.shape))
        if local.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str) -> dict[str, float]:
    """Fill a sharded (or plain) model from HF safetensors; every rank reads only its rows.

    DCP plans one read per local shard and ``HuggingFaceStorageReader`` serves it with
    ``get_slice``, so a rank's memory grows by its shards (which it had to hold anyway), not by
    the model. Any dtype on disk converts on copy. A tensor the model needs and the files lack
    is an error; extra tensors in the files are ignored.
    """
    t0 = time.perf_counter()
    hf_dir = resolve_hf_dir(path)
    sd = _unique_state(get_model_state_dict(model))
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(str(hf_dir)),
             planner=DefaultLoadPlanner(allow_partial_load=False))
    set_model_state_dict(model, sd, options=StateDictOptions(strict=False))
    dt = time.perf_counter() - t0
    log.info("loaded %d tensors from %s in %.2fs", len(sd), hf_dir, dt)
    return {"load_hf_s": dt}


# --- what a checkpoint holds ----------------------------------------------------------------------

class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP stores non-tensor values with torch.save; read them back with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # type: ignore[override]
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def rng_state() -> dict[str, Any]:
    """This process's generators as tensors and plain numbers (torch, CUDA, python, numpy)."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(),
                           "python": {"version": version, "gauss": gauss,
                                      "internal": torch.tensor(internal, dtype=torch.int64)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    except ImportError:
        pass
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state saved (any subset of its generators)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        p = state["python"]
        random.setstate((int(p["version"]), tuple(int(x) for x in p["internal"].tolist()),
                         p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"],
                             n["has_gauss"], n["cached"]))


class AppState(Stateful):
    """Everything a run needs to continue, as one Stateful (the DCP tutorial's shape).

    ``model`` / ``optim`` come from get_state_dict, so they are DTensor shards that DCP
    reshards on load; the scheduler, counters and loader position are replicated (same on every
    rank); RNG states are per rank, under ``rng.rank_<r>``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, train_state: "TrainState", data: Any = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_state, self.data = train_state, data
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # While loading: the generators the checkpoint holds for this rank (None: all). A rank
        # the saving run did not have, or CUDA state saved on CPU, is not asked for.
        self.rng_on_load: Optional[set[str]] = None

    def _extras(self) -> dict[str, Any]:
        out = {"scheduler": self.scheduler.state_dict(), "train": self.train_state.state_dict()}
        if self.data is not None:
            out["data"] = self.data.state_dict()
        return out

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd = {"model": model_sd, "optim": optim_sd, **self._extras()}
        rng = {k: v for k, v in rng_state().items()
               if self.rng_on_load is None or k in self.rng_on_load}
        if rng:
            sd["rng"] = {f"rank_{self.rank}": rng}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["scheduler"])
        self.train_state.load_state_dict(sd["train"])
        if self.data is not None and "data" in sd:
            self.data.load_state_dict(sd["data"])
        mine = sd.get("rng", {}).get(f"rank_{self.rank}")
        if mine is not None:
            set_rng_state(mine)

    def full_state_dict(self) -> dict[str, Any]:
        """Gathered to rank 0 on CPU (collective); other ranks get {}."""
        model_sd, optim_sd = get_state_dict(
            self.model, self.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        rngs: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
        dist.gather_object(rng_state(), rngs if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return {}
        return {"model": model_sd, "optim": optim_sd, **self._extras(),
                "rng": {f"rank_{r}": s for r, s in enumerate(rngs)}}


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer with the test-only fault hook (see FAULT_ENV)."""

    def __init__(self, path: str, *, fault: bool = False):
        super().__init__(path)
        self.fault = fault

    def write_data(self, plan, planner):  # type: ignore[override]
        fut = super().write_data(plan, planner)
        if self.fault:
            fut.wait()
            log.error("fault injection (%s): exiting mid-save of %s", FAULT_ENV, self.path)
            os._exit(FAULT_EXIT_CODE)
        return fut


# --- saving and resuming --------------------------------------------------------------------------

class Checkpointer:
    """DCP save every ``save.every_steps`` and at the end, keep the last ``save.keep_last``,
    resume from the newest. Every rank holds one; collectives happen at the same steps."""

    def __init__(self, save: SaveConfig, *, output_dir: str, app: AppState, device: torch.device,
                 hf_config: Any = None, tokenizer: Any = None, tracker: Any = None):
        self.cfg, self.app, self.device = save, app, device
        self.output_dir = Path(output_dir)
        self.root = self.output_dir / CHECKPOINTS
        self.hf_config, self.tokenizer, self.tracker = hf_config, tokenizer, tracker
        self.rank = dist.get_rank()
        self.last_saved: Optional[int] = None
        self.resumed_from: Optional[Path] = None
        self._pending: Optional[tuple[Any, int, Path, float]] = None
        # Async saves run their collectives in a background thread: on a group of their own, so
        # they never interleave with the training step's collectives on the default group.
        self._pg = dist.new_group(backend="gloo") if save.async_save else None
        fault = os.environ.get(FAULT_ENV)
        self._fault_step = int(fault) if fault else None

    # resume -------------------------------------------------------------------------------------

    def resume(self, resume: str) -> Optional[Path]:
        """Load the checkpoint ``resume`` names (see resolve_resume); None when starting fresh."""
        path = resolve_resume(resume, self.output_dir)
        if path is None:
            log.info("no checkpoint to resume from (resume=%s): starting at step 0", resume)
            return None
        t0 = time.perf_counter()
        self.load(path)
        step = self.app.train_state.step
        own = path.resolve().parent == self.root.resolve()
        self.last_saved = step if own else None
        self.resumed_from = path
        log.info("resumed from %s at step %d in %.2fs", path, step, time.perf_counter() - t0)
        if self.tracker is not None:
            # the same run dir continues its MLflow run (tracking.py); another run's checkpoint
            # starts a new MLflow run that records where it came from
            self.tracker.set_tags({"resume_step": str(step),
                                   **({} if own else {"resumed_from": str(path)})})
        return path

    def load(self, path: Path) -> None:
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        prefix = f"app.rng.rank_{self.app.rank}."
        self.app.rng_on_load = {k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)}
        if not self.app.rng_on_load:
            log.warning("%s has no RNG state for rank %d (saved with fewer ranks): keeping "
                        "this rank's seeded generators", path, self.app.rank)
        try:
            dcp.load({"app": self.app}, checkpoint_id=str(path), planner=_WeightsOnlyLoadPlanner())
        finally:
            self.app.rng_on_load = None

    # save ---------------------------------------------------------------------------------------

    def on_step_end(self, state: "TrainState") -> None:
        """The loop's hook: publish a finished async save, start a save every ``every_steps``."""
        if self._pending is not None and self._all_done():
            self._finish_pending()
        if self.cfg.every_steps and state.step % self.cfg.every_steps == 0:
            self.save(state.step)

    def finish(self, state: "TrainState") -> None:
        """At the end of training: the final checkpoint (if saving is on), then wait for it."""
        if self.cfg.every_steps:
            self.save_now(state)
        elif self._pending is not None:
            self._finish_pending()

    def save_now(self, state: "TrainState") -> Path:
        """A published checkpoint of this step before returning, whatever ``every_steps`` says
        (end of training, preemption); no second write if this step is saved or in flight."""
        in_flight = self._pending is not None and self._pending[1] == state.step
        if self.last_saved != state.step and not in_flight:
            self.save(state.step)
        if self._pending is not None:
            self._finish_pending()
        return step_dir(self.output_dir, state.step)

    def save(self, step: int) -> Path:
        """Write ``step_N.tmp`` on every rank, then publish it as ``step_N`` (rank 0)."""
        if self._pending is not None:  # one save in flight at a time
            self._finish_pending()
        final = step_dir(self.output_dir, step)
        tmp = final.with_name(final.name + TMP_SUFFIX)
        if self.rank == 0:
            for stale in interrupted(self.output_dir):
                log.warning("removing %s, left by an interrupted save", stale)
                _remove(stale, self.root)
            tmp.mkdir(parents=True)
            self._write_hf_meta(tmp / HF_META)
        dist.barrier()
        t0 = time.perf_counter()
        writer = _Writer(str(tmp), fault=self._fault_step == step)
        if self.cfg.full_state_dict:
            sd = self.app.full_state_dict()
            if self.rank == 0:
                dcp.save({"app": sd}, storage_writer=writer, no_dist=True)
            self._publish(step, tmp, final, t0)
        elif self.cfg.async_save:
            fut = dcp.async_save({"app": self.app}, storage_writer=writer, process_group=self._pg)
            fut = getattr(fut, "upload_completion", fut)
            self._pending = (fut, step, tmp, t0)
            self._log({"checkpoint/blocking_s": time.perf_counter() - t0}, step)
        else:
            dcp.save({"app": self.app}, storage_writer=writer)
            self._publish(step, tmp, final, t0)
        return final

    def _all_done(self) -> bool:
        flag = torch.tensor(float(self._pending[0].done()), device=self.device)  # type: ignore[index]
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _finish_pending(self) -> None:
        fut, step, tmp, t0 = self._pending  # type: ignore[misc]
        self._pending = None
        fut.result()  # re-raises a failed background write
        self._publish(step, tmp, step_dir(self.output_dir, step), t0)

    def _publish(self, step: int, tmp: Path, final: Path, t0: float) -> None:
        dist.barrier()  # every rank's files are written
        written = time.perf_counter() - t0
        if self.rank == 0:
            if not (tmp / METADATA).is_file():
                raise RuntimeError(f"DCP finished but {tmp / METADATA} is missing")
            if final.exists():  # a fresh run (resume=none) reusing a run dir: replace
                _remove(final, self.root)
            tmp.rename(final)
            _fsync_dir(self.root)
            size = dir_bytes(final)
            for old in expired(self.output_dir, self.cfg.keep_last):
                _remove(old, self.root)
            log.info("checkpoint step %d: %s (%.1f MB, written in %.2fs)", step, final,
                     size / 1e6, written)
            self._log({"checkpoint/write_s": written, "checkpoint/size_mb": size / 1e6}, step)
            if not self.cfg.async_save:
                self._log({"checkpoint/blocking_s": time.perf_counter() - t0}, step)
        self.last_saved = step
        dist.barrier()

    def _write_hf_meta(self, path: Path) -> None:
        if self.hf_config is not None:
            write_hf_meta(path, self.hf_config, self.tokenizer)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=step)

    def close(self) -> None:
        """Wait for an async save still in flight (on the error path too), free its group."""
        if self._pending is not None:
            fut = self._pending[0]
            self._pending = None
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the training error is the one to surface
                log.exception("async checkpoint failed")
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None


# --- HF out --------------------------------------------------------------------------------------

def hf_config(m: ModelConfig, *, dtype: str, tokenizer: Any = None) -> Any:
    """The config.json of an export: the source model's when it came from model.path, else the
    group's shape; with the dtype saved and the tokenizer's special token ids."""
    from transformers import LlamaConfig

    from .model import llama_config, read_hf_config

    cfg = LlamaConfig.from_dict(read_hf_config(m.path)) if m.path else llama_config(m)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = dtype
    cfg.use_cache = True
    if tokenizer is not None:
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, attr, None)
            if value is not None:
                setattr(cfg, attr, value)
    return cfg


def write_hf_meta(out: Path, config: Any, tokenizer: Any = None) -> None:
    """config.json (and the tokenizer's files) of an HF directory."""
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(out / "config.json"), use_diff=False)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out))


def write_hf_weights(sd: dict[str, torch.Tensor], out: Path, *,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """safetensors files in save_pretrained's layout: model.safetensors, or numbered shards
    plus model.safetensors.index.json. Returns the file names."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v.detach().contiguous()
        size += n
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
                 "weight_map": {k: name for name, s in zip(names, shards) for k in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    umask = os.umask(0o22)
    os.umask(umask)
    for name, s in zip(names, shards):
        save_file(s, str(out / name), metadata={"format": "pt"})
        os.chmod(out / name, 0o666 & ~umask)  # save_file creates 0600; match save_pretrained
    return names


def write_hf_dir(sd: dict[str, torch.Tensor], out: Path, *, config: Any = None,
                 meta_dir: Optional[Path] = None, tokenizer: Any = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """A complete HF directory, written beside ``out`` and renamed into place at the end.

    config.json and tokenizer files come from ``config`` / ``tokenizer``, or are copied from
    ``meta_dir`` (a checkpoint's ``hf/`` folder), so an export and a conversion of the same
    weights give the same files.
    """
    out = Path(out)
    tmp = out.with_name(out.name + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if meta_dir is not None:
        for f in sorted(meta_dir.iterdir()):
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
    else:
        write_hf_meta(tmp, config, tokenizer)
    tied = json.loads((tmp / "config.json").read_text()).get("tie_word_embeddings", False)
    if tied:  # the head is the embedding: HF files hold it once
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    write_hf_weights(sd, tmp, max_shard_bytes=max_shard_bytes)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def export_hf(model: nn.Module, out: Path, *, config: Any, tokenizer: Any = None) -> Optional[Path]:
    """Gather the full model to rank 0 (CPU, one tensor at a time) and write an HF directory.

    Collective: every rank calls it; rank 0 writes and returns the path, others return None.
    """
    t0 = time.perf_counter()
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = None
    if rank == 0:
        path = write_hf_dir(sd, out, config=config, tokenizer=tokenizer)
        log.info("exported %s (%.1f MB) in %.2fs", path, dir_bytes(path) / 1e6,
                 time.perf_counter() - t0)
    if dist.is_initialized():
        dist.barrier()
    return path


@torch.no_grad()
def load_model_weights(model: nn.Module, checkpoint: Path) -> None:
    """Only the weights of a DCP checkpoint into a (sharded) model, e.g. to evaluate it; each
    rank reads its shards, whatever the world size that saved it."""
    sd = get_model_state_dict(model)
    dcp.load({"app": {"model": sd}}, checkpoint_id=str(checkpoint),
             planner=_WeightsOnlyLoadPlanner())
    set_model_state_dict(model, sd)


def read_model_state(checkpoint: Path, prefix: str = "app.model.") -> dict[str, torch.Tensor]:
    """The full model tensors of a DCP checkpoint, on one process without a process group."""
    md = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
          if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    if not sd:
        raise ValueError(f"{checkpoint} holds no tensors under {prefix!r}: not a llama_fsdp "
                         "checkpoint")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(sd, checkpoint_id=str(checkpoint), planner=_WeightsOnlyLoadPlanner(),
                 no_dist=True)
    return {k[len(prefix):]: v for k, v in sd.items()}
