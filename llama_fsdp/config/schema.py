"""Typed schemas for every config node, registered in Hydra's ConfigStore.

YAML files under conf/ only set values; the root schema (``base_config``, first in
conf/config.yaml's defaults) types every group, so a misspelled key or a wrong type fails at
compose time with the key's name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from .kernels import AUTO as AUTO_KERNEL
from .metrics import SUMMARY_EVAL_LOSS
from .objectives import DEFAULT as DEFAULT_OBJECTIVE
from .optimizers import DEFAULT as DEFAULT_OPTIMIZER
from .optimizers import OPTIMIZERS
from .placement import LOCAL
from .precision import PRECISION_POLICIES
from .rundir import MLFLOW_DB, OUTPUT_ROOTS

PRECISIONS = ("auto", *PRECISION_POLICIES)  # auto: resolved per device (precision.py)
AC_MODES = ("none", "full", "selective")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class RopeScalingConfig:
    """Llama 3.1/3.2 frequency scaling (``rope_type: llama3``)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    name: str = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = 8
    intermediate_size: int = MISSING
    vocab_size: int = 128256
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    rope_scaling: Optional[RopeScalingConfig] = None
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    # A Hugging Face directory or hub name to start from; its config.json must match the shape.
    path: Optional[str] = None
    # Attention kernel: a name of llama_fsdp/config/kernels.py's table ("auto": varlen for
    # packed rows on CPU and on CUDA in 16-bit, else sdpa), or a hub kernel.
    attn_implementation: str = AUTO_KERNEL
    init_std: float = 0.02


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """One decoder layer's Linear weights (out, in) by module name, in the layer's order."""
    h, q = m.hidden_size, m.hidden_size // m.num_heads
    kv, i = m.num_kv_heads * q, m.intermediate_size
    return {"q_proj": (m.num_heads * q, h), "k_proj": (kv, h), "v_proj": (kv, h),
            "o_proj": (h, m.num_heads * q), "gate_proj": (i, h), "up_proj": (i, h),
            "down_proj": (h, i)}


@dataclass
class ShardingConfig:
    strategy: str = "full"
    # Ranks per shard group for hybrid strategies; null means ranks per node.
    shard_size: Optional[int] = None
    cpu_offload: bool = False


@dataclass
class PrecisionConfig:
    # auto: mixed on CUDA (bf16 compute, fp32 master weights and reduction), fp32 on CPU.
    name: str = "auto"


@dataclass
class CheckpointingConfig:
    """Activation checkpointing (not weight checkpoints; those are ``save``)."""

    mode: str = "none"
    # selective: wrap every k-th decoder layer (layer-level selective AC, as torchtitan's "int").
    every_k: int = 2
    # Keep what checkpointing keeps of each wrapped layer (its input) in pinned host memory
    # from forward to backward, copied on a side stream (CUDA; on CPU a plain copy). The plan
    # counts it against the host's RAM (docs/long_context.md).
    offload: bool = False

    def wrapped_layers(self, num_layers: int) -> range:
        """Indices of the decoder layers activation checkpointing wraps (model/parallelize.py wraps
        them, plan.py counts them)."""
        match self.mode:
            case "none":
                return range(0)
            case "full":
                return range(num_layers)
            case "selective":
                return range(self.every_k - 1, num_layers, self.every_k)
        raise ValueError(f"checkpointing mode {self.mode!r} is not one of {', '.join(AC_MODES)}")


@dataclass
class ClusterConfig:
    # local: ranks on this host; slurm: sbatch through submitit; torchrun: this process is one
    # rank of a job started by torchrun or a Kubernetes operator (its environment says which).
    kind: str = LOCAL
    # Nodes. null (cluster=torchrun): as many as the environment says.
    nodes: Optional[int] = 1
    # Ranks per node. null: every visible GPU on CUDA, else 2 CPU ranks (cluster=torchrun: the
    # environment's LOCAL_WORLD_SIZE).
    nproc_per_node: Optional[int] = None
    device: str = "auto"
    # Job time limit in minutes. Local: null (none). SLURM: the allocation's --time; SLURM sends
    # SIGUSR2 signal_delay_s before it ends (and before a preemption), the ranks save a
    # checkpoint, and the job requeues itself, at most max_requeues times (submitit's name).
    timeout_min: Optional[int] = None
    # The earlier name of timeout_min, still read: set, it sets timeout_min (with a warning).
    time_min: Optional[int] = None
    signal_delay_s: int = 300
    max_requeues: int = 3
    # A rank that dies (crash, OOM kill, lost node) stops every rank; the run then restarts from
    # its newest complete checkpoint, at most max_restarts times (torchrun's --max-restarts).
    max_restarts: int = 0
    # Collective timeouts: init covers rendezvous, model build and checkpoint loading; train
    # applies from the first training step on (a collective slower than this is a hang: the
    # ranks stop and leave their stacks in <run>/hang/).
    init_timeout_s: int = 1800
    train_timeout_s: int = 900
    # SLURM (submitit) options; ignored by the local launcher.
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    mem_gb: Optional[int] = None
    cpus_per_task: Optional[int] = None
    gpus_per_node: int = 0
    setup: list[str] = field(default_factory=list)
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    srun_args: list[str] = field(default_factory=list)
    wait: bool = True
    # Torch threads per rank; null: the CPUs this rank may use (its SLURM allocation or CPU
    # affinity) split between the node's ranks.
    threads_per_rank: Optional[int] = None
    # The accelerator, for the planner and MFU: a name from llama_fsdp/config/devices.py (h100, h200,
    # a100, ...). null: the local GPU's name, or h100 for SLURM GPU jobs (with a warning).
    gpu_type: Optional[str] = None
    # Overrides of that table: per-device memory (GB) and dense peak TFLOP/s.
    device_memory_gb: Optional[float] = None
    peak_tflops: Optional[float] = None


@dataclass
class DataConfig:
    """Records → tokens → masked, packed rows (llama_fsdp/data/; README "Your own data")."""

    # Valid values (plain class attributes, not config keys).
    SOURCES = ("synthetic", "jsonl", "hf")
    FORMATS = ("auto", "instruction", "chat", "text")
    OVERLONG = ("truncate", "drop", "error")

    # synthetic (embedded, generated) | jsonl (local json/jsonl/parquet/csv/txt files)
    # | hf (datasets.load_dataset: a hub name or a local dataset directory)
    name: str = "synthetic"
    # synthetic: generated training records (the held-out set is generated apart, sized by the
    # eval_* rule below applied to num_records).
    num_records: int = 4000
    # The held-out (eval) records when no eval file / split is named: eval_fraction of the
    # records, at least eval_min_records, at most eval_max_records, never all of them (at least
    # one record always trains). eval_fraction=0 holds out nothing (no eval).
    eval_fraction: float = 0.05
    eval_min_records: int = 1
    eval_max_records: int = 200
    # An exact held-out count instead of the rule above (null: the rule). 0 holds out nothing.
    eval_records: Optional[int] = None
    # Generation (synthetic) and held-out selection seed; the sampling order uses train.seed.
    seed: int = 1234
    # jsonl: a file, a glob or a directory of files; hf: a hub dataset name or local directory.
    path: Optional[str] = None
    subset: Optional[str] = None  # hf: the dataset's config name
    revision: Optional[str] = None  # hf: git revision of a hub dataset
    split: str = "train"
    eval_split: Optional[str] = None  # hf: a held-out split (null: hold out of the train split)
    eval_path: Optional[str] = None  # jsonl: a held-out file or glob (null: hold out of path)
    # "module:function" or "path/to/file.py:function", applied to every record of the files /
    # hub split before anything else: function(record: dict) -> a record (dict), a list of
    # records (one record becomes several), or None (skip it). For layouts the *_column names
    # cannot map, e.g. answers nested in a list.
    preprocess: Optional[str] = None
    # auto | instruction (alpaca: instruction/input/output) | chat (a messages list, rendered
    # with the tokenizer's chat template) | text. auto picks by the columns present.
    format: str = "auto"
    instruction_column: str = "instruction"
    input_column: str = "input"
    output_column: str = "output"
    # chat: a list of {role, content} (or ShareGPT's {from, value}) messages.
    messages_column: str = "messages"
    text_column: str = "text"
    # Instruction records: the prompt, then the output (tokenized apart, so the boundary is exact).
    # The default is compact, for the synthetic task (short rows learn fastest); conf/data/jsonl
    # and hf use the Alpaca layout.
    prompt_template: str = "{instruction} {input} ="
    prompt_template_no_input: str = "{instruction} ="
    # An HF tokenizer directory or hub name. null: model.path's own tokenizer when the model has
    # a path; else the project tokenizer (512 pieces, trained once on the synthetic corpus and
    # cached; for the synthetic task and model=tiny, vocab_size 512).
    tokenizer: Optional[str] = None
    # A Jinja chat template (the text, or a path to a .jinja file) replacing the tokenizer's, for
    # chat records with a tokenizer that has none (base models).
    chat_template: Optional[str] = None
    # Loss on prompt tokens too (default: only responses / assistant turns, and their EOS).
    train_on_prompt: bool = False
    # Several records per row (positions restart, no attention across records); false: one
    # record per row, right-padded.
    packing: bool = True
    # A record longer than train.seq_len: truncate (counted in the log) | drop | error.
    overlong: str = "truncate"
    # Processes for tokenization (datasets.map).
    num_proc: int = 1


@dataclass
class DivergenceConfig:
    """A loss that runs away stops the run before it turns into NaN (train/divergence.py): a
    loss that is not a number, or a loss curve whose median over the last ``window`` log steps
    is both ``ratio`` times the lowest such median so far and ``min_rise`` above it. The median
    keeps one bad batch (a spike) and one easy batch (a dip that would set a low best) out;
    the ratio and the rise together keep the noise of a falling curve, and of a small loss
    such as DPO's, out. ``action``: stop (with a report, the last good checkpoint kept), warn
    (once, and train on), off (only a loss that is not a number stops)."""

    ACTIONS = ("stop", "warn", "off")  # valid values (a class attribute, not a config key)

    action: str = "stop"
    ratio: float = 1.5
    min_rise: float = 1.0
    window: int = 3


@dataclass
class TrainConfig:
    # train.loss (llama_fsdp/objective/loss.py): chunked computes the head and the cross-entropy a chunk
    # of loss_chunk target tokens at a time, never holding b x s x vocab logits; full is
    # F.cross_entropy over all the logits (class attributes, not config keys).
    CHUNKED, FULL = "chunked", "full"
    LOSSES = (CHUNKED, FULL)

    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 128
    max_steps: int = 60
    # The optimizer's hyperparameters: null takes the recipe's value for the model's size, the
    # fine-tuning method and the objective (llama_fsdp/config/recipes.py, docs/recipes.md); a
    # value given here always wins. The schedule: linear warm-up over warmup_steps to lr, then
    # cosine to lr x min_lr_ratio at max_steps (1.0: constant). max_grad_norm 0: no clipping.
    lr: Optional[float] = None
    min_lr_ratio: Optional[float] = None
    warmup_steps: Optional[int] = None
    weight_decay: Optional[float] = None
    beta1: Optional[float] = None
    beta2: Optional[float] = None
    eps: Optional[float] = None
    seed: int = 0
    compile: bool = False
    max_grad_norm: Optional[float] = None
    log_every: int = 1
    loss: str = "chunked"
    loss_chunk: int = 1024  # target tokens per chunk of the chunked loss
    # Stop after this step without changing the LR schedule (which runs to max_steps): train a
    # long run in chunks with save.every_steps and resume=auto. null: run to max_steps.
    stop_after: Optional[int] = None
    # Step hooks: "module:attr" import paths. Each names a factory called once per rank as
    # factory(rank=, world_size=, output_dir=) that returns a callable hook(state), called on
    # every rank at the end of every step (state.step is the step just done; on CUDA,
    # state.losses has the previous log step's loss, read once the next step is queued).
    callbacks: list[str] = field(default_factory=list)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)


@dataclass
class HarnessConfig:
    """EleutherAI's lm-evaluation-harness on the trained weights (llama_fsdp/harness/): at the
    end of the run on its HF export (LoRA / QLoRA: the merged one, written for it), and every
    ``every_steps`` on the model gathered at that step. Results: MLflow metrics
    harness/<task>/<metric> (and _stderr), lm-eval's results JSON (<run>/harness/)."""

    # lm-eval task (or group, or tag) names; empty: no harness. llama_fsdp_synthetic is bundled
    # (the default data's held-out records, offline); hellaswag, arc_easy, mmlu for real runs.
    tasks: list[str] = field(default_factory=list)
    # A folder of task YAMLs of your own (searched besides lm-eval's and ours).
    include_path: Optional[str] = None
    # Consent to run the Python that include_path's YAMLs name with !function (lm-eval imports
    # the folder's .py files): without it such a folder is refused before launch, naming them.
    trust_task_code: bool = False
    # Documents per task (below 1: a fraction); null: all.
    limit: Optional[float] = None
    # Few-shot examples per prompt; null: each task's own default.
    num_fewshot: Optional[int] = None
    batch_size: int = 8
    # Also every N steps during training (0: only at the end).
    every_steps: int = 0
    # The longest context in tokens (longer ones are cut from the left); null: the model's.
    max_length: Optional[int] = None
    # lm-eval's bootstrap resamples for the stderr of metrics that are not means.
    bootstrap_iters: int = 100000


@dataclass
class EvalConfig:
    """The in-run eval (objective/sft.py, dpo.py): held-out loss always; exact match of greedy
    answers only where answers are short. The plan states what it costs in training steps
    (plan/eval_cost.py)."""

    # null task_prompts: this many on the synthetic task (answers of a few tokens), none on
    # other data (free-form answers rarely match word for word) (class attributes)
    TASK_PROMPTS = 64
    # the longest answer (tokens, with its EOS) exact match decodes for: longer references are
    # left out, and a null max_new_tokens is at most this (class attribute)
    SHORT_ANSWER_TOKENS = 32

    every_steps: int = 20
    # Held-out loss over at most this many micro-batches a rank; null: every held-out row while
    # that keeps one eval within a training step, else the rows that do (plan/eval_cost.py).
    max_batches: Optional[int] = None
    # Greedy answers to this many held-out prompts whose answers are short, scored by exact
    # match; 0 disables; null: TASK_PROMPTS on data=synthetic, else 0. Decoding stops when every
    # prompt on every rank has ended (one all-reduce a token).
    task_prompts: Optional[int] = None
    # Greedy steps per prompt (and the longest answer scored); null: the longest short
    # reference answer (with its EOS), at most SHORT_ANSWER_TOKENS.
    max_new_tokens: Optional[int] = None

    def resolved(self, data_name: str) -> "EvalConfig":
        """task_prompts as the run uses it (null: by the data)."""
        if self.task_prompts is not None:
            return self
        prompts = self.TASK_PROMPTS if data_name == "synthetic" else 0
        return dataclasses.replace(self, task_prompts=prompts)

    @property
    def answer_tokens(self) -> int:
        """The longest answer exact match scores (its decoding bound)."""
        return self.max_new_tokens or self.SHORT_ANSWER_TOKENS
    harness: HarnessConfig = field(default_factory=HarnessConfig)


@dataclass
class FinetuneConfig:
    """What trains (conf/finetune/): every weight (full), or low-rank adapters beside a frozen
    base (lora), the base stored in 4-bit NF4 (qlora: torchao's NF4Tensor, sharded and
    all-gathered in 4 bits by FSDP2)."""

    METHODS = ("full", "lora", "qlora")  # valid values (a class attribute, not a config key)
    # The projections of a Llama decoder layer that can take adapters (class attribute).
    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    method: str = "full"
    # LoRA: W x + (alpha / rank) * B A dropout(x) for each target projection; A (rank x in) and
    # B (out x rank, zero at the start) train, W is frozen.
    # null: the recipe's (config/recipes.py: torchtune's rank by size, alpha = 2 x rank).
    rank: Optional[int] = None
    alpha: Optional[float] = None
    dropout: float = 0.0
    # The projections that get adapters (names of the Linear modules in every decoder layer).
    target_modules: list[str] = field(default_factory=lambda: list(FinetuneConfig.TARGETS))
    # qlora: NF4 quantization blocks (elements per scale; scales per double-quantized group).
    nf4_block_size: int = 64
    nf4_scaler_block_size: int = 256
    # lora / qlora write the PEFT adapter at the end of every run (<run>/export: the run's
    # model in MLflow, megabytes). With this, also the base with the adapters merged in, as an
    # HF model (<run>/export_merged; qlora: over the dequantized base).
    export_merged: bool = False

    @property
    def adapters(self) -> bool:
        """lora and qlora train adapters beside a frozen base; full trains every weight."""
        return self.method != "full"

    @property
    def nf4(self) -> bool:
        """qlora: the frozen base of the target projections is stored in NF4."""
        return self.method == "qlora"


@dataclass
class ObjectiveConfig:
    """What the weights train for (conf/objective/), beside which weights train (finetune):
    a name of config/objectives.py's table -- next-token cross-entropy on the answers (sft), or
    Direct Preference Optimization on prompt / chosen / rejected pairs (dpo:
    llama_fsdp/objective/dpo.py, docs/dpo.md). The other keys are DPO's."""

    # Valid values (class attributes, not config keys).
    # sigmoid: DPO's -log sigmoid(beta * margin), with label_smoothing the conservative cDPO;
    # ipo: (margin per answer token - 1 / (2 beta))^2, TRL's IPO.
    SIGMOID, IPO = "sigmoid", "ipo"
    LOSSES = (SIGMOID, IPO)
    # model: the policy with its adapters off (lora / qlora: nothing added), or a frozen copy
    # sharded per layer like it (full); cached: the reference's log-probs computed once, before
    # the first step, and kept on disk beside the tokenized data (no reference in memory).
    MODEL, CACHED = "model", "cached"
    REFERENCES = (MODEL, CACHED)

    name: str = DEFAULT_OBJECTIVE
    beta: Optional[float] = None  # null: the recipe's (config/recipes.py)
    loss: str = SIGMOID
    label_smoothing: float = 0.0
    reference: str = MODEL


# where optim.fused=null means torch's fused AdamW (torch has a fused kernel for both)
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


@dataclass
class OptimConfig:
    """The optimizer (conf/optim/): AdamW with its moments in the parameters' dtype (adamw), or
    in 8 or 4 bits with block-wise scales (torchao's low-bit AdamW). Its hyperparameters stay
    in train (lr, beta1, beta2, eps, weight_decay)."""

    name: str = DEFAULT_OPTIMIZER  # a name of llama_fsdp/config/optimizers.py's table
    # Low-bit moments: elements per scale (null: torchao's default, 256 for 8-bit, 128 for 4-bit).
    block_size: Optional[int] = None
    # bf16 parameters updated by stochastic rounding (fp32 math, no extra memory).
    bf16_stochastic_round: bool = False
    # Run the low-bit step without torch.compile (slower steps, no compile at the start).
    eager: bool = False
    # adamw only: torch's fused AdamW (one kernel over every parameter, no param-sized
    # temporary; torchtitan's default on CUDA) instead of foreach (the same math, in fp32 for
    # bf16 parameters where foreach rounds each op to bf16). null: fused on CUDA and the CPU,
    # where it is the faster step (an H200 1b step 24.3 -> 10.0 ms, benchmarks/gpu.md; the
    # tiny model's 3.8M parameters on one CPU thread 11.6-17.0 -> 2.9 ms,
    # benchmarks/throughput.md); foreach on other devices.
    fused: Optional[bool] = None

    def fused_on(self, device: str) -> bool:
        """Whether the step is torch's fused AdamW for parameters on ``device`` ("cuda",
        "cpu"): optim.fused, by default on CUDA and the CPU; never for torchao's steps."""
        if self.lowbit or self.bf16_stochastic_round:
            return False
        return device in FUSED_ADAMW_DEVICES if self.fused is None else self.fused

    @property
    def lowbit(self) -> bool:
        """Moments in 8 or 4 bits (torchao), not in the parameters' dtype."""
        return self.name in OPTIMIZERS and OPTIMIZERS[self.name].lowbit

    @property
    def block(self) -> int:
        """The low-bit block size in use (0 for adamw: no blocks)."""
        return (self.block_size or OPTIMIZERS[self.name].default_block) if self.lowbit else 0


@dataclass
class SaveConfig:
    """Weight checkpoints (llama_fsdp/checkpoint/); resume is the root ``resume`` key."""

    # A sharded DCP checkpoint in <output_dir>/checkpoints/step_N every N steps and at the end
    # of training; 0: none (resume=auto then finds nothing to resume from).
    every_steps: int = 0
    # Complete checkpoints kept; older ones (and .tmp of interrupted saves) are deleted.
    keep_last: int = 2
    # dcp.async_save: the loop waits only for a CPU copy of the state, the write runs in a thread.
    async_save: bool = False
    # A consolidated HF directory (<output_dir>/export: safetensors, config.json, tokenizer)
    # at the end, loadable with from_pretrained; `python -m llama_fsdp.convert` does the same
    # for any checkpoint. null: true for a full fine-tune of a model under 100M parameters
    # (the tiny default leaves a model to evaluate and talk to: 14 MB), false otherwise;
    # eval.harness.tasks turn it on (the harness scores the export).
    export_hf: Optional[bool] = None
    # Gather model + optimizer to rank 0 (CPU) and write one file there, instead of every rank
    # writing its shards. Still a DCP checkpoint: resume and convert read it the same way.
    full_state_dict: bool = False


@dataclass
class TrackingConfig:
    BEST_MODES = ("min", "max")  # valid values of best_mode (a class attribute, not a key)

    enabled: bool = True
    # Relative sqlite paths resolve against the directory the command was launched from.
    uri: str = f"sqlite:///{MLFLOW_DB}"
    experiment: str = "llama_fsdp"
    run_name: Optional[str] = None
    # An unreachable tracking server at launch: refuse the run (false), or train anyway and
    # deliver the spooled metrics when the server is back (true).
    allow_offline: bool = False
    # After the ranks end, how long the launcher keeps offering what the store has not taken yet
    # (a server that went away mid-run); what is left stays in the run's tracking/ folder,
    # delivered by `python -m llama_fsdp.tracking <run dir>`.
    final_delivery_s: float = 30.0
    # CPU / GPU utilisation and memory as MLflow system metrics, every interval_s.
    system_metrics: bool = False
    system_metrics_interval_s: float = 10.0
    # A sweep's best point, whose numbers its parent row shows: the finished point with the
    # lowest (best_mode=min) or highest (max) value of this end-of-run metric. At the default,
    # a sweep whose points have no eval loss picks the fastest point (only systems keys swept)
    # or the lowest final loss (tracking/sweep.py: Best.for_points).
    best_metric: str = SUMMARY_EVAL_LOSS
    best_mode: str = "min"


@dataclass
class Config:
    model: ModelConfig = MISSING
    sharding: ShardingConfig = MISSING
    precision: PrecisionConfig = MISSING
    checkpointing: CheckpointingConfig = MISSING
    cluster: ClusterConfig = MISSING
    data: DataConfig = MISSING
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    resume: str = "auto"
    dry_run: bool = False
    force: bool = False
    # Where this run writes (checkpoints, logs, resolved config); Hydra's run dir by default.
    output_dir: str = "${hydra:runtime.output_dir}"
    # Shared across runs: trained tokenizers, tokenized datasets. null: $LLAMA_FSDP_CACHE_DIR
    # where set, else <launch dir>/outputs/cache (rundir.CACHE_ENV, rundir.CACHE).
    cache_dir: Optional[str] = None


def register_configs() -> None:
    """Register the root schema. Every group is a typed field of it, so the group options
    (YAML, values only) and command-line overrides are checked against their dataclass when
    merged: a misspelled key or a wrong type fails at compose time with the key's name; and
    ``hydra/sweeper=optuna`` (config/search.py). The
    ``outputs`` resolver names the roots of the outputs/ tree (rundir.OUTPUT_ROOTS)."""
    from .search import register_search

    ConfigStore.instance().store(name="base_config", node=Config)
    register_search(ConfigStore.instance())  # hydra/sweeper=optuna
    if not OmegaConf.has_resolver("outputs"):  # conf/config.yaml: ${outputs:runs}, rundir.py's
        OmegaConf.register_new_resolver("outputs", lambda root: OUTPUT_ROOTS[root])


def conf_dir() -> Path:
    """The config groups `python -m llama_fsdp` composes: conf/ of the checkout, installed
    inside the package as ``llama_fsdp.conf``."""
    from importlib.resources import files

    return Path(str(files("llama_fsdp.conf")))


def model_config_from_node(node: Any) -> ModelConfig:
    """A ``model`` config node (a preset file, a run's config.yaml section) as a typed
    ModelConfig: unset fields take the schema's defaults, as at compose time."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))


def model_presets() -> dict[str, ModelConfig]:
    """Every ``model=`` option as a typed ModelConfig (unset fields take the schema's defaults,
    as at compose time); an option that does not validate is left out (compose reports it)."""
    from omegaconf import OmegaConf

    out = {}
    for f in sorted((conf_dir() / "model").glob("*.yaml")):
        node = OmegaConf.load(f)
        node.pop("defaults", None)  # type: ignore[union-attr]
        try:
            out[f.stem] = model_config_from_node(node)
        except Exception:  # noqa: BLE001 - a broken preset is reported by compose, not here
            continue
    return out  # type: ignore[return-value]


def model_preset(name: str) -> ModelConfig:
    """One ``model=`` option (conf/model/<name>.yaml) as a typed ModelConfig, without Hydra."""
    presets = model_presets()
    if name not in presets:
        raise KeyError(f"model={name}: valid: {', '.join(sorted(presets))}")
    return presets[name]
