"""The command line: ``python -m llama_fsdp [overrides]`` (or ``llama-fsdp``)."""
from .command import main

__all__ = ["main"]
