"""The GPU check's knobs that the CPU rehearsal does not set (benchmarks/gpu_check_stages.py):
each mutation of ``BROKEN`` still breaks the code it names (its text is there once, so a
refactor cannot leave it silently breaking nothing), a broken copy holds it and leaves the
checkout as it was, an unknown knob value is refused with the valid ones, and STAGES runs in
the order given, setup first."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_stages as stages  # noqa: E402


@pytest.mark.parametrize("name", sorted(stages.MUTATIONS))
def test_each_mutation_breaks_its_code_in_a_copy_only(name, tmp_path):
    m = stages.MUTATIONS[name]
    original = (REPO / m.path).read_text()
    assert original.count(m.old) == 1, (m.path, m.old)
    assert (REPO / m.test.split("::")[0]).exists(), m.test
    copy = stages.break_copy(m, tmp_path / name)
    broken = (copy / m.path).read_text()
    assert m.new in broken and m.old not in broken.replace(m.new, "")
    assert broken.replace(m.new, m.old) == original
    assert (REPO / m.path).read_text() == original  # the checkout is untouched
    assert (copy / "llama_fsdp" / "__init__.py").exists() and not (copy / ".git").exists()


def test_an_unknown_knob_value_is_refused_with_the_valid_ones(monkeypatch):
    monkeypatch.setenv("BROKEN", "resume-data-position,nope")
    with pytest.raises(SystemExit, match=r"BROKEN: unknown \['nope'\]; valid: "
                                         r"dpo-reference-is-policy, resume-data-position"):
        stages.listed("BROKEN", (), set(stages.MUTATIONS))
    monkeypatch.setenv("LANDING", " loss-full-8k , qlora-65k-24gb ")
    assert stages.listed("LANDING", (), set(stages.LANDING_BY_NAME)) == (
        "loss-full-8k", "qlora-65k-24gb")
    monkeypatch.delenv("LANDING")
    assert stages.listed("LANDING", ("chunked-loss",)) == ("chunked-loss",)


def test_stages_run_in_the_order_given_setup_first():
    s = gpu_check.Settings.from_env({"DEVICE": "cpu", "STAGES": "landing,throughput,setup"})
    assert [st.name for st in s.stages()] == ["setup", "landing", "throughput"]
    everything = gpu_check.Settings.from_env({"DEVICE": "cpu"})
    assert [st.name for st in everything.stages()] == [st.name for st in gpu_check.STAGES]
