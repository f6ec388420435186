"""``python -m muloco.launch.slurm_group``: the in-job command of SLURM scripts written before SLURM had
its folder, so such a job requeued after an upgrade still starts; it is ``muloco.launch.slurm.group``."""

import sys

from muloco.launch.slurm.group import main

if __name__ == "__main__":
    sys.exit(main())
