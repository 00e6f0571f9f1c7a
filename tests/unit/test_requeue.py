"""A job SLURM takes back (issue 57), in its parts: what SLURM says of a job and a partition
(scontrol's and sinfo's own lines), the ranks' answer to SIGTERM (real signals to this
process), and a resumed run's history in a real MLflow store: each step once, the resumed
attempt's; the run's status while it waits. The whole path runs on the test cluster
(tests/integration/test_slurm_requeue.py)."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from llama_fsdp.config import metrics as names
from llama_fsdp.launchers.slurm import node_ram
from llama_fsdp.launchers.slurm_state import (
    PartitionFacts,
    parse_job,
    parse_kill_wait,
    parse_memory,
    parse_partitions,
)

# `scontrol show job -o` of a job as this machine's SLURM 22.05 printed it (trimmed): running,
# just requeued by `scontrol requeue`, pending again, and selected for preemption
RUNNING = ("JobId=7 JobName=tiny UserId=root(0) Priority=1 JobState=RUNNING Reason=None "
           "Requeue=1 Restarts=0 BatchFlag=1 PreemptTime=None SuspendTime=None "
           "Command=/tmp/a b/job.sh WorkDir=/tmp/a b")
REQUEUED = RUNNING.replace("JobState=RUNNING", "JobState=COMPLETING").replace("Restarts=0",
                                                                             "Restarts=1")
PENDING = REQUEUED.replace("JobState=COMPLETING Reason=None", "JobState=PENDING Reason=BeginTime")
PREEMPTING = RUNNING.replace("PreemptTime=None", "PreemptTime=2026-11-28T05:49:00")
CANCELLED = RUNNING.replace("JobState=RUNNING", "JobState=COMPLETING")


def test_a_requeued_job_is_told_from_a_cancelled_or_preempted_one():
    running, requeued, pending, preempting, cancelled = map(
        parse_job, (RUNNING, REQUEUED, PENDING, PREEMPTING, CANCELLED))
    assert (running.state, running.restarts, running.preempting) == ("RUNNING", 0, False)
    assert requeued.requeued(0) and pending.requeued(0)  # its restart count passed the run's
    assert not pending.requeued(1)  # the same requeue, seen from the run it started
    assert not cancelled.requeued(0) and not running.requeued(0)  # COMPLETING, no restart
    assert preempting.preempting and not preempting.requeued(0)  # in its grace time
    assert parse_job("slurm_load_jobs error: Invalid job id specified") is None


def test_a_partitions_memory_and_stop_times():
    parts = parse_partitions(
        "PartitionName=debug Default=YES GraceTime=0 Nodes=node[1-2] MaxTime=UNLIMITED\n"
        "PartitionName=preemptible Default=NO GraceTime=30 Nodes=node[1-2]\n")
    assert parts[""]["PartitionName"] == "debug" and parts["preemptible"]["GraceTime"] == "30"
    assert parse_memory("24105\n 64000+\n") == 24105 and parse_memory("") is None
    assert parse_kill_wait("JobRequeue = 1\nKillWait                = 5 sec\n") == 5
    assert parse_kill_wait("") == 30  # SLURM's default
    assert PartitionFacts("p", 1000, grace_s=30, kill_wait_s=5).stop_warning_s == 35


def test_a_slurm_rank_s_host_memory_says_where_it_comes_from():
    """Before: with cluster.mem_gb unset the plan used the submitting host's RAM as a node's."""
    facts = PartitionFacts("debug", 24105, 0, 30)
    assert node_ram(64, facts)[:2] == (64 * 10**9, "cluster.mem_gb")
    assert node_ram(None, facts)[:2] == (24105 * 2**20, "partition debug's nodes, sinfo")
    ram, source, more = node_ram(None, None)
    assert ram is None and source == "cluster.mem_gb unset, and SLURM does not answer here"
    assert "cluster.mem_gb" in more


@pytest.fixture
def handlers():
    """This process's stop-signal handlers, as they were, after the test."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _signal(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs at the next bytecode


def test_sigterm_asks_for_a_save_when_it_fits_in_the_warning(handlers):
    from llama_fsdp.train.stopping import NONE, PREEMPT, PREEMPT_NOW, StopSignals

    save_s = [2.0]
    stops = StopSignals(warning_s=10, save_s=lambda: save_s[0]).install()
    assert stops.request() == NONE
    _signal(signal.SIGTERM)
    assert stops.request() == PREEMPT  # 2 s of saving fit in the 10 s SLURM leaves
    save_s[0] = 30.0
    assert stops.request() == PREEMPT_NOW  # they do not: stop without starting a save
    assert "a save takes about 30 s" in stops.why
    save_s[0] = None
    assert stops.request() == PREEMPT  # not known: save


def test_sigterm_is_no_stop_request_where_it_warns_of_nothing(handlers):
    """Local and torchrun ranks (no warning_s): SIGTERM keeps its default, ending the rank."""
    from llama_fsdp.train.stopping import PREEMPT, StopSignals

    before = signal.getsignal(signal.SIGTERM)
    stops = StopSignals().install()
    assert signal.getsignal(signal.SIGTERM) is before
    _signal(signal.SIGUSR2)
    assert stops.request() == PREEMPT


def _preempted(spec):
    """A worker stopped by a preemption's signal (what train() returns after its save)."""
    from types import SimpleNamespace

    return SimpleNamespace(status="preempted", steps=3)


@pytest.mark.parametrize("slurm_says,ended,marked", [(REQUEUED, False, True),
                                                     (CANCELLED, True, False)])
def test_a_preempted_point_has_ended_only_when_slurm_did_not_take_its_job_back(
        tmp_path, monkeypatch, handlers, slurm_says, ended, marked):
    """Rank 0 of a sweep point no launcher waits for, its worker stopped by SIGTERM: requeued,
    the point waits (its run says "requeued") and the sweep must not count it ended;
    cancelled (`scancel`), the point has ended. Before: a preempted point never ended."""
    import pickle
    from types import SimpleNamespace

    from llama_fsdp.launchers import rank, slurm_state

    for var in ("SLURM_RESTART_COUNT", rank.ATTEMPT_ENV):
        monkeypatch.delenv(var, raising=False)
    calls = []
    monkeypatch.setattr(slurm_state, "job_state", lambda job: parse_job(slurm_says))
    monkeypatch.setattr(rank, "_point_ended", lambda spec: calls.append("ended"))
    monkeypatch.setattr(rank, "_mark_requeued", lambda spec, **kw: calls.append("requeued"))
    spec = SimpleNamespace(output_dir=str(tmp_path), sweep_id="s1",
                           placement=SimpleNamespace(stop_warning_s=35),
                           tracking=SimpleNamespace(enabled=True),
                           cluster=SimpleNamespace(max_restarts=0))
    supervisor = rank.Supervisor(pickle.dumps((f"{__name__}:_preempted", spec)), "7", 0, [],
                                 watched=False)
    supervisor.signals.add(signal.SIGTERM)  # what the worker stopped on
    assert supervisor.run().status == "preempted"
    assert calls == ["requeued"] * marked + ["ended"] * ended


# --- a resumed run's MLflow record ---------------------------------------------------------------


def _store(tmp_path):
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking import Spool, deliver_pending, events, write_run_file

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "run"
    write_run_file(run_dir, {"tracking_uri": uri})
    Spool(run_dir).append(events.Create("exp", "run"))
    assert deliver_pending(run_dir, deadline_s=30) == 0
    from llama_fsdp.tracking import read_run_file

    return MlflowClient(tracking_uri=uri), run_dir, read_run_file(run_dir)["run_id"], uri


def _attempt(tracker, steps, scale: float) -> None:
    for step in steps:
        tracker.log_metrics({names.LOSS: scale * step, names.TOKENS_PER_SEC: 100.0 + step},
                            step=step)
        tracker.log_metrics({names.SYSTEM_PREFIX + "cpu": 1.0}, step=step)  # a sample's index


def test_a_resumed_run_shows_each_step_once_from_the_attempt_that_counts(tmp_path):
    """Attempt 1 logs steps 1-6 and stops (its newest checkpoint: step 3); attempt 2 resumes at
    step 3 and trains 4-8. Before: steps 4-6 showed twice, and the setup's step-0 metrics once
    per attempt. Now: once each, 4-6 the resumed attempt's; the system metrics (stepped by
    their samples) and step 0 untouched."""
    from llama_fsdp.tracking import Tracker, deliver_pending

    client, run_dir, run_id, uri = _store(tmp_path)
    first = Tracker(str(run_dir), uri, ship=False)
    assert not first.history().started
    first.log_start_metrics({names.GLOBAL_BATCH: 8.0})
    _attempt(first, range(1, 7), scale=1.0)
    assert deliver_pending(run_dir, deadline_s=30) == 0
    second = Tracker(str(run_dir), uri, ship=False)
    history = second.history()
    assert history.started and history.logged_through == 6
    second.continue_from(3, history)
    _attempt(second, range(4, 9), scale=-1.0)
    assert deliver_pending(run_dir, deadline_s=30) == 0
    losses = client.get_metric_history(run_id, names.LOSS)
    assert sorted((m.step, m.value) for m in losses) == [
        (1, 1.0), (2, 2.0), (3, 3.0), *((s, -float(s)) for s in range(4, 9))]
    assert client.get_run(run_id).data.metrics[names.LOSS] == -8.0  # the latest: step 8's
    assert len(client.get_metric_history(run_id, names.SYSTEM_PREFIX + "cpu")) == 11
    assert len(client.get_metric_history(run_id, names.GLOBAL_BATCH)) == 1


def test_where_mlflow_cannot_delete_a_point_the_resumed_run_leaves_out_what_it_holds(tmp_path):
    """An MLflow server has no call that deletes a metric point: the resumed attempt does not
    log the steps the run holds already (they come from the same batches and state)."""
    from llama_fsdp.tracking import Spool, Tracker, events, write_run_file

    run_dir = tmp_path / "run"
    write_run_file(run_dir, {"tracking_uri": "http://127.0.0.1:9"})
    first = Tracker(str(run_dir), "http://127.0.0.1:9", ship=False)
    _attempt(first, range(1, 7), scale=1.0)
    second = Tracker(str(run_dir), "http://127.0.0.1:9", ship=False)
    second.continue_from(3, second.history())
    _attempt(second, range(4, 9), scale=-1.0)
    losses = [(e.step, e.metrics[names.LOSS]) for e in Spool(run_dir).events()
              if isinstance(e, events.Metrics) and names.LOSS in e.metrics]
    assert losses == [(s, float(s)) for s in range(1, 7)] + [(7, -7.0), (8, -8.0)]
    assert not any(isinstance(e, events.Rewind) for e in Spool(run_dir).events())


def test_a_requeued_run_waits_as_scheduled_and_runs_again(tmp_path):
    """While its job waits in the queue the run is SCHEDULED and says "requeued" (before:
    FAILED, or KILLED); RUNNING again once the job runs."""
    from llama_fsdp.tracking import Spool, deliver_pending, events

    client, run_dir, run_id, _ = _store(tmp_path)
    Spool(run_dir).append(events.Status("KILLED"))  # what the stopped attempt's rank 0 said
    Spool(run_dir).append(events.Waiting())
    assert deliver_pending(run_dir, deadline_s=30) == 0
    run = client.get_run(run_id)
    assert (run.info.status, run.data.tags["status"]) == ("SCHEDULED", "requeued")
    Spool(run_dir).append(events.Running())
    assert deliver_pending(run_dir, deadline_s=30) == 0
    run = client.get_run(run_id)
    assert (run.info.status, run.data.tags["status"]) == ("RUNNING", "running")


def test_a_slurm_sweep_says_it_submits_its_points_not_that_it_runs_them_here(caplog):
    """Hydra's launcher logs "Launching N jobs locally" for every sweep; a SLURM sweep submits
    its points as jobs, and the line says that."""
    from types import SimpleNamespace

    from llama_fsdp.cli.multirun import HYDRA_LAUNCHER_LOG, say_what_launching_means
    from llama_fsdp.launchers import launcher_for

    hydra_log = logging.getLogger(HYDRA_LAUNCHER_LOG)
    try:
        caplog.set_level(logging.INFO, logger=HYDRA_LAUNCHER_LOG)
        say_what_launching_means(launcher_for(SimpleNamespace(kind="slurm", wait=False)))
        hydra_log.info(f"Launching {4} jobs locally")
        say_what_launching_means(launcher_for(SimpleNamespace(kind="local")))
        hydra_log.info(f"Launching {3} jobs locally")
    finally:
        say_what_launching_means(launcher_for(SimpleNamespace(kind="local")))
    assert [r.getMessage() for r in caplog.records] == [
        "submitting 4 sweep points as SLURM jobs, all at once; the sweep returns once they are "
        "queued", "Launching 3 jobs locally"]
