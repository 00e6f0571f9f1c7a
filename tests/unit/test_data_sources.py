"""Local files (data=jsonl), datasets.load_dataset on local directories (data=hf), formats,
the tokenized-data cache, and bad data."""
from __future__ import annotations

import re

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from llama_fsdp.config.schema import DataConfig
from llama_fsdp.run.checks import data_option_problems
from llama_fsdp.data import build_data, tokenize_splits

RECS = [{"instruction": f"Name thing {i}.", "input": "cat dog" if i % 2 else "",
         "output": f"sun {i}", "extra": i} for i in range(40)]
CHATS = [{"messages": [{"role": "user", "content": f"hi {i}"},
                       {"role": "assistant", "content": f"dog {i}"}]} for i in range(40)]
TEXTS = [{"text": f"plain text number {i} about the moon"} for i in range(40)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "data-cache"


def _jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _build(cache, seq_len=64, **cfg):
    return build_data(DataConfig(**cfg), seq_len=seq_len, micro_batch=2, dp_rank=0, dp_world=1,
                      seed=0, cache_dir=cache, vocab_size=512)


def _first_record_text(dm):
    store = dm.train.store
    return dm.tokenizer.decode(store.record(0)[0].tolist())


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet", "csv"])
def test_local_file_types(tmp_path, cache, ext):
    import datasets

    ds = datasets.Dataset.from_list(RECS)
    f = tmp_path / f"d.{ext}"
    {"jsonl": lambda: _jsonl(f, RECS), "json": lambda: f.write_text(json.dumps(RECS)),
     "parquet": lambda: ds.to_parquet(str(f)), "csv": lambda: ds.to_csv(str(f), index=False)}[ext]()
    dm = _build(cache, name="jsonl", path=str(f), eval_records=8)
    assert dm.stats["train_records"] == 32 and dm.stats["eval_records"] == 8
    assert _first_record_text(dm).startswith("<s> Name thing")


def test_glob_directory_and_eval_file(tmp_path, cache):
    (tmp_path / "tr").mkdir()
    _jsonl(tmp_path / "tr" / "a.jsonl", RECS[:20])
    _jsonl(tmp_path / "tr" / "b.jsonl", RECS[20:])
    _jsonl(tmp_path / "ev.jsonl", RECS[:5])
    dm = _build(cache, name="jsonl", path=str(tmp_path / "tr"), eval_path=str(tmp_path / "ev.jsonl"))
    assert dm.stats["train_records"] == 40 and dm.stats["eval_records"] == 5
    dm2 = _build(cache, name="jsonl", path=str(tmp_path / "tr" / "*.jsonl"), eval_records=0)
    assert dm2.stats["train_records"] == 40 and dm2.stats["eval_records"] == 0
    assert dm2.eval_batches() == []


def test_formats_detected_and_columns_configurable(tmp_path, cache):
    chat = _build(cache, name="jsonl", path=str(_jsonl(tmp_path / "c.jsonl", CHATS)), eval_records=4)
    assert "<|user|>\nhi" in _first_record_text(chat)
    text = _build(cache, name="jsonl", path=str(_jsonl(tmp_path / "t.jsonl", TEXTS)), eval_records=4)
    assert "plain text number" in _first_record_text(text)
    assert text.stats["train_target_tokens"] == text.stats["train_tokens"] - text.stats["train_records"]
    renamed = [{"q": r["instruction"], "a": r["output"]} for r in RECS]
    dm = _build(cache, name="jsonl", path=str(_jsonl(tmp_path / "r.jsonl", renamed)), eval_records=4,
                format="instruction", instruction_column="q", output_column="a")
    assert _first_record_text(dm) == "<s> Name thing 0. = sun 0</s>"  # the no-input template
    alpaca = _build(cache, name="jsonl", path=str(tmp_path / "r.jsonl"), eval_records=4,
                    instruction_column="q", output_column="a",
                    prompt_template_no_input="### Instruction:\n{instruction}\n\n### Response:\n")
    want = "<s> ### Instruction:\nName thing 0.\n\n### Response:\n sun 0</s>"
    assert _first_record_text(alpaca) == want


def test_hf_local_dataset_directory(tmp_path, cache):
    """data=hf goes through datasets.load_dataset(path, split=...) (a local repo-style directory)."""
    repo = tmp_path / "my_dataset"
    (repo / "data").mkdir(parents=True)
    _jsonl(repo / "data" / "train.jsonl", RECS)
    _jsonl(repo / "data" / "test.jsonl", RECS[:6])
    dm = _build(cache, name="hf", path=str(repo), split="train", eval_split="test")
    assert dm.stats["train_records"] == 40 and dm.stats["eval_records"] == 6
    dm = _build(cache, name="hf", path=str(repo), split="train", eval_records=10)
    assert dm.stats["train_records"] == 30 and dm.stats["eval_records"] == 10
    with pytest.raises(ValueError, match="split 'validation'"):
        _build(cache, name="hf", path=str(repo), eval_split="validation")


def test_hf_saved_dataset_directory(tmp_path, cache):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHATS),
                          "validation": datasets.Dataset.from_list(CHATS[:4])}).save_to_disk(
        str(tmp_path / "saved"))
    dm = _build(cache, name="hf", path=str(tmp_path / "saved"), eval_split="validation")
    assert dm.stats["train_records"] == 40 and dm.stats["eval_records"] == 4


def test_second_build_reads_the_cache(tmp_path, cache, caplog):
    f = _jsonl(tmp_path / "d.jsonl", RECS)
    first = _build(cache, name="jsonl", path=str(f), eval_records=4)
    assert first.stats["tokenized_from_cache"] == 0.0
    with caplog.at_level(logging.INFO, logger="llama_fsdp.data"):
        second = _build(cache, name="jsonl", path=str(f), eval_records=4)
    assert second.stats["tokenized_from_cache"] == 1.0
    assert "found in cache" in caplog.text and "tokenizing" not in caplog.text
    assert second.stats == {**first.stats, "tokenized_from_cache": 1.0}
    # what the key covers: seq_len, format options, and the file's contents
    for changed in ({"seq_len": 96}, {"train_on_prompt": True}, {"eval_records": 5},
                    {"prompt_template": "{instruction} / {input} :"}):
        assert _build(cache, **{"name": "jsonl", "path": str(f), "eval_records": 4, **changed}
                      ).stats["tokenized_from_cache"] == 0.0
    _jsonl(f, RECS[:30])
    edited = _build(cache, name="jsonl", path=str(f), eval_records=4)
    assert edited.stats["tokenized_from_cache"] == 0.0 and edited.stats["train_records"] == 26


def test_tokenize_splits_then_build_uses_it(tmp_path, cache):
    f = _jsonl(tmp_path / "p.jsonl", RECS)
    cfg = DataConfig(name="jsonl", path=str(f), eval_records=4)
    assert not tokenize_splits(cfg, seq_len=80, cache_dir=cache).from_cache
    dm = build_data(cfg, seq_len=80, micro_batch=2, dp_rank=0, dp_world=1, seed=0, cache_dir=cache,
                    vocab_size=512)
    assert dm.stats["tokenized_from_cache"] == 1.0


def test_a_rank_reads_the_cached_splits_as_datasets_does_without_importing_it(tmp_path, cache):
    """Ranks read the tokenized cache as Arrow tables (data/cache.read_split): the same records,
    lengths, masks and flags as datasets.load_from_disk gives, without importing datasets or
    pandas (0.5 s of each rank's start)."""
    import subprocess
    import sys

    import datasets

    from llama_fsdp.data import TokenStore

    f = _jsonl(tmp_path / "p.jsonl", RECS[:7] + [{**RECS[7], "output": "x " * 200}] + RECS[8:])
    cfg = DataConfig(name="jsonl", path=str(f), eval_records=4)  # overlong: truncate
    prep = tokenize_splits(cfg, seq_len=64, cache_dir=cache)
    for split in ("train", "eval"):
        ours = TokenStore(getattr(prep, split))
        theirs = TokenStore(datasets.load_from_disk(str(prep.path / split)))
        for name in ("offsets", "ids", "mask", "prompt_len", "truncated"):
            np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name), name)
            assert getattr(ours, name).dtype == getattr(theirs, name).dtype, name
        assert [ours.task(i) for i in range(len(ours))] == \
            [theirs.task(i) for i in range(len(theirs))]
    assert TokenStore(prep.train).truncated.any()  # the flag is read, not all False
    code = ("import sys\nfrom llama_fsdp.data import TokenStore\n"
            "from llama_fsdp.data.cache import read_split\n"
            f"store = TokenStore(read_split(__import__('pathlib').Path({str(prep.path)!r}) / 'train'))\n"
            "store.task(0)\n"
            "print(len(store), 'datasets' in sys.modules, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(len(TokenStore(prep.train))), "False", "False"]


# --- bad data ------------------------------------------------------------------------------------

def test_missing_column_names_file_and_columns(tmp_path, cache):
    f = _jsonl(tmp_path / "m.jsonl", [{"instruction": "x", "answer": "y"}] * 5)
    with pytest.raises(ValueError, match=r"m\.jsonl.*cannot tell the record format.*'answer'"):
        _build(cache, name="jsonl", path=str(f), eval_records=1)
    with pytest.raises(ValueError, match=r"m\.jsonl.*needs column\(s\) \['output'\]"):
        _build(cache, name="jsonl", path=str(f), eval_records=1, format="instruction")


@pytest.mark.parametrize("num_proc", [1, 2])
def test_null_field_names_the_record(tmp_path, cache, num_proc):
    """num_proc=2 tokenizes in spawned workers (data.cache._spawned_workers): the error comes
    back from them naming the record."""
    recs = [dict(r) for r in RECS[:10]]
    recs[7]["output"] = None
    f = _jsonl(tmp_path / "n.jsonl", recs)
    with pytest.raises(ValueError, match=r"n\.jsonl: record 7 \(0-based\).*'output' is missing"):
        _build(cache, name="jsonl", path=str(f), eval_records=0, num_proc=num_proc)


def test_empty_file(tmp_path, cache):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"e\.jsonl: empty file"):
        _build(cache, name="jsonl", path=str(tmp_path / "e.jsonl"))


def test_malformed_json_line(tmp_path, cache):
    f = tmp_path / "bad.jsonl"
    good = "".join(json.dumps(r) + "\n" for r in RECS[:2])
    f.write_text(good + '{"instruction": "x", "output": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: malformed JSON"):
        _build(cache, name="jsonl", path=str(f), eval_records=0)


def test_missing_path(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _build(cache, name="jsonl", path=str(tmp_path / "nope.jsonl"))
    # (the options are checked with the run, before any data is read: run/checks.py)
    assert "needs data.path" in " ".join(data_option_problems(DataConfig(name="jsonl")))


def test_overlong_records(tmp_path, cache, caplog):
    recs = RECS[:10] + [{"instruction": "long", "output": " ".join(["moon"] * 200)}]
    f = _jsonl(tmp_path / "o.jsonl", recs)
    msg = r"o\.jsonl: record 10 \(0-based\): \d+ tokens, longer than train.seq_len=64"
    with pytest.raises(ValueError, match=msg):
        _build(cache, name="jsonl", path=str(f), eval_records=0, overlong="error")
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.data"):
        dm = _build(cache, name="jsonl", path=str(f), eval_records=0, overlong="truncate")
    assert dm.stats["records_truncated"] == 1 and dm.stats["train_records"] == 11
    assert "train: 1 of 11 records (9%) are longer than train.seq_len=64 tokens and were truncated" \
        in caplog.text
    assert dm.train.store.lengths.max() == 64
    dropped = _build(cache, name="jsonl", path=str(f), eval_records=0, overlong="drop")
    assert dropped.stats["records_dropped"] == 1 and dropped.stats["train_records"] == 10


def test_vocab_mismatch_names_model_vocab_size(cache):
    with pytest.raises(ValueError, match=r"512 tokens but model.vocab_size=128256.*"
                                         r"model.vocab_size=512"):
        build_data(DataConfig(num_records=50), seq_len=64, micro_batch=2, dp_rank=0, dp_world=1,
                   seed=0, cache_dir=cache, vocab_size=128256)


def test_bad_config_values():
    assert re.search(r"data.format='yaml'.*data.overlong='cut'", " ".join(
        data_option_problems(DataConfig(format="yaml", overlong="cut"))))


def test_tokenization_with_several_processes(tmp_path, cache):
    """num_proc=2 stores every record of both splits as one process does: the same tokens, loss
    mask, prompt length and truncation flag, in the same order."""
    import numpy as np

    recs = [{**r, "instruction": f"{r['instruction']} Part {k}."} for k in range(5) for r in RECS]
    # two files with the same records: two cache keys (num_proc is not part of the key), so the
    # second is tokenized again, by two processes, at the same seq_len
    one = _build(cache, name="jsonl", path=str(_jsonl(tmp_path / "one.jsonl", recs)),
                 eval_records=4)
    two = _build(cache, name="jsonl", path=str(_jsonl(tmp_path / "two.jsonl", recs)),
                 eval_records=4, num_proc=2)
    assert two.stats["tokenized_from_cache"] == 0.0
    for split in ("train", "eval"):
        a, b = getattr(one, split).store, getattr(two, split).store
        assert len(a) == len(b) == {"train": 196, "eval": 4}[split]
        for field in ("offsets", "ids", "mask", "prompt_len", "truncated"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), (split, field)


# --- real files with the defaults (issue: real fine-tuning data) ---------------------------------

WORDS = ("the a model data answer question because water energy light city river people time year "
         "explain describe list three ways improve health learning history science simple short "
         "example important reason first second finally also however which that with from").split()


def _sentence(r, n: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(n)).capitalize() + "."


def alpaca_records(n: int, seed: int = 0) -> list[dict]:
    """Stanford-Alpaca-like records: short instructions, input mostly empty, answers of a few to
    a hundred words (some in Chinese)."""
    import random

    r = random.Random(seed)
    out = []
    for i in range(n):
        answer = " ".join(_sentence(r, r.randint(5, 15)) for _ in range(r.randint(1, 8)))
        if i % 17 == 0:
            answer += " 水是生命之源，我们应该节约用水。"
        out.append({"instruction": _sentence(r, r.randint(4, 12)),
                    "input": _sentence(r, r.randint(3, 20)) if r.random() < 0.4 else "",
                    "output": answer})
    return out


def _spec(spec_factory, cache, *overrides):
    return spec_factory([f"cache_dir={cache}", *overrides])


def test_small_alpaca_json_array_trains_with_the_defaults(spec_factory, tmp_path, cache, caplog):
    """102 records, a JSON array, every default (2 ranks x batch 8, seq_len 128): builds, holds
    out a few records for eval, and says what it did."""
    from llama_fsdp.prepare.data import check_data as driver_prepare

    f = tmp_path / "alpaca_data.json"
    f.write_text(json.dumps(alpaca_records(102), ensure_ascii=False, indent=2))
    spec = _spec(spec_factory, cache, "data=jsonl", f"data.path={f}")
    with caplog.at_level(logging.INFO, logger="llama_fsdp"):
        dm = driver_prepare(spec)
    assert dm.batches_per_epoch >= 1 and len(dm.eval) >= 1
    kept = dm.stats["train_records"] + dm.stats["eval_records"]
    assert kept + dm.stats["records_without_targets"] == 102
    assert dm.info.eval_origin.startswith("held out 5 of 102 records by data.eval_fraction=0.05")
    assert ": 97 training and 5 eval records (held out 5 of 102 records by" in caplog.text
    # the project tokenizer on real text: said once, with its rate
    assert caplog.text.count("tokenized with the project tokenizer") == 1
    assert f"{dm.stats['tokens_per_char']:.2f} tokens per character" in caplog.text


def test_many_truncated_records_report_lengths_and_the_seq_len_that_fits(tmp_path, cache, caplog):
    import re

    f = tmp_path / "alpaca.json"
    f.write_text(json.dumps(alpaca_records(120, seed=1)))
    cfg = dict(name="jsonl", path=str(f), eval_fraction=0,
               prompt_template="### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
               prompt_template_no_input="### Instruction:\n{instruction}\n\n### Response:\n")
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.data"):
        dm = _build(cache, seq_len=128, **cfg)
    found = re.search(r"train: (\d+) of 120 records \(\d+%\) are longer than train.seq_len=128 "
                      r"tokens and were truncated \(data.overlong=truncate\)\. Record lengths in "
                      r"tokens: p50 (\d+), p90 \d+, p95 (\d+), p99 \d+, max (\d+); "
                      r"train.seq_len=(\d+) would keep 95% of them whole", caplog.text)
    assert found, caplog.text
    truncated, p50, p95, longest, advice = map(int, found.groups())
    assert truncated == dm.stats["records_truncated"] > 6 and p50 <= p95 <= longest
    assert advice % 64 == 0 and advice >= p95
    # the advice holds: at that seq_len at most 5% of the records are cut
    again = _build(cache, seq_len=advice, **cfg)
    assert again.stats["records_truncated"] <= 0.05 * 120
    assert again.stats["record_tokens_p95"] == dm.stats["record_tokens_p95"] == p95


SEED_TASKS = [{"id": f"seed_task_{i}", "name": f"task_{i}",
               "instruction": f"Give an example of thing {i}.",
               "instances": [{"input": "", "output": f"Example {i}."},
                             {"input": "more", "output": f"Another {i}."}][: 1 + i % 2],
               "is_classification": False} for i in range(30)]


def test_nested_layout_is_refused_before_launch_with_the_columns_and_the_fix(spec_factory,
                                                                              tmp_path, cache):
    """Self-Instruct's seed_tasks.jsonl: the answers are nested in a list."""
    from llama_fsdp.prepare.errors import PrepareError
    from llama_fsdp.prepare.data import check_data as driver_prepare

    f = _jsonl(tmp_path / "seed_tasks.jsonl", SEED_TASKS)
    spec = _spec(spec_factory, cache, "data=jsonl", f"data.path={f}")
    with pytest.raises(PrepareError) as e:
        driver_prepare(spec)
    msg = str(e.value)
    assert str(f) in msg
    for found in ("'id' (string)", "'instances' (list of {input, output})",
                  "'is_classification' (bool)", "Found 'instruction' but no 'output' column",
                  "Column 'instances' nests records", "data.output_column",
                  "data.preprocess=module:function"):
        assert found in msg, found


def test_preprocess_hook_flattens_nested_records(spec_factory, tmp_path, cache):
    from llama_fsdp.prepare.data import check_data as driver_prepare

    f = _jsonl(tmp_path / "seed_tasks.jsonl", SEED_TASKS)
    hook = tmp_path / "hooks.py"
    hook.write_text("def flatten(rec):\n"
                    "    return [{'instruction': rec['instruction'], 'input': x['input'],\n"
                    "             'output': x['output']} for x in rec['instances']]\n")
    spec = _spec(spec_factory, cache, "data=jsonl", f"data.path={f}",
                 f"data.preprocess={hook}:flatten")
    dm = driver_prepare(spec)
    assert dm.stats["train_records"] + dm.stats["eval_records"] == 45  # 15 x 1 + 15 x 2
    assert dm.info.format == "instruction"
    # an edited hook is a different dataset
    hook.write_text(hook.read_text().replace("for x in rec['instances']]",
                                             "for x in rec['instances'][:1]]"))
    again = driver_prepare(spec)
    assert again.stats["tokenized_from_cache"] == 0.0
    assert again.stats["train_records"] + again.stats["eval_records"] == 30


def test_preprocess_errors_name_the_record(tmp_path, cache):
    hook = tmp_path / "bad_hooks.py"
    hook.write_text("def pick(rec):\n    return {'instruction': rec['instruction'],\n"
                    "            'output': rec['instances'][1]['output']}\n"
                    "def text(rec):\n    return 'not a record'\n")
    f = _jsonl(tmp_path / "seed.jsonl", SEED_TASKS)
    with pytest.raises(ValueError, match=r"seed\.jsonl: record 0 \(0-based\): data\.preprocess="
                                         r".*:pick raised IndexError"):
        _build(cache, name="jsonl", path=str(f), preprocess=f"{hook}:pick")
    with pytest.raises(ValueError, match=r"record 0 \(0-based\): .* returned str; it must return "
                                         r"a record"):
        _build(cache, name="jsonl", path=str(f), preprocess=f"{hook}:text")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module'.*PYTHONPATH"):
        _build(cache, name="jsonl", path=str(f), preprocess="no_such_module:f")


@pytest.mark.parametrize("n,held_out", [(2, 1), (3, 1), (30, 2), (102, 5), (1000, 50),
                                        (100000, 200)])
def test_eval_hold_out_adapts_to_the_data(n, held_out):
    from llama_fsdp.data.sources import eval_count

    assert eval_count(DataConfig(), n) == held_out
    assert eval_count(DataConfig(eval_fraction=0), n) == 0
    assert eval_count(DataConfig(eval_records=1), n) == 1


def test_too_few_records_for_the_split_are_refused(tmp_path, cache):
    f = _jsonl(tmp_path / "one.jsonl", RECS[:1])
    with pytest.raises(ValueError, match=r"one\.jsonl: 1 record\(s\) are too few to hold out "
                                         r"data.eval_min_records=1.*data.eval_fraction=0"):
        _build(cache, name="jsonl", path=str(f))
    assert _build(cache, name="jsonl", path=str(f), eval_fraction=0).stats["train_records"] == 1
    f = _jsonl(tmp_path / "few.jsonl", RECS[:10])
    with pytest.raises(ValueError, match=r"few\.jsonl: data.eval_records=10 leaves no training "):
        _build(cache, name="jsonl", path=str(f), eval_records=10)


def test_a_tiny_file_fills_a_global_batch_by_repeating(tmp_path, cache, caplog):
    f = _jsonl(tmp_path / "tiny.jsonl", RECS[:3])
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.data"):
        dm = build_data(DataConfig(name="jsonl", path=str(f)), seq_len=64, micro_batch=8,
                        dp_rank=0, dp_world=2, seed=0, cache_dir=cache, vocab_size=512)
    assert dm.stats["train_records"] == 2 and dm.stats["eval_records"] == 1
    assert dm.batches_per_epoch == 1 and dm.repeats == 16
    b = next(dm.train_batches())
    assert b["input_ids"].shape == (8, 64) and (b["labels"] != -100).sum() > 0
    assert "every epoch repeats them 16 times" in caplog.text


def test_records_without_targets_are_left_out_or_refused(tmp_path, cache, caplog):
    long_prompt = {"instruction": " ".join(["moon"] * 100), "output": "sun"}
    f = _jsonl(tmp_path / "nt.jsonl", RECS[:20] + [long_prompt] * 3)
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.data"):
        dm = _build(cache, name="jsonl", path=str(f), eval_fraction=0)
    assert dm.stats["train_records"] == 20 and dm.stats["records_without_targets"] == 3
    assert ("train: 3 of 23 records have no target token and are left out (3 because truncation "
            "to train.seq_len=64 cut off the answer: raise train.seq_len)") in caplog.text
    f = _jsonl(tmp_path / "none.jsonl", [long_prompt] * 4)
    with pytest.raises(ValueError, match=r"none\.jsonl: none of the 4 records can train: 4 have "
                                         r"no target token .*train\.seq_len=128 keeps 95%"):
        _build(cache, name="jsonl", path=str(f), eval_fraction=0)


def test_notes_are_said_once_by_the_announcing_process(tmp_path, cache, caplog):
    f = _jsonl(tmp_path / "once.jsonl", RECS)
    kw = dict(seq_len=64, micro_batch=2, dp_world=2, seed=0, cache_dir=cache, vocab_size=512)

    def notes():
        return [r.getMessage() for r in caplog.records if r.name == "llama_fsdp.data"]

    with caplog.at_level(logging.INFO, logger="llama_fsdp.data"):
        build_data(DataConfig(name="jsonl", path=str(f)), dp_rank=1, **kw)
        assert notes() == []  # not rank 0: silent
        dm = build_data(DataConfig(name="jsonl", path=str(f)), dp_rank=0, announce=False, **kw)
        assert notes() == []
        build_data(DataConfig(name="jsonl", path=str(f)), dp_rank=0, **kw)
    said = [m for m in notes() if "tokenized with the project tokenizer" in m]
    assert len(said) == 1 and f"{dm.stats['tokens_per_char']:.2f} tokens per character" in said[0]
    assert any("project tokenizer" in m for _, m in dm.info.notes)
    assert dm.info.params()["derived.tokenizer_source"] == "project"
    # the synthetic task is what the project tokenizer is for: no advice there
    syn = build_data(DataConfig(num_records=100), dp_rank=0, announce=False, **kw)
    assert syn.info.eval_records == 5 and not any(lvl >= logging.WARNING
                                                  for lvl, _ in syn.info.notes)
