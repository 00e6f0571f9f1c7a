"""The DPO fixture's export, again and again, under load (issue 66, item 4).

One fresh clone's CI saw tests/multirank/test_dpo.py's module fixture fail once in
``export_hf`` -> ``get_model_state_dict`` -> DTensor ``redistribute`` on gloo, with
``start (128) + length (140175726371696) exceeds dimension size (256)``. This runs what that
fixture runs before an export -- DPO runs of the tiny Llama from an HF folder on 2 gloo ranks,
many in the same two rank processes, every one ending in an export -- and then the full-state
gather alone, ``--gathers`` times more on the last run's model; ``--pairs`` such pairs of rank
processes at once (2: both cores busy, as CI's two pytest workers keep them):

    .venv/bin/python -m benchmarks.dpo_export_repeat --runs 25 --gathers 25 --pairs 2

Every gather is compared with the first: a length read from garbage raises, and a gather that
returned other values would differ. Prints one line per pair and exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
import traceback
from pathlib import Path

STEPS = 1
BASE = ["objective=dpo", "objective.beta=0.5", "eval.every_steps=0", "train.warmup_steps=0",
        f"train.max_steps={STEPS}", "precision=fp32", "data.num_records=240",
        "data.eval_records=24", "train.seq_len=64", "finetune.rank=8", "finetune.alpha=16",
        "train.lr=3e-3", "tracking.enabled=false", "cluster.nproc_per_node=2",
        "train.batch_size=4"]
# the fixture's kinds of run, in turn: each ends in an export (the adapter's, or the whole model's)
# (save.export_hf: the whole model, through export_hf, where the failure was)
KINDS = (["finetune=full", "save.export_hf=true"], ["finetune=lora"],
         ["finetune=full", "sharding=no_shard", "save.export_hf=true"],
         ["finetune=lora", "sharding=grad_op", "checkpointing=full"])


def _session(rank: int, world: int, specs: list, gathers: int) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from llama_fsdp.train.worker import DistEnv, RankRun

    env, cpu = DistEnv(rank, rank, world, world), torch.device("cpu")
    done, errors, run = 0, [], None
    for spec in specs:
        try:
            run = RankRun.build(spec, env, cpu)
            run.train()  # trains STEPS steps and exports at the end
            done += 1
        except Exception:  # noqa: BLE001 -- counted and reported: the point of the script
            errors.append(traceback.format_exc(limit=8))
    first, same = None, 0
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for _ in range(gathers if run is not None else 0):
        try:
            sd = get_model_state_dict(run.model, options=options)
            if rank == 0:
                if first is None:
                    first = {k: v.clone() for k, v in sd.items()}
                same += all(torch.equal(first[k], v) for k, v in sd.items())
            done += 1
        except Exception:  # noqa: BLE001
            errors.append(traceback.format_exc(limit=8))
    return {"done": done, "errors": errors, "same": same}


def _pair(index: int, runs: int, gathers: int, out: "mp.Queue") -> None:
    t0 = time.perf_counter()
    try:
        ranks = _pair_runs(index, runs, gathers)
        out.put((index, time.perf_counter() - t0, ranks, None))
    except BaseException:  # noqa: BLE001 -- reported by the parent, which waits for it
        out.put((index, time.perf_counter() - t0, None, traceback.format_exc()))


def _pair_runs(index: int, runs: int, gathers: int) -> list:
    import torch
    from transformers import LlamaForCausalLM

    from llama_fsdp.data import build_tokenizer
    from llama_fsdp.model.llama import llama_config
    from tests.conftest import make_spec
    from tests.distributed import run_ranks

    root = Path(tempfile.mkdtemp(prefix=f"dpo-export-{index}-"))
    spec = make_spec()
    torch.manual_seed(3)
    hf = root / "tiny-llama"
    LlamaForCausalLM(llama_config(spec.model)).save_pretrained(hf)
    build_tokenizer(spec.data, root / "tok-cache").save_pretrained(hf)
    specs = [make_spec([*BASE, f"model.path={hf}", *KINDS[i % len(KINDS)]],
                       output_dir=root / f"run{i}") for i in range(runs)]
    return run_ranks(_session, 2, specs, gathers, timeout=60 * 60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=25, help="DPO runs (each exports) per pair")
    ap.add_argument("--gathers", type=int, default=25, help="full-state gathers after them")
    ap.add_argument("--pairs", type=int, default=2, help="pairs of rank processes at once")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_pair, args=(i, a.runs, a.gathers, out)) for i in range(a.pairs)]
    for p in procs:
        p.start()
    failed = 0
    for _ in procs:
        index, seconds, ranks, crash = out.get()
        if crash:
            failed += 1
            print(f"pair {index}: crashed after {seconds:.0f} s\n{crash}")
            continue
        errors = [e for r in ranks for e in r["errors"]]
        failed += bool(errors) or ranks[0]["same"] != a.gathers
        print(f"pair {index}: {a.runs} runs + {a.gathers} gathers in {seconds:.0f} s; rank "
              f"exports and gathers done {[r['done'] for r in ranks]}, rank 0's gathers equal "
              f"to its first {ranks[0]['same']}/{a.gathers}, errors {len(errors)}")
        for e in errors[:3]:
            print(e)
    for p in procs:
        p.join()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
