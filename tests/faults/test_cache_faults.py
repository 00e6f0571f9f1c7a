"""A damaged cache is never trusted: a truncated tokenized split or a damaged trained tokenizer
is named and rebuilt, and a tokenization killed midway leaves nothing that looks complete."""
from __future__ import annotations

import functools
import re
import signal
import time

import psutil
import pytest

from llama_fsdp.config.rundir import CACHE_ENV
from tests.faults.conftest import no_leftovers
from tests.faults import conftest as faults

# a fault in the run's state, not in how its processes start or end: the command forked warm
run_cli = functools.partial(faults.run_cli, warm=True)
start_cli = functools.partial(faults.start_cli, warm=True)

pytestmark = [pytest.mark.slow]

SHORT = ["train.max_steps=2", "tracking.enabled=false"]


@pytest.fixture(autouse=True)
def own_cache(monkeypatch):
    """Each test damages a cache of its own: the launch folder's outputs/cache (the suite's
    shared one, $LLAMA_FSDP_CACHE_DIR, is not theirs to damage)."""
    monkeypatch.delenv(CACHE_ENV, raising=False)


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


def _partial_build(data) -> list:
    """The files of a build in progress (a hidden .synthetic-* folder) once one is written,
    and only while its manifest, the mark of a complete entry, is not."""
    from llama_fsdp.config.manifest import MANIFEST

    for build in data.glob(".synthetic-*"):
        files = [p for p in build.rglob("*") if p.is_file()]
        if files and not (build / MANIFEST).exists():
            return files
    return []


def test_tokenization_killed_midway_leaves_no_entry_that_looks_complete(tmp_path):
    """The driver is killed while it tokenizes (SIGKILL: nothing runs after it), once its build
    has written part of an entry: the next run finds no cache entry, tokenizes again and
    trains."""
    from llama_fsdp.config.manifest import MANIFEST

    proc = start_cli(tmp_path, *SHORT, "data.num_records=30000")
    deadline = time.monotonic() + 240
    data = tmp_path / "outputs" / "cache" / "data"
    entries = lambda: [p for p in data.glob("synthetic-*") if p.is_dir()]  # noqa: E731

    def stop() -> None:  # SIGSTOP, and wait until every thread of the driver is stopped
        proc.send_signal(signal.SIGSTOP)
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
            time.sleep(0.001)

    while time.monotonic() < deadline and not list(data.glob(".synthetic-*")):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    stop()  # the build has begun: from here the driver runs in 10 ms slices, looked at between
    while time.monotonic() < deadline and not _partial_build(data):
        assert not entries(), "the build finished between two looks"
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)
        stop()
    assert _partial_build(data) and not entries(), "the build was not caught midway"
    proc.send_signal(signal.SIGKILL)  # while stopped, with part of an entry written
    proc.wait(timeout=60)
    left = [p for p in data.glob(".synthetic-*") if p.is_dir()]
    assert left and not any((p / MANIFEST).exists() for p in left)  # the partial write stays
    assert not entries()  # nothing that looks whole
    assert no_leftovers(str(tmp_path)) == []
    code, out, _ = run_cli(tmp_path, *SHORT, "data.num_records=30000")
    assert code == 0, out[-3000:]
    assert re.search(r"tokenizing \d+ train records", out)  # by the driver, again
    assert not list(data.glob(".synthetic-*"))  # the killed build's leftovers are gone
