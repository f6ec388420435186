"""Sweeps: a grid of runs from a sweep file (``sweep.py``: ``Sweep``, ``grid``, ``main``), submitted to
SLURM as job arrays (``muloco/launch/slurm/``) or run on this machine (``local_runs.py``, submitit)."""
