"""Training precision that fits the device.

``training.mixed_precision_param`` takes ``auto`` (muloco's default) besides torchtitan's
``bfloat16`` and ``float32``. ``auto`` resolves, before torchtitan builds anything, to

- ``bfloat16`` on CUDA: compute in bf16 with fp32 master weights, fp32 optimizer state
  and fp32 gradient reductions (torchtitan's FSDP ``MixedPrecisionPolicy``; ``training.
  mixed_precision_reduce`` stays ``float32``). On an H100 this is 7.7× the tokens/s of fp32
  (``../shared/gpu/README.md``);
- ``float32`` on CPU, where bf16 matmuls are slower than fp32 and tests compare numbers.

Pass ``--training.mixed_precision_param bfloat16`` or ``float32`` to force either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.config.configs import TrainingConfig

from muloco.utils.values import require_positive

PRECISIONS = ("auto", "bfloat16", "float32")


@dataclass(kw_only=True, slots=True)
class MulocoTrainingConfig(TrainingConfig):
    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = "auto"
    """auto: bfloat16 on CUDA (fp32 master weights and reductions), float32 on CPU; or force one."""
    epochs: float = 0.0
    """Passes over the training split, instead of training.steps (0: train training.steps). The
    rows are counted before the run; K replica groups read disjoint shards, so together they pass
    over the split once per epoch."""
    batch_over_groups: int = 0
    """Sequences per step summed over the K replica groups (the GPU presets: 512): with
    global_batch_size -1 each group takes this / K, K from --fault_tolerance.group_size (0: off)."""

    def validate(self) -> None:
        require_positive("training.seq_len", self.seq_len, "a positive integer")
        require_positive("training.local_batch_size", self.local_batch_size, "a positive integer")
        require_positive("training.steps", self.steps, "a positive integer")
        if self.epochs:
            require_positive(
                "training.epochs",
                self.epochs,
                "a positive number of passes over the training split (0: train training.steps)",
            )
        if self.global_batch_size != -1:
            require_positive("training.global_batch_size", self.global_batch_size, "a positive integer or -1")
            if self.global_batch_size % self.local_batch_size:
                raise ValueError(
                    f"training.global_batch_size {self.global_batch_size} is not a multiple of "
                    f"training.local_batch_size {self.local_batch_size}."
                )
        require_positive("training.max_norm", self.max_norm)


def resolve_precision(requested: str, device_type: str) -> str:
    """The parameter dtype torchtitan trains in for ``requested`` on ``device_type``."""
    if requested not in PRECISIONS:
        raise ValueError(f"training.mixed_precision_param must be one of {', '.join(PRECISIONS)}; got {requested!r}")
    if requested != "auto":
        return requested
    return "bfloat16" if device_type == "cuda" else "float32"
