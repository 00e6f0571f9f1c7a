"""llama_fsdp.run."""
