"""The worker process a rank supervisor starts (launchers/rank.py): run the entry point,
pickle its result, or leave the traceback with the time it happened.

    python -m llama_fsdp.launchers.child <in.pkl> <out.pkl> <traceback.json>
"""
from __future__ import annotations

import importlib
import json
import pickle
import sys
import time
import traceback
from pathlib import Path


def main(inp: str, out: str, tb_file: str) -> int:
    entry, spec = pickle.loads(Path(inp).read_bytes())
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
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
    from llama_fsdp.launchers.common import skip_final_collection

    code = main(*sys.argv[1:4])
    skip_final_collection()
    sys.exit(code)
