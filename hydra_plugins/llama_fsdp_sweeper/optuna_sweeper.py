"""`hydra/sweeper=optuna`: Hydra instantiates sweepers only from the hydra_plugins package and
imports every module here at each start, so this module is the class alone; the search is
llama_fsdp/cli/search.py (Optuna is imported only when a search runs)."""
from __future__ import annotations

from typing import Any, Optional

from hydra.plugins.sweeper import Sweeper


class OptunaSweeper(Sweeper):
    """A search over ``params`` with an Optuna study (config/search.py: the keys)."""

    def __init__(self, sampler: Any = None, direction: Optional[str] = None,
                 storage: Optional[str] = None, study_name: Optional[str] = None,
                 n_trials: int = 20, n_jobs: int = 1, baseline: bool = True,
                 pruner: Any = None, params: Any = None) -> None:
        self.sampler, self.direction, self.storage = sampler, direction, storage
        self.study_name, self.n_trials, self.n_jobs = study_name, n_trials, n_jobs
        self.baseline, self.params, self.pruner = baseline, params or {}, pruner
        self.config: Any = None
        self.hydra_context: Any = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from llama_fsdp.cli.search import run_search

        return run_search(self, arguments)
