"""Sharded DCP checkpoints: what a run needs to continue (model, optimizer, LR scheduler,
counters, loader position, RNG), written by every rank in parallel, published atomically, kept
K deep, resharded on load (2 ranks -> 4 ranks hybrid works).

Reading a checkpoint unpickles two things, both restricted: DCP's ``.metadata`` file into DCP's
metadata classes only (``SafeReader``, pickles.py: torch's own reader would unpickle anything,
and a crafted file runs code), and the non-tensor values with ``torch.load(weights_only=True)``
(``_WeightsOnlyLoadPlanner``). Every load here goes through both.
"""
from __future__ import annotations

import errno
import io
import json
import logging
import random
import time
import warnings
from pathlib import Path
from typing import Any, Optional

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

from ..config.schema import FinetuneConfig, OptimConfig, SaveConfig
from ..config.manifest import write_manifest
from ..config.rundir import HF_META, RunDir, read_identity
from .state import TrainState
from .hf import write_hf_meta
from .optim_meta import optim_mismatch, write_optim_meta
from .pickles import check_file, load_metadata
from .layout import (
    METADATA,
    TMP_SUFFIX,
    _fsync_dir,
    _remove,
    dir_bytes,
    expired,
    interrupted,
    latest_checkpoint,
    step_dir,
    verify,
    write_checkpoint_run,
)

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says what is intact and what to do."""


def _root_cause(err: BaseException) -> BaseException:
    """The innermost error (DCP wraps a rank's OSError in CheckpointException)."""
    seen = err
    while True:
        inner = seen.__cause__ or seen.__context__
        failures = getattr(seen, "failures", None)  # CheckpointException: {rank: exception}
        if failures:
            inner = next(iter(failures.values()))
            if isinstance(inner, tuple):
                inner = inner[0]
        if not isinstance(inner, BaseException):
            return seen
        seen = inner


def disk_full(err: BaseException) -> bool:
    """Whether a failed write looks like a full disk or quota: ENOSPC / EDQUOT, or torch's zip
    writer's "unexpected pos" (a write that came up short, which is how torch.save reports
    one)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return "unexpected pos" in text or "No space left on device" in text


def save_hint(root: Path, err: BaseException) -> str:
    """What to do about a failed save, the path as it is spelled."""
    if disk_full(err):
        return (f"The disk looks full: free space on {root} (df -h {root}) or point output_dir "
                "elsewhere")
    return f"Check that {root} is writable"


# What a failed DCP write or read raises: DCP's CheckpointException derives from BaseException.
SAVE_ERRORS = (Exception, dcp.api.CheckpointException)


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader, its ``.metadata`` unpickled into DCP's classes only
    (pickles.py); a crafted one raises UnsafeCheckpoint naming the file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


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
    rank); RNG states are per rank, under ``rng.rank_<r>``. Frozen parameters (a LoRA base) are
    left out: they come from model.path or the seeded init, so ``model`` holds what trains.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, train_state: TrainState, data: Any = None, *,
                 guard: Any = None, hparams: Optional[dict[str, Any]] = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_state, self.data = train_state, data
        # the divergence guard's history (a resumed run judges its steps against the same
        # best), and the hyperparameters the run trained with (a resume says what changed)
        self.guard, self.hparams = guard, hparams
        self.saved_hparams: Optional[dict[str, Any]] = None  # the loaded checkpoint's
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # While loading: the generators the checkpoint holds for this rank (None: all). A rank
        # the saving run did not have, or CUDA state saved on CPU, is not asked for.
        self.rng_on_load: Optional[set[str]] = None
        # While loading: which of the optional entries (OPTIONAL) the checkpoint holds (None:
        # all); an older checkpoint has neither
        self.optional_on_load: Optional[set[str]] = None

    OPTIONAL = ("guard", "hparams")  # entries a checkpoint may lack (written since issue 63)

    def _extras(self) -> dict[str, Any]:
        out = {"scheduler": self.scheduler.state_dict(), "train": self.train_state.state_dict()}
        if self.data is not None:
            out["data"] = self.data.state_dict()
        # (JSON strings: one value each, whatever the history's length, read weights-only)
        if self.guard is not None:
            out["guard"] = json.dumps(self.guard.state_dict())
        if self.hparams is not None:
            out["hparams"] = json.dumps(self.hparams)
        on_load = self.optional_on_load
        return {k: v for k, v in out.items()
                if on_load is None or k not in self.OPTIONAL or k in on_load}

    def _options(self, **kw: Any) -> StateDictOptions:
        """Frozen parameters are not in the checkpoint (missing on load: checked by hand)."""
        frozen = any(not p.requires_grad for p in self.model.parameters())
        return StateDictOptions(ignore_frozen_params=True, strict=not frozen, **kw)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        sd = {"model": model_sd, "optim": optim_sd, **self._extras()}
        rng = {k: v for k, v in rng_state().items()
               if self.rng_on_load is None or k in self.rng_on_load}
        if rng:
            sd["rng"] = {f"rank_{self.rank}": rng}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        keys = set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                              optim_state_dict=sd["optim"], options=self._options())
        from ..model.lora import clean_name

        trained = {clean_name(n) for n, p in self.model.named_parameters() if p.requires_grad}
        missing = [k for k in getattr(keys, "missing_keys", []) if k in trained]
        if missing:
            raise RuntimeError(f"the checkpoint lacks {len(missing)} trained parameter(s), "
                               f"e.g. {missing[0]}")
        self.scheduler.load_state_dict(sd["scheduler"])
        self.train_state.load_state_dict(sd["train"])
        if self.guard is not None and "guard" in sd:
            self.guard.load_state_dict(json.loads(sd["guard"]))
        self.saved_hparams = json.loads(sd["hparams"]) if "hparams" in sd else None
        if self.data is not None and "data" in sd:
            self.data.load_state_dict(sd["data"])
        mine = sd.get("rng", {}).get(f"rank_{self.rank}")
        if mine is not None:
            set_rng_state(mine)

    def full_state_dict(self) -> dict[str, Any]:
        """Gathered to rank 0 on CPU (collective); other ranks get {}."""
        model_sd, optim_sd = get_state_dict(
            self.model, self.optimizer, options=self._options(full_state_dict=True,
                                                              cpu_offload=True))
        rngs: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
        dist.gather_object(rng_state(), rngs if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return {}
        return {"model": model_sd, "optim": optim_sd, **self._extras(),
                "rng": {f"rank_{r}": s for r, s in enumerate(rngs)}}



# --- saving and resuming --------------------------------------------------------------------------

class Checkpointer:
    """DCP save every ``save.every_steps`` and at the end, keep the last ``save.keep_last``,
    resume from the newest. Every rank holds one; collectives happen at the same steps.
    ``optim``, ``finetune``: the optimizer whose state is saved and what trains, recorded
    beside it (optim_meta.py)."""

    def __init__(self, save: SaveConfig, *, output_dir: str, app: AppState, device: torch.device,
                 hf_config: Any = None, tokenizer: Any = None, tracker: Any = None,
                 optim: Optional[OptimConfig] = None,
                 finetune: Optional[FinetuneConfig] = None):
        self.cfg, self.app, self.device = save, app, device
        self.optim, self.finetune = optim or OptimConfig(), finetune or FinetuneConfig()
        self.output_dir = Path(output_dir)
        self.root = RunDir(output_dir).checkpoints
        self.hf_config, self.tokenizer, self.tracker = hf_config, tokenizer, tracker
        self.rank = dist.get_rank()
        # the run that trains here (prepare wrote it): its checkpoints carry it, and retention
        # prunes only its own
        self.identity = read_identity(output_dir)
        self.last_saved: Optional[int] = None
        self.resumed_from: Optional[Path] = None
        # how long a save is expected to take: the last one's write time, or before any, the
        # time the checkpoint resumed from took to load (the same bytes); None: not known
        self.expected_save_s: Optional[float] = None
        self._pending: Optional[tuple[Any, int, Path, float]] = None
        # Async saves run their collectives in a background thread: on a group of their own, so
        # they never interleave with the training step's collectives on the default group.
        self._pg = dist.new_group(backend="gloo") if save.async_save else None

    # resume -------------------------------------------------------------------------------------

    def resume(self, candidates: list[Path]) -> Optional[Path]:
        """Load the first readable checkpoint of ``candidates`` (layout.resume_candidates:
        newest first); None to start fresh when there are none. A checkpoint with missing or
        truncated files, or one DCP cannot read, is skipped with a warning; if none can be
        read the run stops: it never trains on from garbage."""
        if not candidates:
            log.info("starting at step 0 (no checkpoint to resume from)")
            return None
        skipped = []
        for path in candidates:
            if (unsafe := check_file(path / METADATA)) is not None and \
                    (path / METADATA).is_file():
                raise CheckpointError(unsafe)  # not damaged but hostile: nothing else is tried
            problem = verify(path)
            other = optim_mismatch(path, self.optim, self.finetune) if problem is None else None
            if other is not None:
                raise CheckpointError(other)  # not a damaged checkpoint: no older one is tried
            problem = problem or self._try_load(path)
            if problem is None:
                break
            skipped.append(f"{path.name}: {problem}")
            log.warning("checkpoint %s cannot be used (%s)%s", path, problem,
                        "; trying the one before" if path != candidates[-1] else "")
        else:
            raise CheckpointError(
                f"no checkpoint of {candidates[0].parent} can be read ({'; '.join(skipped)}). "
                "Start again with resume=retire, which moves them aside (or point resume= at a "
                "good checkpoint); the "
                "unreadable ones are left as they are")
        step = self.app.train_state.step
        own = path.resolve().parent == self.root.resolve()
        self.last_saved = step if own else None
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, step)
        if self.tracker is not None:
            # the same run dir continues its MLflow run (tracking.py); another run's checkpoint
            # starts a new MLflow run that records where it came from
            tags = {"resume_step": str(step), **({} if own else {"resumed_from": str(path)})}
            if skipped:
                tags["resume_skipped"] = "; ".join(skipped)[:5000]
            self.tracker.set_tags(tags)
        return path

    def _try_load(self, path: Path) -> Optional[str]:
        """Load a checkpoint on every rank; None on success, else why it failed (agreed by all
        ranks, so they fall back together)."""
        t0 = time.perf_counter()
        try:
            self.load(path)
            error = None
        except SAVE_ERRORS as e:  # a corrupt checkpoint: reported, then skipped
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
        failed = torch.tensor(float(error is not None), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            error = "another rank could not read it"
        if error is None:
            self.expected_save_s = time.perf_counter() - t0
            log.info("loaded %s in %.2fs", path, self.expected_save_s)
        return error

    def load(self, path: Path) -> None:
        keys = SafeReader(str(path)).read_metadata().state_dict_metadata
        prefix = f"app.rng.rank_{self.app.rank}."
        self.app.rng_on_load = {k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)}
        if not self.app.rng_on_load:
            log.warning("%s has no RNG state for rank %d (saved with fewer ranks): keeping "
                        "this rank's seeded generators", path, self.app.rank)
        self.app.optional_on_load = {k for k in AppState.OPTIONAL if f"app.{k}" in keys}
        try:
            dcp.load({"app": self.app}, storage_reader=SafeReader(str(path)),
                     planner=_WeightsOnlyLoadPlanner())
        finally:
            self.app.rng_on_load = self.app.optional_on_load = None

    # save ---------------------------------------------------------------------------------------

    def saves_at(self, step: int) -> bool:
        """Whether ``on_step_end`` starts a save at this step."""
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def on_step_end(self, state: TrainState) -> None:
        """The loop's hook: publish a finished async save, start a save every ``every_steps``."""
        if self._pending is not None and self._all_done():
            self._finish_pending()
        if self.saves_at(state.step):
            self.save(state.step)

    def finish(self, state: TrainState) -> None:
        """At the end of training: the final checkpoint (if saving is on), then wait for it."""
        if self.cfg.every_steps:
            self.save_now(state)
        elif self._pending is not None:
            self._finish_pending()

    def save_now(self, state: TrainState) -> Path:
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
            write_optim_meta(tmp, self.optim, self.finetune)
            if self.identity:
                write_checkpoint_run(tmp, self.identity)
        dist.barrier()
        t0 = time.perf_counter()
        writer = dcp.FileSystemWriter(str(tmp))
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
            try:
                dcp.save({"app": self.app}, storage_writer=writer)
            except SAVE_ERRORS as e:
                raise self._save_failed(step, tmp, e) from e
            self._publish(step, tmp, final, t0)
        return final

    def _save_failed(self, step: int, tmp: Path, err: BaseException) -> "CheckpointError":
        """A save that failed (a full disk, a quota, a lost mount): its partial files are
        removed (freeing what they took) and the published checkpoints are untouched."""
        root = _root_cause(err)
        if self.rank == 0 and tmp.exists():
            _remove(tmp, self.root)
        previous = latest_checkpoint(self.output_dir)
        keep = (f"the previous checkpoint {previous.name} is intact and resume=auto continues "
                "from it" if previous else "there is no earlier checkpoint of this run")
        return CheckpointError(f"checkpoint step {step} could not be written to {tmp}: "
                               f"{type(root).__name__}: {root}. Nothing was published: {keep}. "
                               f"{save_hint(self.root, root)}, then run again with resume=auto")

    def _all_done(self) -> bool:
        # a CPU tensor: on CUDA it goes over the gloo half of the process group, so asking
        # every step while a save is in flight never waits for the GPU's queue
        flag = torch.tensor(float(self._pending[0].done()))  # type: ignore[index]
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _finish_pending(self) -> None:
        fut, step, tmp, t0 = self._pending  # type: ignore[misc]
        self._pending = None
        try:
            fut.result()  # re-raises a failed background write
        except SAVE_ERRORS as e:
            raise self._save_failed(step, tmp, e) from e
        self._publish(step, tmp, step_dir(self.output_dir, step), t0)

    def _publish(self, step: int, tmp: Path, final: Path, t0: float) -> None:
        dist.barrier()  # every rank's files are written
        written = time.perf_counter() - t0
        self.expected_save_s = written
        if self.rank == 0:
            if not (tmp / METADATA).is_file():
                raise RuntimeError(f"DCP finished but {tmp / METADATA} is missing")
            write_manifest(tmp)
            # a run saving a step again (resumed from an earlier one) replaces its own checkpoint
            # of that step; one holding what llama_fsdp did not write is kept and this save fails
            if final.exists() and not _remove(final, self.root, published=True):
                raise CheckpointError(f"checkpoint step {step} could not be published: {final} "
                                      "holds what llama_fsdp did not write (see the warning); "
                                      f"its files are in {tmp}")
            tmp.rename(final)
            _fsync_dir(self.root)
            size = dir_bytes(final)
            for old in expired(self.output_dir, self.cfg.keep_last,
                               run=self.identity.get("run")):
                _remove(old, self.root, published=True)
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

    def publish_pending(self) -> None:
        """Publish a save still in flight (collective): a run that stops on every rank at once
        (it diverged) keeps the good checkpoint it was writing, never a stranded step_N.tmp.
        A save that failed is logged: the error that stopped the run is the one to surface."""
        if self._pending is None:
            return
        try:
            self._finish_pending()
        except CheckpointError as e:
            log.error("%s", e)

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



@torch.no_grad()
def load_model_weights(model: nn.Module, checkpoint: Path) -> None:
    """Only the weights of a DCP checkpoint into a (sharded) model, e.g. to evaluate it; each
    rank reads its shards, whatever the world size that saved it."""
    sd = get_model_state_dict(model)
    dcp.load({"app": {"model": sd}}, storage_reader=SafeReader(str(checkpoint)),
             planner=_WeightsOnlyLoadPlanner())
    set_model_state_dict(model, sd)


def read_model_state(checkpoint: Path, prefix: str = "app.model.") -> dict[str, torch.Tensor]:
    """The full model tensors of a DCP checkpoint, on one process without a process group."""
    md = SafeReader(str(checkpoint)).read_metadata().state_dict_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
          if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    if not sd:
        raise ValueError(f"{checkpoint} holds no tensors under {prefix!r}: not a llama_fsdp "
                         "checkpoint")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(sd, storage_reader=SafeReader(str(checkpoint)),
                 planner=_WeightsOnlyLoadPlanner(), no_dist=True)
    return {k[len(prefix):]: v for k, v in sd.items()}
