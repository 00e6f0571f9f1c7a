"""llama_fsdp.config."""
