"""Tables committed under benchmarks/ that are generated, not measured, stay current."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import plan_seed_table

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_classic_budget_table_file_is_current():
    from llama_fsdp.plan.activations import _varlen_repeats_kv

    if _varlen_repeats_kv():
        pytest.skip("the table is of a torch whose varlen_attn takes grouped-query k/v (>= 2.12)")
    table = plan_seed_table.seed_table_markdown()
    assert (BENCHMARKS / "plan_seed_table.md").read_text() == table
    assert "| 8.03 | 16.06 |" in table  # Llama 3.1 8B: 8.03B parameters, 16.06 GB in bf16


@pytest.mark.parametrize("attn", ["auto", "varlen", "sdpa", "eager"])
def test_peers_build_the_framework_model_shape(attn):
    """The harness hands the peers the model node llama_fsdp composes (benchmarks/
    throughput.py, shape.json); they build it with transformers' own attention, never
    llama_fsdp's auto / varlen names, which transformers refuses."""
    import dataclasses

    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.peers.common import llama_config
    from llama_fsdp.config.schema import model_preset

    shape = {**dataclasses.asdict(model_preset("tiny")), "attn_implementation": attn}
    model = LlamaForCausalLM(llama_config(shape))
    assert model.config._attn_implementation == ("sdpa" if attn in ("auto", "varlen") else attn)
    assert model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape[-1] == shape[
        "vocab_size"]


def test_throughput_rounds_rotate_the_runner_order(monkeypatch, tmp_path):
    """Every runner takes every place in the round order equally often (a place can be slow:
    first, right after the previous round's last run has exited), and a runner that has only
    failed is not tried again, while one that ran once is."""
    import types
    from collections import Counter

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its siblings by name
    import throughput
    from throughput_runners import RunResult

    runners = [types.SimpleNamespace(key=k, label=k) for k in ("full", "bare", "hf", "titan")]
    calls: list[tuple[int, str]] = []

    def fake_execute(runner, run_dir, *, round_no, timeout_s):
        calls.append((round_no, runner.key))
        # titan never runs; hf fails in round 2 only (a passing failure)
        failed = runner.key == "titan" or (runner.key == "hf" and round_no == 2)
        return RunResult(runner=runner.key, round=round_no, elapsed_s=1.0,
                         error="cannot run" if failed else None)

    monkeypatch.setattr(throughput, "execute", fake_execute)
    results, rounds = throughput.run_rounds(runners, 6, tmp_path, timeout_s=60)
    assert len(rounds) == 6
    order = {r: [k for n, k in calls if n == r] for r in range(1, 7)}
    assert order[1] == ["full", "bare", "hf", "titan"]
    assert order[2] == ["bare", "hf", "full"]  # titan only failed: dropped
    assert order[3] == ["hf", "full", "bare"]  # hf failed once but ran before: kept
    places = Counter((k, ks.index(k)) for r, ks in order.items() if 2 <= r <= 4 for k in ks)
    # rounds 2-4: three orders of the three runners left, each runner once in each place
    assert all(places[(k, i)] == 1 for k in ("full", "bare", "hf") for i in range(3)), places
    assert [r.ok for r in results["hf"]] == [True, False, True, True, True, True]
    assert len(results["titan"]) == 1


@pytest.mark.parametrize("layout,expected", [("trainer.py", "0.3"), ("trainer/__init__.py", "0.3"),
                                             ("train.py", "0.2")])
def test_titan_runner_reads_the_generation_without_importing_torchtitan(
        monkeypatch, tmp_path, layout, expected):
    """The torchtitan runner picks its API (0.3's Trainer.Config, 0.2's JobConfig) from the
    installed files. Importing torchtitan would run its device probe (cuda when no accelerator
    is present) before the runner can point it at the CPU, so the probe must not import it."""
    import sys

    from benchmarks.peers.titan import generation

    pkg = tmp_path / "torchtitan"
    (pkg / layout).parent.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('the generation probe imported me')\n")
    (pkg / layout).write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchtitan", raising=False)
    assert generation() == expected
    assert "torchtitan" not in sys.modules


@pytest.mark.parametrize("stamped,expect_ok", [(5, True), (3, False)])
def test_a_run_that_crashes_after_its_last_step_keeps_its_steps(
        monkeypatch, tmp_path, stamped, expect_ok):
    """torch 2.13 on gloo sometimes aborts a rank in teardown ("terminate called without an
    active exception") after training finished. A run that stamped every step and then died
    keeps its timings, with the exit reported; one that died before its last step is a failure
    and contributes nothing."""
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from throughput_report import _failures, summarize
    from throughput_runners import Bench, Runner, execute

    script = ("import json, os, time\n"
              f"with open(os.environ['BENCH_STEP_CLOCK'], 'w') as f:\n"
              f"    for s in range(1, {stamped} + 1):\n"
              "        f.write(json.dumps({'step': s, 't': time.time() + s, 'cpu': s}) + '\\n')\n"
              "print('Traceback (most recent call last):\\nRuntimeError: teardown', flush=True)\n"
              "os.abort()\n")

    class Crashing(Runner):
        key = label = "crashing"

        def command(self, run_dir):
            return [sys.executable, "-c", script]

    bench = Bench(device="cpu", ranks=1, model="tiny", batch_size=1, seq_len=8, steps=5,
                  warmup=1, precision="fp32", main_python=Path(sys.executable),
                  bench_python=Path(sys.executable), shape_file=tmp_path / "shape.json")
    result = execute(Crashing(bench), tmp_path / "run", round_no=1, timeout_s=60)
    summary = summarize(Crashing(bench), [result], warmup=1)
    report = "\n".join(_failures([summary]))
    assert result.ok is expect_ok
    if expect_ok:
        assert len(summary.walls) == 4  # steps 2..5 (step 1 is the warm-up), one wall each
        assert result.exit_error.startswith("exit code -6") and "RuntimeError" in result.exit_error
        assert "failed after their last step (kept in the medians)" in report
    else:
        assert summary.walls == [] and "RuntimeError: teardown" in summary.error
        assert "Cannot run here" in report


def test_cuda_step_stamps_come_from_events_without_a_sync_per_step():
    """The step clock on a GPU (stand-in events: CI has no GPU): one synchronize for the time
    base, then each step's stamp is the base plus the event's GPU time since the first; no
    more than `lag` steps wait, and the rest are written at close."""
    from benchmarks.step_clock import _CudaStamps

    syncs, made = [], []

    class Event:
        def __init__(self):
            self.gpu_ms, self.done, self.waited = None, False, False
            made.append(self)

        def record(self):
            self.gpu_ms = 250.0 * (len(made) - 1)  # the GPU finishes a step every 250 ms

        def synchronize(self):
            self.done = self.waited = True

        def query(self):
            return self.done

        def elapsed_time(self, later):
            return later.gpu_ms - self.gpu_ms

    clock = _CudaStamps(lag=2, event=Event, synchronize=lambda: syncs.append(1))
    first = clock.add(1, cpu=0.1)
    assert len(first) == 1 and first[0]["step"] == 1 and syncs == [1]
    t0 = first[0]["t"]
    assert clock.add(2, cpu=0.2) == [] and clock.add(3, cpu=0.3) == []  # queued, not waited on
    out = clock.add(4, cpu=0.4)  # a third waiting step: the oldest is waited for
    assert [s["step"] for s in out] == [2] and made[1].waited and not made[2].waited
    assert out[0]["t"] == pytest.approx(t0 + 0.25) and out[0]["cpu"] == 0.2
    made[2].done = made[3].done = True  # the GPU got there: done steps are written at once
    assert [s["step"] for s in clock.add(5, cpu=0.5)] == [3, 4]
    rest = clock.close()
    assert [s["step"] for s in rest] == [5] and made[4].waited
    assert rest[0]["t"] - t0 == pytest.approx(1.0)
    assert syncs == [1] and clock.close() == []


def test_the_trainer_preset_pairs_llama_fsdp_with_trainer_and_trainer_peft_on_the_same_adapters(
        monkeypatch, tmp_path):
    """`--runners trainer` runs both comparisons in one call: no_shard against the Trainer's
    DDP, and LoRA against Trainer + PEFT with the same rank, alpha and projections, so PEFT
    trains exactly the adapter parameters the framework's plan counts."""
    import argparse
    import dataclasses

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import throughput
    from throughput_runners import Bench

    from benchmarks.peers.common import llama_config
    from benchmarks.peers.hf_trainer import LORA_TARGETS
    from llama_fsdp.config.schema import FinetuneConfig, model_preset
    from llama_fsdp.plan.lora import adapter_params

    import sys

    bench = Bench(device="cpu", ranks=2, model="tiny", batch_size=8, seq_len=128, steps=10,
                  warmup=5, precision="fp32", main_python=Path(sys.executable),
                  bench_python=Path(sys.executable), shape_file=tmp_path / "shape.json")
    args = argparse.Namespace(runners="trainer", device="cpu")
    keys = [r.key for r in throughput.select_runners(args, bench, clock=True)]
    assert keys == ["llama_fsdp_no_shard", "hf_trainer", "llama_fsdp_no_shard_lora",
                    "hf_trainer_peft"]
    ours, peft_runner = throughput.build_runners(
        bench, ["llama_fsdp_no_shard_lora", "hf_trainer_peft"], clock=True)
    rank = throughput.LORA_RANK
    assert {"finetune=lora", f"finetune.rank={rank}", f"finetune.alpha={2 * rank}",
            "sharding=no_shard"} <= set(ours.overrides(tmp_path))
    command = peft_runner.command(tmp_path)
    assert command[command.index("--lora-rank") + 1] == str(rank)
    assert command[command.index("--lora-alpha") + 1] == str(2 * rank)
    assert command[command.index("--sharding") + 1] == "no_shard"

    shape = model_preset("tiny")
    model = get_peft_model(LlamaForCausalLM(llama_config(dataclasses.asdict(shape))),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS)))
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == adapter_params(shape, FinetuneConfig(method="lora", rank=rank)) == 311_296


def test_real_model_trains_on_real_worked_examples_of_another_source_than_its_held_out_set():
    """benchmarks/real_model.py --train cot: BIG-Bench Hard's and GSM8K's chain-of-thought
    exemplars as the installed lm-eval ships them, answers reasoned step by step, and none of
    the held-out MMLU questions among them (the issue's "records of another source")."""
    from benchmarks import real_model as rm

    train, held = rm.train_records("cot"), rm.heldout_records(57)
    # 27 BBH tasks, 3 exemplars each (two tasks' 3- and 5-object variants reuse the 7-object
    # variant's: 12 left out), and GSM8K's 8
    assert len(train) == 27 * 3 - 12 + 8
    assert all(r["output"].startswith("Let's think step by step.") for r in train)
    assert sum("the answer is" in r["output"].lower() for r in train) >= 75
    assert len({r["input"] for r in train}) == len(train)  # each exemplar once
    questions = {r["instruction"].split("\n")[0] for r in held}
    assert len(held) == 57 and not questions & {r["input"] for r in train}
    assert len({r["instruction"] for r in train}) == 24  # 23 distinct BBH descriptions, GSM8K
    hand = rm.train_records("handwritten")
    assert len(hand) == 117 and not {r["output"] for r in hand} & {r["output"] for r in train}


def test_real_model_timing_table_reads_each_runner_against_trl():
    from benchmarks import real_model as rm

    found = {"llama_fsdp": [{"step_s": 8.0, "load": (1.0, 1.5)}, {"step_s": 9.0, "load": (2, 2)}],
             "llama_fsdp_auto": [{"step_s": 4.0, "load": (1, 1)}],
             "trl": [{"step_s": 10.0, "load": (1, 1)}]}
    table = rm.timing_report(found).splitlines()
    assert table[2].startswith("| llama_fsdp | 8.00 s (load 1.0), 9.00 s (load 2.0) | 8.50 s |")
    assert table[2].endswith("| 0.850 |") and table[3].endswith("| 4.00 s | 0.400 |")
    assert table[4].endswith("| 1.000 |")
