"""The tracking events rank 0 and the driver spool, one typed record per kind.

A spool line is the event's ``wire()`` form, a JSON object whose ``t`` names the kind (the
short keys keep a run of thousands of steps small on disk); ``decode`` reads one back, so a
spool written by an earlier version is delivered the same way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Create:
    """Create the run (and its experiment) when the spool starts without one."""

    KIND: ClassVar[str] = "create"
    experiment: str
    run_name: str
    tags: dict[str, str] = field(default_factory=dict)
    ts: int = field(default_factory=now_ms)
    experiment_tags: dict[str, str] = field(default_factory=dict)  # set on the experiment too
    # (a sweep's own saved view)

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "experiment": self.experiment, "run_name": self.run_name,
                "tags": self.tags, "ts": self.ts, "etags": self.experiment_tags}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Create":
        return cls(d["experiment"], d["run_name"], d.get("tags") or {}, d["ts"],
                   d.get("etags") or {})


@dataclass(frozen=True)
class Params:
    KIND: ClassVar[str] = "params"
    params: dict[str, Any]

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "p": self.params}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Params":
        return cls(d["p"])


@dataclass(frozen=True)
class Metrics:
    KIND: ClassVar[str] = "metrics"
    metrics: dict[str, float]
    step: int
    ts: int = field(default_factory=now_ms)

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "step": self.step, "ts": self.ts, "m": self.metrics}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Metrics":
        return cls(d["m"], d["step"], d["ts"])


@dataclass(frozen=True)
class Tags:
    KIND: ClassVar[str] = "tags"
    tags: dict[str, str]

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "tags": self.tags}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Tags":
        return cls(d["tags"])


@dataclass(frozen=True)
class Text:
    """A text artifact (the resolved config.yaml)."""

    KIND: ClassVar[str] = "text"
    text: str
    file: str

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "text": self.text, "file": self.file}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Text":
        return cls(d["text"], d["file"])


@dataclass(frozen=True)
class Artifacts:
    KIND: ClassVar[str] = "artifacts"
    dir: str
    path: Optional[str] = None

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "dir": self.dir, "path": self.path}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Artifacts":
        return cls(d["dir"], d.get("path"))


@dataclass(frozen=True)
class Model:
    """An exported HF (or adapter) directory as the run's logged model, with the run's final
    metrics (logged to the run, linked to the model: its page lists them)."""

    KIND: ClassVar[str] = "model"
    dir: str
    name: str
    step: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    model_type: str = "transformers-llama"
    metrics: dict[str, float] = field(default_factory=dict)
    ts: int = 0  # when the metrics were taken (0: when delivered)

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "dir": self.dir, "name": self.name, "step": self.step,
                "params": self.params, "model_type": self.model_type, "m": self.metrics,
                "ts": self.ts}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Model":
        return cls(d["dir"], d["name"], d.get("step", 0), d.get("params") or {},
                   d.get("model_type", "transformers-llama"), d.get("m") or {},
                   d.get("ts", 0))


@dataclass(frozen=True)
class Inputs:
    """The run's data sets (MLflow dataset inputs), as plain dicts."""

    KIND: ClassVar[str] = "inputs"
    datasets: list[dict[str, Any]]

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "datasets": self.datasets}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Inputs":
        return cls(d["datasets"])


@dataclass(frozen=True)
class Status:
    """The run ends: FINISHED, FAILED or KILLED; ``word``: what the status column says when it
    says more than MLflow's status (a run that diverged is FAILED, and says "diverged")."""

    KIND: ClassVar[str] = "status"
    status: str
    ts: int = field(default_factory=now_ms)
    word: Optional[str] = None

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "status": self.status, "ts": self.ts,
                **({"word": self.word} if self.word else {})}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Status":
        return cls(d["status"], d["ts"], d.get("word"))


@dataclass(frozen=True)
class Running:
    """The run continues (a resume, a sweep started again): RUNNING again."""

    KIND: ClassVar[str] = "running"

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Running":
        return cls()


@dataclass(frozen=True)
class Waiting:
    """The run waits in a scheduler's queue again (its job was requeued): SCHEDULED, with the
    status word "requeued", until its ranks start again (``Running``)."""

    KIND: ClassVar[str] = "waiting"

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Waiting":
        return cls()


@dataclass(frozen=True)
class Rewind:
    """The run continues from its checkpoint at ``step``: the points an attempt that stopped
    later logged past it (of every metric but the system ones) are replaced by the steps
    trained again, which follow."""

    KIND: ClassVar[str] = "rewind"
    step: int

    def wire(self) -> dict[str, Any]:
        return {"t": self.KIND, "step": self.step}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Rewind":
        return cls(d["step"])


Event = Union[Create, Params, Metrics, Tags, Text, Artifacts, Model, Inputs, Status, Running,
              Waiting, Rewind]
KINDS: dict[str, Any] = {k.KIND: k for k in (Create, Params, Metrics, Tags, Text, Artifacts,
                                              Model, Inputs, Status, Running, Waiting, Rewind)}


def decode(d: dict[str, Any]) -> Event:
    """A spool line (parsed JSON) as its event; an unknown kind raises ValueError."""
    kind = KINDS.get(d.get("t"))
    if kind is None:
        raise ValueError(f"unknown tracking event {d.get('t')!r}")
    return kind.from_wire(d)
