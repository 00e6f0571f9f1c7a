"""`python -m llama_fsdp [overrides]`: the command line lives in cli/."""
from .cli import main
from .launchers.process import exit_now

if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # the exit code the command chose; an exception goes on as usual
        exit_now(e.code)
    exit_now(0)  # a torchrun rank or the driver, its run reported: no finalization to fail it
