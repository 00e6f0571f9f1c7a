"""The command line as Hydra reads it, with Hydra's own override parser: the overrides of a
sweep that vary and a point's values of them, the command line as typed, and dotted keys the
schema does not have, each with the closest valid key (checked before Hydra composes)."""
from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override

from ..config.schema import Config
from ..config.credentials import redact, strip_credentials
from ..run.checks import field_type, not_a_key


def parse_override(arg: str) -> Optional[Override]:
    """One command-line argument as Hydra reads it; None for what is no override (a flag)."""
    try:
        return OverridesParser.create().parse_override(arg)
    except Exception:  # noqa: BLE001 - Hydra's parser raises its own errors for non-overrides
        return None


def swept_overrides(args: list[str]) -> dict[str, str]:
    """The overrides of a sweep command that vary (comma lists, ranges, choices): key ->
    the values as typed ("1,2,4"). A list value (``cluster.setup=[a,b]``) is one value."""
    out = {}
    for arg in args:
        o = parse_override(arg)
        if o is not None and o.is_sweep_override():
            out[o.key_or_group] = ",".join(o.sweep_string_iterator())
    return out


def sweep_size(args: list[str]) -> Optional[int]:
    """How many points a sweep command runs (Hydra's basic sweeper: every combination of the
    swept values); None when a swept value is no list of choices (an interval, for another
    sweeper)."""
    size = 1
    for arg in args:
        o = parse_override(arg)
        if o is None or not o.is_sweep_override():
            continue
        try:
            size *= len(list(o.sweep_string_iterator()))
        except Exception:  # noqa: BLE001 - Hydra raises its own errors for these
            return None
    return size


def point_values(args: list[str], swept: Optional[list[str]]) -> dict[str, str]:
    """A sweep point's values of the swept keys (every override of the point when the swept
    keys are not known): {"train.batch_size": "2", "sharding": "full"}."""
    out = {}
    for arg in args:
        o = parse_override(arg)
        if o is None or o.is_delete() or o.is_sweep_override():
            continue
        if swept is None or o.key_or_group in swept:
            out[o.key_or_group] = o.get_value_element_as_str()
    return out


def command_line(*, drop: tuple[str, ...] = (), point: Optional[dict[str, str]] = None) -> str:
    """The command line as the user typed it (the MLflow run's description), without the
    overrides of the keys in ``drop``; for a sweep ``point`` (its values of the swept keys),
    the command that runs that point alone: no ``-m``, each swept key at the point's value."""
    prog = "llama-fsdp" if Path(sys.argv[0]).name == "llama-fsdp" else "python -m llama_fsdp"
    return " ".join([prog, *(shlex.quote(shown_override(a))
                             for a in command_args(sys.argv[1:], drop=drop, point=point))])


def command_args(argv: list[str], *, drop: tuple[str, ...] = (),
                 point: Optional[dict[str, str]] = None) -> list[str]:
    """``command_line``'s arguments, from the arguments as typed."""
    out = []
    for arg in argv:
        o = parse_override(arg)
        if o is not None and o.key_or_group in drop:
            continue
        if point is not None:
            if arg in ("-m", "--multirun"):
                continue
            if o is not None and o.is_sweep_override() and o.key_or_group in point:
                arg = f"{o.get_key_element()}={point[o.key_or_group]}"
        out.append(arg)
    return out


def rerun_command(values: dict[str, str]) -> str:
    """The command that runs one point of a search alone: the command as typed without ``-m``,
    the sweeper's settings and the sweep folder, each searched key at ``values``."""
    prog = "llama-fsdp" if Path(sys.argv[0]).name == "llama-fsdp" else "python -m llama_fsdp"
    out = []
    for arg in sys.argv[1:]:
        o = parse_override(arg)
        key = o.key_or_group if o is not None else ""
        if arg in ("-m", "--multirun") or key in values or key == "hydra.sweep.dir" or (
                key.startswith(("hydra.sweeper", "hydra/sweeper"))):
            continue
        out.append(arg)
    out += [f"{k}={v}" for k, v in values.items()]
    return " ".join([prog, *(shlex.quote(shown_override(a)) for a in out)])


SEARCH_PARAMS = "hydra.sweeper.params."


def quote_search_spaces(argv: list[str]) -> list[str]:
    """``hydra.sweeper.params.<key>=tag(log, interval(...))`` as Hydra takes it: a search space
    as a string value of the sweeper's params (Hydra refuses a sweep of its own config), added
    where the params have no such key yet (``++``)."""
    out = []
    for arg in argv:
        o = parse_override(arg)
        if o is not None and o.key_or_group.startswith(SEARCH_PARAMS) and o.is_sweep_override():
            value = arg.split("=", 1)[1].replace("\\", "\\\\").replace("'", "\\'")
            arg = f"++{o.key_or_group}='{value}'"
        out.append(arg)
    return out


def shown_override(arg: str) -> str:
    """An argument as it may be shown and stored: a tracking URI without its credentials (they
    come from the environment), any other URL's redacted."""
    o = parse_override(arg)
    if o is not None and o.key_or_group == "tracking.uri" and not o.is_sweep_override():
        try:
            return f"{arg.split('=', 1)[0]}={strip_credentials(o.value())}"
        except Exception:  # noqa: BLE001 - a secret MLflow cannot take: hidden, refused later
            pass
    return redact(arg)


def override_key_problems(args: list[str]) -> list[str]:
    """Dotted ``key=value`` overrides of the command line whose key the schema does not have,
    each with the closest valid key: Hydra refuses them too, but says only "Key 'batchsize' not
    in 'TrainConfig'" and suggests ``+train.batchsize``, which fails in turn. Keys under a field
    that is not a dataclass (a dict, a list), ``+``/``~`` overrides, config groups and
    ``hydra.*`` are left to Hydra and to ``validate.unknown_keys``."""
    out = []
    for arg in args:
        o = parse_override(arg)
        if o is None or o.is_add() or o.is_delete() or o.is_force_add():
            continue
        key = o.key_or_group
        if "." not in key or key.startswith("hydra."):
            continue
        schema: Any = Config
        parts = key.split(".")
        for i, part in enumerate(parts):
            fields = {f.name for f in dataclasses.fields(schema)}
            if part not in fields:
                if i:  # (not a root field: a config group, or Hydra's to judge)
                    out.append(not_a_key(key, ".".join(parts[:i]) + ".", fields))
                break
            schema = field_type(schema, part)
            if not dataclasses.is_dataclass(schema):
                break
    return out


def overridden_keys() -> set[str]:
    """The keys the command line of this (Hydra) job overrides."""
    return {o.key_or_group for a in HydraConfig.get().overrides.task
            if (o := parse_override(a)) is not None}
