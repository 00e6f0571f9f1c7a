"""The peer training loops benchmarks/throughput.py compares llama_fsdp against."""
