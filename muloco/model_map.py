"""``python -m muloco.model_map``: kept for the command users type; the CLI is ``muloco.sizing.cli``."""

from muloco.sizing.cli import main
from muloco.utils.command_line import run_main

if __name__ == "__main__":
    run_main(main)
