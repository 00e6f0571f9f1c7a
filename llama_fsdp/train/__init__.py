"""llama_fsdp.train."""
