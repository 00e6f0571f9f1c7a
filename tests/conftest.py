"""Shared fixtures: the real composed config (conf/) turned into RunSpecs for tests."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llama_fsdp.config.rundir import CACHE_ENV
from tests import cpu_account  # CPU-seconds per test, with LLAMA_FSDP_CPU_ACCOUNT=DIR

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# MLflow 3's server (and `mlflow ui`) starts a job runner with about eight huey consumers, each
# importing mlflow (2-3 s of CPU and ~240 MB apiece) for GenAI jobs no test uses
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
# Rank processes import test hooks (tests.faults.hooks, through train.callbacks).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
# CPU tests pin the CPU, so they mean the same on a machine with a GPU.
CPU = ["cluster.device=cpu"]

# Under CI (.ci/run exports LLAMA_FSDP_CI=1) a skipped test fails, unless its reason starts
# with one of these: what CI has not got, or installs only on request.
CI_ENV = "LLAMA_FSDP_CI"
CI_ALLOWED_SKIPS = {
    "needs CUDA": "no GPU in CI (tests/gpu)",
    "needs a CUDA device": "no GPU in CI (tests/gpu)",
    "needs a GPU of": "no GPU in CI (tests/gpu)",
    "bash benchmarks/setup_peers.sh downloads": "an opt-in install (LLAMA_FSDP_DOCS_INSTALL=1)",
    "bash scripts/offline_wheels.sh downloads": "an opt-in download for a GPU session "
                                                "(LLAMA_FSDP_DOCS_INSTALL=1)",
    "no GPU session since the planner was fitted": "a GPU session's records come from a lent "
                                                   "GPU (tests/unit/test_plan_gpu_record.py)",
    "the real model runs on request": "an opt-in download and minutes of CPU "
                                      "(LLAMA_FSDP_REAL_MODEL=1: tests/integration/"
                                      "test_real_model.py)",
}
# Allowed only in the floor run (scripts/test_floor.sh exports FLOOR_ENV=1): of its torch 2.11.
# In CI's main run the same skip would mean the install fell back to another torch
# (scripts/install.sh says so), and it fails.
FLOOR_ENV = "LLAMA_FSDP_FLOOR"
FLOOR_ONLY_SKIPS = {
    "the README's numbers are of torch": "scripts/test_floor.sh's torch 2.11 (the README's "
                                         "summary is of the build make run installs, which "
                                         "CI's run checks)",
    "the table is of a torch whose varlen_attn": "scripts/test_floor.sh's torch 2.11 (the table "
                                                 "is of torch >= 2.12, which CI's run checks)",
}


# `python -m llama_fsdp...` forked from a warm interpreter (tests/warm.py), one set per pytest
# process; LLAMA_FSDP_TEST_COLD=1 runs every command in a new interpreter instead. What the
# tests start in sessions of their own ends with the pytest process (tests/reaper.py).
_warm_dir: list[str] = []


def pytest_sessionstart(session):
    xdist_controller = (getattr(session.config.option, "numprocesses", None)
                        and not hasattr(session.config, "workerinput"))
    if xdist_controller:  # (it runs no test)
        return
    import tempfile

    from tests import reaper, warm

    cpu_account.configure(session.config)  # first: before this process starts anything
    _warm_dir.append(tempfile.mkdtemp(prefix="lf-warm-"))
    reaper.start(_warm_dir[0])  # the servers and warm interpreters end with this process
    # one data and tokenizer cache for the session's runs (a run in a fresh folder trained the
    # project tokenizer and tokenized its data again: 2.7 s of CPU): tests of the cache itself
    # and the documented commands (a user's default, outputs/cache) set their own
    os.environ.setdefault(CACHE_ENV, os.path.join(_warm_dir[0], "cache"))
    if not os.environ.get("LLAMA_FSDP_TEST_COLD"):
        warm.setup(_warm_dir[0])


def _end_warm() -> None:
    import shutil

    from tests import reaper, warm

    for d in _warm_dir:
        warm.teardown(d)
        reaper.stop()
        shutil.rmtree(d, ignore_errors=True)
    _warm_dir.clear()


def compose(overrides: list[str] | None = None):
    """Compose conf/ exactly as `python -m llama_fsdp` does, with test overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from llama_fsdp.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def spec_of(cfg, **kwargs):
    """build_spec as the command line calls it: with the placement of the config's launcher."""
    from llama_fsdp.launchers import launcher_for
    from llama_fsdp.run.spec import build_spec

    return build_spec(cfg, placement=launcher_for(cfg.cluster).placement, **kwargs)


def make_spec(overrides: list[str] | None = None, *, output_dir: str | Path = "/tmp/llama_fsdp_test"):
    """A RunSpec of the real composed config; on the CPU unless an override says otherwise."""
    cfg = compose([f"output_dir={output_dir}", *CPU, *(overrides or [])])
    return spec_of(cfg, launch_dir=REPO)


def launch_prepared(spec, *, command: str = "pytest"):
    """What `python -m llama_fsdp` does after planning: prepare in this process, then launch
    the real rank processes; returns the ranks' results."""
    from llama_fsdp.launchers import launcher_for
    from llama_fsdp.prepare.job import prepare

    prepared = prepare(spec, command=command)
    launcher = launcher_for(spec.cluster, "llama_fsdp.train.worker:run_worker")
    return launcher.start(prepared.spec, stream=False)


@pytest.fixture
def spec_factory(tmp_path):
    """make_spec with a fresh output dir and a private MLflow store per test."""

    def factory(overrides: list[str] | None = None, **kw):
        out = kw.pop("output_dir", tmp_path / "run")
        base = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
        return make_spec([*base, *(overrides or [])], output_dir=out)

    return factory


def mask_runs(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of true values in a 0/1 mask."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


# Every test on the session's SLURM cluster lives in one of these files (checked at collection):
# under xdist they share one worker, so one cluster serves them all.
SLURM_FILES = ("test_slurm_",)
# Under xdist, heavy work first: the last scope to start should be a short one.
SCOPE_ORDER = ("integration", "faults", "multirank", "unit", "gpu")


# What scripts/test_floor.sh runs on the oldest torch and transformers llama_fsdp supports (the
# GPU image's: torch 2.11, transformers 5.17, with the torchao it carries): the code whose
# behaviour depends on their versions, and one run of each kind end to end, not the whole
# suite again. Node-id prefixes (a module, or module::test), each with what it holds there;
# they get the `floor` marker at collection.
FLOOR_TESTS = {
    # torch's tensors, autograd, DTensor and DCP; torchao; transformers' Llama and tokenizers
    "tests/unit/test_nf4.py": "torchao's NF4 tensors and their quantization",
    "tests/unit/test_loss.py": "the chunked loss against the full one",
    "tests/unit/test_model_init.py": "transformers' Llama built on meta, then materialized",
    "tests/unit/test_checkpoint.py": "DCP and safetensors reading and writing",
    "tests/unit/test_data_tokenizer.py": "transformers' tokenizers (BPE, sentencepiece)",
    "tests/unit/test_data_chat.py": "chat templates rendered by transformers",
    "tests/unit/test_data_packing.py": "packing and position ids",
    "tests/unit/test_data_preference.py": "preference pairs through the tokenizer",
    "tests/unit/test_dpo.py": "DPO's loss against TRL's DPOTrainer on transformers' model",
    "tests/unit/test_optim.py": "torchao's low-bit AdamW",
    "tests/unit/test_imports.py": "varlen's grouped-query signature read by version",
    "tests/unit/test_launchers.py": "process ends with torch's threads (exit_now)",
    "tests/unit/test_memory_probe.py": "what torch allocates, measured",
    "tests/unit/test_eval.py": "generation with transformers' cache",
    "tests/unit/test_hostile_inputs.py": "transformers' loaders on hostile folders",
    # FSDP2, DDP, device meshes, DCP resharding, mixed precision, AC, compile, varlen attention
    "tests/multirank/test_fsdp.py": "fully_shard and replicate on gloo: 1 rank equals N",
    "tests/multirank/test_checkpoint.py": "DCP save, exact and resharded resume, HF export",
    "tests/multirank/test_adapters.py": "LoRA and QLoRA (torchao NF4) under fully_shard",
    "tests/multirank/test_long_context.py": "the chunked loss and offloaded activations",
    "tests/multirank/test_precision_ac.py": "MixedPrecisionPolicy, checkpoint_wrapper, compile",
    "tests/multirank/test_log_reads.py": "async collectives read late",
    "tests/multirank/test_rendezvous.py": "the TCP store's binding",
    "tests/multirank/test_data_dist.py": "the sampler across ranks",
    "tests/multirank/test_optim.py::test_uneven_shards": "torchao's low-bit state on uneven "
                                                        "shards (the module's other runs: CI's)",
    # one run of each kind through the command line, and torchrun's agent (torch's own)
    "tests/integration/test_local_run.py::test_default_run": "the default command (full SFT)",
    "tests/integration/test_docs_commands.py::test_finetune_lora": "finetune=lora",
    "tests/integration/test_docs_commands.py::test_finetune_qlora": "finetune=qlora",
    "tests/integration/test_docs_commands.py::test_dpo_lora": "objective=dpo",
    "tests/integration/test_torchrun.py::test_two_torchrun_nodes": "torchrun's elastic agent",
}


def _scope(nodeid: str) -> str:
    """The unit of scheduling of a test: its module, or "slurm" for the SLURM modules."""
    path = nodeid.split("::", 1)[0]
    return "slurm" if Path(path).name.startswith(SLURM_FILES) else path


def _scope_rank(item) -> tuple[int, int]:
    parts = Path(item.nodeid.split("::", 1)[0]).parts
    folder = parts[1] if len(parts) > 2 else ""
    order = SCOPE_ORDER.index(folder) if folder in SCOPE_ORDER else len(SCOPE_ORDER)
    return (0 if _scope(item.nodeid) == "slurm" else 1, order)


# Longest scope first (LPT): each scope's seconds in the last whole-suite run (every phase of
# every test, summed), kept in pytest's cache (.pytest_cache). Handing scopes to whichever
# worker frees up, in that order, ends at most 7/6 of the best split of 2 workers (Graham's
# bound; xdist queues the next scope when a worker has 2 tests left, which loosens it a little);
# the folder order above, all a fresh checkout has, started the longest multirank module
# (test_plan_memory.py, 5 min on CI) after ten others. A scope the cache has not seen (a new
# module) goes first: it may be long.
SCOPE_SECONDS = "llama_fsdp/scope_seconds"


# a fresh clone (CI) has no cache: the scopes' seconds of a whole suite run on a 2-core machine
# like CI's, committed (copy the cache's "llama_fsdp/scope_seconds" here to refresh it)
COMMITTED_SECONDS = Path(__file__).with_name("scope_seconds.json")


def _scope_seconds(config) -> dict[str, float]:
    cache = getattr(config, "cache", None)
    seconds = cache.get(SCOPE_SECONDS, {}) if cache is not None else {}
    if not seconds and COMMITTED_SECONDS.exists():
        seconds = json.loads(COMMITTED_SECONDS.read_text())
    return seconds if isinstance(seconds, dict) else {}


def _lpt_rank(seconds: dict[str, float]):
    def rank(item) -> tuple:
        known = seconds.get(_scope(item.nodeid))
        return (0, 0.0, _scope_rank(item)) if known is None else (1, -known, _scope_rank(item))
    return rank


def _whole_suite(config) -> bool:
    """A run of the suite as `make test` runs it (not -k, -m, a file, --lf): its scopes' times
    are worth keeping."""
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not config.getoption("keyword") and not config.getoption("markexpr")
            and not config.getoption("lf", False) and not config.getoption("failedfirst", False))


_ran: dict[str, float] = {}


def pytest_runtest_logreport(report):  # under xdist the controller sees every worker's
    scope = _scope(report.nodeid)
    _ran[scope] = _ran.get(scope, 0.0) + report.duration


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield from cpu_account.around_test(item)


def pytest_sessionfinish(session, exitstatus):
    _end_warm()
    cpu_account.finish()
    config = session.config
    if (hasattr(config, "workerinput") or not _ran or getattr(config, "cache", None) is None
            or not _whole_suite(config) or exitstatus not in (0, 1)):
        return
    config.cache.set(SCOPE_SECONDS, {**_scope_seconds(config),
                                     **{k: round(v, 1) for k, v in _ran.items()}})


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _fail_unexpected_skip(report) -> None:
    """Under CI, a skip whose reason CI_ALLOWED_SKIPS does not list becomes a failure."""
    if not report.skipped or os.environ.get(CI_ENV) != "1" or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    floor = FLOOR_ONLY_SKIPS if os.environ.get(FLOOR_ENV) == "1" else {}
    if not reason.startswith((*CI_ALLOWED_SKIPS, *floor)):
        report.outcome = "failed"
        report.longrepr = (f"{CI_ENV}=1 and this test was skipped: {reason}\nCI installs "
                           "what the suite needs; a skip here hides a test that did not run. "
                           "Mend the environment, or allow the reason in tests/conftest.py's "
                           "CI_ALLOWED_SKIPS with why CI cannot run it.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a whole module skipped (pytest.skip(allow_module_level=True))
    _fail_unexpected_skip(outcome.get_result())


def pytest_collection_modifyitems(config, items):
    """Heaviest scopes first (a stable sort: a module's tests keep their order): by the last
    whole suite's seconds per scope where the cache has them, else by SCOPE_ORDER; and a test
    on the SLURM cluster outside the SLURM files is refused: it would start a second cluster."""
    for item in items:
        if ("slurm_cluster" in getattr(item, "fixturenames", ())
                and _scope(item.nodeid) != "slurm"):
            raise pytest.UsageError(f"{item.nodeid} uses the SLURM cluster: move it to a "
                                    f"tests/integration/test_slurm_*.py module")
    matched = set()
    for item in items:
        if prefix := next((p for p in FLOOR_TESTS if item.nodeid.startswith(p)), None):
            item.add_marker(pytest.mark.floor)
            matched.add(prefix)
    missed = sorted(set(FLOOR_TESTS) - matched)
    if config.getoption("markexpr") == "floor" and missed:
        raise pytest.UsageError(f"FLOOR_TESTS names tests that are not collected: {missed}")
    seconds = _scope_seconds(config)
    items.sort(key=_lpt_rank(seconds) if seconds else _scope_rank)


@pytest.hookimpl(optionalhook=True)  # pytest without xdist still runs the suite
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs `-n 2 --dist loadscope`: a module's tests stay on one worker (its
    session-scoped shared runs then run once), and the SLURM modules share one worker.

    Not `--dist loadgroup` with xdist_group marks: pytest 9.2 keeps node ids in a structured
    field that xdist 3.8's group suffix no longer reaches (pytest-xdist#1386), so the marks were
    silently ignored and modules spread over both workers: each worker ran the shared runs of
    the sweep, checkpoint, precision and fault modules again (measured 40-170 s each)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False  # keep the collection's order: heaviest first
    return ModuleScheduling(config, log)
