"""``python -m muloco.export``: kept for the command users type; the command is :mod:`muloco.tools.export`."""

from muloco.tools.export import main
from muloco.utils.command_line import run_main

if __name__ == "__main__":
    run_main(main)
