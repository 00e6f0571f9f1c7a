"""`python -m llama_fsdp.evaluate RUN_DIR_OR_HF_DIR --tasks ...`: llama_fsdp/harness/evaluate_cmd.py."""
from .harness.evaluate_cmd import main

if __name__ == "__main__":
    raise SystemExit(main())
