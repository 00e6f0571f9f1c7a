"""Preference pairs (objective=dpo): the layouts TRL reads, tokenized with the prompt masked and
each pair in one row; bad pairs refused by the driver's data preparation, naming the file, the
record and the fix."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from llama_fsdp.config.schema import DataConfig
from llama_fsdp.data import build_data
from llama_fsdp.data.packing import IGNORE_INDEX
from llama_fsdp.prepare.errors import PrepareError
from llama_fsdp.prepare.data import check_data
from tests.conftest import REPO
from tests import warm

PAIRS = [{"prompt": f"Opposite word {i} =", "chosen": f"cold {i}", "rejected": f"wet {i}"}
         for i in range(12)]
HH = [{"chosen": f"\n\nHuman: name a pet {i}\n\nAssistant: a cat",
       "rejected": f"\n\nHuman: name a pet {i}\n\nAssistant: no"} for i in range(12)]
CONV = [{"prompt": [{"role": "user", "content": f"name a pet {i}"}],
         "chosen": [{"role": "assistant", "content": "a cat"}],
         "rejected": [{"role": "assistant", "content": "no"}]} for i in range(12)]
# binarized UltraFeedback: a text prompt beside whole conversations sharing their first turn
ULTRA = [{"prompt": f"name a pet {i}",
          "chosen": [{"role": "user", "content": f"name a pet {i}"},
                     {"role": "assistant", "content": "a cat"}],
          "rejected": [{"role": "user", "content": f"name a pet {i}"},
                       {"role": "assistant", "content": "no"}],
          "score_chosen": 8.0, "score_rejected": 2.0} for i in range(12)]


def _jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _build(cache, path, seq_len=64, micro_batch=2, **cfg):
    cfg = {"name": "jsonl", "path": str(path), "eval_records": 2, **cfg}
    return build_data(DataConfig(**cfg), seq_len=seq_len, micro_batch=micro_batch, dp_rank=0,
                      dp_world=1, seed=0, cache_dir=cache, vocab_size=512, preference=True)


def _answer(dm, record: int) -> str:
    """The target tokens of a record, decoded: what the DPO loss reads."""
    ids, mask = dm.train.store.record(record)
    return dm.tokenizer.decode(ids[mask > 0].tolist())


@pytest.mark.parametrize("layout,recs,prompt,chosen,rejected", [
    ("standard", PAIRS, "<s> Opposite word", "cold 0</s>", "wet 0</s>"),
    ("hh-rlhf", HH, "<s> \n\nHuman: name a pet 0\n\nAssistant:", "a cat</s>", "no</s>"),
    ("conversational", CONV, "<s><|user|>\nname a pet 0</s><|assistant|>\n", "a cat</s>",
     "no</s>"),
    ("ultrafeedback", ULTRA, "<s><|user|>\nname a pet 0</s><|assistant|>\n", "a cat</s>",
     "no</s>"),
])
def test_each_layout_tokenizes_the_answers_as_targets_after_the_prompt(tmp_path, cache, layout,
                                                                       recs, prompt, chosen,
                                                                       rejected):
    dm = _build(cache, _jsonl(tmp_path / f"{layout}.jsonl", recs), seq_len=128, eval_records=0,
                eval_fraction=0)
    store, tok = dm.train.store, dm.tokenizer
    i = next(k for k in range(0, len(store), 2)
             if " 0" in tok.decode(store.record(k)[0].tolist()))  # the record of pair 0
    text = tok.decode(store.record(i)[0].tolist())
    assert text.startswith(prompt), text
    assert _answer(dm, i).strip() == chosen and _answer(dm, i + 1).strip() == rejected
    # the prompt is never a target, and both sequences share it token for token
    c, r = store.record(i), store.record(i + 1)
    p = int(store.prompt_len[i])
    assert p == int(store.prompt_len[i + 1]) and (c[0][:p] == r[0][:p]).all()
    assert not c[1][:p].any() and c[1][p:].all()
    assert dm.info.format.startswith("pairs (" + ("conversational" if layout in (
        "conversational", "ultrafeedback") else "standard"))


@pytest.mark.parametrize("packing", [True, False])
def test_a_pair_shares_its_row_and_the_batch_locates_every_target(tmp_path, cache, packing):
    dm = _build(cache, _jsonl(tmp_path / "p.jsonl", PAIRS), packing=packing, micro_batch=3)
    for rows in (np.arange(len(dm.train)), np.array([0, -1, 1])):  # with a padding row
        b = dm.train.batch(rows)
        labels = b["labels"].reshape(-1)
        index, seq, records = b["target_index"], b["target_seq"], b["seq_records"]
        # every target label, in order, and nothing else
        assert (labels != IGNORE_INDEX).nonzero().squeeze(1).tolist() == index.tolist()
        # sequence k is record seq_records[k]: its targets are that record's
        for k, d in enumerate(records.tolist()):
            ids, mask = dm.train.store.record(d)
            assert labels[index[seq == k]].tolist() == ids[1:][mask[1:] > 0].tolist()
        # chosen (2p) then its rejected (2p + 1), and both in one row
        assert (records[0::2] % 2 == 0).all() and (records[1::2] == records[0::2] + 1).all()
        row = index // dm.train.seq_len
        for k in range(0, len(records), 2):
            assert set(row[seq == k].tolist()) == set(row[seq == k + 1].tolist())
    assert dm.stats["train_pairs"] == 10 and dm.stats["eval_pairs"] == 2
    if not packing:
        assert len(dm.train) == 10  # one pair a row
    else:
        assert len(dm.train) < 10


def test_an_overlong_pair_keeps_its_prompt_and_shares_the_rest(tmp_path, cache):
    long = [{"prompt": "Say =", "chosen": " ".join(["cat"] * 40), "rejected": "no"}] * 6
    dm = _build(cache, _jsonl(tmp_path / "long.jsonl", long), seq_len=32, eval_fraction=0,
                eval_records=0)
    lengths = dm.train.store.lengths
    assert (lengths[0::2] + lengths[1::2] == 32).all()  # cut to fit the row exactly
    assert _answer(dm, 1).strip() == "no</s>"  # the short answer is whole
    assert dm.train.store.truncated[0] and not dm.train.store.truncated[1]
    dropped = _build(cache, _jsonl(tmp_path / "long2.jsonl", long + PAIRS), seq_len=32,
                     overlong="drop", eval_fraction=0, eval_records=0)
    assert dropped.stats["train_pairs"] == len(PAIRS) and dropped.stats["records_dropped"] == 6


def test_synthetic_pairs_prefer_the_right_answer(cache):
    from llama_fsdp.data.synthetic import synthetic_records

    dm = build_data(DataConfig(num_records=200, eval_records=20), seq_len=128, micro_batch=4,
                    dp_rank=0, dp_world=1, seed=0, cache_dir=cache, vocab_size=512,
                    preference=True)
    truth = {f"{r['instruction']} {r['input']} =": r["output"]
             for r in synthetic_records(200, 1234, "train")}
    store, tok = dm.train.store, dm.tokenizer
    for i in range(0, 40, 2):
        prompt = tok.decode(store.record(i)[0][1:int(store.prompt_len[i])].tolist())
        chosen, rejected = _answer(dm, i), _answer(dm, i + 1)
        assert chosen.removesuffix("</s>").strip() == truth[prompt]
        assert rejected != chosen
    assert dm.stats["train_pairs"] == 200 and dm.stats["eval_pairs"] == 20


# --- refused before launch ----------------------------------------------------------------------


def _spec(spec_factory, cache, *extra):
    return spec_factory(["objective=dpo", f"cache_dir={cache.parent / 'pref-cache'}",
                         "train.seq_len=64", "data=jsonl", *extra])


def _refused(spec_factory, cache, path: Path, *extra) -> str:
    with pytest.raises(PrepareError) as e:
        check_data(_spec(spec_factory, cache, f"data.path={path}", *extra))
    msg = str(e.value)
    assert str(path) in msg
    return msg


def test_a_missing_field_is_refused_naming_the_record(spec_factory, tmp_path, cache):
    recs = [*PAIRS[:5], {"prompt": "Opposite up =", "chosen": "down", "rejected": None},
            *PAIRS[5:]]
    msg = _refused(spec_factory, cache, _jsonl(tmp_path / "missing.jsonl", recs))
    assert "record 5 (0-based)" in msg and "field 'rejected' is missing or empty" in msg
    assert "data.preprocess returning None" in msg


def test_chosen_equal_to_rejected_is_refused_naming_the_record(spec_factory, tmp_path, cache):
    recs = [*PAIRS[:3], {"prompt": "Opposite up =", "chosen": "down", "rejected": "down"}]
    msg = _refused(spec_factory, cache, _jsonl(tmp_path / "same.jsonl", recs))
    assert "record 3 (0-based)" in msg and "chosen equals rejected" in msg


def test_a_prompt_without_room_is_refused_under_error_with_the_seq_len_that_fits(
        spec_factory, tmp_path, cache):
    recs = [*PAIRS[:7], {"prompt": " ".join(["word"] * 30) + " =", "chosen": "a", "rejected": "b"}]
    msg = _refused(spec_factory, cache, _jsonl(tmp_path / "long_prompt.jsonl", recs),
                   "data.overlong=error")
    assert "record 7 (0-based)" in msg and "leaves no room for the answers" in msg
    assert "train.seq_len=64" in msg and "Fix: raise train.seq_len (train.seq_len=" in msg
    assert "data.overlong=truncate (keeps the prompt's last 16 tokens) or drop" in msg


LONG_PROMPT = {"prompt": " ".join(f"w{i}" for i in range(40)) + " end =", "chosen": "a",
               "rejected": "b"}


def test_a_prompt_without_room_is_cut_to_its_end_under_truncate(tmp_path, cache):
    """data.overlong=truncate keeps the prompt's last seq_len / 4 tokens (TRL's
    max_prompt_length truncation, the prompt half of each sequence's half of the row): the
    pair trains, in one row, on its whole answers."""
    seq_len = 64
    keep = seq_len // 4  # 16 of the prompt's 115 tokens
    dm = _build(cache, _jsonl(tmp_path / "lp.jsonl", [*PAIRS[:7], LONG_PROMPT]),
                seq_len=seq_len, overlong="truncate", eval_fraction=0, eval_records=0)
    store = dm.train.store
    assert dm.stats["train_pairs"] == 8 and store.truncated[14] and store.truncated[15]
    assert store.lengths[14] + store.lengths[15] <= seq_len
    # the whole prompt, tokenized where it fits (nothing cut)
    whole = _build(cache, _jsonl(tmp_path / "fits.jsonl", [*PAIRS[:7], LONG_PROMPT]),
                   seq_len=256, eval_fraction=0, eval_records=0).train.store
    assert not whole.truncated[14]
    prompt = whole.record(14)[0][:int(whole.prompt_len[14])].tolist()
    assert len(prompt) > keep
    ids, _ = store.record(14)
    for i in (14, 15):  # both sequences keep the same last `keep` tokens of the prompt
        assert int(store.prompt_len[i]) == keep, (i, int(store.prompt_len[i]))
        assert store.record(i)[0][:keep].tolist() == prompt[-keep:], i
    text = dm.tokenizer.decode(ids.tolist())
    assert text.endswith("end = a</s>") and "w0 " not in text and "w39" in text
    assert _answer(dm, 14).strip() == "a</s>" and _answer(dm, 15).strip() == "b</s>"


def test_a_prompt_without_room_is_left_out_under_drop_and_counted(tmp_path, cache):
    dm = _build(cache, _jsonl(tmp_path / "lp.jsonl", [*PAIRS[:7], LONG_PROMPT]), seq_len=64,
                overlong="drop", eval_fraction=0, eval_records=0)
    assert dm.stats["train_pairs"] == 7 and dm.stats["records_dropped"] == 1


def test_a_file_without_answers_is_refused_with_its_columns(spec_factory, tmp_path, cache):
    recs = [{"question": f"q {i}", "response_j": "a", "response_k": "b"} for i in range(8)]
    msg = _refused(spec_factory, cache, _jsonl(tmp_path / "se.jsonl", recs))
    assert "column(s) ['chosen', 'rejected'] are missing" in msg
    assert "'question' (string)" in msg and "data.preprocess=module:function" in msg


def test_pairs_under_sft_are_told_to_use_dpo(spec_factory, tmp_path, cache):
    f = _jsonl(tmp_path / "pairs.jsonl", PAIRS)
    with pytest.raises(PrepareError) as e:
        check_data(spec_factory(["data=jsonl", f"data.path={f}",
                                 f"cache_dir={cache.parent / 'pref-cache'}"]))
    assert "this is preference data" in str(e.value) and "use objective=dpo" in str(e.value)


def test_the_command_line_refuses_a_bad_pairs_file_before_any_rank_starts(tmp_path):
    f = _jsonl(tmp_path / "same.jsonl", [*PAIRS[:3], {"prompt": "p", "chosen": "x",
                                                      "rejected": "x"}])
    out = tmp_path / "run"
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "objective=dpo", "data=jsonl",
                        f"data.path={f}", f"output_dir={out}", "cluster.device=cpu",
                        "tracking.enabled=false", f"cache_dir={tmp_path}/cache"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode != 0
    assert f"{f}: record 3 (0-based): chosen equals rejected" in r.stdout + r.stderr
    assert not out.exists()  # refused in the driver: no run directory, no rank
