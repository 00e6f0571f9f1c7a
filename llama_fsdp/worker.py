"""What every rank runs: process group -> mesh -> sharded model -> data -> loop -> summary."""
from __future__ import annotations

import logging
import os
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint as ckpt_io
from .data import build_data, prepare_data
from .model import build_meta_model, decoder_layers, init_buffers, init_weights
from .parallel import build_mesh, local_numel, model_dtype, parallelize
from .plan import make_plan
from .preemption import Preempted, PreemptionWatcher
from .spec import RunSpec
from .tracking import Console, MlflowTracker, NullConsole, NullTracker
from .train import LoopContext, TrainState, build_optimizer, build_scheduler, run_loop

log = logging.getLogger(__name__)

ERROR_FILE = "rank{rank}.error"


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        e = os.environ
        return cls(int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)),
                   int(e.get("WORLD_SIZE", 1)), int(e.get("LOCAL_WORLD_SIZE", 1)))


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    for noisy in ("alembic", "mlflow", "urllib3", "httpx", "filelock", "submitit"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def init_distributed(spec: RunSpec, env: DistEnv) -> torch.device:
    threads = spec.cluster.threads_per_rank or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    if spec.device == "cuda":
        device = torch.device("cuda", env.local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if dist.get_world_size() != spec.world_size:
        raise RuntimeError(f"launched {dist.get_world_size()} ranks but the run expects "
                           f"{spec.world_size}: the launcher and the spec disagree")
    return device


def build_model(spec: RunSpec, device: torch.device) -> nn.Module:
    """Meta-device model -> AC/compile/FSDP2 -> materialize this rank's shards -> init."""
    model = build_meta_model(spec.model)
    model.to(model_dtype(spec.policy.param_dtype))
    mesh = build_mesh(spec.mesh, device.type)
    parallelize(model, decoder_layers(model), mesh=mesh, mesh_spec=spec.mesh, policy=spec.policy,
                ac_mode=spec.checkpointing.mode, ac_every_k=spec.checkpointing.every_k,
                compile=spec.train.compile, cpu_offload=spec.sharding.cpu_offload)
    model.to_empty(device="cpu" if spec.sharding.cpu_offload else device)
    if spec.model.path:  # weights come from the checkpoint: no full tensors built for nothing
        init_buffers(model)
    else:
        init_weights(model, std=spec.model.init_std, seed=spec.train.seed)
    return model


def _trackers(spec: RunSpec, rank: int) -> tuple[Any, Any]:
    if rank != 0:
        return NullTracker(), NullConsole()
    tracker: Any = NullTracker()
    if spec.tracking.enabled:
        tags = {"git_commit": spec.git_commit, "output_dir": spec.output_dir,
                "hostname": socket.gethostname(), "world_size": str(spec.world_size),
                "strategy": spec.strategy}
        if spec.sweep_id:
            tags["sweep_id"] = spec.sweep_id
        tracker = MlflowTracker(uri=spec.tracking_uri, experiment=spec.tracking.experiment,
                                run_name=spec.run_name, output_dir=spec.output_dir, tags=tags,
                                config_yaml=spec.config_yaml)
    return tracker, Console(total=spec.train.max_steps)


def load_data(spec: RunSpec, env: DistEnv) -> Any:
    """Rank 0 tokenizes (or finds the cache) with progress shown; then every rank loads."""
    if env.rank == 0:
        prepare_data(spec.data, seq_len=spec.train.seq_len, cache_dir=Path(spec.cache_dir))
    dist.barrier()
    return build_data(spec.data, seq_len=spec.train.seq_len, micro_batch=spec.train.batch_size,
                      dp_rank=dist.get_rank(), dp_world=dist.get_world_size(),
                      seed=spec.train.seed, cache_dir=Path(spec.cache_dir),
                      vocab_size=spec.model.vocab_size)


def record_start(tracker: Any, spec: RunSpec, model: nn.Module, data: Any, plan: Any) -> None:
    """Derived values, rank placement, data statistics and the plan's prediction."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    tracker.set_tags({"rank_hosts": ",".join(hosts)})  # which node each rank ran on
    tracker.log_params({"derived.world_size": spec.world_size,
                        "derived.global_batch": spec.global_batch,
                        "derived.tokens_per_step": spec.tokens_per_step,
                        "derived.mesh": "x".join(map(str, spec.mesh.shape)),
                        "derived.local_params_rank0": local_numel(model)})
    tracker.log_metrics({**data.stats, **plan.metrics()}, step=0)


def train_on_rank(spec: RunSpec, env: DistEnv, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(spec.train.seed)
    model = build_model(spec, device)
    if spec.model.path:
        ckpt_io.load_hf_weights(model, spec.model.path)  # each rank reads only its shards
    data = load_data(spec, env)
    optimizer = build_optimizer(model, spec.train)
    scheduler = build_scheduler(optimizer, spec.train)
    tracker, console = _trackers(spec, env.rank)
    plan = make_plan(spec)
    record_start(tracker, spec, model, data, plan)
    state = TrainState()
    tokenizer = getattr(data, "tokenizer", None)
    hf_cfg = ckpt_io.hf_config(spec.model, dtype=spec.policy.param_dtype, tokenizer=tokenizer)
    ckpt = ckpt_io.Checkpointer(spec.save, output_dir=spec.output_dir, device=device,
                                app=ckpt_io.AppState(model, optimizer, scheduler, state, data),
                                hf_config=hf_cfg, tokenizer=tokenizer, tracker=tracker)
    resumed_from = ckpt.resume(spec.resume)  # before the loader's first batch
    preemption = PreemptionWatcher().install()
    ctx = LoopContext(device=device, train=spec.train, eval=spec.eval,
                      batches=data.train_batches(),
                      eval_batches=lambda: data.eval_batches(spec.eval.max_batches),
                      tracker=tracker, console=console, flops_per_token=plan.flops_per_token,
                      peak_flops=plan.peak_flops if spec.device == "cuda" else None,
                      on_step_end=_chain(ckpt.on_step_end,
                                         preemption.step_hook(device, ckpt.save_now)),
                      on_eval=lambda step: task_metrics(model, data, spec, device))
    status, export_dir = "FAILED", None
    try:
        last = run_loop(model, optimizer, scheduler, state, ctx)
        ckpt.finish(state)
        if spec.save.export_hf:
            export_dir = ckpt_io.export_hf(model, Path(spec.output_dir) / ckpt_io.EXPORT,
                                           config=hf_cfg, tokenizer=tokenizer)
        status = "FINISHED"
    except (Preempted, SystemExit):
        status = "KILLED"  # preempted: checkpoint saved, job requeued; the next job resumes
        raise
    finally:
        ckpt.close()
        console.close()
        tracker.finish(status)
    return {"rank": env.rank, "steps": state.step, "losses": state.losses, "final": last,
            "tokens_seen": state.tokens_seen, "mlflow_run_id": tracker.run_id,
            "tracking_uri": spec.tracking_uri, "output_dir": spec.output_dir,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "checkpoints": [str(p) for _, p in ckpt_io.list_checkpoints(spec.output_dir)],
            "export_dir": str(export_dir) if export_dir else None}


def task_metrics(model: nn.Module, data: Any, spec: RunSpec, device: torch.device) -> dict:
    """Exact match of greedy answers on held-out prompts (synthetic data); all ranks call it."""
    if not spec.eval.task_prompts:
        return {}
    # Generation grows the sequence one token at a time: run it eagerly, not recompiled per length.
    with torch.compiler.set_stance("force_eager"):
        scores = data.evaluate_task(model, device=device, max_prompts=spec.eval.task_prompts,
                                    max_new_tokens=spec.eval.max_new_tokens)
    return {f"eval_{k}": v for k, v in scores.items()}


def _chain(*hooks: Any) -> Any:
    def hook(state: TrainState) -> None:
        for h in hooks:
            h(state)

    return hook


def run_worker(spec: RunSpec) -> dict[str, Any]:
    """Entry point of one rank; the environment gives RANK, WORLD_SIZE, MASTER_ADDR/PORT."""
    env = DistEnv.from_environ()
    setup_logging(env.rank)
    try:
        device = init_distributed(spec, env)
        try:
            return train_on_rank(spec, env, device)
        finally:
            dist.destroy_process_group()
    except Preempted as e:
        log.warning("%s", e)
        raise SystemExit(0) from None  # not a failure: the requeued job carries on
    except SystemExit:
        raise  # submitit's requeue exit on rank 0
    except BaseException:
        _report_failure(spec, env)
        raise


def _report_failure(spec: RunSpec, env: DistEnv) -> None:
    """Leave the traceback where the launcher looks, so it can stop the other ranks at once."""
    path = Path(spec.output_dir) / ERROR_FILE.format(rank=env.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"rank {env.rank} on {socket.gethostname()}:\n{traceback.format_exc()}")
