"""torchtitan 0.3.0's fault-tolerant trainer logs the whole model config as indented JSON when it
builds the model (``experiments/torchft/trainer.py``: "Building {name} {flavor} with {...}"), about
1,300 lines per DiLoCo replica group; its plain trainer logs one line. The record keeps its first
line and says where the config is kept instead: the run's facts (``run.json``) and the flavor."""

from __future__ import annotations

import logging

_MARK = " with {"


class OneLineModelConfig(logging.Filter):
    """Cuts "Building <model> <flavor> with {<json>}" to its first part (other records pass as they are)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if isinstance(msg, str) and msg.startswith("Building ") and _MARK in msg:
            record.msg = msg.split(_MARK, 1)[0] + " (its settings: the flavor, and the facts in the run's run.json)"
        return True


def apply() -> None:
    """On the root logger, which is torchtitan's ``logger``; idempotent."""
    root = logging.getLogger()
    if not any(isinstance(f, OneLineModelConfig) for f in root.filters):
        root.addFilter(OneLineModelConfig())
