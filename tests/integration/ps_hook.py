"""A step hook (``train.callbacks=[tests.integration.ps_hook:snapshot]``): after the first step,
rank 0 writes what `ps` shows of every process to the file LLAMA_FSDP_TEST_PS names, while
every rank of the run is alive."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Callable

PS_FILE = "LLAMA_FSDP_TEST_PS"


def snapshot(*, rank: int, world_size: int, output_dir: str) -> Callable[[Any], None]:
    done = []

    def hook(state: Any) -> None:
        if rank == 0 and not done:
            done.append(True)
            # a process's comm and args, tab-separated (either may hold blanks)
            lines = [f"{_ps('comm', pid)}\t{_ps('args', pid)}" for pid in _pids()]
            Path(os.environ[PS_FILE]).write_text("\n".join(lines))

    return hook


def _pids() -> list[str]:
    return subprocess.run(["ps", "-eo", "pid="], capture_output=True, text=True).stdout.split()


def _ps(field: str, pid: str) -> str:
    return subprocess.run(["ps", "-o", f"{field}=", "-p", pid], capture_output=True,
                          text=True).stdout.strip()
