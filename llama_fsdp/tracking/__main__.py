"""`python -m llama_fsdp.tracking <run dir> [--uri URI] [--timeout S]`: deliver a run's
spooled tracking events (after an outage)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

from ..config.credentials import export_credentials
from .delivery import RunRefused, deliver_pending
from .store import NotAStore
from ..config.rundir import RunDir
from .spool import Spool, read_run_file

log = logging.getLogger("llama_fsdp.tracking")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_fsdp.tracking", description=__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--uri", default=None, help="deliver to this store instead of the run's")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not RunDir(args.run_dir).run_file.is_file():
        p.error(f"{args.run_dir} is not a run directory with tracking events (no "
                f"{RunDir(args.run_dir).run_file}): give a run's directory, as the "
                "launcher's warning or the run summary names it (outputs/runs/<date>/<time>)")
    if args.uri is not None:  # its credentials, if any, as MLflow reads them: the environment
        args.uri = export_credentials(args.uri)
    spool = Spool(args.run_dir)
    before = spool.backlog()
    try:
        left = deliver_pending(args.run_dir, deadline_s=args.timeout, uri=args.uri,
                               refused="raise")
    except (RunRefused, NotAStore) as e:
        log.error("%s: nothing delivered, %d bytes left: %s", args.run_dir, before, e)
        return 1
    info = read_run_file(args.run_dir)
    log.info("%s: delivered %d bytes of events to %s (run %s); %d left", args.run_dir,
             before - left, args.uri or info.get("tracking_uri"), info.get("run_id"), left)
    return 0 if left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
