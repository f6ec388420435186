"""``python -m muloco.launch.slurm KIND ...``: write and submit a run's SLURM jobs (``jobs.py``)."""

from muloco.launch.slurm.jobs import main
from muloco.utils.command_line import run_main

if __name__ == "__main__":
    run_main(main)
