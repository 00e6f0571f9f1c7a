"""The worker process a rank supervisor starts (launchers/rank.py): run the entry point,
pickle its result, or leave the traceback with the time it happened.

    python -m llama_fsdp.launchers.worker_process <in.pkl> <out.pkl> <traceback.json>
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from pathlib import Path

from llama_fsdp.launchers.process import exit_now, load_entry
from llama_fsdp.launchers.proctitle import set_title


def main(inp: str, out: str, tb_file: str) -> int:
    entry, spec = pickle.loads(Path(inp).read_bytes())
    if hasattr(spec, "world_size"):  # a RunSpec (an entry point may take anything)
        set_title(int(os.environ.get("RANK", "0")), spec.world_size, "worker", spec.output_dir)
    entry = load_entry(entry)
    try:
        result = entry(spec)
    except BaseException:  # noqa: BLE001 - every way out is reported to the supervisor
        Path(tb_file).write_text(json.dumps({"time": time.time(),
                                             "traceback": traceback.format_exc()}))
        traceback.print_exc()
        return 1
    tmp = Path(out + ".tmp")
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    exit_now(main(*sys.argv[1:4]))  # the result is on disk: nothing at exit may fail it
