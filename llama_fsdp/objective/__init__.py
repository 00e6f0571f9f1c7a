"""llama_fsdp.objective."""
