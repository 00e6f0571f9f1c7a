"""Tokenization + packing throughput of the data path, and packing efficiency vs padding.

    .venv/bin/python benchmarks/bench_data.py [--records 50000] [--num-proc 1 2]

Builds a 50k-record Alpaca-style JSONL file (seeded), then times, on a fresh cache each time:
tokenize (datasets.map, cached to disk) and pack (best-fit decreasing), for the synthetic set
and the JSONL file, and reports packed vs padded efficiency. Results: data_throughput.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from pathlib import Path

from llama_fsdp.config.schema import DataConfig
from llama_fsdp.data import Packed, TokenStore, build_tokenizer, tokenize_splits

WORDS = ("the of and to in is was for that with as on by at from his an were are which this be "
         "or has had not but first one their its new after who they have her she two been other "
         "when there all during into school time may years more most only over city some world "
         "would where later up such used many can state about national out known university "
         "united then made series between year three both well film under team number part "
         "music these use could through war four while river high being second including county "
         "north game several south however album name life called before against each within "
         "population system end did because since early group company family work public until "
         "main around government same long those area day back house band took another people "
         "also club career like five best season line among even any old following american "
         "released won station west way born left said book water church show given several").split()
ALPACA = dict(prompt_template="### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
              prompt_template_no_input="### Instruction:\n{instruction}\n\n### Response:\n")


def make_jsonl(path: Path, n: int, seed: int = 0) -> None:
    r = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            rec = {"instruction": " ".join(r.choices(WORDS, k=r.randint(4, 16))).capitalize() + "?",
                   "input": " ".join(r.choices(WORDS, k=r.choice([0, 0, r.randint(5, 60)]))),
                   "output": " ".join(r.choices(WORDS, k=int(r.lognormvariate(3.5, 0.8)) + 1)) + "."}
            f.write(json.dumps(rec) + "\n")


def bench(cfg: DataConfig, seq_len: int, tok, label: str, repeat: int) -> dict:
    """Best of ``repeat`` cold runs (fresh cache: load + tokenize + save), then pack."""
    best = None
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            prep = tokenize_splits(cfg, seq_len=seq_len, cache_dir=Path(cache), tokenizer=tok,
                                show_progress=False)
            t1 = time.perf_counter()
            store = TokenStore(prep.train)
            packed = Packed.build(store, seq_len, tok.pad_token_id, packing=True)
            t2 = time.perf_counter()
            again = tokenize_splits(cfg, seq_len=seq_len, cache_dir=Path(cache), tokenizer=tok)
            Packed.build(TokenStore(again.train), seq_len, tok.pad_token_id, packing=True)
            t3 = time.perf_counter()
            padded = Packed.build(store, seq_len, tok.pad_token_id, packing=False)
        if best is None or t2 - t0 < best[1] - best[0] + best[2] - best[1]:
            best = (t0, t1, t2, t3, prep, store, packed, padded)
    t0, t1, t2, t3, prep, store, packed, padded = best
    tokens = int(store.lengths.sum()) + prep.meta["eval"]["tokens"]
    records = len(store) + prep.meta["eval"]["records"]
    return {"set": label, "num_proc": cfg.num_proc, "seq_len": seq_len, "records": records,
            "tokens": tokens, "tokenize_s": t1 - t0, "pack_s": t2 - t1, "cached_s": t3 - t2,
            "rec_per_s": records / (t2 - t0), "all_tok_per_s": tokens / (t2 - t0),
            "rows_packed": len(packed), "eff_packed": packed.efficiency,
            "rows_padded": len(padded), "eff_padded": padded.efficiency,
            "truncated": prep.meta["train"]["truncated"] + prep.meta["eval"]["truncated"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(DataConfig(), Path(tmp))
        f = Path(tmp) / "alpaca50k.jsonl"
        make_jsonl(f, args.records)
        rows = []
        for n in args.num_proc:
            rows.append(bench(DataConfig(num_records=args.records, eval_records=1000, num_proc=n),
                              128, tok, f"synthetic {args.records // 1000}k", args.repeat))
            for seq_len in (1024, 2048):
                cfg = DataConfig(name="jsonl", path=str(f), eval_records=1000, num_proc=n, **ALPACA)
                rows.append(bench(cfg, seq_len, tok, f"alpaca-style jsonl {args.records // 1000}k",
                                  args.repeat))
    print("| set | num_proc | seq_len | records | tokens | load+tokenize s | pack s "
          "| records/s | tokens/s | cached load+pack s | truncated | rows packed / padded "
          "| efficiency packed / padded |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['num_proc']} | {r['seq_len']} | {r['records']:,} | {r['tokens']:,} "
              f"| {r['tokenize_s']:.1f} | {r['pack_s']:.2f} | {r['rec_per_s']:,.0f} "
              f"| {r['all_tok_per_s']:,.0f} | {r['cached_s']:.2f} | {r['truncated']} "
              f"| {r['rows_packed']:,} / {r['rows_padded']:,} "
              f"| {r['eff_packed']:.3f} / {r['eff_padded']:.3f} |")


if __name__ == "__main__":
    main()
