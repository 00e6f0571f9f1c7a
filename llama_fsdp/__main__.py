"""`python -m llama_fsdp [overrides]`: the command line lives in cli.py."""
from .cli import main

if __name__ == "__main__":
    main()
