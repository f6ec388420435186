"""torchft 0.2.0's Rust side logs at INFO by default: every quorum tick of a lighthouse and every
quorum of a manager, several lines a second. Its logger reads ``RUST_LOG`` once, when
``torchft._torchft`` is first imported, so the level must be in the environment before that.
This sets ``RUST_LOG=warn`` unless the user set it (``RUST_LOG=info`` brings the lines back)."""

from __future__ import annotations

import os

QUIET = "warn"


def apply() -> None:
    """Idempotent; has no effect on a process that imported torchft before it."""
    os.environ.setdefault("RUST_LOG", QUIET)
