"""Local files (data=jsonl), datasets.load_dataset on local directories (data=hf), formats,
the tokenized-data cache, and bad data."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from llama_fsdp.config import DataConfig
from llama_fsdp.data import build_data, prepare_data

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


def test_prepare_data_then_build_uses_it(tmp_path, cache):
    f = _jsonl(tmp_path / "p.jsonl", RECS)
    cfg = DataConfig(name="jsonl", path=str(f), eval_records=4)
    assert not prepare_data(cfg, seq_len=80, cache_dir=cache).from_cache
    dm = build_data(cfg, seq_len=80, micro_batch=2, dp_rank=0, dp_world=1, seed=0, cache_dir=cache,
                    vocab_size=512)
    assert dm.stats["tokenized_from_cache"] == 1.0


# --- bad data ------------------------------------------------------------------------------------

def test_missing_column_names_file_and_columns(tmp_path, cache):
    f = _jsonl(tmp_path / "m.jsonl", [{"instruction": "x", "answer": "y"}] * 5)
    with pytest.raises(ValueError, match=r"m\.jsonl.*cannot tell the record format.*'answer'"):
        _build(cache, name="jsonl", path=str(f), eval_records=1)
    with pytest.raises(ValueError, match=r"m\.jsonl.*needs column\(s\) \['output'\]"):
        _build(cache, name="jsonl", path=str(f), eval_records=1, format="instruction")


@pytest.mark.parametrize("num_proc", [1, 2])
def test_null_field_names_the_record(tmp_path, cache, num_proc):
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
    with pytest.raises(ValueError, match="needs data.path"):
        _build(cache, name="jsonl")


def test_overlong_records(tmp_path, cache, caplog):
    recs = RECS[:10] + [{"instruction": "long", "output": " ".join(["moon"] * 200)}]
    f = _jsonl(tmp_path / "o.jsonl", recs)
    msg = r"o\.jsonl: record 10 \(0-based\): \d+ tokens, longer than train.seq_len=64"
    with pytest.raises(ValueError, match=msg):
        _build(cache, name="jsonl", path=str(f), eval_records=0, overlong="error")
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.data"):
        dm = _build(cache, name="jsonl", path=str(f), eval_records=0, overlong="truncate")
    assert dm.stats["records_truncated"] == 1 and dm.stats["train_records"] == 11
    assert "1 record(s) longer than seq_len=64 were truncated" in caplog.text
    assert dm.train.store.lengths.max() == 64
    dropped = _build(cache, name="jsonl", path=str(f), eval_records=0, overlong="drop")
    assert dropped.stats["records_dropped"] == 1 and dropped.stats["train_records"] == 10


def test_vocab_mismatch_names_model_vocab_size(cache):
    with pytest.raises(ValueError, match=r"512 tokens but model.vocab_size=128256.*"
                                         r"model.vocab_size=512"):
        build_data(DataConfig(num_records=50), seq_len=64, micro_batch=2, dp_rank=0, dp_world=1,
                   seed=0, cache_dir=cache, vocab_size=128256)


def test_bad_config_values(cache):
    with pytest.raises(ValueError, match=r"data.format='yaml'.*data.overlong='cut'"):
        _build(cache, format="yaml", overlong="cut")


def test_tokenization_with_several_processes(tmp_path, cache):
    f = _jsonl(tmp_path / "mp.jsonl", RECS * 5)
    one = _build(cache, name="jsonl", path=str(f), eval_records=4)
    two = _build(cache, name="jsonl", path=str(f), eval_records=4, num_proc=2, seq_len=65)
    assert one.stats["train_tokens"] == two.stats["train_tokens"]
