"""The driver's check of data the cache already holds (llama_fsdp/data/check_record.py): a launch with
the inputs of an earlier one prints the same notes and numbers from that check's record, without
loading transformers or datasets; a changed input, tokenizer or cache entry is checked again."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest

from llama_fsdp.data.check_record import WarmData
from llama_fsdp.prepare.data import prepare_data
from tests.conftest import REPO


def _records(n: int) -> list[dict]:
    return [{"instruction": f"Add {i} and {i + 1}.", "input": "" if i % 3 else "numbers",
             "output": f"{i} plus {i + 1} is {2 * i + 1}." + " More words." * (i % 40)}
            for i in range(n)]


@pytest.fixture
def data_spec(spec_factory, cache, tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _records(90)))
    overrides = [f"cache_dir={cache}", "data=jsonl", f"data.path={f}", "train.seq_len=64"]
    return spec_factory(overrides), overrides, f


def _messages(caplog) -> list[str]:
    """What llama_fsdp logged, the time a check took left out."""
    return [re.sub(r"^data ready in [0-9.]+s", "data ready", r.getMessage())
            for r in caplog.records if r.name.startswith("llama_fsdp")]


def test_a_second_check_reads_the_record_and_says_the_same(data_spec, caplog):
    spec, _, _ = data_spec
    with caplog.at_level(logging.INFO, logger="llama_fsdp"):
        built = prepare_data(spec)
    said = _messages(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llama_fsdp"):
        known = prepare_data(spec)
    assert isinstance(known, WarmData) and not isinstance(built, WarmData)
    assert known.info == built.info and known.batches_per_epoch == built.batches_per_epoch
    assert known.stats == {**built.stats, "tokenized_from_cache": 1.0}
    # every note and number the build printed (truncation advice included), in its order
    notes = [m for m in said if m.startswith(("data", "train:", "eval:"))]
    assert any("longer than train.seq_len=64" in m for m in notes), said
    assert [m for m in _messages(caplog) if m in notes] == notes


def test_a_warm_check_loads_neither_transformers_nor_datasets(data_spec, tmp_path):
    spec, overrides, _ = data_spec
    prepare_data(spec)  # the first check: builds the data and records it
    probe = (f"import sys\nfrom tests.conftest import make_spec\n"
             f"from llama_fsdp.prepare.data import prepare_data\n"
             f"data = prepare_data(make_spec({overrides!r}, output_dir={str(tmp_path / 'run')!r}))\n"
             "print('LOADED', type(data).__name__, sorted(m for m in "
             "('transformers', 'datasets', 'torch') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LOADED WarmData []" in r.stdout, r.stdout[-500:] + r.stderr[-2000:]


def test_a_changed_source_tokenizer_or_entry_is_checked_again(data_spec, caplog):
    spec, _, source = data_spec
    built = prepare_data(spec)
    assert isinstance(prepare_data(spec), WarmData)
    # the source file edited in place (same size): its mtime says so
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not isinstance(prepare_data(spec), WarmData)
    assert isinstance(prepare_data(spec), WarmData)  # recorded again
    # the tokenizer directory changed since the record
    tok = next(p for p in sorted(os.scandir(built.info.tokenizer), key=lambda e: e.name)
               if p.is_file())
    st = os.stat(tok.path)
    os.utime(tok.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    rebuilt = prepare_data(spec)
    assert not isinstance(rebuilt, WarmData)
    # a damaged cache entry: checked, named and built again by the data path
    entry = rebuilt.info.cache_path
    arrow = next(os.path.join(d, f) for d, _, fs in os.walk(entry) for f in fs
                 if f.endswith(".arrow"))
    with open(arrow, "r+b") as f:
        f.seek(8)
        f.write(b"\0\1\2\3")
    with caplog.at_level(logging.WARNING, logger="llama_fsdp"):
        again = prepare_data(spec)
    assert not isinstance(again, WarmData)
    assert "the cached tokenized data is damaged" in caplog.text
