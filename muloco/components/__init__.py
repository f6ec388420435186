"""The trainer's components that torchtitan's trainer composes: checkpointing, metrics, validation,
preemption, mixed precision (torchtitan keeps its own in ``torchtitan/components``)."""
