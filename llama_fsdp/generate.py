"""`python -m llama_fsdp.generate RUN_DIR_OR_HF_DIR "prompt"`: llama_fsdp/harness/generate_cmd.py."""
from .harness.generate_cmd import main

if __name__ == "__main__":
    raise SystemExit(main())
