"""Launcher pieces: what each executor and rank is given (parameters, environment), failure
reports, and how a rank process ends."""
from __future__ import annotations

import json
import os
import pickle
import platform
import shutil
import signal
import subprocess
import sys

import pytest

from llama_fsdp.launchers.errors import failure_message
from llama_fsdp.launchers.environment import worker_env
from llama_fsdp.launchers.local import NO_TIME_LIMIT_MIN, local_parameters
from llama_fsdp.launchers.rank import read_reports, report_path
from llama_fsdp.launchers.slurm import executor_parameters, with_restarts
from tests.conftest import make_spec


def _report(rank, t, traceback="", sig=0, code=1):
    return {"rank": rank, "host": "n1", "pid": 100 + rank, "exitcode": -sig if sig else code,
            "signal": sig, "signal_name": signal.Signals(sig).name if sig else None, "time": t,
            "traceback": traceback, "echo": "Connection reset by peer" in traceback,
            "attempt": 0, "log_tail": [f"rank {rank} log line"]}


def test_failure_report_leads_with_the_rank_that_died_not_its_echoes(tmp_path):
    # rank 1 was SIGKILLed (no traceback); rank 0's collective broke and it reported first
    echo = "Traceback\nRuntimeError: Read error: Connection reset by peer"
    report_path(tmp_path, 0).write_text(json.dumps(_report(0, 1.0, echo)))
    report_path(tmp_path, 1).write_text(json.dumps(_report(1, 2.0, sig=signal.SIGKILL)))
    reports = read_reports(tmp_path)
    assert [r["rank"] for r in reports] == [1, 0]
    msg = failure_message("42", reports)
    assert msg.startswith("job 42 failed; the first rank to fail:\nrank 1 on n1 (pid 101): "
                          "killed by signal 9 (SIGKILL)")
    assert "OOM killer" in msg and "rank 1 log line" in msg
    assert msg.index("rank 1 on n1") < msg.index("then rank 0 on n1: RuntimeError: Read error")


def test_earliest_real_error_is_the_cause(tmp_path):
    report_path(tmp_path, 0).write_text(json.dumps(_report(0, 5.0, "Traceback\nKeyError: 'x'")))
    report_path(tmp_path, 1).write_text(json.dumps(_report(1, 3.0, "Traceback\nValueError: bad")))
    assert [r["rank"] for r in read_reports(tmp_path)] == [1, 0]


def test_local_executor_sees_this_hosts_gpus_and_has_no_time_limit(monkeypatch, tmp_path):
    spec = make_spec(["cluster.device=cpu"], output_dir=tmp_path)
    params = local_parameters(spec)
    assert params == {"tasks_per_node": 2, "nodes": 1, "timeout_min": NO_TIME_LIMIT_MIN,
                      "signal_delay_s": 300}
    # on CUDA each rank must see the GPUs (submitit hides them unless gpus_per_node is given)
    cuda = spec.__class__(**{**spec.__dict__, "device": "cuda"})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_parameters(cuda)["gpus_per_node"] == 2
    assert "visible_gpus" not in local_parameters(cuda)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert local_parameters(cuda)["visible_gpus"] == (2, 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1a2b,GPU-3c4d")
    assert local_parameters(cuda)["setup"] == ["export CUDA_VISIBLE_DEVICES=GPU-1a2b,GPU-3c4d"]
    limited = make_spec(["cluster.device=cpu", "cluster.timeout_min=30"], output_dir=tmp_path)
    assert local_parameters(limited)["timeout_min"] == 30


def test_slurm_executor_parameters(tmp_path):
    spec = make_spec(["cluster=slurm", "cluster.nodes=2", "cluster.nproc_per_node=4",
                      "cluster.gpus_per_node=4", "cluster.device=cuda", "cluster.partition=gpu",
                      "cluster.mem_gb=200", "cluster.signal_delay_s=600", "dry_run=true",
                      "cluster.srun_args=['--cpu-bind=none']", "sharding=hybrid"],
                     output_dir=tmp_path)
    p = executor_parameters(spec)
    assert p["nodes"] == 2 and p["ntasks_per_node"] == 4 and p["gpus_per_node"] == 4
    assert p["time"] == 60 and p["signal_delay_s"] == 600 and p["mem"] == "200GB"
    assert p["partition"] == "gpu" and "account" not in p
    assert p["srun_args"] == ["--kill-on-bad-exit=1", "--open-mode=append", "--cpu-bind=none"]
    assert "export HF_HUB_OFFLINE=1" in p["setup"]
    assert any(line.startswith("export TORCH_FR_DUMP_TEMP_FILE=") for line in p["setup"])


def test_restart_loop_wraps_only_the_srun_line():
    script = "#!/bin/bash\n#SBATCH --nodes=2\n\n# command\nexport X=1\nsrun --unbuffered python -m x\n"
    out = with_restarts(script, 2)
    lines = out.splitlines()
    assert lines[:5] == script.splitlines()[:5]
    assert lines[5] == "for attempt in $(seq 0 2); do"
    assert "  export LLAMA_FSDP_ATTEMPT=$attempt" in lines
    assert "  srun --unbuffered python -m x && exit 0" in lines
    assert lines[-1] == "exit 1" and out.count("srun ") == 1


def test_ranks_never_reach_a_hub():
    env = worker_env("/runs/x", "cuda")
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_DATASETS_OFFLINE"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join("/runs/x", "hang", "nccl_trace_rank_")


@pytest.mark.parametrize("user,users_own", [
    ({}, False),
    ({"MALLOC_ARENA_MAX": "2"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, True),
    ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2:glibc.malloc.mmap_threshold=1"}, True),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, True),
    ({"LD_PRELOAD": "/opt/lib/libtcmalloc_minimal.so.4 /opt/lib/libfoo.so"}, True),
    ({"LD_PRELOAD": "/opt/hoard/libhoard.so"}, True),
    ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, False),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libgomp.so.1"}, False),
    # a value that merely mentions malloc is no allocator setting
    ({"HOME": "/home/malloc", "NOTES": "tried MALLOC_ARENA_MAX"}, False),
])
def test_cpu_ranks_keep_their_heap_unless_the_user_set_the_allocator(user, users_own):
    """CPU ranks get both malloc settings (one without the other is worse than neither); a
    user's own allocator or glibc malloc setting is left as it is; GPU ranks get neither."""
    from llama_fsdp.launchers.environment import CPU_MALLOC_ENV

    ours = set(CPU_MALLOC_ENV)
    assert ours == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}
    cpu = set(worker_env("/runs/x", "cpu", environ=user))
    assert (ours.isdisjoint(cpu) if users_own else ours <= cpu), (
        f"{user}: the user's own allocator setting is {users_own}, the ranks got "
        f"{sorted(ours & cpu)}")
    assert ours.isdisjoint(worker_env("/runs/x", "cuda", environ=user))


def test_a_cpu_slurm_job_exports_the_malloc_settings_before_the_users_setup(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    spec = make_spec(["cluster=slurm", "cluster.device=cpu",
                      "cluster.setup=['export MALLOC_TRIM_THRESHOLD_=1']"])
    setup = executor_parameters(spec)["setup"]
    ours = setup.index("export MALLOC_TRIM_THRESHOLD_=268435456")
    assert "export MALLOC_MMAP_THRESHOLD_=33554432" in setup
    assert setup.index("export MALLOC_TRIM_THRESHOLD_=1") > ours  # the user's line wins


def test_the_ranks_environment_does_not_stay_in_the_launching_process(monkeypatch):
    """A CPU run's malloc settings must not reach a later (GPU) run's ranks from a sweep in
    the same process, nor look like the user's own to it."""
    from llama_fsdp.launchers.environment import scoped_environ

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    with scoped_environ({"HF_HUB_OFFLINE": "1", "MALLOC_TRIM_THRESHOLD_": "268435456"}):
        assert os.environ["HF_HUB_OFFLINE"] == "1"
        assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "268435456"
        os.environ["HF_HUB_OFFLINE"] = "2"  # changed inside (the attempt number is): restored
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "MALLOC_TRIM_THRESHOLD_" not in os.environ


def test_glibc_honours_the_cpu_malloc_settings(tmp_path):
    """The variables are spelled as this glibc reads them: a 24 MiB buffer is mmapped (and
    unmapped on free) by default, and with the settings comes from the heap and stays there
    after it is freed, for the next step's tensors."""
    from llama_fsdp.launchers.environment import CPU_MALLOC_ENV

    libc, version = platform.libc_ver()
    if libc != "glibc" or tuple(map(int, version.split(".")[:2])) < (2, 33):
        pytest.skip("mallinfo2 needs glibc >= 2.33")
    script = tmp_path / "heap.py"
    script.write_text(
        "import ctypes, json\n"
        "class MI(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks',\n"
        "                'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.mallinfo2.restype = MI\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "n = 24 << 20\n"
        "before = libc.mallinfo2()\n"
        "p = libc.malloc(n)\n"
        "ctypes.memset(p, 1, n)\n"
        "held = libc.mallinfo2()\n"
        "libc.free(ctypes.c_void_p(p))\n"
        "after = libc.mallinfo2()\n"
        "print(json.dumps({'mmapped': held.hblks - before.hblks,\n"
        "                  'heap_after_free': after.arena}))\n")
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}

    def heap(env):
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout)

    default, tuned = heap(clean), heap({**clean, **CPU_MALLOC_ENV})
    assert default["mmapped"] == 1 and default["heap_after_free"] < 24 << 20, default
    assert tuned["mmapped"] == 0 and tuned["heap_after_free"] >= 24 << 20, tuned


def test_more_local_ranks_than_gpus_is_refused_before_launch(monkeypatch, tmp_path):
    from llama_fsdp.launchers import hosts
    from llama_fsdp.run.spec import ConfigError

    monkeypatch.setattr(hosts, "local_cuda_count", lambda: 2)
    monkeypatch.setattr(hosts, "local_bf16", lambda: True)
    with pytest.raises(ConfigError, match=r"cluster.nproc_per_node=4 but only 2 GPU\(s\) are "
                                          r"visible: use cluster.nproc_per_node<=2"):
        make_spec(["cluster.device=cuda", "cluster.nproc_per_node=4"], output_dir=tmp_path)


def test_a_machine_without_gpus_is_told_that_not_that_its_gpu_lacks_bf16(tmp_path):
    import torch

    from llama_fsdp.run.spec import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError) as e:
        make_spec(["cluster.device=cuda", "precision=mixed"], output_dir=tmp_path)
    assert "no CUDA device is visible: use cluster.device=cpu" in str(e.value)
    assert "does not support" not in str(e.value)


def test_slurm_without_sbatch_is_one_plain_line(monkeypatch, tmp_path):
    from llama_fsdp.launchers import launcher_for

    def preflight(spec):
        return launcher_for(spec.cluster).preflight(spec)

    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM command anywhere
    spec = make_spec(["cluster=slurm", "cluster.device=cpu"], output_dir=tmp_path / "run")
    assert preflight(spec) == [
        "cluster=slurm but sbatch is not on PATH: this is not a SLURM login node. Run from one, "
        "use cluster=local, or add dry_run=true to see the job script"]
    assert preflight(make_spec(output_dir=tmp_path / "local")) == []


@pytest.mark.skipif(not shutil.which("sinfo"), reason="SLURM's client commands are not installed")
def test_slurm_whose_controller_does_not_answer_is_refused(monkeypatch, tmp_path):
    """The commands are installed but no controller answers (a workstation with slurm-client):
    refused before any data work, with sinfo's own reason."""
    from llama_fsdp.launchers import launcher_for

    (tmp_path / "slurm.conf").write_text("ClusterName=nowhere\nSlurmctldHost=127.0.0.1\n"
                                         "SlurmctldPort=9\n")  # nothing listens on port 9
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    spec = make_spec(["cluster=slurm", "cluster.device=cpu"], output_dir=tmp_path / "run")
    (problem,) = launcher_for(spec.cluster).preflight(spec)
    assert problem.startswith("cluster=slurm but the SLURM controller does not answer here (")
    assert "use cluster=local" in problem


def test_requeue_budget_and_restart_loop_reach_the_executors(tmp_path):
    """cluster.max_requeues is how many preemptions/timeouts submitit resubmits after;
    cluster.max_restarts wraps the SLURM job step in a restart loop."""
    from llama_fsdp.launchers.local import _executor
    from llama_fsdp.launchers.slurm import make_executor

    local = _executor(make_spec(["cluster.device=cpu", "cluster.max_requeues=5"],
                                output_dir=tmp_path / "local"))
    assert local.max_num_timeout == 5
    slurm = make_executor(make_spec(["cluster=slurm", "cluster.device=cpu", "dry_run=true",
                                     "cluster.max_requeues=2", "cluster.max_restarts=3"],
                                    output_dir=tmp_path / "slurm"))
    assert slurm.max_num_timeout == 2
    script = slurm._make_submission_file_text("python -m x", "uid")
    assert 'job step failed (attempt $attempt of 3 restarts)' in script
    assert script.rstrip().endswith("done\nexit 1")


def test_a_rank_process_hands_its_result_over_and_still_runs_its_exit_work(tmp_path):
    """A rank's process hands its result over, then ends through launchers.program.exit_now
    (no finalization: test_a_finished_process_ends_with_its_code_however_late_a_cpp_thread_
    returns), its atexit handlers run."""
    (tmp_path / "rank_entry.py").write_text(
        "import atexit, pathlib\n"
        "def entry(spec):\n"
        "    marker = pathlib.Path(spec['marker'])\n"
        "    atexit.register(lambda: marker.write_text('atexit ran'))\n"
        "    return {'loss': 1.5}\n")
    inp, out, tb = (tmp_path / n for n in ("in.pkl", "out.pkl", "tb.json"))
    inp.write_bytes(pickle.dumps(("rank_entry:entry", {"marker": str(tmp_path / "atexit")})))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]])}
    done = subprocess.run([sys.executable, "-m", "llama_fsdp.launchers.worker_process", str(inp),
                           str(out), str(tb)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert pickle.loads(out.read_bytes()) == {"loss": 1.5} and not tb.exists()
    assert (tmp_path / "atexit").read_text() == "atexit ran"


def test_tf32_for_fp32_on_cuda_sets_both_apis_alike():
    """torch.compile reads the legacy TF32 flag (dynamo) and the fp32_precision setting
    (inductor); setting only one makes reading the other raise. In a fresh process: the global
    flags are not this test process's to change."""
    code = ("import torch\nfrom llama_fsdp.train.distributed import enable_tf32\nenable_tf32()\n"
            "print(torch._C._get_cublas_allow_tf32(), torch.backends.cuda.matmul.fp32_precision)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "tf32"]


def test_the_sbatch_script_is_previewed_without_slurm(tmp_path, monkeypatch):
    """A dry run plans on a laptop: the script is written with no srun or sbatch on PATH
    (submitit's executor refuses to exist there)."""
    import shutil

    from llama_fsdp.launchers import launcher_for

    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    assert shutil.which("srun") is None
    spec = make_spec(["cluster=slurm", "cluster.nodes=4", "cluster.device=cpu",
                      "cluster.nproc_per_node=8", "cluster.max_restarts=1"],
                     output_dir=tmp_path / "run")
    script = launcher_for(spec.cluster).preview(spec)
    assert "#SBATCH --nodes=4" in script and "#SBATCH --ntasks-per-node=8" in script
    assert "srun " in script and "(attempt $attempt of 1 restarts)" in script


def test_the_local_controller_gets_the_environment_submitit_gives_it(monkeypatch, tmp_path):
    """launchers/submitit_compat.start_controller mirrors submitit's: the same variables reach
    the controller, with a session of its own and the parent-death signal added."""
    import subprocess

    from submitit.local import local as submitit_local

    from llama_fsdp.launchers import submitit_compat

    seen = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: seen.append((cmd, kw)))
    args = dict(tasks_per_node=2, cuda_devices="0,1", timeout_min=3.0, signal_delay_s=7,
                setup=["export A=1"])
    submitit_local.start_controller(tmp_path, "python -m x", **args)
    submitit_compat.start_controller(tmp_path, "python -m x", **args)
    (theirs_cmd, theirs), (ours_cmd, ours) = seen
    assert ours_cmd == theirs_cmd.replace("submitit.local._local", "llama_fsdp.launchers.controller")
    assert ours["shell"] == theirs["shell"]
    assert {k: v for k, v in ours["env"].items() if k.startswith(("SUBMITIT", "CUDA"))} == \
        {k: v for k, v in theirs["env"].items() if k.startswith(("SUBMITIT", "CUDA"))}
    assert callable(ours["preexec_fn"]) and "preexec_fn" not in theirs
    assert submitit_compat.check_version() is None  # the installed submitit is a tested release


def _job_pid() -> int:
    return os.getpid()


def test_an_early_controller_is_the_job_it_is_given(tmp_path, monkeypatch):
    """The local launcher starts the job's controller before it prepares the job (it imports
    the ranks' modules meanwhile): the process started first is the job's controller (its id is
    the job's), and it runs the job's task. What the preparation sets meanwhile for MLflow's
    client (which the controller never imports) does not make it another."""
    from llama_fsdp.launchers.submitit_compat import EarlyController, SessionLocalExecutor

    early = EarlyController(tmp_path / "submitit")
    first = early.process
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")  # as prepare's store check does
    executor = SessionLocalExecutor(folder=tmp_path / "submitit", early=early)
    executor.update_parameters(tasks_per_node=1, nodes=1, timeout_min=2)
    job = executor.submit(_job_pid)
    assert job.job_id == str(first.pid)
    assert job.result() != first.pid  # the task: a process of the controller's own
    assert first.wait(timeout=30) == 0 and early.process is None


def test_an_early_controller_started_with_another_environment_is_not_the_job(tmp_path):
    """A variable read at import (here HF_HUB_OFFLINE) that differs between the controller's
    start and the job's submission: the early controller ends and the job gets a new one."""
    from llama_fsdp.launchers.submitit_compat import EarlyController

    early = EarlyController(tmp_path, {**os.environ, "HF_HUB_OFFLINE": "0"})
    first = early.process
    assert early.go(tmp_path, {**os.environ, "HF_HUB_OFFLINE": "1",
                               "SUBMITIT_LOCAL_NTASKS": "1"}) is None
    assert first.returncode == 0  # ended without a job, at once
    assert not (tmp_path / "submitit").exists()


def test_an_early_controller_without_a_job_ends_and_leaves_nothing(tmp_path):
    """A launch that stops before its ranks (its data refused, nothing left to train) ends the
    controller it started early."""
    from llama_fsdp.launchers.submitit_compat import EarlyController

    early = EarlyController(tmp_path, {**os.environ, "LLAMA_FSDP_PRELOAD": "json"})
    first = early.process
    early.cancel()
    assert first.returncode == 0 and early.process is None
    assert early.go(tmp_path, dict(os.environ)) is None  # used up


def test_the_earlier_name_of_the_time_limit_still_sets_it(tmp_path, caplog):
    """cluster.time_min (the name before cluster.timeout_min, submitit's) is still read, over
    the group's default, and says what it became."""
    old = make_spec(["cluster=slurm", "cluster.device=cpu", "cluster.time_min=240"],
                    output_dir=tmp_path)
    assert old.cluster.timeout_min == 240 and old.cluster.time_min is None
    assert executor_parameters(old)["time"] == 240
    assert "read as cluster.timeout_min=240" in caplog.text
    new = make_spec(["cluster=slurm", "cluster.device=cpu"], output_dir=tmp_path)
    assert executor_parameters(new)["time"] == 60


RANK0_PROBE = """
import pickle, sys, threading
from llama_fsdp.tracking import open_tracker
tracker = open_tracker(pickle.load(open(sys.argv[1], "rb")))
for step in (1, 2, 3):
    tracker.log_metrics({"loss": 1.0 / step}, step=step)
tracker.finish("FINISHED")
print("RANK0", "mlflow" in sys.modules, sorted(t.name for t in threading.enumerate()))
"""


def test_the_local_launcher_delivers_rank_0s_spool_while_it_waits(tmp_path):
    """cluster=local: the launcher ships rank 0's spool to MLflow while the ranks run, so rank 0
    (a process of its own here, as a rank is) appends and ends without a shipper of its own or
    MLflow loaded; SLURM's ranks ship their own."""
    from mlflow.tracking import MlflowClient

    from llama_fsdp.launchers import launcher_for
    from llama_fsdp.prepare.tracking import start_run
    from llama_fsdp.tracking import read_run_file

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = make_spec([f"tracking.uri={uri}"], output_dir=tmp_path / "run")
    start_run(spec, command="pytest")
    with launcher_for(spec.cluster).shipping(spec) as ranks_spec:
        (tmp_path / "spec.pkl").write_bytes(pickle.dumps(ranks_spec))
        r = subprocess.run([sys.executable, "-c", RANK0_PROBE, str(tmp_path / "spec.pkl")],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RANK0 False ['MainThread']" in r.stdout, r.stdout + r.stderr[-2000:]
    client = MlflowClient(uri)
    run = client.get_run(read_run_file(spec.output_dir)["run_id"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]
    slurm = make_spec(["cluster=slurm", "cluster.timeout_min=10"], output_dir=tmp_path / "s")
    with launcher_for(slurm.cluster).shipping(slurm) as ranks_spec:
        assert ranks_spec is slurm and not ranks_spec.launcher_ships
HOSTILE = "it's a dir $(touch {marker}) `touch {marker}`"


def test_every_value_in_the_job_script_is_quoted(tmp_path):
    """A run directory with a space, an apostrophe and command substitutions: the script is
    valid bash, and run (with srun a stub that records what it was given) it creates no marker
    and hands the ranks the path as it is. Before: `export TORCH_FR_DUMP_TEMP_FILE=...` was
    written unquoted (the apostrophe broke the script; $(...) ran on the node)."""
    from llama_fsdp.launchers.slurm import sbatch_preview
    from tests.conftest import compose, spec_of

    marker = tmp_path / "marker"
    run = tmp_path / HOSTILE.format(marker=marker)
    cfg = compose(["output_dir=/tmp/unused", "cluster=slurm", "cluster.device=cpu",
                   "cluster.max_restarts=1",
                   "cluster.setup=[echo setup ran]"])
    script = sbatch_preview(spec_of(cfg, output_dir=str(run)))
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/bin/sh\nprintf %s "$TORCH_FR_DUMP_TEMP_FILE" > "$SEEN"\n')
    (stub / "srun").chmod(0o755)
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PATH": f"{stub}:{os.environ['PATH']}",
                              "SEEN": str(tmp_path / "seen")}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "setup ran" in out.stdout
    assert not marker.exists()
    assert (tmp_path / "seen").read_text() == str(run / "hang" / "nccl_trace_rank_")


@pytest.mark.parametrize("key", ["cluster.partition", "cluster.account", "cluster.qos",
                                 "cluster.constraint", "cluster.setup", "cluster.srun_args",
                                 "cluster.sbatch_extra", "tracking.run_name", "output_dir"])
def test_a_line_break_in_anything_that_reaches_sbatch_is_refused_naming_the_key(key, tmp_path):
    """Before: a newline in cluster.partition (qos, account, ...) started a shell line of its
    own in the job script, which ran, and the #SBATCH lines after it were ignored."""
    from omegaconf import open_dict

    from llama_fsdp.run.spec import ConfigError
    from tests.conftest import compose, spec_of

    cfg = compose([f"output_dir={tmp_path}/run", "cluster=slurm", "cluster.device=cpu"])
    evil = "debug\ntouch /tmp/pwned"
    with open_dict(cfg):
        match key:
            case "cluster.setup" | "cluster.srun_args":
                cfg[key.split(".")[0]][key.split(".")[1]] = ["ok", evil]
            case "cluster.sbatch_extra":
                cfg.cluster.sbatch_extra = {"comment": evil}
            case "output_dir":
                cfg.output_dir = f"{tmp_path}/a\rb"
            case _:
                section, field = key.split(".")
                cfg[section][field] = evil
    with pytest.raises(ConfigError) as e:
        spec_of(cfg)
    assert f"{key}" in str(e.value) and "holds a line break" in str(e.value)


def test_cuda_ranks_get_expandable_segments_unless_the_user_set_the_allocator():
    """The H200 check measured 8B QLoRA reserving 1.60x what it allocated: a CUDA rank starts
    its allocator with expandable segments, and a user's own setting (either name torch reads)
    is left alone."""
    from llama_fsdp.train.distributed import ALLOC_CONF, ALLOC_CONF_ENV, allocator_settings

    env: dict = {}
    assert allocator_settings(env) == ALLOC_CONF and env == {ALLOC_CONF_ENV: ALLOC_CONF}
    for name in (ALLOC_CONF_ENV, "PYTORCH_ALLOC_CONF"):
        mine = {name: "max_split_size_mb:128"}
        assert allocator_settings(mine) is None and mine == {name: "max_split_size_mb:128"}


ENDING = r'''
import atexit, concurrent.futures, datetime, logging, sys, threading, time
import torch.distributed as dist
from llama_fsdp.launchers.process import exit_now

# a C++ call with the GIL released that returns while the interpreter finalizes: a store wait
# that times out after 2 s, in a daemon thread (as a gloo worker drops a work's tensors)
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
def wait():
    try:
        store.wait(["never"], datetime.timedelta(seconds=2))
    except Exception:
        pass
threading.Thread(target=wait, daemon=True).start()
class SlowTeardown:  # module teardown still under way when the wait returns
    def __del__(self, sleep=time.sleep):
        sleep(4)
held = SlowTeardown()
# what an ending must keep: a pool's queued work, a non-daemon thread, atexit, logging, stdout
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: (time.sleep(0.3), open(sys.argv[2] + ".pool", "w").write("done")))
threading.Thread(target=lambda: (time.sleep(0.3), open(sys.argv[2] + ".thread", "w").write("done"))).start()
atexit.register(lambda: open(sys.argv[2] + ".atexit", "w").write("done"))
logging.basicConfig(filename=sys.argv[2] + ".log", level=logging.INFO)
logging.info("logged")
sys.stdout.write("no newline")
if sys.argv[1] == "exit_now":
    exit_now(3)
sys.exit(3)
'''


@pytest.mark.parametrize("ending", ["sys.exit", "exit_now"])
def test_a_finished_process_ends_with_its_code_however_late_a_cpp_thread_returns(tmp_path,
                                                                                  ending):
    """A C++ thread coming back into Python during finalization aborts a plain exit
    ("terminate called without an active exception", SIGABRT: how a rank that had finished
    its run was once reported killed); exit_now, which ranks and the CLI end with, exits with
    the code, and still lets the pool's work, the threads, atexit, logging and stdout finish."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    out = subprocess.run([sys.executable, str(script), ending, str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=60)
    if ending == "sys.exit":  # the failure exit_now exists for
        if sys.version_info >= (3, 14):
            pytest.skip("Python 3.14 parks such a thread instead of unwinding it")
        assert out.returncode == -signal.SIGABRT, (out.returncode, out.stderr[-2000:])
        assert "terminate called without an active exception" in out.stderr
        return
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stdout == "no newline"
    for kept in ("pool", "thread", "atexit"):
        assert (tmp_path / f"x.{kept}").read_text() == "done", kept
    assert "logged" in (tmp_path / "x.log").read_text()


RANK_PROBE = '''
import os, signal, sys

IMPORTED_IN = os.getpid()  # the process that imported this module


def entry(spec):
    import psutil

    supervisor = psutil.Process(os.getppid())
    print(f"rank {os.environ['RANK']} writes to its own log")
    return {"imported_in": IMPORTED_IN, "pid": os.getpid(), "supervisor": supervisor.pid,
            "controller": supervisor.ppid(), "rank": int(os.environ["RANK"]),
            "task": int(os.environ["SUBMITIT_LOCAL_GLOBALID"]),
            "handlers": [signal.getsignal(s) is signal.SIG_DFL
                         for s in (signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1)],
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler}
'''


def test_local_ranks_are_forked_from_a_controller_that_imported_their_module_once(
        tmp_path, monkeypatch):
    """cluster=local: the controller imports the entry point's module, then forks each rank's
    supervisor, which forks its worker (launchers/forked.py): the tree is controller ->
    supervisor -> worker, the module was imported in the controller alone, and each worker
    starts as a new interpreter would: its own rank's environment, the default signal
    handlers, its standard output in its own task's log."""
    from llama_fsdp.launchers import launcher_for

    (tmp_path / "rank_probe.py").write_text(RANK_PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get(
        "PYTHONPATH", "")]))
    spec = make_spec(["tracking.enabled=false", "cluster.nproc_per_node=2"],
                     output_dir=tmp_path / "run")
    results = launcher_for(spec.cluster, "rank_probe:entry").start(spec, stream=False)
    assert [r["rank"] for r in results] == [0, 1] == [r["task"] for r in results]
    controller = {r["controller"] for r in results}
    assert len(controller) == 1 and len({r["supervisor"] for r in results}) == 2, results
    assert all(r["imported_in"] == r["controller"] != r["pid"] for r in results), results
    assert all(r["handlers"] == [True, True, True] and r["sigint"] for r in results), results
    logs = sorted((tmp_path / "run").rglob("*_log.out"))
    assert len(logs) == 2
    for rank, log in enumerate(logs):
        assert f"rank {rank} writes to its own log" in log.read_text()
        assert f"rank {1 - rank} writes" not in log.read_text()


def test_more_ctrl_cs_while_the_mlflow_run_is_closed_wait_for_it(tmp_path, monkeypatch, caplog):
    """Before: a third Ctrl-C while the launcher closed a stopped run raised KeyboardInterrupt
    inside close_tracking, with a traceback, and left the MLflow run RUNNING. The Ctrl-Cs come
    while the store is being written to (the launcher's delivery, in this main thread): each
    one's handler runs before os.kill returns, so their order is the code's, not a timer's."""
    from mlflow.tracking import MlflowClient

    from llama_fsdp.config.status import USER_STOPPED
    from llama_fsdp.launchers import launcher_for
    from llama_fsdp.tracking import Spool, delivery, events, read_run_file, write_run_file

    uri, run = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "run"
    write_run_file(run, {"tracking_uri": uri})
    Spool(run).append(events.Create("exp", "stopped run", {}))
    ship, sent = delivery.Delivery.ship, []

    def impatient_user_meanwhile(self, pending):  # three Ctrl-Cs as the store is written to
        while len(sent) < 3:
            sent.append(signal.getsignal(signal.SIGINT))
            os.kill(os.getpid(), signal.SIGINT)
        return ship(self, pending)

    monkeypatch.setattr(delivery.Delivery, "ship", impatient_user_meanwhile)
    launcher = launcher_for(type("C", (), {"kind": "local"})())
    # a known start, whatever an earlier test in this worker left: Python's own handler (one
    # left ignoring SIGINT would make the Ctrl-Cs no-ops and the check of its restoring moot)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupted = None
    try:
        launcher.close_tracking(str(run), status=USER_STOPPED, deadline_s=20)
    except KeyboardInterrupt as e:  # (caught: pytest would stop the whole session)
        interrupted = e
    finally:
        restored = signal.signal(signal.SIGINT, previous)
    assert interrupted is None, "a Ctrl-C interrupted closing the MLflow run"
    assert len(sent) == 3 and signal.default_int_handler not in sent  # each met the shield
    assert caplog.text.count("(SIGINT ignored meanwhile)") == 1, caplog.text  # said once
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(read_run_file(run)["run_id"]).info.status == "KILLED"
    assert restored is signal.default_int_handler  # restored after
