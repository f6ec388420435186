"""Inner optimizers: flat, CLI-friendly settings on top of torchtitan's container."""

from muloco.optim.container import MulocoOptimizers

__all__ = ["MulocoOptimizers"]
