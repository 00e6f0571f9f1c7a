"""llama_fsdp's Optuna sweeper, where Hydra looks for plugins (hydra_plugins.*)."""
