"""SLURM: the job scripts a run or a sweep submits (``jobs.py``: kinds ddp, groups, spanning, array;
``python -m muloco.launch.slurm``), their templates (``templates/``), one replica group inside an
allocation (``group.py``), the cluster's partitions and limits (``cluster.py``) and the SLURM commands
run (``commands.py``). Process supervision on one machine is ``muloco/launch/`` itself; sweeps are
``muloco/launch/sweeps/``."""
