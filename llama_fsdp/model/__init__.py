"""llama_fsdp.model."""
