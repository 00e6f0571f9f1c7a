"""The spool's typed events: every kind survives its line on disk, and a spool written by an
earlier version (the same JSON lines) reads back as the same events."""
from __future__ import annotations

import json

import pytest

from llama_fsdp.tracking import Spool, events


def test_every_event_kind_round_trips_through_the_spool(tmp_path):
    written = [events.Create("exp", "tiny full", {"a": "b"}, ts=5), events.Params({"x.y": 1}),
               events.Metrics({"loss": 1.5}, step=3, ts=7), events.Tags({"k": "v"}),
               events.Text("yaml: 1", "config.yaml"), events.Artifacts("/d", "sub"),
               events.Model("/run/export", "run", 4, {"base": "x"}, "peft-lora",
                            {"summary/final_loss": 2.5}, ts=8),
               events.Inputs([{"name": "n"}]), events.Status("FINISHED", ts=9), events.Running(),
               events.Waiting(), events.Rewind(12)]
    assert {type(e) for e in written} == set(events.KINDS.values())  # one of each kind
    spool = Spool(tmp_path)
    for e in written:
        spool.append(e)
    assert [e for _, e in spool.pending()] == written
    assert spool.events() == written


def test_lines_of_an_earlier_spool_decode_to_their_events(tmp_path):
    lines = ['{"t": "metrics", "step": 2, "ts": 11, "m": {"loss": 0.5}}',
             '{"t": "params", "p": {"train.lr": 0.003}}',
             '{"t": "model", "dir": "/r/export", "name": "r", "step": 6, "params": {}}',
             '{"t": "status", "status": "KILLED", "ts": 12}']
    decoded = [events.decode(json.loads(line)) for line in lines]
    assert decoded == [events.Metrics({"loss": 0.5}, 2, 11), events.Params({"train.lr": 0.003}),
                       events.Model("/r/export", "r", 6, {}), events.Status("KILLED", 12)]
    with pytest.raises(ValueError, match="unknown tracking event 'nope'"):
        events.decode({"t": "nope"})
