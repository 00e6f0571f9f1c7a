"""A damaged cache is never trusted: a truncated tokenized split or a damaged trained tokenizer
is named and rebuilt, and a tokenization killed midway leaves nothing that looks complete."""
from __future__ import annotations

import re
import signal
import time

import pytest

from tests.faults.conftest import no_leftovers, run_cli, start_cli

pytestmark = [pytest.mark.slow]

SHORT = ["train.max_steps=2", "tracking.enabled=false"]


def _truncate(path, keep: float = 0.5) -> int:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return len(data)


def test_a_truncated_tokenized_split_is_named_and_rebuilt(tmp_path):
    code, out, _ = run_cli(tmp_path, *SHORT)
    assert code == 0, out[-3000:]
    arrow = next((tmp_path / "outputs" / "cache" / "data").glob("synthetic-*/train/*.arrow"))
    size = _truncate(arrow)
    code, out, _ = run_cli(tmp_path, *SHORT)
    assert code == 0, out[-3000:]
    assert f"the cached tokenized data is damaged ({arrow} has {size // 2} bytes, {size} were " \
           "written): tokenizing again" in out
    assert "status         finished" in out
    assert arrow.stat().st_size == size  # rebuilt whole
    code, out, _ = run_cli(tmp_path, *SHORT)  # and trusted again
    assert code == 0 and "damaged" not in out and "tokenized data found in cache" in out


def test_a_damaged_project_tokenizer_is_named_and_trained_again(tmp_path):
    code, out, _ = run_cli(tmp_path, *SHORT)
    assert code == 0, out[-3000:]
    spm = next((tmp_path / "outputs" / "cache" / "tokenizers").glob("project-*/tokenizer.model"))
    data = bytearray(spm.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped: only the digest sees it
    spm.write_bytes(bytes(data))
    code, out, _ = run_cli(tmp_path, *SHORT)
    assert code == 0, out[-3000:]
    assert f"the cached project tokenizer is damaged ({spm} does not match the SHA-256 " \
           "recorded when it was written): training it again" in out
    assert "status         finished" in out


def test_tokenization_killed_midway_leaves_no_entry_that_looks_complete(tmp_path):
    """The driver is killed while it tokenizes (SIGKILL: nothing runs after it): the next run
    finds no cache entry, tokenizes again and trains."""
    proc = start_cli(tmp_path, *SHORT, "data.num_records=30000")
    deadline = time.monotonic() + 240
    data = tmp_path / "outputs" / "cache" / "data"
    while time.monotonic() < deadline and not list(data.glob(".synthetic-*")):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    time.sleep(0.5)  # inside the build
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not [p for p in data.glob("synthetic-*") if p.is_dir()]  # only the hidden build dir
    assert no_leftovers(str(tmp_path)) == []
    code, out, _ = run_cli(tmp_path, *SHORT, "data.num_records=30000")
    assert code == 0, out[-3000:]
    assert re.search(r"tokenizing \d+ train records", out)  # by the driver, again
    assert not list(data.glob(".synthetic-*"))  # the killed build's leftovers are gone
