"""Every check of a run before anything runs, each problem with its fix, in one place.

``spec.build_spec`` calls ``config_problems`` (what the composed config says), then the checks
of what it derives with the launcher's answers (devices, mesh, adapters, attention, the
optimizer: ``derived_problems``), and reports them all at once (ConfigError); the planner asks
``variant_problems`` of every spec it varies. What the launchers themselves cannot do with a
config (a SLURM job without a time limit, a torchrun environment that disagrees) is theirs to
say, in ``Placement.problems``. Checks that need the data or a server run where those are at
hand (prepare/: the data's records, the tracking store), and the plan's verdict (does it fit)
is the planner's. ``unknown_keys`` and ``not_a_key`` also serve the command line's override
check. No torch here: the command line checks a run in well under a second.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import typing
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from ..checkpoint.layout import METADATA, export_problem, resolve_resume, resume_candidates, verify
from ..checkpoint.layout import others as checkpoint_others
from ..checkpoint.optim_meta import optim_mismatch
from ..checkpoint.pickles import check_file
from ..config import devices, strategies
from ..config.hf_dir import (
    SHAPE_BOUNDS,
    hf_config_problems,
    hf_shape,
    model_file_problems,
    read_config_json,
    remote_code_problem,
    shape_diff,
)
from ..config.kernels import KERNELS, SIXTEEN_BIT, VARLEN
from ..config.model_folder import architecture_problems
from ..config.nf4 import shard_problems
from ..config.objectives import DPO, OBJECTIVES
from ..config.optimizers import OPTIMIZERS
from ..config.placement import Placement
from ..config.precision import resolve_precision
from ..config.rundir import HF_META, OPTIM_META, RunDir, claim_problem
from ..config.schema import (
    AC_MODES,
    DEVICES,
    PRECISIONS,
    ClusterConfig,
    Config,
    DataConfig,
    DivergenceConfig,
    EvalConfig,
    FinetuneConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    RopeScalingConfig,
    TrackingConfig,
    TrainConfig,
    model_presets,
    projection_shapes,
)
from ..config.strategies import AUTO, MeshSpec
from ..tracking.store import sqlite_store_problem
from .callbacks import resolve

log = logging.getLogger(__name__)


# --- numbers and lines ------------------------------------------------------------------------


def out_of_range(key: str, value: Any, *, low: Optional[float] = None,
                 high: Optional[float] = None, low_open: bool = False,
                 high_open: bool = False) -> Optional[str]:
    """Why a number (None: not set, nothing to say) is not a finite value in its range, for a
    problems() list: NaN and infinity pass every ``<`` test and would train (or plan) silently."""
    if value is None:
        return None
    lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
    hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
    wanted = (f"in {lo}, {hi}" if lo and hi else f"{'>' if low_open else '>='} {low:g}" if lo
              else f"{'<' if high_open else '<='} {high:g}")
    if not math.isfinite(value):
        return f"{key}={value} must be a finite number {wanted}"
    if (low is not None and (value <= low if low_open else value < low)) or \
            (high is not None and (value >= high if high_open else value > high)):
        return f"{key}={value} must be {wanted}"
    return None


def has_line_break(value: Any) -> bool:
    """A value that would start a new line in a shell script or a #SBATCH line."""
    return isinstance(value, str) and any(c in value for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def line_break(key: str, value: Any) -> str:
    return (f"{key}={value!r} holds a line break, which would start a new line in the job "
            "script (a command that runs, and every #SBATCH line after it ignored): give it on "
            "one line")


# --- each node's options ----------------------------------------------------------------------


def rope_scaling_problems(rs: RopeScalingConfig, key: str = "model.rope_scaling") -> list[str]:
    checks = [out_of_range(f"{key}.{f}", getattr(rs, f), low=0, low_open=True)
              for f in ("factor", "low_freq_factor", "high_freq_factor")]
    checks.append(out_of_range(f"{key}.original_max_position_embeddings",
                               rs.original_max_position_embeddings, low=1))
    return [c for c in checks if c]


def model_number_problems(m: ModelConfig) -> list[str]:
    """The numbers that are not shapes (those: ``check_model``)."""
    checks = [out_of_range("model.rope_theta", m.rope_theta, low=0, low_open=True),
              out_of_range("model.rms_norm_eps", m.rms_norm_eps, low=0, low_open=True),
              out_of_range("model.init_std", m.init_std, low=0, low_open=True),
              out_of_range("model.max_position_embeddings", m.max_position_embeddings,
                           low=1)]
    out = [c for c in checks if c]
    return out + (rope_scaling_problems(m.rope_scaling) if m.rope_scaling is not None else [])


def cluster_option_problems(c: ClusterConfig) -> list[str]:
    """What is wrong with the options themselves, for RunSpec's all-at-once report."""
    out = []
    # every string that reaches the sbatch script: a line break there starts a new shell
    # line (which runs), and every #SBATCH line after it is silently ignored
    texts = [("cluster.partition", c.partition), ("cluster.account", c.account),
             ("cluster.qos", c.qos), ("cluster.constraint", c.constraint),
             *((f"cluster.setup[{i}]", v) for i, v in enumerate(c.setup)),
             *((f"cluster.srun_args[{i}]", v) for i, v in enumerate(c.srun_args)),
             *((f"cluster.sbatch_extra.{k}", f"{k}{v}") for k, v in c.sbatch_extra.items())]
    out += [line_break(key, value) for key, value in texts if has_line_break(value)]
    checks = [out_of_range("cluster.timeout_min", c.timeout_min, low=1),
              out_of_range("cluster.time_min", c.time_min, low=1),
              out_of_range("cluster.mem_gb", c.mem_gb, low=1),
              out_of_range("cluster.cpus_per_task", c.cpus_per_task, low=1),
              out_of_range("cluster.gpus_per_node", c.gpus_per_node, low=0),
              out_of_range("cluster.threads_per_rank", c.threads_per_rank, low=1),
              out_of_range("cluster.device_memory_gb", c.device_memory_gb, low=0,
                           low_open=True),
              out_of_range("cluster.peak_tflops", c.peak_tflops, low=0, low_open=True)]
    return out + [c for c in checks if c]


def data_option_problems(d: DataConfig) -> list[str]:
    """Everything wrong with this node, for RunSpec's all-at-once report."""
    out = []
    if d.name not in DataConfig.SOURCES:
        out.append(f"data.name={d.name!r}: valid: {', '.join(DataConfig.SOURCES)}")
    if d.format not in DataConfig.FORMATS:
        out.append(f"data.format={d.format!r}: valid: {', '.join(DataConfig.FORMATS)}")
    if d.overlong not in DataConfig.OVERLONG:
        out.append(f"data.overlong={d.overlong!r}: valid: {', '.join(DataConfig.OVERLONG)}")
    if d.name in ("jsonl", "hf") and not d.path:
        out.append(f"data.name={d.name} needs data.path (a file/glob/directory or hub name)")
    if d.name == "synthetic" and d.num_records < 1:
        out.append("data.num_records must be >= 1")
    if not 0 <= d.eval_fraction < 1:
        out.append(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
    if d.eval_min_records < 0 or d.eval_max_records < 0:
        out.append("data.eval_min_records and data.eval_max_records must be >= 0")
    elif d.eval_min_records > d.eval_max_records:
        out.append(f"data.eval_min_records={d.eval_min_records} exceeds "
                   f"data.eval_max_records={d.eval_max_records}")
    if d.eval_records is not None and d.eval_records < 0:
        out.append("data.eval_records must be >= 0 (or null: the eval_fraction rule)")
    if d.num_proc < 1:
        out.append("data.num_proc must be >= 1")
    if d.preprocess is not None:
        if d.name == "synthetic":
            out.append("data.preprocess applies to data=jsonl and data=hf records, not to the "
                       "synthetic task")
        mod, _, fn = d.preprocess.rpartition(":")
        if not mod or not fn.isidentifier():
            out.append(f"data.preprocess={d.preprocess!r}: expected 'module:function' or "
                       "'path/to/file.py:function'")
    if "{instruction}" not in d.prompt_template or "{input}" not in d.prompt_template:
        out.append("data.prompt_template must contain {instruction} and {input}")
    if "{instruction}" not in d.prompt_template_no_input:
        out.append("data.prompt_template_no_input must contain {instruction}")
    return out


MIN_LR = 1e-12  # below it no step moves an fp32 weight: refused
HIGH_LR = 10.0  # above it a run diverges within steps: said (the guard's tests use such rates)


def train_option_problems(t: TrainConfig) -> list[str]:
    """Its numbers as finite values in their ranges, and the callbacks' form (the integer
    counts and the warmup: ``check_positive``; importing the callbacks: ``callback_problems``)."""
    checks = [out_of_range("train.lr", t.lr, low=0, low_open=True),
              out_of_range("train.min_lr_ratio", t.min_lr_ratio, low=0, high=1),
              out_of_range("train.weight_decay", t.weight_decay, low=0),
              out_of_range("train.beta1", t.beta1, low=0, high=1, high_open=True),
              out_of_range("train.beta2", t.beta2, low=0, high=1, high_open=True),
              out_of_range("train.eps", t.eps, low=0, low_open=True),
              out_of_range("train.max_grad_norm", t.max_grad_norm, low=0),
              out_of_range("train.divergence.ratio", t.divergence.ratio, low=1, low_open=True),
              out_of_range("train.divergence.min_rise", t.divergence.min_rise, low=0),
              out_of_range("train.divergence.window", t.divergence.window, low=1, high=1000)]
    out = [c for c in checks if c]
    if t.lr is not None and 0 < t.lr < MIN_LR:
        out.append(f"train.lr={t.lr:g} is below {MIN_LR:g}: steps that small are rounded away "
                   "in every weight (fp32 keeps 7 significant digits), so nothing would train; "
                   "leave train.lr out for the recipe's (docs/recipes.md)")
    elif t.lr is not None and math.isfinite(t.lr) and t.lr > HIGH_LR:
        log.warning("train.lr=%g is above %g, far above any recipe's (1e-5 to 3e-3, "
                    "docs/recipes.md): the loss will likely run away and the divergence guard "
                    "stop the run", t.lr, HIGH_LR)
    if t.divergence.action not in DivergenceConfig.ACTIONS:
        out.append(f"train.divergence.action={t.divergence.action!r} is not one of "
                   f"{', '.join(DivergenceConfig.ACTIONS)}")
    for path in t.callbacks:
        module, _, attr = path.partition(":")
        if not module or not attr.isidentifier():
            out.append(f"train.callbacks: {path!r} is not 'module:attr' (a factory "
                       "importable on every rank)")
    return out


def eval_option_problems(e: EvalConfig, *, seq_len: int) -> list[str]:
    """The in-run eval's options; an answer longer than a training row is never decoded (the
    model never learned to end one)."""
    checks = [out_of_range("eval.max_batches", e.max_batches, low=1),
              out_of_range("eval.task_prompts", e.task_prompts, low=0),
              out_of_range("eval.max_new_tokens", e.max_new_tokens, low=1,
                           high=max(seq_len, 1))]
    return [c for c in checks if c]


def finetune_option_problems(ft: FinetuneConfig) -> list[str]:
    """What is wrong with the options themselves (shapes against the shard group:
    ``target_problems``)."""
    if not ft.adapters:
        return (["finetune.export_merged applies to lora and qlora (full fine-tuning "
                 "exports the whole model with save.export_hf=true)"]
                if ft.export_merged else [])
    out = []
    if ft.rank is not None and ft.rank < 1:  # (None: the recipe's, set by build_spec)
        out.append(f"finetune.rank={ft.rank} must be >= 1")
    if (alpha := out_of_range("finetune.alpha", ft.alpha, low=0, low_open=True)):
        out.append(alpha)
    if not 0 <= ft.dropout < 1:
        out.append(f"finetune.dropout={ft.dropout} must be in [0, 1)")
    unknown = [t for t in ft.target_modules if t not in FinetuneConfig.TARGETS]
    if unknown or not ft.target_modules or len(set(ft.target_modules)) != len(
            ft.target_modules):
        out.append(f"finetune.target_modules={list(ft.target_modules)}: a non-empty list "
                   f"without repeats of {', '.join(FinetuneConfig.TARGETS)}")
    if min(ft.nf4_block_size, ft.nf4_scaler_block_size) < 2:
        out.append("finetune.nf4_block_size and finetune.nf4_scaler_block_size must be >= 2")
    return out


def objective_option_problems(o: ObjectiveConfig) -> list[str]:
    """What is wrong with the options themselves, for RunSpec's all-at-once report."""
    out = []
    for key, value, valid in (("objective.name", o.name, tuple(OBJECTIVES)),
                              ("objective.loss", o.loss, ObjectiveConfig.LOSSES),
                              ("objective.reference", o.reference, ObjectiveConfig.REFERENCES)):
        if value not in valid:
            out.append(f"{key}={value!r} is not one of {', '.join(valid)}")
    if o.name != DPO:
        changed = [f"objective.{k}" for k, v in vars(o).items()
                   if k != "name" and v != getattr(ObjectiveConfig, k)]
        if changed:
            out.append(f"{', '.join(changed)} set with objective={o.name}: "
                       f"{'they apply' if len(changed) > 1 else 'it applies'} to "
                       f"objective={DPO} (add objective={DPO}, or drop them)")
        return out
    if (beta := out_of_range("objective.beta", o.beta, low=0, low_open=True)):
        out.append(beta)
    if not 0 <= o.label_smoothing < 0.5:
        out.append(f"objective.label_smoothing={o.label_smoothing} must be in [0, 0.5)")
    if o.label_smoothing and o.loss != ObjectiveConfig.SIGMOID:
        out.append(f"objective.label_smoothing applies to objective.loss=sigmoid, not "
                   f"{o.loss}: drop it")
    return out


def optim_option_problems(o: OptimConfig, *, param_dtype: str, cpu_offload: bool,
                          full_state_dict: bool) -> list[str]:
    """What torchao's optimizers (or this project's use of them) cannot do with this run,
    each with its fix, for RunSpec's all-at-once report."""
    out = []
    if o.block_size is not None and not o.lowbit:
        out.append(f"optim.block_size={o.block_size} sets the blocks of low-bit moments: "
                   "drop it, or pick optim=adamw8bit / optim=adamw4bit")
    elif o.block_size is not None and (o.block_size < 2
                                          or o.block_size & (o.block_size - 1)):
        out.append(f"optim.block_size={o.block_size} must be a power of two (so every "
                   "row of a Llama weight splits in whole blocks), e.g. the default "
                   f"{OPTIMIZERS[o.name].default_block}")
    if o.fused is True and (o.lowbit or o.bf16_stochastic_round):
        what = f"optim={o.name}" if o.lowbit else "optim.bf16_stochastic_round=true"
        out.append(f"optim.fused=true is torch's fused AdamW, but {what} steps with "
                   "torchao's AdamW: drop optim.fused, or use optim=adamw without "
                   "bf16_stochastic_round")
    if o.bf16_stochastic_round and param_dtype != "bfloat16":
        out.append(f"optim.bf16_stochastic_round=true rounds bf16 parameters, but they are "
                   f"{param_dtype} here: use precision=bf16, or drop it")
    if o.lowbit and cpu_offload:
        out.append(f"optim={o.name} with sharding.cpu_offload=true: torchao would step "
                   "every parameter on the host CPU, one at a time (on CPU 14-27x slower than "
                   "AdamW's step), and low-bit moments already save most of the state "
                   "offload would move: drop sharding.cpu_offload, or use optim=adamw")
    if o.lowbit and full_state_dict:
        out.append(f"optim={o.name} with save.full_state_dict=true: torchao's low-bit "
                   "moments cannot be gathered into one file: drop save.full_state_dict "
                   "(sharded checkpoints reshard on load; `python -m llama_fsdp.convert` "
                   "makes the consolidated model)")
    return out


# The longest names MLflow takes (mlflow.utils.validation: MAX_EXPERIMENT_NAME_LENGTH; a run's
# name is a column of 250 characters)
MAX_EXPERIMENT_NAME = 500
MAX_RUN_NAME = 250


def name_problem(key: str, name: Optional[str], longest: int) -> Optional[str]:
    """Why a name MLflow shows cannot be one: empty, a control character (a line break, a tab,
    a NUL), or longer than MLflow takes."""
    import unicodedata

    if name is None:
        return None
    if not name.strip():
        return f"{key}={name!r} is empty: give it a name (MLflow shows runs by it)"
    if has_line_break(name):
        return line_break(key, name)
    if bad := [c for c in name if unicodedata.category(c).startswith("C")]:
        return (f"{key}={name!r} holds a control character ({bad[0]!r}): MLflow shows it in one "
                "line; give a plain name")
    if len(name) > longest:
        return f"{key} is {len(name)} characters long; MLflow takes at most {longest}"
    return None


def tracking_option_problems(t: TrackingConfig) -> list[str]:
    # (final_delivery_s: seconds; 0 leaves undelivered events on disk at once)
    checks = [out_of_range("tracking.final_delivery_s", t.final_delivery_s, low=0),
              out_of_range("tracking.system_metrics_interval_s",
                           t.system_metrics_interval_s, low=0, low_open=True),
              name_problem("tracking.experiment", t.experiment, MAX_EXPERIMENT_NAME),
              name_problem("tracking.run_name", t.run_name, MAX_RUN_NAME)]
    out = [c for c in checks if c]
    if t.best_mode not in TrackingConfig.BEST_MODES:
        out.append(f"tracking.best_mode={t.best_mode!r}: valid: "
                   f"{', '.join(TrackingConfig.BEST_MODES)} (the lowest or the highest "
                   f"tracking.best_metric is a sweep's best point)")
    if not t.best_metric.strip():
        out.append("tracking.best_metric is empty: name the end-of-run metric that picks a "
                   "sweep's best point (e.g. summary/eval_loss, summary/tokens_per_sec)")
    elif problem := best_metric_problem(t.best_metric):
        out.append(problem)
    return out


def best_metric_problem(name: str) -> Optional[str]:
    """A best metric no run logs would leave every sweep's best point "none yet"."""
    from ..config import metrics
    from ..tracking.view import SHOWN

    known = metrics.KNOWN | {s.name for s in SHOWN}
    if name in known or name.startswith(metrics.OPEN_PREFIXES):
        return None
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return (f"tracking.best_metric={name!r} is no metric a run logs, so no sweep point would "
            "have it" + (f"; the closest: {', '.join(close)}" if close else "")
            + " (e.g. summary/eval_loss, summary/final_loss, summary/tokens_per_sec, "
            "harness/<task>/<metric>)")


def tracking_store_problems(uri: str, enabled: bool) -> list[str]:
    """A SQLite file of the user's that is not an MLflow store is never opened as one (it is
    left as it is, byte for byte)."""
    if not enabled or not uri.startswith("sqlite:///"):
        return []
    problem = sqlite_store_problem(Path(uri[len("sqlite:///"):]))
    return [problem] if problem else []


# --- choices, counts and shapes ---------------------------------------------------------------


def check_choices(cfg: Config, problems: list[str]) -> None:
    for key, value, choices in (
        ("sharding.strategy", cfg.sharding.strategy, strategies.CHOICES),
        ("precision.name", cfg.precision.name, PRECISIONS),
        ("checkpointing.mode", cfg.checkpointing.mode, AC_MODES),
        ("cluster.device", cfg.cluster.device, DEVICES),
        ("finetune.method", cfg.finetune.method, FinetuneConfig.METHODS),
        ("optim.name", cfg.optim.name, tuple(OPTIMIZERS)),
        ("train.loss", cfg.train.loss, TrainConfig.LOSSES),
    ):
        if value not in choices:
            problems.append(f"{key}={value!r} is not one of {', '.join(choices)}")


# Upper bounds of the counts that reach an allocation, a loop, a sleep or a system call: far
# above any real run, far below what would exhaust memory or overflow a timer first.
SEED_MAX = 2**32 - 1  # numpy's and every data loader's seed range
TIMEOUT_MAX_S = 7 * 24 * 3600  # a collective's timeout (a timedelta in C++ beyond it overflows)
COUNT_MAX = {"train.batch_size": 1 << 16, "train.grad_accum": 1 << 16,
             "train.seq_len": 1 << 24, "train.max_steps": 10**9, "train.log_every": 10**9,
             "train.loss_chunk": 1 << 24, "cluster.nodes": 1 << 16,
             "cluster.nproc_per_node": 1 << 10, "cluster.threads_per_rank": 1 << 10,
             "cluster.max_restarts": 1000, "cluster.max_requeues": 1000,
             "data.num_proc": 1 << 9, "data.num_records": 10**9,
             "checkpointing.every_k": 1 << 12, "save.keep_last": 10**6,
             "eval.max_batches": 10**6, "eval.task_prompts": 10**6}


def check_positive(cfg: Config, problems: list[str]) -> None:
    t = cfg.train
    for key, value, low in (
        ("train.batch_size", t.batch_size, 1),
        ("train.grad_accum", t.grad_accum, 1),
        ("train.seq_len", t.seq_len, 2),
        ("train.max_steps", t.max_steps, 1),
        ("train.log_every", t.log_every, 1),
        ("train.loss_chunk", t.loss_chunk, 1),
        ("cluster.nodes", 1 if cfg.cluster.nodes is None else cfg.cluster.nodes, 1),
        ("checkpointing.every_k", cfg.checkpointing.every_k, 1),
        ("save.keep_last", cfg.save.keep_last, 1),
    ):
        if value < low:
            problems.append(f"{key}={value} must be >= {low}")
    check_bounds(cfg, problems)
    # (train.lr, min_lr_ratio, max_grad_norm: TrainConfig.problems, NaN and infinity too;
    # the warmup is judged against a max_steps that is valid, reported above otherwise)
    if t.warmup_steps is not None and (t.warmup_steps < 0 or (
            t.max_steps >= 1 and t.warmup_steps >= t.max_steps)):
        problems.append(
            f"train.warmup_steps={t.warmup_steps} must be in [0, train.max_steps={t.max_steps}): "
            f"set it below {max(t.max_steps, 1)} for a run this short, e.g. "
            f"train.warmup_steps={max(t.max_steps // 10, 0)}"
        )
    if cfg.save.every_steps < 0 or cfg.eval.every_steps < 0:
        problems.append("save.every_steps and eval.every_steps must be >= 0 (0 disables)")


def check_bounds(cfg: Config, problems: list[str]) -> None:
    """The upper bounds (COUNT_MAX, seeds, timeouts), and a SLURM signal that comes before its
    job's time limit."""
    for key, high in COUNT_MAX.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and value > high:
            problems.append(f"{key}={value} is more than any run needs (at most {high:,})")
    for key, value in (("train.seed", cfg.train.seed), ("data.seed", cfg.data.seed)):
        if not 0 <= value <= SEED_MAX:
            problems.append(f"{key}={value} must be in [0, {SEED_MAX}] (2**32 - 1)")
    c = cfg.cluster
    for key in ("init_timeout_s", "train_timeout_s", "signal_delay_s"):
        if getattr(c, key) > TIMEOUT_MAX_S:
            problems.append(f"cluster.{key}={getattr(c, key)} is longer than {TIMEOUT_MAX_S:,} s "
                            "(a week): a timeout that long is none")
    if c.timeout_min is not None and c.timeout_min >= 1 and c.signal_delay_s >= 60 * c.timeout_min:
        problems.append(f"cluster.signal_delay_s={c.signal_delay_s} is not before the end of the "
                        f"job's cluster.timeout_min={c.timeout_min} ({60 * c.timeout_min} s): "
                        "the ranks would be told to stop as they start; lower it")


def check_model(m: ModelConfig, t: TrainConfig, problems: list[str]) -> None:
    bounds = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
              "num_kv_heads": "num_key_value_heads"}
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                "vocab_size"):
        value, high = getattr(m, key), SHAPE_BOUNDS[bounds.get(key, key)]
        if value < 1:
            problems.append(f"model.{key}={value} must be >= 1")
        elif value > high:  # (checked before any plan allocates per layer or per row)
            problems.append(f"model.{key}={value} is larger than any Llama's: at most {high:,}")
    if m.max_position_embeddings > 1 << 24:
        problems.append(f"model.max_position_embeddings={m.max_position_embeddings} is larger "
                        f"than any Llama's: at most {1 << 24:,}")
    if m.num_heads >= 1 and m.hidden_size % m.num_heads:
        problems.append(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}"
        )
    if m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads:
        problems.append(
            f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads="
            f"{m.num_kv_heads} (grouped-query attention needs whole groups)"
        )
    if m.attn_implementation not in KERNELS and "/" not in m.attn_implementation:
        problems.append(
            f"model.attn_implementation={m.attn_implementation!r} is not one of "
            f"{', '.join(KERNELS)} (or a hub kernel such as "
            "kernels-community/flash-attn)")
    if t.seq_len > m.max_position_embeddings:
        problems.append(
            f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}: lower train.seq_len"
        )


def unknown_keys(cfg: DictConfig, schema: type = Config, prefix: str = "") -> list[str]:
    """Keys of a composed config that its schema does not have, each with the closest valid
    key: Hydra's ``+key=value`` adds keys past the schema, and they would be silently ignored."""
    fields = {f.name for f in dataclasses.fields(schema)}
    out = []
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if key not in fields:
            out.append(not_a_key(name, prefix, fields))
            continue
        node, kind = cfg._get_node(key), field_type(schema, key)
        if dataclasses.is_dataclass(kind) and isinstance(node, DictConfig) and not node._is_none():
            out += unknown_keys(node, kind, f"{name}.")
    return out


def not_a_key(name: str, prefix: str, fields: set[str]) -> str:
    """``name`` (under ``prefix``, "train." or "") is no field of its schema: the valid ones, and
    the closest."""
    close = difflib.get_close_matches(name.rsplit(".", 1)[-1], sorted(fields), n=1)
    hint = f"; did you mean {prefix}{close[0]}?" if close else ""
    return (f"{name} is not a config key (valid under {prefix.rstrip('.') or 'the root'}: "
            f"{', '.join(sorted(fields))}){hint}")


def field_type(schema: type, name: str) -> Any:
    """A dataclass field's type, Optional[X] as X."""
    kind = typing.get_type_hints(schema)[name]
    return next((a for a in typing.get_args(kind) if a is not type(None)), kind)


# --- devices ----------------------------------------------------------------------------------


def check_devices(cfg: Config, place: Placement, problems: list[str]) -> None:
    """The ranks' devices and the cluster's numbers, whatever launcher starts them (what a
    launcher cannot do is in ``place.problems``)."""
    c = cfg.cluster
    if place.nproc_per_node < 1:
        problems.append(f"cluster.nproc_per_node={place.nproc_per_node} must be >= 1")
    for key in ("signal_delay_s", "max_requeues", "max_restarts"):
        if getattr(c, key) < 0:
            problems.append(f"cluster.{key}={getattr(c, key)} must be >= 0")
    if min(c.init_timeout_s, c.train_timeout_s) < 1:
        problems.append("cluster.init_timeout_s and cluster.train_timeout_s must be >= 1 second")
    precision = resolve_precision(cfg.precision.name, place.device)
    # (a machine with no GPU at all is told so by the launcher, not this)
    if place.device == "cuda" and precision in ("bf16", "mixed") and place.gpu_bf16 is False:
        problems.append(f"precision={precision} computes in bf16, which this GPU does not "
                        "support: use precision=fp32")
    check_offload(cfg, place.device, problems)


def gpu_type_problems(c: ClusterConfig, device: str) -> list[str]:
    """cluster.gpu_type names a row of the accelerator table (config/devices.py)."""
    if device != "cuda" or c.gpu_type is None or c.gpu_type in devices.BY_KEY:
        return []
    return [f"cluster.gpu_type={c.gpu_type!r} is not one of {', '.join(devices.BY_KEY)}: pick "
            "one, or set cluster.peak_tflops and cluster.device_memory_gb"]


def check_offload(cfg: Config, device: str, problems: list[str]) -> None:
    """What goes to host memory: sharding.cpu_offload's shards, checkpointing.offload's layer
    inputs. ``cfg``: a Config, or a RunSpec (spec.variant_problems; the same fields)."""
    if cfg.sharding.cpu_offload and device != "cuda":
        problems.append(
            "sharding.cpu_offload=true needs CUDA (on CPU the parameters already live in host "
            "memory): drop it or run on GPUs"
        )
    elif cfg.sharding.cpu_offload and getattr(
            strategies.STRATEGIES.get(cfg.sharding.strategy), "ddp", False):
        problems.append(
            "sharding.cpu_offload=true with sharding=no_shard: offload moves FSDP shards to host "
            "memory, and no_shard keeps a full replica on every GPU; use sharding=full (or "
            "hybrid) with cpu_offload, or drop it"
        )
    if cfg.checkpointing.offload and cfg.checkpointing.mode == "none":
        problems.append(
            "checkpointing.offload=true with checkpointing=none: offload moves what activation "
            "checkpointing keeps (each wrapped layer's input) to host memory, and nothing is "
            "checkpointed; use checkpointing=full (or selective) with it, or drop it")


# --- adapters ---------------------------------------------------------------------------------


def check_finetune(cfg: Config, mesh: MeshSpec, problems: list[str]) -> None:
    """finetune's options, and for qlora the NF4 shapes over this shard group (nf4.py).
    ``cfg``: a Config, or a RunSpec (spec.variant_problems; the same fields)."""
    ft = cfg.finetune
    own = finetune_option_problems(ft)
    problems.extend(own)
    if ft.adapters and cfg.optim.lowbit:
        problems.append(
            f"finetune={ft.method} with optim={cfg.optim.name}: the adapters' AdamW moments are "
            "a small fraction of the run's memory (the plan's table shows them), so low-bit "
            "moments save next to nothing there; use optim=adamw with adapters, or "
            "finetune=full with low-bit moments")
    if ft.adapters and cfg.save.export_hf:
        problems.append(
            f"save.export_hf=true with finetune={ft.method}: an adapter run exports its PEFT "
            "adapter (always); for the whole model with the adapters merged in, use "
            "finetune.export_merged=true instead")
    if not ft.nf4:
        return
    m = cfg.model
    shapes_known = min(m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size) >= 1
    # (auto picks among the strategies whose shard group the NF4 shapes fit: plan.resolve_auto)
    if not own and shapes_known and cfg.sharding.strategy != AUTO:
        problems.extend(target_problems(ft, m, mesh.shard))
    if cfg.sharding.cpu_offload:
        problems.append("finetune=qlora with sharding.cpu_offload=true: the NF4 base is a "
                        "quarter of a 16-bit one and is not offloaded (untested with FSDP2's "
                        "CPU offload); drop sharding.cpu_offload, or use finetune=lora with it")


def target_problems(ft: Any, m: Any, shard: int) -> list[str]:
    """finetune=qlora: each target projection of model ``m`` that cannot be NF4 over a shard
    group of ``shard`` ranks, with the fixes (the shard sizes that work, lora, fewer targets)."""
    def bad_at(n: int) -> dict[str, str]:
        out = {}
        for name in ft.target_modules:
            why = shard_problems(shapes[name], n, ft.nf4_block_size, ft.nf4_scaler_block_size)
            if why:
                out[name] = why
        return out

    shapes = projection_shapes(m)
    bad = bad_at(shard)
    if not bad:
        return []
    first = next(iter(bad))
    ok = [n for n in range(1, 65) if not bad_at(n)]
    fixes = [f"a shard group of {', '.join(map(str, ok[:8]))} rank(s) (cluster.nproc_per_node, "
             "cluster.nodes, sharding.shard_size)"] if ok else []
    fixes += ["finetune=lora (a 16-bit base shards any way)",
              f"leave {', '.join(bad)} out of finetune.target_modules"
              if len(bad) < len(ft.target_modules) else ""]
    return [f"finetune=qlora: {', '.join(bad)} cannot be stored in NF4 over {shard} shard(s) "
            f"({first} {shapes[first][0]} x {shapes[first][1]}: {bad[first]}). Use "
            + "; or ".join(f for f in fixes if f)]


# --- weights in and out -----------------------------------------------------------------------


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
    for name, node in model_presets().items():
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
    return [f"model.path: {p}" for p in model_file_problems(path)]


def model_path_problems(m: ModelConfig) -> list[str]:
    """model.path must be an HF Llama directory or hub name whose config.json matches the group."""
    if not m.path:
        return []
    local = Path(m.path).expanduser()
    if local.is_dir():
        problems = _local_hf_problems(local)
        if problems:
            return problems
        if (code := remote_code_problem(local, "model.path")) is not None:
            return [code]
        hf = read_config_json(local)
    elif local.exists() or m.path.startswith((".", "/", "~")) or m.path.count("/") != 1:
        return [f"model.path={m.path} is neither a directory nor a hub name (org/name)"]
    else:
        try:
            from huggingface_hub import hf_hub_download

            snapshot = Path(hf_hub_download(m.path, "config.json")).parent
            hf = read_config_json(snapshot)
            if found := hf_config_problems(hf, snapshot / "config.json"):
                return found
            if (code := remote_code_problem(snapshot, "model.path")) is not None:
                return [code]
        except Exception as e:  # noqa: BLE001 - any hub failure is a config problem to report
            return [f"model.path={m.path}: not a local directory, and the hub lookup of its "
                    f"config.json failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"]
    if found := architecture_problems(hf, m.path):
        return found
    diff = shape_diff(m, hf)
    if not diff:
        return []
    fields = ", ".join(f"{k}: model.{k}={ours} but config.json has {theirs}"
                       for k, (ours, theirs) in diff.items())
    return [f"model={m.name} does not match model.path={m.path} ({fields}): use "
            f"{suggest_model_option(hf)}"]


# resume= values that are not a path: continue this directory's run, start a new one (refused
# where an earlier run's checkpoints are), or move those aside first and start a new one
RESUME_MODES = ("auto", "none", "retire")


def resume_problems(resume: str, output_dir: str) -> list[str]:
    """resume=auto and resume=retire always work, and resume=none where no earlier run left
    checkpoints; a path must be a checkpoint or a run directory with complete checkpoints."""
    if resume in RESUME_MODES:
        return new_run_problems(resume, output_dir)
    if not Path(resume).expanduser().exists():
        return [f"resume={resume!r} does not exist: use resume=auto, resume=none or an existing "
                "checkpoint directory"]
    try:
        path = resolve_resume(resume, output_dir)
    except FileNotFoundError as e:
        return [f"{e}: use resume=auto, resume=none or a checkpoint directory"]
    own = RunDir(output_dir).checkpoints.resolve()
    if path is not None and path.resolve().parent != own:
        return new_run_problems(resume, output_dir)
    return []


def new_run_problems(resume: str, output_dir: str) -> list[str]:
    """A new run (resume=none, or another directory's checkpoint) into a directory that holds an
    earlier run's checkpoints would train beside them, and its retention would prune them:
    refused, naming them and the ways out (which never delete them)."""
    if resume in ("auto", "retire"):
        return []
    found = checkpoint_others(output_dir)
    if not found:
        return []
    names = ", ".join(p.name for p in found[-4:]) + (" ..." if len(found) > 4 else "")
    return [f"resume={resume} starts a new run in {output_dir}, which holds the checkpoints of "
            f"an earlier run ({names}); the new run's save.keep_last would prune them, and a "
            "later resume=auto could continue the wrong run. Give a new output_dir, continue "
            f"that run with resume=auto, or start afresh there with resume=retire (its "
            f"checkpoints move to {RunDir(output_dir).retired}/<time>/, nothing is deleted)"]


def resume_shape_problems(cfg: Config) -> list[str]:
    """The checkpoint to resume from was saved by a model of another shape (its config.json)."""
    try:
        candidates = resume_candidates(cfg.resume, cfg.output_dir)
    except (FileNotFoundError, OSError):  # resume_problems reports it
        return []
    if not candidates or not (config := candidates[0] / HF_META / "config.json").is_file():
        return []
    try:
        hf = read_config_json(config.parent)
    except ValueError as e:
        return [f"{config}: {e}"]
    shape = {"hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
             "vocab_size", "tie_word_embeddings"}
    diff = {k: v for k, v in shape_diff(cfg.model, hf).items() if k in shape}
    if not diff:
        return []
    fields = ", ".join(f"{k}: model.{k}={ours} but the checkpoint's is {theirs}"
                       for k, (ours, theirs) in diff.items())
    return [f"resume={cfg.resume}: {candidates[0]} was saved by another model shape ({fields}): "
            f"resume with {suggest_model_option(hf)}, or start afresh with resume=retire"]


def resume_pickle_problems(cfg: Config) -> list[str]:
    """A checkpoint this run may resume from whose .metadata would load more than DCP's
    metadata classes (pickles.py): refused before any process starts."""
    try:
        candidates = resume_candidates(cfg.resume, cfg.output_dir)
    except (FileNotFoundError, OSError):  # resume_problems reports it
        return []
    return [why for path in candidates if (path / METADATA).is_file()
            and (why := check_file(path / METADATA)) is not None]


def resume_optim_problems(cfg: Config) -> list[str]:
    """The checkpoint to resume from holds another optimizer's state, or what another finetune
    method trains (optim_meta.py)."""
    try:
        path = resolve_resume(cfg.resume, cfg.output_dir)
    except (FileNotFoundError, OSError):  # resume_problems reports it
        return []
    if path is None or verify(path) is not None:  # a damaged one: the ranks skip it, saying so
        return []
    try:
        why = optim_mismatch(path, cfg.optim, cfg.finetune)
    except (ValueError, KeyError, TypeError) as e:
        return [f"{path / OPTIM_META} is unreadable ({type(e).__name__}: {e}): resume from "
                "another checkpoint with resume=<path>, or start afresh with resume=none"]
    return [why] if why else []


def export_problems(cfg: Config) -> list[str]:
    """The run's export would replace a directory that is not wholly an earlier export of
    llama_fsdp's (the user's files in <run>/export): refused now, not after training."""
    run = RunDir(cfg.output_dir)
    if claim_problem(run.root) is not None:  # not a run's directory: refused as a whole at launch
        return []
    outs = []
    if cfg.finetune.adapters or cfg.save.export_hf:
        outs.append(run.export)
    if cfg.finetune.adapters and cfg.finetune.export_merged:
        outs.append(run.export_merged)
    return [f"this run's export would replace what is there: {why}" for p in outs
            if (why := export_problem(p)) is not None]


def checkpoint_problems(cfg: Config) -> list[str]:
    """Everything about weights in and out that can be wrong before any process starts."""
    problems = model_path_problems(cfg.model) + resume_problems(cfg.resume, cfg.output_dir)
    problems += resume_pickle_problems(cfg) + resume_optim_problems(cfg) + export_problems(cfg)
    problems += resume_shape_problems(cfg)
    s, stop = cfg.save, cfg.train.stop_after
    if s.async_save and s.full_state_dict:
        problems.append("save.async_save=true with save.full_state_dict=true: the full state dict "
                        "is gathered and written by rank 0 synchronously; drop one of them")
    if stop is not None and not 1 <= stop <= cfg.train.max_steps:
        problems.append(f"train.stop_after={stop} must be in [1, train.max_steps="
                        f"{cfg.train.max_steps}] (or null)")
    return problems


# --- the mesh, attention, the data's form, callbacks -----------------------------------------


def check_mesh(strategy: str, shard_size: Optional[int], world: int, nproc: int,
               problems: list[str]) -> None:
    """sharding.shard_size against the strategy and the world size (config/strategies.py's
    mesh_for maps them)."""
    s = strategies.STRATEGIES.get(strategy)
    if s is None:  # auto plans as full until it is chosen; an unknown name: check_choices
        return
    if s.ddp and shard_size not in (None, 1):
        problems.append(
            f"sharding.shard_size={shard_size} with sharding={strategy}: no_shard keeps a "
            "full replica per rank; drop sharding.shard_size or use sharding=hybrid")
    elif not s.ddp and not s.hybrid and shard_size not in (None, world):
        problems.append(
            f"sharding.shard_size={shard_size} with sharding={strategy} (which shards over "
            f"all {world} ranks): use sharding=hybrid to shard in groups of {shard_size}, or "
            "drop sharding.shard_size")
    elif s.hybrid:
        shard = shard_size if shard_size is not None else nproc
        if shard < 1 or world % shard:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            problems.append(
                f"world size {world} is not divisible by sharding.shard_size={shard}: set "
                f"sharding.shard_size to one of {divisors}, or change cluster.nodes / "
                "cluster.nproc_per_node")


def attention_problems(name: str, *, device: str, compute_dtype: str) -> list[str]:
    """An explicit model.attn_implementation=varlen on CUDA runs flash attention: 16-bit only.
    (torch.nn.attention.varlen is in every torch llama_fsdp runs on: versions.FLOORS.)"""
    if device != "cuda" or name != VARLEN or compute_dtype in SIXTEEN_BIT:
        return []
    return [f"model.attn_implementation=varlen needs 16-bit compute on CUDA (flash), but the "
            f"compute dtype is {compute_dtype}: use precision=mixed or precision=bf16, or "
            "model.attn_implementation=sdpa"]


def tokenizer_problems(d: DataConfig) -> list[str]:
    """data.tokenizer: a local directory must not bring code of its own (a hub name is checked
    where it is fetched, before launch: data/tokenizer.py)."""
    if not d.tokenizer or not (local := Path(d.tokenizer).expanduser()).is_dir():
        return []
    code = remote_code_problem(local, "data.tokenizer")
    return [code] if code else []


def pair_data_problems(d: DataConfig) -> list[str]:
    """Data options that mean nothing for preference pairs (an objective whose rows hold
    pairs: config/objectives.py)."""
    out = []
    if d.train_on_prompt:
        out.append(f"data.train_on_prompt=true with objective={DPO}: DPO compares the answers' "
                   "log-probs, the prompt is never a target: drop it")
    if d.name != "synthetic" and d.format != "auto":
        out.append(f"data.format={d.format} names an SFT record format; objective={DPO} reads "
                   "pairs by their columns (prompt / chosen / rejected): drop data.format")
    return out


def callback_problems(paths: list[str]) -> list[str]:
    """Each train.callbacks entry that cannot be resolved, with why (its module is imported:
    its top-level code runs here as it will on the ranks). Called by the job's preparation,
    once, in the process that prepares the job."""
    out = []
    for path in paths:
        try:
            resolve(path)
        except Exception as e:  # noqa: BLE001 - a module that raises on import is a bad one too
            out.append(str(e) if isinstance(e, ValueError) else
                       f"train.callbacks: importing {path!r} raised {type(e).__name__}: {e}")
    return out


# --- a run, all at once ----------------------------------------------------------------------


def config_problems(cfg: Config) -> list[str]:
    """What the typed config says wrong on its own (``cfg.output_dir``: the run directory this
    launch writes to, where resume=auto looks)."""
    problems: list[str] = []
    check_choices(cfg, problems)
    check_positive(cfg, problems)
    check_model(cfg.model, cfg.train, problems)
    problems += checkpoint_problems(cfg)
    problems += (data_option_problems(cfg.data) + tokenizer_problems(cfg.data)
                 + model_number_problems(cfg.model)
                 + train_option_problems(cfg.train)
                 + eval_option_problems(cfg.eval, seq_len=cfg.train.seq_len)
                 + cluster_option_problems(cfg.cluster) + tracking_option_problems(cfg.tracking)
                 + objective_option_problems(cfg.objective))
    if OBJECTIVES.get(cfg.objective.name) is not None and OBJECTIVES[cfg.objective.name].pairs:
        problems += pair_data_problems(cfg.data)
    from ..harness import harness_problems  # (lm-eval itself: imported only for tasks)

    return problems + harness_problems(cfg.eval.harness)


def derived_problems(cfg: Any, *, place: Placement, mesh: MeshSpec, world: int,
                     param_dtype: Optional[str], compute_dtype: Optional[str]) -> list[str]:
    """What is wrong with the run's derived values: its devices and the launcher's answers, its
    mesh, adapters over it, activation checkpointing, the optimizer, attention (dtypes: None
    for a precision that is not one, which ``check_choices`` reports). ``cfg``: a Config, or a
    RunSpec (the same fields)."""
    problems = list(place.problems)
    check_devices(cfg, place, problems)
    problems += gpu_type_problems(cfg.cluster, place.device)
    check_mesh(cfg.sharding.strategy, cfg.sharding.shard_size, world, place.nproc_per_node,
               problems)
    check_finetune(cfg, mesh, problems)
    ac = cfg.checkpointing
    if ac.mode == "selective" and ac.every_k > cfg.model.num_layers:
        problems.append(f"checkpointing.every_k={ac.every_k} exceeds model.num_layers="
                        f"{cfg.model.num_layers}: nothing would be checkpointed")
    if param_dtype is not None:
        problems += optim_option_problems(cfg.optim, param_dtype=param_dtype,
                                          cpu_offload=cfg.sharding.cpu_offload,
                                          full_state_dict=cfg.save.full_state_dict)
        problems += attention_problems(cfg.model.attn_implementation, device=place.device,
                                       compute_dtype=compute_dtype)
    return problems


def variant_problems(spec: Any) -> list[str]:
    """The rules between a run's choices, asked again of a RunSpec the planner changed (another
    strategy, node count, optimizer, method, offload or sequence length): what build_spec would
    say of the same choices."""
    problems: list[str] = []
    check_model(spec.model, spec.train, problems)
    check_mesh(spec.strategy, spec.sharding.shard_size, spec.world_size, spec.nproc_per_node,
               problems)
    check_finetune(spec, spec.mesh, problems)
    check_offload(spec, spec.device, problems)
    problems += optim_option_problems(spec.optim, param_dtype=spec.policy.param_dtype,
                                      cpu_offload=spec.sharding.cpu_offload,
                                      full_state_dict=spec.save.full_state_dict)
    return problems
