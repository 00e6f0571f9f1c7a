"""What every rank runs: process group -> mesh -> sharded model -> data -> loop -> result.

From the command line to one optimizer step, the functions on the way (folder/module):

    python -m llama_fsdp                         __main__.py -> cli/command.py main
      command._hydra_main -> _run_and_report     compose conf/; launchers.launcher_for picks
                                                 the launcher of cluster.kind, then run_one:
        command.plan_run                         run/spec.py build_spec (the validated RunSpec,
                                                 with the launcher's placement), plan/
                                                 make_plan (memory and FLOPs, printed)
        plan.check_fits, Launcher.preflight      refused here if it cannot fit or launch
        Launcher.launch                          launchers/base.py:
          prepare/job.py prepare_job             own the run dir; tracking store, weights,
                                                 data cache (prepare/data.py), MLflow run
          LocalLauncher.start / SlurmLauncher.start
            launchers/rank.py RankEntry          per rank: a supervisor (submitit's task) ...
              launchers/worker_process.py main   ... starts this worker process, which calls
    train/worker.py run_worker(spec)             (here) with RANK / WORLD_SIZE set
      train/distributed.py process_group         process group (gloo, or nccl + gloo); under
                                                 cluster=torchrun TorchrunLauncher.launch
                                                 opened it, did the job's duties, called this
      train_on_rank -> RankRun.build             build_model (model/llama.py build_meta_model,
                                                 [model/lora.py apply_adapters,]
                                                 model/parallelize.py parallelize, init_weights
                                                 or checkpoint.load_hf_weights; adapters: their
                                                 base from checkpoint.load_hf_base or
                                                 lora.init_base), data.build_data,
                                                 objective.build_objective,
                                                 train/optimizer.py build_optimizer,
                                                 checkpoint.Checkpointer (resume),
                                                 tracking.open_tracker
        RankRun.train -> train/loop.py run_loop  the loop; each step is
          train_step                             micro-batches: model_inputs, the objective's
                                                 loss (objective/loss.py loss_sum for SFT),
                                                 backward; clip_grad_norm, optimizer.step

The driver has already prepared everything that needs no process group (tokenized data in the
cache, HF weights and tokenizer on local disk, the MLflow run), so ranks never touch a hub.
"""
from __future__ import annotations

import logging
import traceback
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint as ckpt_io
from ..config import metrics as names
from ..checkpoint.layout import resume_candidates
from ..config.schema import TrainConfig
from ..data import DataModule, build_data
from . import harness_step
from . import resume as resume_config
from .. import harness
from .distributed import DistEnv, process_group
from ..config.hf_dir import hub_name
from ..model import cpu_gemm
from ..model.lora import apply_adapters, init_adapters, init_base, param_counts, unsharded_nf4
from ..objective.loss import install as install_loss_head
from ..model.llama import (
    build_meta_model,
    decoder_layers,
    init_buffers,
    init_weights,
    retie_embeddings,
)
from ..config import recipes
from .divergence import DIVERGED_FILE, Diverged, DivergenceGuard
from .pruning import Pruned, pruning_hook
from .divergence import report as divergence_report
from .optimizer import build_optimizer, compile_cache_dir, use_compile_cache
from ..model.parallelize import build_mesh, local_numel, parallelize, torch_dtype
from ..plan import Plan, make_plan
from ..plan.optimizer import uses_torchao_step
from ..config.status import (
    DIVERGED,
    FAILED,
    FINISHED,
    MLFLOW_RUNNING,
    OWN_WORDS,
    PREEMPTED,
    PRUNED,
    RunResult,
    mlflow_status,
)
from ..config.rundir import RunDir, write_run_status
from ..run.spec import RunSpec
from .stopping import StopSignals, stop_handler
from ..tracking import Console, NullConsole, NullTracker, open_tracker
from ..tracking.view import (DIVERGED_AT_TAG, PRUNED_AT_TAG, STATUS_TAG, model_name,
                             shown_metrics, status_text)
from ..objective import build_objective
from .loop import LoopContext, StopRequested, build_scheduler, run_loop, steady_median
from ..checkpoint.state import TrainState
from .watchdog import HangWatch, set_train_timeout

log = logging.getLogger(__name__)

def build_model(spec: RunSpec, device: torch.device, *, init: bool = True) -> nn.Module:
    """Meta-device model -> [adapters] -> AC/compile/FSDP2 -> materialize this rank's shards ->
    init (``init=False``: the weights come from a checkpoint or HF files, so no full tensors
    are drawn for nothing; buffers only). With adapters (finetune=lora / qlora) the frozen base
    is never in a checkpoint: it always comes from model.path or the seeded init here."""
    cpu_gemm.install(device.type, torch_dtype(spec.policy.compute_dtype))
    model = build_meta_model(spec.model)
    model.to(torch_dtype(spec.policy.param_dtype))
    ft = spec.finetune
    apply_adapters(model, ft, policy=spec.policy)
    if spec.train.loss == TrainConfig.CHUNKED:  # the head computes the loss (loss.py)
        install_loss_head(model, chunk=spec.train.loss_chunk)
    mesh = build_mesh(spec.mesh, device.type)
    parallelize(model, decoder_layers(model), mesh=mesh, mesh_spec=spec.mesh, policy=spec.policy,
                ac=spec.checkpointing, compile=spec.train.compile,
                cpu_offload=spec.sharding.cpu_offload,
                ignored_params=unsharded_nf4(model, spec.mesh.shard),
                preserve_rng_state=ft.adapters and ft.dropout > 0)
    where = torch.device("cpu") if spec.sharding.cpu_offload else device
    model.to_empty(device=where)
    if spec.mesh.ddp:  # DDP gathers its parameters at the first forward: after this
        retie_embeddings(model)
    if ft.adapters:
        if spec.model.path:
            ckpt_io.load_hf_base(model, spec.model.path, ft, device=where)
        else:
            init_base(model, ft, std=spec.model.init_std, seed=spec.train.seed, device=where)
        init_adapters(model, seed=spec.train.seed)
    elif init:
        init_weights(model, std=spec.model.init_std, seed=spec.train.seed)
    else:
        init_buffers(model)
    return model


def compile_cache(spec: RunSpec, model: nn.Module, rank: int) -> Optional[Path]:
    """A compiled optimizer step (torchao's) gets an inductor cache of its own per optimizer,
    block size and shard layout, under cache_dir, so that the ranks of a node compile it once
    and a later run's first step loads it instead of compiling again (llama_fsdp/train/optimizer.py).
    AdamW, or an eager step, compiles nothing: None."""
    if spec.optim.eager or not uses_torchao_step(spec.optim, spec.policy.param_dtype):
        return None
    path = compile_cache_dir(spec.cache_dir, spec.optim, model)
    use_compile_cache(path)
    if rank == 0:
        log.info("optim=%s: its step is compiled at the first step (cached in %s)",
                 spec.optim.name, path.parent)
    return path


def load_callbacks(spec: RunSpec, rank: int) -> list[Any]:
    """train.callbacks: "module:attr" factories, each called once -> a step-end hook."""
    from ..run.callbacks import resolve

    return [resolve(path)(rank=rank, world_size=spec.world_size, output_dir=spec.output_dir)
            for path in spec.train.callbacks]


@dataclass
class RankRun:
    """One rank's run, built: the pieces the loop needs, and what it reports."""

    spec: RunSpec
    env: DistEnv
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: DataModule
    plan: Plan
    tracker: Any
    console: Any
    checkpointer: Any
    state: TrainState
    resumed_from: Optional[Path] = None
    counts: dict[str, int] = field(default_factory=dict)  # trainable, base, total parameters
    guard: Any = None  # stops a run whose loss runs away (train/divergence.py)
    objective: Any = None  # what it trains for: its loss, batches and evaluation (objective/)

    @classmethod
    def build(cls, spec: RunSpec, env: DistEnv, device: torch.device) -> "RankRun":
        torch.manual_seed(spec.train.seed)
        resume = resume_candidates(spec.resume, spec.output_dir)
        # A checkpoint to resume from holds the weights: no HF read, no random init.
        model = build_model(spec, device, init=not resume and not spec.model.path)
        if not resume and spec.model.path and not spec.finetune.adapters:
            ckpt_io.load_hf_weights(model, spec.model.path)  # each rank reads only its shards
        # the driver announced the data's notes already
        data = build_data(spec.data, **spec.data_kwargs(dp_rank=env.rank, announce=False))
        # (DPO's reference: from the weights not yet trained)
        objective = build_objective(spec, model, data, device, rank=env.rank,
                                    world=env.world_size, resuming=bool(resume))
        optimizer = build_optimizer(model, spec.train, spec.optim,
                                    compile_dir=compile_cache(spec, model, env.rank))
        scheduler = build_scheduler(optimizer, spec.train)
        tracker = open_tracker(spec) if env.rank == 0 else NullTracker()
        console = Console(total=spec.train.max_steps) if env.rank == 0 else NullConsole()
        state = TrainState()
        tokenizer = data.tokenizer
        hf_cfg = ckpt_io.hf_config(spec.model, dtype=spec.policy.param_dtype, tokenizer=tokenizer)
        guard = DivergenceGuard(spec.train.divergence)
        app = ckpt_io.AppState(model, optimizer, scheduler, state, data, guard=guard,
                               hparams=resume_config.record(spec.train))
        checkpointer = ckpt_io.Checkpointer(
            spec.save, output_dir=spec.output_dir, device=device, app=app, hf_config=hf_cfg,
            tokenizer=tokenizer, tracker=tracker, optim=spec.optim,
            finetune=spec.finetune)
        run = cls(spec, env, device, model, optimizer, scheduler, data, make_plan(spec), tracker,
                  console, checkpointer, state, objective=objective, guard=guard)
        run.resumed_from = checkpointer.resume(resume)
        if run.resumed_from is not None:  # the config's lr, schedule, guard: not the checkpoint's
            resume_config.take_config(app, spec.train, rank=env.rank)
        run.console.set_initial(state.step)
        run.record_start()
        return run

    def record_start(self) -> None:
        """Placement, derived values, data statistics, parameter counts and the plan; a run
        that continues its MLflow run (a restart, a requeue, a resume) records only what
        changed, and its steps from the checkpoint on (``Tracker.continue_from``)."""
        hosts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        spec = self.spec
        # The run's config is its params; what follows from it is in tags (strings) and step-0
        # metrics (numbers), so that the params that differ between runs are what was chosen.
        trainable, total = param_counts(self.model)
        self.counts = {names.TRAINABLE_PARAMS: trainable, names.TOTAL_PARAMS: total,
                       # the base is frozen whole under adapters: all the rest is the base
                       names.BASE_PARAMS: total - trainable if spec.finetune.adapters else total}
        history = self.tracker.history()
        if spec.restart:  # its job requeued (SCHEDULED meanwhile), or its ranks restarted
            self.tracker.running()
        self.tracker.set_tags({"rank_hosts": ",".join(hosts),  # which node each rank ran on
                               **({"restarts": str(spec.restart)} if spec.restart else {}),
                               STATUS_TAG: status_text(MLFLOW_RUNNING)})
        if not history.started:  # once per MLflow run: the same facts again are no news
            self.tracker.set_tags({"derived.world_size": str(spec.world_size),
                                   "derived.mesh": "x".join(map(str, spec.mesh.shape)),
                                   "derived.precision": spec.precision.name,
                                   **self.data.info.params()})
            self.tracker.log_text(self.plan.table(), "plan.txt")
            self.tracker.log_start_metrics({
                names.SUMMARY_PREDICTED_PEAK_MEMORY: self.plan.predicted_peak_gb,
                names.GLOBAL_BATCH: spec.global_batch,
                names.TOKENS_PER_STEP: spec.tokens_per_step,
                names.LOCAL_PARAMS_RANK0: local_numel(self.model), **self.counts,
                **self.data.stats, **self.plan.metrics()})
        self.tracker.continue_from(self.state.step, history)
        if spec.restart:
            self.tracker.log_metrics({names.RESTART: float(spec.restart)}, step=self.state.step)

    def loop_context(self, stops: StopSignals, hang: HangWatch) -> LoopContext:
        spec, objective, guard = self.spec, self.objective, self.guard

        def save(state: TrainState) -> None:  # a step whose loss the guard suspects is not saved
            if not guard.suspect:
                self.checkpointer.on_step_end(state)

        return LoopContext(
            device=self.device, train=spec.train, eval=spec.eval,
            batches=objective.batches(self.data.train_batches()), loss_fn=objective.loss,
            tracker=self.tracker, console=self.console,
            flops_per_token=self.plan.flops_per_token, peak_flops=self.plan.peak_flops,
            guard=guard,
            on_step_end=[save, *load_callbacks(spec, self.env.rank),
                         harness_step.periodic(spec, rank=self.env.rank, device=self.device,
                                               tracker=self.tracker, export=self.export_at),
                         hang.arm],
            saves_at=self.checkpointer.saves_at,
            evaluate=lambda step: objective.evaluate(self.model, self.data, spec.eval),
            on_eval=pruning_hook(spec.trial, rank=self.env.rank, device=self.device,
                                 last_step=min(spec.train.max_steps,
                                               spec.train.stop_after or spec.train.max_steps)),
            stop_request=stops.request,
            on_stop=stop_handler(lambda state: self.unless_suspect(self.checkpointer.save_now,
                                                                   state),
                                 save_on_user_stop=spec.save.every_steps > 0,
                                 why=lambda: stops.why),
            after_first_step=lambda: set_train_timeout(spec))

    def train(self) -> RunResult:
        place = self.spec.placement
        stops = StopSignals(warning_s=place.stop_warning_s if place else None,
                            save_s=lambda: self.checkpointer.expected_save_s).install()
        hang = HangWatch(self.spec, self.env.rank)
        status, export_dir, final, summary, report = FAILED, None, {}, {}, None
        linked = False  # the final metrics went with the logged model
        t = self.spec.train
        done_before = self.state.step >= (t.stop_after or t.max_steps)  # resumed a finished run
        try:
            hang.arm()
            result = run_loop(self.model, self.optimizer, self.scheduler, self.state,
                              self.loop_context(stops, hang))
            final = result.last
            summary = self.summary(result.logged, final)
            self.unless_suspect(self.checkpointer.finish, self.state)
            if done_before:
                log.info("this run had already finished at step %d: nothing to train",
                         self.state.step)
            else:
                export_dir, linked = self.export(self.final_metrics(summary))
                summary.update(self.harness_at_end())
            status = FINISHED
        except StopRequested as e:
            status = e.reason
        except Pruned as e:  # a search's trial behind the others: it ends here, not failed
            self.checkpointer.publish_pending()
            status = PRUNED
            if self.env.rank == 0:
                log.info("this trial stops: %s", e)
            self.tracker.set_tags({PRUNED_AT_TAG: str(e.step)})
        except Diverged as e:
            # every rank stops at this step: a save in flight (async) is published first, and
            # the report names it
            self.checkpointer.publish_pending()
            status, report = DIVERGED, self.divergence_report(e)
            if self.env.rank == 0:  # the report and the traceback in the run directory; the
                # command prints the report when the run ends
                where = Path(self.spec.output_dir) / DIVERGED_FILE
                where.write_text(f"{report}\n\n{traceback.format_exc()}")
                log.error("%s: every rank stops (the report and the traceback: %s)",
                          str(e), where)
            self.tracker.set_tags({DIVERGED_AT_TAG: str(e.step)})
        finally:
            hang.close()
            self.checkpointer.close()
            self.console.close()
            if not linked and status != PREEMPTED:  # a preempted run goes on in its requeue
                self.tracker.log_metrics(self.final_metrics(summary), step=0)
            self.tracker.finish(mlflow_status(status), word=OWN_WORDS.get(status))
            if self.env.rank == 0:
                write_run_status(self.spec.output_dir, status=status, step=self.state.step,
                                 config_yaml=self.spec.config_yaml)
        return RunResult(
            rank=self.env.rank, status=status, steps=self.state.step, losses=self.state.losses,
            final=final, summary=summary, tokens_seen=self.state.tokens_seen,
            mlflow_run_id=self.tracker.run_id,
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            checkpoints=[str(p) for _, p in ckpt_io.list_checkpoints(self.spec.output_dir)],
            export_dir=str(export_dir) if export_dir else None, report=report)

    def unless_suspect(self, save: Any, state: TrainState) -> None:
        """``save`` (the final or a stop's checkpoint) unless the guard suspects this step's
        loss: never saved, so the newest checkpoint stays one the guard passed."""
        if not self.guard.suspect:
            save(state)
            return
        self.checkpointer.publish_pending()
        if self.env.rank == 0:
            last = ckpt_io.latest_checkpoint(self.spec.output_dir)
            log.warning("step %d is not saved: its loss %.4g is above the divergence guard's "
                        "line (train.divergence); the newest checkpoint is %s", state.step,
                        self.guard.recent[-1][1], last.name if last else "none")

    def divergence_report(self, err: Diverged) -> str:
        """The learning rate in use against the recipe's, and the last good checkpoint."""
        recipe = self.spec.recipe
        last = ckpt_io.latest_checkpoint(self.spec.output_dir)
        return divergence_report(
            err, peak_lr=self.spec.train.lr,
            source=recipe.sources[recipes.LR] if recipe else recipes.LR,
            recipe_lr=recipe.recipe[recipes.LR] if recipe else None,
            last_good=f"{last.name} (resume=auto continues from it)" if last else None)

    def export(self, metrics: dict[str, float]) -> tuple[Optional[Path], bool]:
        """The run's model at the end, logged to MLflow with the run's final ``metrics``: the
        whole model as an HF directory (save.export_hf), or for adapters always the PEFT
        adapter (and, with finetune.export_merged, the merged model beside it). Collective.
        Returns the export and whether the metrics were logged with it."""
        spec, run_dir, ft = self.spec, RunDir(self.spec.output_dir), self.spec.finetune
        base = hub_name(spec.model.path) if spec.model.path else None  # loads elsewhere too
        params = {"base": base or "random init", "model": spec.model.name,
                  "finetune": ft.method}
        logged = {"name": model_name(spec.run_name, spec.sweep_id), "step": self.state.step,
                  "params": params, "metrics": metrics}
        if ft.adapters:
            path = ckpt_io.export_adapter(self.model, run_dir.export, ft=ft, base_model=base,
                                          tokenizer=self.data.tokenizer)
            if ft.export_merged:
                ckpt_io.export_merged(self.model, run_dir.export_merged,
                                      config=self.checkpointer.hf_config,
                                      # the config's dtype, which keeps an fp32 delta
                                      dtype=torch_dtype(spec.policy.param_dtype),
                                      tokenizer=self.data.tokenizer)
            return path, self.tracker.log_model_dir(path, model_type="peft-lora", **logged)
        if not spec.save.export_hf:
            return None, False
        path = ckpt_io.export_hf(self.model, run_dir.export, config=self.checkpointer.hf_config,
                                 tokenizer=self.data.tokenizer)
        return path, self.tracker.log_model_dir(path, **logged)

    def export_at(self, where: Path) -> None:
        """The model as it is now, as an HF directory (merged under adapters). Collective."""
        spec = self.spec
        if spec.finetune.adapters:
            ckpt_io.export_merged(self.model, where, config=self.checkpointer.hf_config,
                                  dtype=torch_dtype(spec.policy.param_dtype),
                                  tokenizer=self.data.tokenizer)
        else:
            ckpt_io.export_hf(self.model, where, config=self.checkpointer.hf_config,
                              tokenizer=self.data.tokenizer)

    def harness_at_end(self) -> dict[str, float]:
        """eval.harness on the export just written: rank 0 frees the training state and scores
        it; the others are done. The summary's scores (rank 0)."""
        if not self.spec.eval.harness.tasks or self.env.rank != 0:
            return {}
        self.model = self.optimizer = self.scheduler = None  # (the export holds the weights)
        self.checkpointer.app = None
        harness_step.free()
        found = harness_step.score(self.spec, harness_step.model_dir_of(self.spec),
                                   step=self.state.step, device=self.device,
                                   tracker=self.tracker)
        headline = harness.headline_of(found)
        self.tracker.log_metrics(shown_metrics(headline), step=0)  # the table's column
        return headline

    def summary(self, logged: list[dict[str, float]], final: dict[str, float]) -> dict[str, float]:
        """End-of-run numbers the MLflow table sorts on (summary/*)."""
        med = lambda key: steady_median(logged, key)  # noqa: E731
        out = {names.SUMMARY_TOKENS_PER_SEC: med(names.TOKENS_PER_SEC),
               names.SUMMARY_TOKENS_PER_SEC_PER_DEVICE: med(names.TOKENS_PER_SEC_PER_DEVICE),
               names.SUMMARY_STEP_TIME: med(names.STEP_TIME),
               names.SUMMARY_MFU: med(names.MFU),
               names.SUMMARY_PEAK_MEMORY: max((m[names.PEAK_MEMORY] for m in logged),
                                              default=None),
               names.SUMMARY_PREDICTED_PEAK_MEMORY: self.plan.predicted_peak_gb,
               names.SUMMARY_FINAL_LOSS: final.get(names.LOSS),
               names.SUMMARY_EVAL_LOSS: final.get(names.EVAL_LOSS),
               names.SUMMARY_EVAL_EXACT_MATCH: final.get(names.EVAL_EXACT_MATCH)}
        out.update(self.objective.summary(logged, final))
        return {k: float(v) for k, v in out.items() if v is not None}

    def final_metrics(self, summary: dict[str, float]) -> dict[str, float]:
        """What the run logs when it ends, at step 0 (MLflow charts a metric whose latest
        step is 0 as one bar per run): the summary, and the runs table's rounded columns."""
        known = {**self.counts, names.SUMMARY_PREDICTED_PEAK_MEMORY: self.plan.predicted_peak_gb}
        return {**summary, **shown_metrics({**known, **summary})}


def train_on_rank(spec: RunSpec, env: DistEnv, device: torch.device) -> RunResult:
    """Build and train one rank's run in this process, its process group already up: what
    ``run_worker`` does after ``init_distributed``, and what the multi-rank tests run in the
    processes they start (tests/distributed.py)."""
    return RankRun.build(spec, env, device).train()


def run_worker(spec: RunSpec) -> RunResult:
    """Entry point of one rank; the environment gives RANK, WORLD_SIZE, MASTER_ADDR/PORT. The
    process group is this call's, or the launcher's when it opened one (cluster=torchrun)."""
    with process_group(spec) as (env, device):
        return train_on_rank(spec, env, device)
