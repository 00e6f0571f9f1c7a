"""`python -m llama_fsdp.sweep SWEEP_ID [--uri URI]`: llama_fsdp/tracking/sweep.py."""
from .tracking.sweep import main

if __name__ == "__main__":
    main()
