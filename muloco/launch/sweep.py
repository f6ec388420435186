"""The names a sweep file imports (``from muloco.launch.sweep import Sweep, grid, main``), kept at the
path sweep files written before sweeps had their folder use; they live in ``muloco/launch/sweeps/``."""

from muloco.launch.sweeps.sweep import Sweep, grid, lr_grid, main, paper_batch_and_decay, smoke_script

__all__ = ["Sweep", "grid", "lr_grid", "main", "paper_batch_and_decay", "smoke_script"]
