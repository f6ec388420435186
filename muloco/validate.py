"""Validation on held-out data, from the same source as training unless told otherwise.

torchtitan's validator takes its own dataloader config; keeping two copies of the
data source in sync by hand is how runs end up validating on a different corpus
(or, as in MuLoCo's ``dclm_test``, on training data). Here the validation loader
is, by default, the training loader's config with ``split="validation"``. The
time and tokens spent validating are kept out of the training throughput.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import ContextManager
from dataclasses import dataclass, field

from torchtitan.components.validate import Validator

from muloco.data.loader import PackedTextDataLoader


class MulocoValidator(Validator):
    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        enable: bool = True
        freq: int = 50
        steps: int = 8
        """Batches per validation; the same batches every time, so losses compare."""
        follow_training_data: bool = True
        """Validate on the training data source's held-out split (ignores validator.dataloader)."""
        dataloader: PackedTextDataLoader.Config = field(
            default_factory=lambda: PackedTextDataLoader.Config(split="validation")
        )

        def data_config(self, training_data: PackedTextDataLoader.Config) -> PackedTextDataLoader.Config:
            """The data the validator will read, given the training data."""
            if self.follow_training_data:
                return dataclasses.replace(training_data, split="validation")
            return self.dataloader

        def resolve(self, training_data: PackedTextDataLoader.Config) -> None:
            self.dataloader = self.data_config(training_data)

    def evaluate_with(self, params: Callable[[], ContextManager], due: Callable[[int, int], bool]) -> None:
        """Validate other parameters than the model's (DiLoCo: θ_g), on another schedule.

        ``params()`` swaps them in for the duration; ``due(step, freq)`` replaces the
        every-``freq``-steps rule (DiLoCo validates at sync boundaries).
        """
        self._params, self._due = params, due

    def should_validate(self, step: int) -> bool:
        due = getattr(self, "_due", None)
        return due(step, self.config.freq) if due is not None else super().should_validate(step)

    def validate(self, model_parts, step: int) -> None:
        mp = self.metrics_processor
        tokens, started = mp.ntokens_since_last_log, time.perf_counter()
        params = getattr(self, "_params", None)
        with params() if params is not None else contextlib.nullcontext():
            super().validate(model_parts, step)
        mp.ntokens_since_last_log = tokens
        mp.time_last_log += time.perf_counter() - started
