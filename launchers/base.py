"""What every launcher is: one class per ``cluster.kind`` (local, slurm, torchrun) over this
base, as Hydra's submitit plugin has one launcher class per submitit executor over its
``BaseSubmititLauncher``.

A launcher answers, for its kind:

- ``placement``: where the ranks run and what each node has (the device, nodes, ranks per node,
  GPUs, RAM: llama_fsdp/config/placement.py), which the spec, its checks and the plan read;
- ``run_dir``: where the run writes (torchrun: a directory every process of the job agrees on);
- ``preflight``: what this machine lacks to launch, before anything is prepared;
- ``preview``: what a dry run prints instead of launching (the sbatch script, the ranks);
- ``launch``: the job's once-only duties (prepare.prepare_job: own the run directory, skip a
  finished run, tracking store, weights, data, the MLflow run), then every rank runs the entry
  point, a "module:function" name (the worker's); its ranks' results, or None when there was
  nothing to train;
- ``waits`` and ``speaks``: whether this process sees the ranks end, and whether it talks for
  the job.

Who closes the run's tracking after the ranks is decided by ``waits``, here and nowhere else:
rank 0 appends the run's last status to its spool when it ends (tracker.finish), and a launcher
that waits then delivers what is left, or marks FAILED / KILLED a run whose ranks could not say
so (``close_tracking``, which the command line calls); where no launcher waits (SLURM with
cluster.wait=false), rank 0's supervisor marks a failed run (launchers/rank.py). A launcher that
``ships_tracking`` also delivers rank 0's spool while it waits, so that rank 0 never loads
MLflow (the local launcher: it runs on the ranks' host).

The processes under a launch are one mechanism for every kind that starts processes: a
controller (the local one, or srun's step) starts one supervisor per rank (launchers/rank.py),
which runs the worker as its child and reports how it ended. torchrun's agent plays that part
under cluster=torchrun, whose ranks run the entry point in their own process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Optional

from ..prepare.job import prepare_job
from ..config.status import mlflow_status
from ..config.placement import Placement
from ..config.rundir import RunDir
from ..tracking import close_run, deliver_pending, read_run_file, shipping
from .signals import preparing, shielded
from .submitit_compat import check_version

if TYPE_CHECKING:
    from ..run.spec import RunSpec

log = logging.getLogger(__name__)


class Launcher:
    """How a run's ranks start for one ``cluster.kind``; ``cluster``: the config's cluster node."""

    ships_tracking: ClassVar[bool] = False

    def __init__(self, cluster: Any, entry: str = ""):
        self.cluster, self.entry = cluster, entry

    @property
    def waits(self) -> bool:
        """Whether this process sees the ranks end (then it prints the summary and closes the
        run's tracking after them)."""
        return True

    @property
    def speaks(self) -> bool:
        """Whether this process logs the plan and the outcome for the job."""
        return True

    def sweep_note(self, points: int) -> Optional[str]:
        """What a sweep of ``points`` points does with them, where Hydra's own word ("Launching
        N jobs locally": one after another, here) is not right; None: it is."""
        return None

    def placement(self, cfg: Any, output_dir: str) -> Placement:
        """Where the ranks of ``cfg`` (the typed Config) run and what each node has, with what
        this launcher cannot do with it (``Placement.problems``)."""
        raise NotImplementedError

    def run_dir(self, output_dir: str, *, given: bool) -> str:
        """The run directory: the config's output_dir (Hydra's run dir unless ``given`` on
        the command line)."""
        return str(Path(output_dir).expanduser().resolve())

    def preflight(self, spec: RunSpec) -> list[str]:
        """What this machine lacks to launch the run (checked before any preparation)."""
        return []

    def preview(self, spec: RunSpec) -> str:
        """What a dry run says it would start."""
        raise NotImplementedError

    def launch(self, spec: RunSpec, *, held: contextlib.ExitStack,
               command: str) -> Optional[list[Any]]:
        """Prepare the job here, then start its ranks (``start``); None: nothing to train."""
        if (warning := check_version()) is not None:
            log.warning("%s", warning)
        with preparing():
            prepared = prepare_job(spec, held=held, command=command)
        if prepared is None:
            return None
        return self.start(prepared.spec, on_submitted=prepared.owner.slurm_job)

    def start(self, spec: RunSpec, *, stream: bool = True,
              on_submitted: Optional[Callable[[str, bool], None]] = None) -> list[Any]:
        """Run the entry point on every rank of a prepared run; the ranks' results when this
        launcher waits. ``stream``: copy rank 0's log to this terminal while the job runs.
        ``on_submitted(job_id, detached)``: told a SLURM job's id once submitted."""
        raise NotImplementedError

    @contextlib.contextmanager
    def shipping(self, spec: RunSpec) -> Iterator[RunSpec]:
        """The spec the ranks get while the block runs; with ``ships_tracking``, rank 0's spool
        is delivered from here meanwhile and rank 0 only appends to it."""
        if not (self.ships_tracking and spec.tracking.enabled):
            yield spec
            return
        with shipping(spec.output_dir, spec.tracking_uri, final_s=spec.tracking.final_delivery_s):
            yield dataclasses.replace(spec, launcher_ships=True)

    def close_tracking(self, output_dir: str, status: Optional[str], *,
                       deadline_s: float) -> None:
        """After the ranks are gone: deliver what rank 0 could not, and close a run the ranks
        could not close as ended with ``status`` (result.STATUSES; None: as rank 0 said)."""
        if not RunDir(output_dir).tracking.is_dir():
            return
        info = read_run_file(output_dir)
        with shielded(f"closing the MLflow run (at most {deadline_s:g} s)"):
            left = (close_run(output_dir, mlflow_status(status), deadline_s=deadline_s)
                    if status else deliver_pending(output_dir, deadline_s=deadline_s))
        if left:
            log.warning("%d bytes of tracking events are not in MLflow yet (%s does not answer); "
                        "deliver them with: python -m llama_fsdp.tracking %s", left,
                        info.get("tracking_uri"), output_dir)
