"""The sweep summary table: the swept keys are columns even when only one point ran, and a
point refused before it launched (no MLflow run) still has its row."""
from __future__ import annotations

from types import SimpleNamespace

from llama_fsdp.sweep import format_table, summary_rows


def _run(params: dict, metrics: dict, status: str = "FINISHED"):
    return SimpleNamespace(data=SimpleNamespace(params=params, metrics=metrics),
                           info=SimpleNamespace(status=status))


def test_a_refused_point_has_a_row_and_the_swept_key_stays_a_column():
    ran = _run({"train.batch_size": "2", "train.lr": "0.001"},
               {"summary/tokens_per_sec": 2942.0, "summary/final_loss": 0.8209})
    keys, rows = summary_rows([ran], ["train.batch_size"], [("batch_size=0", 2)])
    assert keys == ["train.batch_size"]
    assert [(r["train.batch_size"], r["status"]) for r in rows] == [
        ("2", "FINISHED"), ("0", "REFUSED (exit 2)")]
    table = format_table(keys, rows).splitlines()
    assert table[0].split()[0] == "train.batch_size"
    assert table[2].split()[0] == "2" and table[3].split() == ["0", "-", "-", "-", "REFUSED",
                                                               "(exit", "2)"]


def test_keys_that_differ_between_points_are_columns_too():
    a = _run({"train.batch_size": "2", "sharding.strategy": "full"}, {})
    b = _run({"train.batch_size": "4", "sharding.strategy": "full"}, {})
    keys, rows = summary_rows([b, a])
    assert keys == ["train.batch_size"] and [r["train.batch_size"] for r in rows] == ["2", "4"]
