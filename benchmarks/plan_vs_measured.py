"""The planner's predicted peak per rank next to the memory real CPU gloo ranks allocate.

How it is measured: a small malloc shim (``MEMTRACK_C``, built with the system C compiler and
LD_PRELOADed into the rank processes) keeps a running total and a high-water mark of the live
heap blocks of at least 64 KiB, in every thread. Every CPU tensor of that size comes from
torch's allocator (posix_memalign / free), so the total is the bytes torch allocates for
tensors, plus gloo's own buffers; small blocks (Python objects, metadata) and the runtime's code
are left out, and the total just before the model is built is subtracted. Hooks cut each step
into phases (model forward, loss, layers' backward, root backward + clip, optimizer) and read
each phase's high-water mark. What is still allocated once the model, optimizer and batches are
gone is the runtime's own (MKL / oneDNN / gloo buffers made during the first step, 0-10 MB) and
is subtracted as process overhead.

Why not the torch profiler (profile_memory=True): it records the allocations and frees of the
profiled thread only. Gloo's worker threads free the buffers its collectives hold (the clone
``_reduce_scatter_base_`` makes of its input, all-gather outputs, ``distribute_tensor``'s
scatter outputs), so the profiler's running sum drifts by tens of MB within a step.

``phase_peaks`` (llama_fsdp.plan) is the per-phase model the plan now predicts with:
``Plan.predicted_peak_bytes`` is its maximum over the phases, which matches the measured peak to
within 10% (never below it) where the old summed plan (``Plan.memory.total``) is 10-37% above it.
Most cases' batches are input_ids only (no packed documents) and set data.packing=false; the
packed cases (the last field of a case: the attention, ``varlen`` or ``sdpa``) add position_ids
that restart at records of 8-40 tokens, as the plan's packed-sequence terms count them.

    .venv/bin/python benchmarks/plan_vs_measured.py --out benchmarks/plan_vs_measured_cpu.md
    .venv/bin/python benchmarks/plan_vs_measured.py --quick
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GB = 10**9
MIN_BLOCK = 64 * 1024
# The tiny model's layers (h=256, 4 layers, GQA 8/4 heads, i=768) with a larger vocabulary so
# the logits and loss weigh as in real Llamas (vocab/h: 128256/4096 = 31 for 8B; 8192/256 = 32).
SHAPE = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=8",
         "model.num_kv_heads=4", "model.intermediate_size=768", "model.vocab_size=8192"]
# the per-phase model is the plan's prediction now (Plan.predicted_peak_bytes is its maximum)
from llama_fsdp.plan import PHASES, phase_peak_bytes, phase_peaks  # noqa: F401

# --- the malloc shim ----------------------------------------------------------------------------

MEMTRACK_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static _Atomic long cur = 0, peak = 0;
#define MIN_BLOCK %d

static inline void add(void *p) {
  if (!p) return;
  size_t n = malloc_usable_size(p);
  if (n < MIN_BLOCK) return;
  long c = atomic_fetch_add(&cur, (long)n) + (long)n;
  long pk = atomic_load(&peak);
  while (c > pk && !atomic_compare_exchange_weak(&peak, &pk, c)) {}
}
static inline void sub(void *p) {
  if (!p) return;
  size_t n = malloc_usable_size(p);
  if (n >= MIN_BLOCK) atomic_fetch_sub(&cur, (long)n);
}
void *malloc(size_t n) { void *p = __libc_malloc(n); add(p); return p; }
void free(void *p) { sub(p); __libc_free(p); }
void *calloc(size_t a, size_t b) { void *p = __libc_calloc(a, b); add(p); return p; }
void *realloc(void *q, size_t n) {
  sub(q);
  void *p = __libc_realloc(q, n);
  if (p) add(p); else if (q && n) add(q);
  return p;
}
void *memalign(size_t a, size_t n) { void *p = __libc_memalign(a, n); add(p); return p; }
void *aligned_alloc(size_t a, size_t n) { return memalign(a, n); }
void *valloc(size_t n) { return memalign(4096, n); }
int posix_memalign(void **out, size_t a, size_t n) {
  void *p = __libc_memalign(a, n);
  if (!p && n) return ENOMEM;
  add(p);
  *out = p;
  return 0;
}
long memtrack_current(void) { return atomic_load(&cur); }
long memtrack_peak(void) { return atomic_load(&peak); }
void memtrack_reset_peak(void) { atomic_store(&peak, atomic_load(&cur)); }
""" % MIN_BLOCK


def build_memtrack(out_dir: Optional[Path] = None) -> Optional[Path]:
    """Compile the shim; its path, or None without a C compiler (or on a non-glibc system)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        return None
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="memtrack-"))
    src, lib = out_dir / "memtrack.c", out_dir / "libmemtrack.so"
    src.write_text(MEMTRACK_C)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)],
                          capture_output=True, text=True)
    return lib if done.returncode == 0 and lib.exists() else None


@contextlib.contextmanager
def preloaded(lib: Path) -> Iterator[None]:
    """LD_PRELOAD the shim into the processes spawned inside (run_ranks' ranks)."""
    old = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = str(lib) + (f" {old}" if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old


class Heap:
    """The shim's counters in this process (LD_PRELOADed): live bytes and high-water mark."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None)
        try:
            self._cur, self._peak = lib.memtrack_current, lib.memtrack_peak
            self._reset = lib.memtrack_reset_peak
        except AttributeError:
            raise RuntimeError("the memtrack shim is not preloaded in this process") from None
        self._cur.restype = self._peak.restype = ctypes.c_long

    def current(self) -> int:
        return int(self._cur())

    def take_peak(self) -> int:
        """The high-water mark since the last call; starts a new one."""
        peak = int(self._peak())
        self._reset()
        return peak


# --- cases ------------------------------------------------------------------------------------


# train.loss=chunked cases: chunks of a quarter of a micro-batch-4 step (4 chunks at b=4)
LOSS_CHUNK = 256


def overrides(world: int, strategy: str, precision: str, ac: str, batch: int,
              tied: bool = False, grad_accum: int = 1, packed: str = "",
              optim: str = "", method: str = "full", loss: str = "full") -> list[str]:
    """``packed``: "" for unpacked input_ids, else the attention over packed records;
    ``optim``: "" for AdamW, else the optim= option and its flags: "adamw8bit", "adamw4bit
    eager" (optim.eager), "adamw sr" (optim.bf16_stochastic_round); ``method``: finetune=full |
    lora | qlora (conf/finetune's defaults: rank 16, all 7 projections); ``loss``: train.loss
    (full, the loss the sweep was first measured with; chunked, in LOSS_CHUNK-token chunks),
    and "offload" after it for checkpointing.offload=true."""
    name, *flags = loss.split()
    o = ["tracking.enabled=false", "cluster.device=cpu", f"cluster.nproc_per_node={world}",
         f"sharding={strategy}", f"precision={precision}", f"checkpointing={ac}",
         f"train.batch_size={batch}", f"train.grad_accum={grad_accum}", "train.seq_len=256",
         *SHAPE, f"model.tie_word_embeddings={str(tied).lower()}", f"finetune={method}",
         f"train.loss={name}", f"train.loss_chunk={LOSS_CHUNK}",
         *(["checkpointing.offload=true"] if "offload" in flags else [])]
    if packed:  # _batches adds position_ids restarting per record
        o += ["data.packing=true", f"model.attn_implementation={packed}"]
    else:  # _batches makes unpacked input_ids: no document mask
        o.append("data.packing=false")
    if strategy in ("hybrid", "hybrid_grad_op") and world == 4:
        o.append("sharding.shard_size=2")
    if optim:
        name, *flags = optim.split()
        o += [f"optim={name}", *({"eager": "optim.eager=true",
                                 "sr": "optim.bf16_stochastic_round=true"}[f] for f in flags)]
    return o


def case_name(world: int, strategy: str, precision: str, ac: str, batch: int,
              tied: bool = False, grad_accum: int = 1, packed: str = "", optim: str = "",
              method: str = "full", loss: str = "full") -> str:
    return ((f"{method}, " if method != "full" else "")
            + f"{world} ranks, {strategy}, {precision}, AC {ac}, b={batch}"
            + (f" x {grad_accum}" if grad_accum > 1 else "") + (", tied" if tied else "")
            + (f", packed ({packed})" if packed else "") + (f", {optim}" if optim else "")
            + ("".join(f", {w} loss" if i == 0 else f", {w}" for i, w in
                       enumerate(loss.split())) if loss != "full" else ""))


# --- on each rank -----------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


PACKED_RECORDS = (8, 40)  # record lengths of the packed cases' rows (tokens)


def _batches(spec, rank: int, steps: int) -> list[list[dict]]:
    """Random tokens: per step, train.grad_accum micro-batches (with packed records'
    position_ids when data.packing is on)."""
    import torch

    from benchmarks.peers.common import packed_positions

    t = spec.train
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(t.grad_accum):
            ids = torch.randint(0, spec.model.vocab_size, (t.batch_size, t.seq_len),
                                generator=gen)
            micro.append({"input_ids": ids, "labels": ids.clone()})
            if spec.data.packing:
                micro[-1]["position_ids"] = packed_positions(t.batch_size, t.seq_len,
                                                             PACKED_RECORDS, gen)
        out.append(micro)
    return out


def warm_up(spec, batches: list[list[dict]], rank: int = 0) -> None:
    """One throw-away step with the case's shapes, so the math libraries' caches exist before
    the baseline is taken.

    MKL keeps the packing buffers of its GEMMs in its own memory pool, and oneDNN keeps its
    primitives (with their packed weights) in a cache and its scratchpad per thread; none of
    them is freed when the tensors are. Their sizes depend on the kernels the CPU gets: MKL
    takes its AVX-512 paths only on Intel CPUs, oneDNN uses AMX tiles where the CPU has them,
    and avx512_bf16 or plain AVX2 elsewhere. Measured on an AMD EPYC (Zen 4, avx512_bf16):
    5.1 MB of MKL pool after an fp32 step (0.1 MB with MKL_DISABLE_FAST_MM=1) and 4-9 MB of
    oneDNN state after a bf16 step (0.1 MB with ONEDNN_MAX_CPU_ISA=AVX2); another machine
    left 23 MB. Warmed up, a case's own step leaves nothing behind on any CPU, so what remains
    after it ("end") is a real leak, and the peaks are the tensors alone.
    """
    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.train.loop import build_scheduler, train_step
    from llama_fsdp.train.worker import build_model, compile_cache

    import torch

    model = build_model(spec, torch.device("cpu"))  # a compiled step compiles here, once
    optimizer = build_optimizer(model, spec.train, spec.optim,
                                compile_dir=compile_cache(spec, model, rank))
    scheduler = build_scheduler(optimizer, spec.train)
    train_step(model, optimizer, scheduler, batches[0], device=torch.device("cpu"),
               max_grad_norm=spec.train.max_grad_norm)
    del model, optimizer, scheduler
    gc.collect()


def measure_case(spec, rank: int, steps: int = 2, *, warm: bool = True) -> dict[str, Any]:
    """Build the sharded model, run `steps` real train_steps; heap bytes above the baseline.

    warm: run warm_up first, so the baseline already holds the math libraries' caches.
    init: live after model + optimizer construction (the optimizer state is created lazily);
    steps: per step, the live bytes at its start and the peak of each phase.
    """
    import torch

    from llama_fsdp.model.llama import decoder_layers
    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.train.loop import build_scheduler, train_step
    from llama_fsdp.train.worker import build_model, compile_cache

    heap = Heap()
    device = torch.device("cpu")
    batches = _batches(spec, rank, steps)
    if warm:
        warm_up(spec, batches, rank)
    gc.collect()
    base, rss0, t0 = heap.current(), _rss_bytes(), time.perf_counter()
    model = build_model(spec, device)
    # a compiled optimizer step's cache, as the worker sets it
    optimizer = build_optimizer(model, spec.train, spec.optim,
                                compile_dir=compile_cache(spec, model, rank))
    scheduler = build_scheduler(optimizer, spec.train)
    init = heap.current() - base
    phase: dict[str, int] = {}

    def mark(name: str) -> None:  # the highest over a step's micro-batches
        phase[name] = max(phase.get(name, 0), heap.take_peak() - base)

    # train.loss=chunked computes the loss inside the head's forward (llama_fsdp/objective/loss.py): the
    # forward phase ends where the head starts, the loss phase where it returns
    chunked = spec.train.loss == "chunked"

    def after_forward(module, args, output) -> None:
        mark("loss" if chunked else "forward")
        output.logits.register_hook(lambda grad: mark("loss"))

    frozen_input = [False]

    def before_first_layer(module, args, kwargs) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        frozen_input[0] = hidden is not None and not hidden.requires_grad
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(lambda grad: mark("layers"))

    def after_first_projection(module, args, output) -> None:
        # a frozen embedding (finetune=lora / qlora): layer 0's input needs no gradient, so the
        # layers' backward ends where the gradient reaches layer 0's q_proj
        if frozen_input[0] and output.requires_grad:
            output.register_hook(lambda grad: mark("layers"))

    first = decoder_layers(model)[0]
    q_proj = next(m for n, m in first.named_modules() if n.endswith("q_proj"))
    head = model.get_output_embeddings()
    hooks = [head.register_forward_pre_hook(lambda m, a: mark("forward")),
             head.register_forward_hook(lambda m, a, o: mark("loss" if chunked else "forward")),
             model.register_forward_hook(after_forward),
             first.register_forward_pre_hook(before_first_layer, with_kwargs=True),
             q_proj.register_forward_hook(after_first_projection),
             optimizer.register_step_pre_hook(lambda opt, args, kwargs: mark("root"))]
    out_steps = []
    for micro in batches:
        start = heap.current() - base
        heap.take_peak()
        phase.clear()
        train_step(model, optimizer, scheduler, micro, device=device,
                   max_grad_norm=spec.train.max_grad_norm)
        mark("optimizer")
        out_steps.append({"start": start, **phase})
    rss_live = _rss_bytes()
    small = small_state_bytes(model, optimizer)
    for h in hooks:
        h.remove()
    del model, optimizer, scheduler, hooks, first, q_proj, head
    gc.collect()
    return {"init": init, "steps": out_steps, "end": heap.current() - base, "rss0": rss0,
            "rss_after": rss_live, "seconds": time.perf_counter() - t0, "small": small}


def small_state_bytes(model, optimizer) -> int:
    """Bytes of the parameters' and optimizer states' tensors (this rank's shards; every inner
    tensor of an NF4 weight or a low-bit moment) smaller than the shim's MIN_BLOCK: live all step, but not seen by
    the shim. At the tiny shape every adapter and NF4 shard is one (1-3 MB in all)."""
    import torch

    def plain(t) -> list:  # a DTensor's local shard; a subclass's inner tensors, recursively
        t = t.to_local() if hasattr(t, "to_local") else t
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
            return [t]
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in plain(getattr(t, n))]

    tensors = [x for p in model.parameters() for x in plain(p)]
    for state in optimizer.state.values():
        tensors += [x for v in state.values() if torch.is_tensor(v) for x in plain(v)]
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for n in sizes.values() if n < MIN_BLOCK)


def measure_on_rank(rank: int, world: int, specs: dict[str, Any], steps: int = 2) -> dict:
    """Every case in turn on this rank (one process group): name -> measure_case's result."""
    import torch

    torch.set_num_threads(1)
    out = {name: measure_case(spec, rank, steps) for name, spec in specs.items()}
    out["_ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def rss_on_rank(rank: int, world: int, spec) -> dict:
    """One case in fresh processes: peak RSS (ru_maxrss, MLflow's peak_memory_gb on CPU) less
    the RSS just before the model was built."""
    import torch

    torch.set_num_threads(1)
    res = measure_case(spec, rank, steps=2, warm=False)  # ru_maxrss: the first step's too
    return {**res, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def peak_of(result: dict) -> int:
    """One rank's peak: the highest phase high-water mark over the steps, less the process
    overhead (what the runtime still holds once the model and optimizer are gone), with the
    state tensors too small for the shim (small_state_bytes)."""
    return (max(v for s in result["steps"] for k, v in s.items() if k in PHASES)
            - result["end"] + result.get("small", 0))


# --- driver -----------------------------------------------------------------------------------

# torchao's optimizers (optim=): 8- and 4-bit moments on every strategy, micro-batch 1 with AC
# (where the optimizer phase and the root's reduce-scatter weigh most) and 4, eager, and AdamW
# with bf16 stochastic rounding
LOWBIT_CASES = (
    [(2, "full", p, ac, b, False, 1, "", o) for o in ("adamw8bit", "adamw4bit")
     for p, ac, b in (("fp32", "none", 4), ("bf16", "full", 1))]
    + [(2, "grad_op", "mixed", "full", 1, False, 1, "", "adamw4bit"),
       (2, "no_shard", "fp32", "none", 2, False, 1, "", "adamw8bit"),
       (4, "hybrid", "bf16", "full", 1, False, 1, "", "adamw4bit"),
       (4, "full", "fp32", "full", 1, True, 1, "", "adamw8bit"),
       (2, "full", "fp32", "full", 1, False, 1, "", "adamw8bit eager"),
       (2, "full", "bf16", "full", 1, False, 1, "", "adamw4bit eager"),
       (2, "full", "bf16", "full", 1, False, 1, "", "adamw sr")]
)
FULL_CASES = (
    [(w, s, p, ac, 4) for w in (2, 4) for s in ("full", "grad_op", "no_shard", "hybrid")
     for p in ("fp32", "bf16") for ac in ("none", "full") if not (s == "hybrid" and w == 2)]
    + [(w, s, p, ac, 1) for w in (2, 4) for s in ("full", "grad_op") for p in ("fp32", "mixed")
       for ac in ("none", "full")]
    + [(2, s, "mixed", ac, 4) for s in ("full", "no_shard") for ac in ("none", "full")]
    # tied embedding and gradient accumulation
    + [(2, s, p, ac, 1, True) for s, p, ac in (("full", "fp32", "full"), ("full", "bf16", "none"),
                                                ("grad_op", "mixed", "full"),
                                                ("no_shard", "bf16", "full"))]
    + [(4, "hybrid", "fp32", "full", 1, True), (4, "full", "mixed", "none", 1, True)]
    + [(2, "full", "fp32", "none", 2, False, 2), (2, "grad_op", "bf16", "full", 1, False, 2),
       (2, "full", "mixed", "full", 1, True, 2), (4, "no_shard", "fp32", "none", 1, False, 2)]
    # no_shard is DDP: its buckets with accumulation and a tied embedding, autocast with AC
    + [(2, "no_shard", "fp32", "none", 2, False, 2), (2, "no_shard", "fp32", "none", 4, True),
       (2, "no_shard", "mixed", "full", 1, True, 2)]
    # packed records: varlen (the CPU default, block-sparse SDPA) and SDPA's dense mask
    + [(2, "full", "fp32", "none", 4, False, 1, a) for a in ("varlen", "sdpa")]
    + [(2, "full", "bf16", "full", 4, False, 1, "varlen"), (2, "no_shard", "fp32", "none", 4,
                                                             False, 1, "varlen"),
       (2, "grad_op", "mixed", "none", 1, True, 2, "varlen")]
    # SELECTIVE_AND_MASK_CASES: layer-selective AC (every 2nd of the 4 layers) and SDPA's
    # dense mask in 16-bit and under activation checkpointing
    + [(2, "full", "fp32", "selective", 4), (2, "full", "bf16", "selective", 4),
       (2, "grad_op", "mixed", "selective", 1), (2, "no_shard", "fp32", "selective", 4),
       (2, "full", "mixed", "selective", 1, True, 2), (4, "full", "fp32", "selective", 1),
       (2, "full", "bf16", "none", 4, False, 1, "sdpa"),
       (2, "full", "fp32", "selective", 4, False, 1, "sdpa"),
       (2, "full", "fp32", "full", 4, False, 1, "sdpa")]
    + LOWBIT_CASES
)
# finetune=lora | qlora (rank 16 on all 7 projections): a frozen base without gradients or
# optimizer state, NF4 for qlora; every strategy, precision and AC mode, tied, accumulation,
# packed records, 1 to 4 ranks (the tiny shape's k / v cannot be NF4 over 4 shards: qlora at 4
# ranks is hybrid 2 x 2)
ADAPTER_CASES = (
    [(w, "full", p, ac, b, False, 1, "", "", m) for m in ("lora", "qlora") for w, p, ac, b in
     ((1, "bf16", "full", 1), (2, "fp32", "none", 4), (2, "bf16", "full", 1),
      (2, "mixed", "none", 4))]
    + [(2, "grad_op", "bf16", "full", 4, False, 1, "", "", "lora"),
       (2, "grad_op", "mixed", "none", 1, False, 1, "", "", "qlora"),
       (2, "no_shard", "fp32", "none", 4, False, 1, "", "", "lora"),
       (2, "no_shard", "mixed", "full", 1, False, 1, "", "", "qlora"),
       (2, "full", "mixed", "full", 1, True, 2, "", "", "qlora"),
       (2, "full", "mixed", "full", 1, True, 1, "", "", "lora"),
       (2, "full", "fp32", "none", 4, False, 1, "varlen", "", "lora"),
       (4, "hybrid", "bf16", "full", 4, False, 1, "", "", "qlora"),
       (4, "full", "fp32", "full", 1, False, 1, "", "", "lora")]
)
FULL_CASES += ADAPTER_CASES
# train.loss=chunked (llama_fsdp/objective/loss.py, chunks of LOSS_CHUNK tokens): every strategy,
# precision and AC mode, micro-batch 1 to 4, tied with accumulation, lora / qlora, packed
# records; and checkpointing.offload (on CPU a plain copy of each checkpointed input)
LOSS_CASES = (
    # one rank: FSDP2 gathers nothing in a group of one (llama_fsdp.plan.phases.alone), and the
    # chunked loss runs inside the head's forward, where more ranks hold its all-gather output
    [(1, "full", "bf16", "full", 1, False, 1, "", "", m, "chunked") for m in ("lora", "qlora")]
    + [(1, "full", "bf16", "none", 2, False, 1, "", "", "full", "chunked"),
       (1, "full", "mixed", "none", 2, True, 1, "", "", "full", "chunked")]
    + [(w, s, p, ac, b, False, 1, "", "", "full", "chunked") for w, s, p, ac, b in
     ((2, "full", "fp32", "none", 4), (2, "full", "bf16", "none", 2), (2, "full", "bf16", "full", 4),
      (2, "full", "mixed", "full", 1), (2, "grad_op", "bf16", "none", 4),
      (2, "no_shard", "fp32", "none", 4), (2, "no_shard", "mixed", "none", 4),
      (4, "hybrid", "bf16", "none", 4), (4, "full", "fp32", "full", 1))]
    + [(2, "full", "mixed", "full", 1, True, 2, "", "", "full", "chunked"),
       (2, "no_shard", "bf16", "full", 1, True, 1, "", "", "full", "chunked"),
       (2, "full", "fp32", "none", 4, False, 1, "varlen", "", "full", "chunked"),
       (2, "full", "bf16", "full", 1, False, 1, "", "", "qlora", "chunked"),
       (2, "full", "mixed", "none", 4, False, 1, "", "", "lora", "chunked"),
       (2, "full", "mixed", "full", 1, True, 2, "", "", "qlora", "chunked"),
       (4, "hybrid", "bf16", "full", 4, False, 1, "", "", "qlora", "chunked"),
       (2, "full", "fp32", "full", 4, False, 1, "", "", "full", "chunked offload"),
       (2, "full", "bf16", "full", 1, False, 1, "", "", "qlora", "chunked offload")]
)
FULL_CASES += LOSS_CASES
QUICK_CASES = [(2, "full", "fp32", "none", 4), (2, "grad_op", "bf16", "full", 4),
               (2, "full", "mixed", "full", 1, True, 2), (4, "no_shard", "fp32", "none", 4),
               (4, "hybrid", "bf16", "full", 4), (4, "full", "fp32", "full", 1)]
RSS_CASES = [(2, "full", "fp32", "none", 4), (2, "grad_op", "bf16", "full", 4),
             (4, "no_shard", "fp32", "none", 4)]


def _row(case, spec, per_rank: list[dict]) -> dict:
    from llama_fsdp.plan import make_plan

    best = max(per_rank, key=peak_of)
    phases = {k: max(s[k] for s in best["steps"]) - best["end"] + best.get("small", 0)
              for k in PHASES}
    model = phase_peaks(spec, gloo=True)
    return {"case": case, "name": case_name(*case), "plan": make_plan(spec), "model": model,
            "measured": peak_of(best), "phases": phases, "overhead": best["end"],
            "per_rank": per_rank}


def run_cases(cases, lib: Path, *, steps: int = 2, timeout: float = 1800) -> list[dict]:
    """Each world size's cases in one run_ranks call; a row per case (the worst rank)."""
    from tests.conftest import make_spec
    from tests.distributed import run_ranks

    rows = []
    for world in sorted({c[0] for c in cases}):
        mine = [c for c in cases if c[0] == world]
        specs = {case_name(*c): make_spec(overrides(*c), output_dir="/tmp/llama_fsdp_planmem")
                 for c in mine}
        with preloaded(lib):
            results = run_ranks(measure_on_rank, world, specs, steps, timeout=timeout)
        rows += [_row(c, specs[case_name(*c)], [r[case_name(*c)] for r in results])
                 for c in mine]
    return rows


def _rss_row(case, spec, per_rank: list[dict]) -> dict:
    return {**_row(case, spec, per_rank), "rss0": max(r["rss0"] for r in per_rank),
            "rss_delta": max(r["ru_maxrss"] - r["rss0"] for r in per_rank)}


def rss_rows(cases, lib: Path) -> list[dict]:
    """Each case in fresh processes, for peak RSS (ru_maxrss is a process-lifetime maximum)."""
    from tests.conftest import make_spec
    from tests.distributed import run_ranks

    rows = []
    for c in cases:
        spec = make_spec(overrides(*c), output_dir="/tmp/llama_fsdp_planmem")
        with preloaded(lib):
            rows.append(_rss_row(c, spec, run_ranks(rss_on_rank, c[0], spec, timeout=600)))
    return rows


def rows_from_json(path: Path) -> tuple[list[dict], list[dict], Optional[float]]:
    """Rows again from --json's raw measurements (to re-render the table)."""
    import json

    from tests.conftest import make_spec

    raw = json.loads(path.read_text())

    def spec(case):
        return make_spec(overrides(*case), output_dir="/tmp/llama_fsdp_planmem")

    return ([_row(tuple(r["case"]), spec(r["case"]), r["per_rank"]) for r in raw["rows"]],
            [_rss_row(tuple(r["case"]), spec(r["case"]), r["per_rank"]) for r in raw["rss"]],
            raw.get("seconds"))


def _gb(b: float) -> str:
    return f"{b / GB:.4f}"


def markdown(rows: list[dict], rss: list[dict], command: str) -> str:
    ratio = [r["measured"] / r["plan"].memory.total for r in rows]
    model = [r["measured"] / max(r["model"].values()) for r in rows]
    lines = [
        "# Planned vs measured peak memory per rank, CPU gloo ranks",
        "",
        f"Produced by `{command}` (torch 2.13 CPU build, 2 cores, 2 measured steps per "
        "config; the method is in the script's docstring). Model: h=256, 4 layers, 8/4 heads, "
        "i=768, vocab 8192, seq_len 256. GB = 1e9 bytes.",
        "",
        "- *sum*: `make_plan(spec).memory.total`, the sum of the plan's components (what "
        "`predicted_peak_bytes` was before the plan adopted the phase model).",
        "- *measured*: the highest heap high-water mark of any rank in any phase of the 2 steps, "
        "above the heap just before the model was built, less the process overhead "
        "(*ovh*: what the runtime still holds after the model, optimizer and batches are "
        "deleted: MKL / oneDNN / gloo buffers, 0-10 MB), plus the parameters' and optimizer "
        "states' tensors smaller than the shim's 64 KiB blocks (live all step, unseen by it: "
        "at this shape every LoRA adapter and NF4 shard, 1-3 MB in all).",
        "- *predicted*: `make_plan(spec).predicted_peak_bytes`, i.e. "
        "`max(phase_peaks(spec, gloo=True).values())`, the plan's per-phase model "
        "(docstring of `llama_fsdp.plan.phase_peaks`). The cases set data.packing=false "
        "(the batches are unpacked input_ids), except the *packed* ones: position_ids restart "
        f"at records of {PACKED_RECORDS[0]}-{PACKED_RECORDS[1]} tokens, run by the attention "
        "named (varlen, the CPU default: block-sparse SDPA; sdpa: transformers' dense mask).",
        "- *peak phase*: where the measured peak is / where the phase model puts it.",
        "",
        "| config | sum GB | measured GB | measured / sum | predicted GB "
        "| measured / predicted | peak phase | ovh MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mod = r["model"]
        lines.append(
            f"| {r['name']} | {_gb(r['plan'].memory.total)} | {_gb(r['measured'])} | "
            f"{r['measured'] / r['plan'].memory.total:.3f} | {_gb(max(mod.values()))} | "
            f"{r['measured'] / max(mod.values()):.3f} | {max(r['phases'], key=r['phases'].get)} / "
            f"{max(mod, key=mod.get)} | {r['overhead'] / 1e6:.1f} |")
    lines += [
        "",
        f"{len(rows)} configs. measured / sum: {min(ratio):.3f} to {max(ratio):.3f} "
        f"(the sum is {1 / min(ratio) - 1:.0%} above the real peak at worst). "
        f"measured / predicted (phase model): {min(model):.3f} to {max(model):.3f}.",
        "",
        "## What the numbers say",
        "",
        "- The plan's terms are right where they are live: in the loss phase (the peak of "
        "every micro-batch-4 config here) the heap holds params + AdamW moments + the "
        "plan's activations (less the recomputed layer) + `logits_loss` + the unsharded params "
        "kept (all of them, or the last layer) to within 1%.",
        "- `Memory.total` adds, at the start of backward, three things that are not live then: "
        "the sharded grads (None until the step's first reduce-scatter: "
        "`zero_grad(set_to_none=True)`); `comm_buffers` (2 layers in flight and the largest "
        "unit's params, grads and reduce-scatter input, never all at once: untied, the head "
        "is resharded after its own backward and the embedding is never gathered in backward; "
        "tied, the root, left at FSDP2's default, stays gathered from forward to its own "
        "backward); and the layer that activation checkpointing recomputes "
        "(inside the layers' backward, once the loss buffers are gone). Hence the real "
        f"peak is {min(ratio):.0%} to {max(ratio):.0%} of the sum, the least with AC on and "
        "micro-batch 1.",
        "- FSDP units (parallel.apply_fsdp): an untied model is sharded in torchtitan's groups "
        "(the embedding alone, each layer, [norm, head] not resharded after forward, an empty "
        "root); a tied one keeps embedding, norm and head in the root, not resharded after "
        "forward (FSDP2's default for the root; resharding it made backward start with an "
        "all-gather of the whole root that nothing overlapped). Against the earlier "
        "grouping (every layer, then a root holding embedding, norm and head), measured on "
        "these 40 untied FSDP configs: micro-batch 1 peaks 2-22% lower (the embedding and head "
        "are no longer gathered together for the whole backward), micro-batch 4 full / hybrid "
        "peaks 2-6% higher (the head stays gathered through the loss, the price of not "
        "all-gathering it again when backward starts), grad_op unchanged.",
        "- Other phases need terms the sum lacks; they win when the loss buffers are small "
        "(micro-batch 1): the head's and the embedding's reduce-scatter inputs (the root's, "
        "embedding + head, when tied) are far larger than `layer * reduce_bytes`; gloo's `_reduce_scatter_base_` clones its input (CPU only); "
        "foreach AdamW makes one param-sized temporary; a tied embedding's grad is made beside "
        "the head's and summed out of place; with `grad_accum > 1` the sharded grads are live "
        "in forward.",
        "- `llama_fsdp.plan.phase_peaks` puts those together, phase by phase, and the library "
        "now uses it: `Plan.predicted_peak_bytes` is its maximum (`gloo=True` for CPU runs), "
        "so fits / headroom / `check_fits` / `sharding=auto` use it, and `Plan.table()` shows "
        "the peak by phase beside the component sizes (`Memory`, whose `total` is the sum "
        "above).",
        "- The batches here are input_ids only. Packed batches (position_ids restarting per "
        "document) make transformers build a 4-D mask, and SDPA then gets k/v repeated to all "
        "heads and keeps a compute-dtype copy of the b x s x s mask per layer: "
        "+ layers x b x s x (2c(h - g) + c s) bytes, measured +8.7 MB (fp32, b=4, s=256), "
        "+12.7 MB (fp32, b=2, s=512) and +6.4 MB (bf16, b=2, s=512) with AC none. The plan "
        "counts it (`packed_mask_bytes`, in the activations of every saved layer and of the "
        "recomputed one) when data.packing is true with model.attn_implementation=sdpa; at "
        "s=8192 it is GBs per layer stack. varlen, the default for packed rows on CPU and on "
        "CUDA in 16-bit, keeps no such mask (on CPU its chunks' masks, made once per "
        "micro-batch, are counted at their bound of s bools per token): the *packed* rows above "
        "measure both.",
        "- Low-bit AdamW (the rows naming an optimizer: `optim=adamw8bit`, `adamw4bit`; "
        "`eager`: `optim.eager=true`; `adamw sr`: AdamW with `optim.bf16_stochastic_round`): "
        "the state is `llama_fsdp/plan/optimizer.py`'s codes, fp32 block scales, code tables "
        "and full-precision moments of the small parameters (equal to the bytes torchao "
        "allocates: tests/multirank/test_optim.py). torchao steps one parameter at a time, so "
        "instead of foreach AdamW's param-sized temporary the optimizer phase holds a few fp32 "
        "copies of the largest local parameter: measured 1.1-1.9 (8-bit), 6.0-6.1 (4-bit), "
        "13.0-13.8 (eager), none with stochastic rounding (one fused in-place kernel); planned "
        "2, 6.5, 14 and 0. With the state smaller, 4-bit peaks move into the optimizer step at "
        "micro-batch 1. The tied 4-rank 8-bit row is the plan's loosest (0.85): the layers "
        "phase of a tied model is over-predicted with AdamW too (0.86 in the tied AdamW rows' "
        "per-phase table), and 8-bit moments leave less around it.",
        "- finetune=lora / qlora (the rows named so; rank 16 on all 7 projections) have their "
        "own phase model (`llama_fsdp/plan/lora.py`): a frozen base (16-bit, NF4 with its "
        "scales for qlora's projections) with no gradients and no optimizer state, the "
        "adapters' gradients and moments, LoRA's saved activations (no RMSNorm x rsqrt, each "
        "adapter's rank-wide A x), layers gathered in 4 bits and dequantized one weight at a "
        "time, no head or embedding backward, and a step that ends at layer 0, whose "
        "reduce-scatter waits for FSDP2's final callback (its input needs no gradient). The "
        "peak is the loss phase's in every one of them.",
        "- objective=dpo (measured by `benchmarks/dpo_cpu.py` with the same malloc shim and "
        "method, on 2 ranks at the default shape, LoRA and full fine-tuning, the reference live "
        "and cached): measured / predicted 0.989 for DPO with LoRA (SFT with LoRA on the same "
        "pairs: 1.004), 0.906 for DPO with full fine-tuning and its frozen sharded reference "
        "(SFT: 0.909), 1.004 / 0.902 with the reference's log-probs cached; the table is "
        "benchmarks/dpo_cpu.md.",
        "- train.loss=chunked (the rows naming the chunked loss, in chunks of 256 tokens; "
        "every other row pins train.loss=full, the loss the sweep was first measured with): "
        "one chunk's logits in the compute dtype beside their fp32 copy, the hidden and its "
        "gradient over the micro-batch, the head's gradient made in forward where it trains, "
        "and, since the loss runs inside the head's forward, the head unit's all-gather "
        "output still held (`llama_fsdp/plan/loss.py`). Measured within 0.93 to 1.02 of the "
        "plan, its loss phase within 0.93 to 1.02. The *offload* rows "
        "(checkpointing.offload=true) are a plain copy on CPU and change nothing here: their "
        "pinned host memory and device saving are CUDA's "
        "(tests/gpu/test_gpu_long_context.py). Against the same config with the full loss, "
        "the peak drops by what the plan says (tests/multirank/test_plan_memory.py: 2 ranks, "
        "full, bf16, AC none, b=2: planned 103.4 -> 70.3 MB).",
        "- `tests/multirank/test_plan_memory.py` checks 24 of these configs on every run "
        "(4 with low-bit moments, one of them eager, the tied 4-rank 8-bit row, 5 lora / qlora, "
        "6 with the chunked loss): measured within [0.88, 1.02] x `predicted_peak_bytes` (the "
        "phase model) with AdamW, within [0.965, 1.035] (README's 3.5%) with low-bit moments or "
        "adapters, within [0.85, 1.02] for the tied 4-rank 8-bit row; measured <= the sum and "
        ">= 0.55 x the sum, "
        "and the heap at the start of step 2 equal to params + optimizer state (1 MB + 1%).",
        "",
        "## Per phase, measured / predicted",
        "",
        "| config | " + " | ".join(PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    for r in rows:
        lines.append(f"| {r['name']} | " + " | ".join(
            f"{r['phases'][k] / r['model'][k]:.2f}" for k in PHASES) + " |")
    if rss:
        lines += [
            "",
            "## Process RSS, for the record",
            "",
            "Each case in fresh processes: peak RSS (`ru_maxrss`, which MLflow's "
            "`peak_memory_gb` reports on CPU) less the RSS just before the model was built, "
            "max over the ranks. RSS also holds heap pages freed but kept by glibc, thread "
            "stacks, and the code and JIT kernels loaded on first use, so it is no measure of "
            "the plan at this size.",
            "",
            "| config | sum GB | heap peak GB | RSS before build GB "
            "| peak RSS - before GB | (peak RSS - before) / sum |",
            "|---|---|---|---|---|---|",
        ]
        for r in rss:
            pred = r["plan"].memory.total
            lines.append(f"| {r['name']} | {_gb(pred)} | {_gb(r['measured'])} | "
                         f"{r['rss0'] / GB:.3f} | {_gb(r['rss_delta'])} | "
                         f"{r['rss_delta'] / pred:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few cases")
    ap.add_argument("--only", action="append", default=None, metavar="TEXT",
                    help="only the full sweep's cases whose name contains TEXT (repeatable); "
                    "prints their table rows (no RSS runs)")
    ap.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS runs")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown here")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw measurements")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="render the markdown from an earlier --json instead of measuring")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    seconds = None
    if args.from_json:
        rows, rss, seconds = rows_from_json(args.from_json)
    else:
        lib = build_memtrack()
        if lib is None:
            sys.exit("needs a C compiler (cc) on Linux to build the malloc shim")
        cases = QUICK_CASES if args.quick else FULL_CASES
        if args.only:
            cases = [c for c in cases if any(t in case_name(*c) for t in args.only)]
            if not cases:
                sys.exit(f"no case of the full sweep matches {args.only}")
            args.no_rss = True
        rows = run_cases(cases, lib)
        for r in rows:
            print(f"{r['name']:<40} sum {_gb(r['plan'].memory.total)}  measured "
                  f"{_gb(r['measured'])}  predicted {_gb(r['plan'].predicted_peak_bytes)}",
                  flush=True)
        rss = [] if args.no_rss else rss_rows(RSS_CASES, lib)
        seconds = time.perf_counter() - t0
        if args.json:
            import json

            raw = {k: [{"case": r["case"], "per_rank": r["per_rank"]} for r in v]
                   for k, v in (("rows", rows), ("rss", rss))}
            args.json.write_text(json.dumps({**raw, "seconds": seconds}))
    command = ("python benchmarks/plan_vs_measured.py" + (" --quick" if args.quick else "")
               + "".join(f" --only '{t}'" for t in args.only or ())
               + (" --no-rss" if args.no_rss and not args.only else "")
               + (f" --out {args.out}" if args.out else ""))
    text = markdown(rows, rss, command)
    if seconds is not None:
        text += f"\nWall time: {seconds:.0f} s.\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
