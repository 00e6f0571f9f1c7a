"""`-m hydra/sweeper=optuna`: the schema of the project's own Optuna sweeper (a search, where
Hydra's basic sweeper runs a grid). The keys are hydra-optuna-sweeper's, so a command written
for that plugin runs here; the plugin itself pins optuna<3, this one runs on Optuna 5's
ask-and-tell API (hydra_plugins/llama_fsdp_sweeper, llama_fsdp/cli/search.py).

    python -m llama_fsdp -m hydra/sweeper=optuna hydra.sweeper.n_trials=6 \\
        'hydra.sweeper.params.train.lr=tag(log, interval(1e-4, 1e-2))'
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# Hydra instantiates a sweeper only from the hydra_plugins package (Plugins._instantiate)
SWEEPER_TARGET = "hydra_plugins.llama_fsdp_sweeper.optuna_sweeper.OptunaSweeper"
# In the sweep's folder: the study (Optuna's journal storage), which the same command resumes
STUDY_FILE = "optuna_study.jsonl"
# The search's own artifacts on the sweep's parent run
SEARCH_CHART = "search_objective.png"
SEARCH_TABLE = "search_trials.md"
NO_PRUNER = "optuna.pruners.NopPruner"  # hydra/sweeper/pruner=none: no trial stops early


@dataclass
class SamplerConfig:
    """An Optuna sampler by class (optuna.samplers.*) and its seed: TPE, seeded, by default
    (the same command asks for the same trials). ``hydra/sweeper/sampler=random|bruteforce``
    picks another (SAMPLERS)."""

    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = 123


@dataclass
class PrunerConfig:
    """An Optuna pruner by class (optuna.pruners.*): a trial whose eval metric at an eval step
    is worse than the median of the finished trials at that step stops there (once
    ``n_startup_trials`` trials have finished, and from step ``n_warmup_steps``)."""

    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 2
    n_warmup_steps: int = 0


@dataclass
class ThresholdPrunerConfig:
    """A trial stops at the first eval whose metric is above ``upper`` (or below ``lower``)."""

    _target_: str = "optuna.pruners.ThresholdPruner"
    lower: Optional[float] = None
    upper: Optional[float] = None
    n_warmup_steps: int = 0


@dataclass
class PercentilePrunerConfig:
    """Like the median pruner, at another percentile (25.0: keep only the best quarter)."""

    _target_: str = "optuna.pruners.PercentilePruner"
    percentile: float = 25.0
    n_startup_trials: int = 2
    n_warmup_steps: int = 0


@dataclass
class NoPrunerConfig:
    """Every trial runs its steps (hydra/sweeper/pruner=none; or hydra.sweeper.pruner=null)."""

    _target_: str = NO_PRUNER


# hydra/sweeper/sampler=... and hydra/sweeper/pruner=... (the Hydra groups)
SAMPLERS = {"tpe": SamplerConfig,
            "random": lambda: SamplerConfig("optuna.samplers.RandomSampler"),
            "bruteforce": lambda: SamplerConfig("optuna.samplers.BruteForceSampler")}
PRUNERS = {"median": PrunerConfig, "percentile": PercentilePrunerConfig,
           "threshold": ThresholdPrunerConfig, "none": NoPrunerConfig}


@dataclass(frozen=True)
class SearchTrial:
    """What a search's trial needs to report its eval metric to the study and be pruned
    (RunSpec.trial, read on rank 0): where the study is, which trial this is, the metric and
    the pruner (its config: instantiated where the rank runs)."""

    storage: str  # an Optuna storage URL, or the journal file's path
    study: str
    number: int
    metric: str  # an eval metric (eval_loss, ...), reported at each eval step after step 0
    direction: str  # minimize | maximize
    pruner: dict = field(default_factory=dict)


@dataclass
class OptunaSweeperConfig:
    """hydra.sweeper with ``hydra/sweeper=optuna``."""

    _target_: str = SWEEPER_TARGET
    # (_self_ first: the groups' choices fill sampler and pruner, not this node's nulls)
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"sampler": "tpe"},
                                                         {"pruner": "median"}])
    sampler: Any = None  # hydra/sweeper/sampler=tpe (SAMPLERS)
    # minimize | maximize; null: tracking.best_mode's (min: minimize)
    direction: Optional[str] = None
    # An Optuna storage URL (sqlite:///..., a database server); null: the journal file
    # STUDY_FILE in the sweep's folder
    storage: Optional[str] = None
    # null: the sweep's id (sweep-<date>_<time>)
    study_name: Optional[str] = None
    # trials in the study in all (the trials of an earlier run of the same sweep count)
    n_trials: int = 20
    # trials asked for at once (before any of them is told): with cluster=slurm, SLURM jobs
    # submitted together and waited for together; on one machine, one after another. (A search
    # needs each result: cluster.wait=false, a sweep that returns at submission, is refused.)
    n_jobs: int = 1
    # Trial 0 is the run as configured (the searched keys at the recipe's or the config's
    # values), so that the search is held to what the command runs without it.
    baseline: bool = True
    # hydra/sweeper/pruner=median (PRUNERS): trials stop early when their eval metric falls
    # behind (eval.every_steps > 0, and the objective an eval metric: tracking.best_metric
    # eval_loss, the default); the MLflow run says "pruned". hydra/sweeper/pruner=none: every
    # trial runs its steps.
    pruner: Any = None
    # the search space: key -> Hydra's sweep syntax, choice(1, 2), interval(0.1, 1.0),
    # tag(log, interval(1e-5, 1e-3)), tag(int, interval(1, 8)), range(1, 5); a plain value fixes
    # the key. `train.lr: ...` and a nested `train: {lr: ...}` are the same key.
    params: dict[str, Any] = field(default_factory=dict)


def register_search(store: Any) -> None:
    """``hydra/sweeper=optuna`` in Hydra's ConfigStore (``store``), and its class among Hydra's
    plugins: Hydra finds plugins by walking hydra_plugins' folders, which an editable install
    (pip install -e, scripts/install.sh) does not show it."""
    from hydra.core.plugins import Plugins
    from hydra_plugins.llama_fsdp_sweeper.optuna_sweeper import OptunaSweeper

    store.store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConfig,
                provider="llama_fsdp")
    for name, node in SAMPLERS.items():
        store.store(group="hydra/sweeper/sampler", name=name, node=node(),
                    provider="llama_fsdp")
    for name, node in PRUNERS.items():
        store.store(group="hydra/sweeper/pruner", name=name, node=node(), provider="llama_fsdp")
    Plugins.instance().register(OptunaSweeper)
