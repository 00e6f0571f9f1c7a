"""llama_fsdp.prepare."""
