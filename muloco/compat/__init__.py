"""The one place where muloco adapts third-party behaviour (torch 2.13, torchtitan 0.3.0, torchft 0.2.0).

Every entry point calls :func:`apply` before it imports torchtitan: torchtitan copies
the device type into module globals at import time, so a later fix would be too late.
Each adaptation is idempotent, leaves CUDA runs unchanged, and has a test in
``tests/test_compat.py``. Why each one exists is in its own module's docstring.
Five adaptations are composed in where they apply rather than patched in here:
``fsdp_gloo`` wraps the model's parallelize function (:mod:`muloco.models`) and
``healing_transport`` is the checkpoint transport of the replica-group manager;
``torchrun_failures`` is installed by the replica-group agent (:mod:`muloco.launch.replica_group`);
``lone_rank_sleep`` by :mod:`muloco.trainer` and :mod:`muloco.diloco_trainer`, which import
torchtitan's trainers; and
``lr_position`` (a scheduler put at a step) is called by :mod:`muloco.diloco_trainer`. Hugging Face
interop (the state-dict adapter, LLaDA, the tokenizer conversion) is not a patch: it lives in
:mod:`muloco.hf`.
"""

from __future__ import annotations

import sys

_applied = False


def apply() -> None:
    """Apply every adaptation once, before torchtitan is imported."""
    global _applied
    if _applied:
        return
    # Imported here, not at the top: most of them import torch, and a torch-free process (the
    # lighthouse, the launchers) imports one of this folder's torch-free modules without paying
    # for the package's torch ones.
    from muloco.compat import (
        checkpoint_safety,
        compile_on_first_call,
        cpu_device,
        distributed,
        lazy_hf_datasets,
        model_config_log,
        torchft_log_level,
        triton_stub,
    )

    torchft_log_level.apply()
    model_config_log.apply()
    cpu_device.apply()
    triton_stub.apply()
    distributed.apply()
    checkpoint_safety.apply()
    compile_on_first_call.apply()  # a finder: torchtitan's attention module is imported when it was going to be
    lazy_hf_datasets.apply()  # it imports a torchtitan module, which the ones above must precede
    cpu_device.quiet_gpu_only_warnings()  # so does this one
    _applied = True


def assert_applied_before_torchtitan() -> None:
    """Fail loudly if torchtitan was imported with the wrong device type baked in."""
    from muloco.compat import cpu_device  # imports torch; see apply()

    utils = sys.modules.get("torchtitan.tools.utils")
    if utils is not None and utils.device_type != cpu_device.device_type():
        raise RuntimeError(
            f"torchtitan was imported before muloco.compat.apply() and chose device "
            f"'{utils.device_type}' on a machine whose device is "
            f"'{cpu_device.device_type()}'; call muloco.compat.apply() first."
        )


__all__ = ["apply", "assert_applied_before_torchtitan"]
