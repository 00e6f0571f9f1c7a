"""The config groups, installed as the package data of ``llama_fsdp.conf`` (see pyproject.toml)."""
