"""muloco: communication-efficient DiLoCo / MuLoCo training on TorchTitan and torchft."""
