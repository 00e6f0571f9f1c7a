"""The library versions this code is tested with, checked before anything runs.

Older releases lack what the code relies on (transformers' ``rope_parameters``, without which
the llama3 rope scaling would be dropped silently; DCP's HuggingFaceStorageReader; FSDP2's
fully_shard on module groups), so they fail here, loudly, instead of training something else.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# The floors tested: CI installs newer releases; transformers 5.17 is also run by CI
# (.ci/run), torch 2.11 is the GPU machines' build.
FLOORS = {"torch": (2, 11), "transformers": (5, 17)}


def _release(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def version_problems() -> list[str]:
    problems = []
    for name, floor in FLOORS.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            problems.append(f"{name} is not installed (need >= {'.'.join(map(str, floor))})")
            continue
        if _release(have) < floor:
            problems.append(f"{name} {have} is older than {'.'.join(map(str, floor))}, the "
                            "oldest release llama_fsdp is tested with: upgrade it "
                            f"(pip install -U '{name}>={'.'.join(map(str, floor))}')")
    return problems


def check_versions() -> None:
    problems = version_problems()
    if problems:
        raise SystemExit("llama_fsdp cannot run here:\n" + "\n".join(f"  - {p}" for p in problems))


# torch.nn.attention.varlen.varlen_attn takes grouped-query k/v (enable_gqa) from this release on;
# before, llama_fsdp repeats k/v to every query head (llama_fsdp/model/attention.py reads the
# signature; tests/unit/test_imports.py holds the two together).
VARLEN_GQA_TORCH = (2, 12)


def varlen_takes_gqa() -> bool:
    """Whether the installed torch's varlen_attn takes grouped-query k/v, from its version
    (the planner's question, asked without importing torch)."""
    try:
        return _release(version("torch")) >= VARLEN_GQA_TORCH
    except PackageNotFoundError:
        return True
