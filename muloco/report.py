"""``python -m muloco.report``: kept for the command users type; the command is :mod:`muloco.tools.report`."""

from muloco.tools.report import main
from muloco.utils.command_line import run_main

if __name__ == "__main__":
    run_main(main)
