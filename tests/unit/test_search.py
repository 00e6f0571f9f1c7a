"""hydra/sweeper=optuna's parts that need no training: the search space read with Hydra's
parser from the command line and from a config file alike, the command line's search spaces as
Hydra takes them, the command that reruns a trial, and a search that cannot start refused in
one line before anything is made (the real command; the searches themselves:
tests/integration/test_search.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import warm


def test_a_search_space_is_the_same_from_the_command_line_and_a_file():
    """The command line's hydra.sweeper.params.train.lr=... nests (train: {lr: ...}); a YAML
    file's key may be dotted; a sweep override among the arguments is searched too, a plain
    one fixes its key."""
    from optuna.distributions import (CategoricalDistribution, FloatDistribution,
                                      IntDistribution)

    from llama_fsdp.cli.search import SearchSpace

    nested = SearchSpace.of({"train": {"lr": "tag(log, interval(1e-4, 1e-2))"}}, [])
    dotted = SearchSpace.of({"train.lr": "tag(log, interval(1e-4, 1e-2))"}, [])
    assert nested.distributions() == dotted.distributions() == {
        "train.lr": FloatDistribution(1e-4, 1e-2, log=True)}
    space = SearchSpace.of({"train.batch_size": "choice(1, 2, 4)", "train.max_steps": 30},
                           ["train.grad_accum=tag(int, interval(1, 4))", "sharding=full"])
    assert space.distributions() == {
        "train.batch_size": CategoricalDistribution(["1", "2", "4"]),
        "train.grad_accum": IntDistribution(1, 4)}
    assert space.fixed == ["train.max_steps=30", "sharding=full"]
    assert space.typed["train.batch_size"] == "choice(1, 2, 4)"


def test_a_command_lines_search_space_reaches_the_sweeper_as_written():
    """Hydra refuses a sweep of its own config ("Sweeping over Hydra's configuration is not
    supported"); quoted, the space is the sweeper's string, and other arguments are as typed."""
    from llama_fsdp.cli.overrides import parse_override, quote_search_spaces

    argv = ["-m", "hydra.sweeper.params.train.lr=tag(log, interval(1e-4, 1e-2))",
            "train.lr=0.1", "hydra.sweeper.n_trials=6"]
    quoted = quote_search_spaces(argv)
    assert quoted[0] == "-m" and quoted[2:] == argv[2:]
    o = parse_override(quoted[1])
    assert not o.is_sweep_override() and o.key_or_group == "hydra.sweeper.params.train.lr"
    assert o.value() == "tag(log, interval(1e-4, 1e-2))"


def test_the_best_trial_reruns_as_one_command_without_the_search(monkeypatch):
    from llama_fsdp.cli.overrides import rerun_command

    monkeypatch.setattr(sys, "argv", [
        "llama_fsdp", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=6",
        "++hydra.sweeper.params.train.lr='tag(log, interval(1e-4, 1e-2))'",
        "train.max_steps=30", "hydra.sweep.dir=/s", "data.path=/my data/x.jsonl"])
    assert rerun_command({"train.lr": "0.002471"}) == (
        "python -m llama_fsdp train.max_steps=30 'data.path=/my data/x.jsonl' train.lr=0.002471")


@pytest.mark.parametrize("args, message", [
    ([], "hydra/sweeper=optuna has nothing to search: give a search space, e.g. "
         "'hydra.sweeper.params.train.lr=tag(log, interval(1e-4, 1e-2))'"),
    (["hydra.sweeper.params.train.lr=tag(log, interval(0, 1e-2))"],
     "train.lr: a log interval must start above 0, not 0"),
    (["hydra.sweeper.params.train.lr=interval(0.1, 0.1)", "hydra.sweeper.n_trials=0"],
     "hydra.sweeper.n_trials=0, n_jobs=1: both must be at least 1; train.lr: "
     "interval(0.1, 0.1) is empty"),
    (["hydra.sweeper.params.train.lr=choice(0.1, 0.2)", "tracking.enabled=false"],
     "reads each trial's result from its MLflow run: drop tracking.enabled=false"),
    (["hydra.sweeper.params.train.lr=choice(0.1, 0.2)", "dry_run=true"],
     "a search needs each trial's result: drop dry_run=true"),
])
def test_a_search_that_cannot_start_is_refused_in_one_line_before_anything_is_made(
        args, message, tmp_path):
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "-m", "hydra/sweeper=optuna", *args,
                        "cluster.device=cpu", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"],
                       cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert message in out and "Traceback" not in out
    assert not (tmp_path / "outputs" / "sweeps").exists() or not any(
        (tmp_path / "outputs" / "sweeps").rglob("*.jsonl"))  # no study
    assert not (tmp_path / "mlflow.db").exists()  # no parent run


def test_a_search_in_a_preset_of_ones_own_is_read_as_on_the_command_line(tmp_path):
    """docs/mlflow.md's preset, in a config folder of the user's (--config-dir: Hydra's search
    path), composes hydra/sweeper=optuna with its space and trials."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from llama_fsdp.cli.search import is_search, search_plan
    from llama_fsdp.config.schema import register_configs
    from tests.docs_commands import REPO, code_block

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "lr_search.yaml").write_text(
        code_block(REPO / "docs" / "mlflow.md", "# @package _global_", "yaml"))
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("llama_fsdp.conf", version_base=None):
        cfg = compose("config", overrides=["experiment=lr_search",
                                           f"hydra.searchpath=[file://{tmp_path}]"],
                      return_hydra_config=True)
    assert is_search(cfg)
    assert search_plan(cfg, []) == ({"train.lr": "tag(log, interval(1e-4, 1e-2))",
                                     "train.batch_size": "choice(4, 8, 16)"}, 20)


def test_the_run_as_configured_is_read_back_as_the_space_holds_its_values(tmp_path):
    """Trial 0 launches without the searched keys (their values are the recipe's, known only to
    the run): its values come from its MLflow params, as the space's distributions hold them,
    or None when one lies outside (the study then has it as failed)."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    from llama_fsdp.cli.search import _values_used
    from llama_fsdp.tracking import write_run_file

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    run = client.create_run(client.create_experiment("e"))
    client.log_batch(run.info.run_id, params=[Param("train.lr", "0.003"),
                                              Param("train.batch_size", "8")])
    write_run_file(tmp_path / "0", {"run_id": run.info.run_id})
    lr = {"train.lr": FloatDistribution(1e-3, 3e-2, log=True)}
    assert _values_used(tmp_path / "0", lr, client) == {"train.lr": 0.003}
    assert _values_used(tmp_path / "0", {"train.lr": FloatDistribution(1e-2, 3e-2)},
                        client) is None
    sizes = {"train.batch_size": CategoricalDistribution(["4", "8"])}
    assert _values_used(tmp_path / "0", sizes, client) == {"train.batch_size": "8"}
    assert _values_used(tmp_path / "0", {"sharding": CategoricalDistribution(["full"])},
                        client) is None  # a group: no param of its own
    assert _values_used(tmp_path / "1", lr, client) == {}  # refused: it never ran


def _journal_study(path, pruner):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(path)))
    return optuna.create_study(study_name="s", storage=storage, pruner=pruner)


def test_a_trial_behind_the_finished_ones_at_an_eval_step_is_pruned(tmp_path, caplog):
    """Rank 0's reporter against a real study in a journal file, with the default pruner
    (hydra/sweeper/pruner=median): a finished trial reported eval_loss 3.0 at step 3; a running
    trial at 5.0 there is told to stop, one at 2.5 goes on; step 0 (every trial's same start)
    is never reported; the baseline, added to the study after it runs, has nothing to report
    to; a study out of reach is a warning, and the trial runs its steps."""
    import logging

    import optuna

    from llama_fsdp.config.search import PrunerConfig, SearchTrial
    from llama_fsdp.train.pruning import TrialReporter

    journal = tmp_path / "study.jsonl"
    study = _journal_study(journal, optuna.pruners.MedianPruner(n_startup_trials=1))
    done = study.ask()
    done.report(3.0, 3)
    study.tell(done, 3.0)
    behind, ahead = study.ask(), study.ask()

    def reporter(number, storage=str(journal)):
        return TrialReporter(SearchTrial(storage=storage, study="s", number=number,
                                         metric="eval_loss", direction="minimize",
                                         pruner=dict(vars(PrunerConfig(n_startup_trials=1)))))

    slow = reporter(behind.number)
    assert slow.prune(0, {"eval_loss": 9.0}) is None  # step 0: not reported
    why = slow.prune(3, {"eval_loss": 5.0})
    assert why and why.startswith("eval_loss 5.0000 at step 3: the study's MedianPruner"), why
    assert reporter(ahead.number).prune(3, {"eval_loss": 2.5}) is None
    trials = {t.number: t for t in study.get_trials()}
    assert trials[behind.number].intermediate_values == {3: 5.0}  # step 0 is not there
    assert trials[ahead.number].intermediate_values == {3: 2.5}
    assert reporter(99).trial is None  # not a running trial of the study
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.train.pruning"):
        lost = reporter(behind.number, storage="sqlite:////nonexistent/dir/study.db")
    assert lost.trial is None and lost.prune(3, {"eval_loss": 50.0}) is None
    assert "cannot report to its study" in caplog.text


def test_pruning_is_on_only_where_a_trial_has_an_eval_metric_to_report():
    """The default objective (summary/eval_loss) prunes on eval_loss at eval steps; no eval, or
    an objective known only at the end (the final loss, a harness score), is said and off;
    hydra/sweeper/pruner=none is off."""
    from omegaconf import OmegaConf

    from llama_fsdp.cli.search import pruned_metric, prunes
    from llama_fsdp.config.search import PRUNERS

    def config(**changed):
        c = OmegaConf.create({"eval": {"every_steps": 4, "harness": {"tasks": []}},
                              "tracking": {"best_metric": "summary/eval_loss",
                                           "best_mode": "min"}})
        for key, value in changed.items():
            OmegaConf.update(c, key, value)
        return c

    assert pruned_metric(config()) == ("eval_loss", "")
    assert pruned_metric(config(**{"eval.every_steps": 0}))[0] is None
    metric, why = pruned_metric(config(**{"tracking.best_metric": "summary/final_loss"}))
    assert metric is None and "summary/final_loss" in why and "tracking.best_metric" in why
    assert pruned_metric(config(**{"eval.harness.tasks": ["arc_easy"]}))[0] is None
    assert prunes(vars(PRUNERS["median"]())) and not prunes(vars(PRUNERS["none"]()))
    assert not prunes(None)
