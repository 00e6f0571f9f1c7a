"""`python -m llama_fsdp.convert CHECKPOINT OUT`: llama_fsdp/checkpoint/convert.py."""
from .checkpoint.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
