"""Validation on held-out data, from the same source as training unless told otherwise.

torchtitan's validator takes its own dataloader config; keeping two copies of the
data source in sync by hand is how runs end up validating on a different corpus
(or, as in MuLoCo's ``dclm_test``, on training data). Here the validation loader
is, by default, the training loader's config with ``split="validation"``. The
time and tokens spent validating are kept out of the training throughput.

What is measured follows the objective: the next-token loss for ``ar``; for ``mdlm``
the negative ELBO per token (nats; its exp is a perplexity bound) estimated with
``objective.eval_samples`` stratified mask counts per row from fixed seeds, so every
replica and every validation sees the same masks, plus the masked-token accuracy. Both
also report ``validation_bits_per_byte``: the total nats over the targets, in bits, per
UTF-8 byte of the text those targets spell. Both objectives score the same text (an ``ar``
row's labels are every token after a document's BOS, EOS included; an ``mdlm`` row's are
those and the BOS, which weighs no bytes), so bits per byte put ``ar`` and ``mdlm`` runs,
and runs with different tokenizers, in one table.

``tuning_steps`` > 0 scores θ_g on that many *further* held-out batches (the documents after
the reported ones) as ``tuning_loss`` beside each validation: ``python -m muloco.compare
--tune`` picks outer steps by it, so no reported loss is one a setting was chosen on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ContextManager

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import Validator

from muloco.data.loader import PackedTextDataLoader
from muloco.objectives import Objective
from muloco.utils.values import require_steps_or_fraction


class MulocoValidator(Validator):
    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        enable: bool = True
        freq: int | float = 50
        """Steps between validations, or a fraction of training.steps (0.25: four a run; DiLoCo
        validates θ_g at the first sync at or after each due step)."""
        steps: int = 8
        """Batches per validation; the same batches every time, so losses compare."""
        tuning_steps: int = 0
        """Held-out batches after the ``steps`` reported ones, scored as ``tuning_loss`` (0: none):
        what ``compare --tune`` chooses by, apart from the reported validation loss."""
        follow_training_data: bool = True
        """Validate on the training data source's held-out split (ignores validator.dataloader)."""
        dataloader: PackedTextDataLoader.Config = field(
            default_factory=lambda: PackedTextDataLoader.Config(split="validation")
        )

        def validate(self) -> None:
            """Its own settings, and ``dataloader`` read only with ``follow_training_data`` off: a
            value set there while validation follows the training data would be dropped without a word."""
            if self.enable:
                require_steps_or_fraction("validator.freq", self.freq)
                if self.tuning_steps < 0:
                    raise ValueError(
                        f"validator.tuning_steps is {self.tuning_steps}; it must be >= 0 (0: no tuning batches)."
                    )
                if self.tuning_steps and self.steps == -1:
                    raise ValueError(
                        "validator.tuning_steps reads the held-out batches after the validator.steps "
                        "reported ones, and validator.steps -1 reports on all of them; give "
                        "validator.steps a count."
                    )
            self.dataloader.validate("validator.dataloader")
            if self.follow_training_data and self.dataloader != type(self.dataloader)(split="validation"):
                raise ValueError(
                    "validator.dataloader is set but not read: validation follows the training data's "
                    "held-out split (validator.follow_training_data). Add "
                    "--validator.no-follow-training-data to validate on validator.dataloader, or "
                    "drop its settings."
                )

        def data_config(self, training_data: PackedTextDataLoader.Config) -> PackedTextDataLoader.Config:
            """The data the validator will read, given the training data."""
            if self.follow_training_data:
                return dataclasses.replace(training_data, split="validation")
            return self.dataloader

        def resolve(self, training_data: PackedTextDataLoader.Config) -> None:
            self.dataloader = self.data_config(training_data)

    objective: Objective | None = None
    """Set by the trainer once built."""

    def post_dataloading_process(self, input_dict, labels, model_parts):
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels, model_parts)
        if self.objective is not None:
            extra.update(self.objective.attention_kwargs(inputs))
        return inputs, labels, extra

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
        mp.validation_started = started
        if mp.validation_targets_per_byte is None:
            mp.validation_targets_per_byte = self._targets_per_byte(next(model_parts[0].parameters()).device)
        params = getattr(self, "_params", None)
        with params() if params is not None else contextlib.nullcontext():
            tuning = self._tuning_loss(model_parts, step) if self.config.tuning_steps > 0 else None
            with self._also_logging({} if tuning is None else {"tuning_loss": tuning}):
                self._score(model_parts, step)
        mp.ntokens_since_last_log = tokens
        mp.time_last_log += time.perf_counter() - started

    def _score(self, model_parts, step: int) -> None:
        """Score the current parameters on the validation batches and log it."""
        if self.objective.elbo_validation:
            self._validate_elbo(model_parts, step)
        else:
            super().validate(model_parts, step)

    def _tuning_loss(self, model_parts, step: int) -> float:
        """The same score on the ``tuning_steps`` batches that follow the reported ones (the
        same code path, its data shifted and its log captured instead of written)."""
        mp, config, data = self.metrics_processor, self.config, self.dl_config
        captured: list[float] = []
        log, started = mp.log_validation, mp.validation_started
        mp.log_validation = lambda loss, step, extra_metrics=None: captured.append(float(loss))
        self.dl_config, reported = _AfterBatches(data, config.steps), config.steps
        config.steps = config.tuning_steps
        try:
            self._score(model_parts, step)
        finally:
            mp.log_validation, self.dl_config, config.steps = log, data, reported
            mp.validation_started = started
        if not captured:
            raise RuntimeError("the tuning batches were not scored")
        return captured[0]

    @contextlib.contextmanager
    def _also_logging(self, extra: dict[str, float]):
        """Add ``extra`` to the next validation record."""
        if not extra:
            yield
            return
        mp = self.metrics_processor
        log = mp.log_validation
        mp.log_validation = lambda loss, step, extra_metrics=None: log(loss, step, {**(extra_metrics or {}), **extra})
        try:
            yield
        finally:
            mp.log_validation = log

    def _batches(self):
        """The validation batches: the same first ``steps`` of this rank's shard every time."""
        loader = self.dl_config.build(
            dp_world_size=self.dp_world_size,
            dp_rank=self.dp_rank,
            tokenizer=self.tokenizer,
            seq_len=self.seq_len,
            local_batch_size=self.local_batch_size,
        )
        for index, batch in enumerate(loader):
            if self.config.steps != -1 and index >= self.config.steps:
                return
            yield index, batch

    def _targets_per_byte(self, device: torch.device) -> float | None:
        """Targets (labels not ignored) per UTF-8 byte of the text they spell, over every rank's
        validation batches; None for a tokenizer that cannot say what its tokens weigh."""
        token_bytes = getattr(self.tokenizer, "token_bytes", None)
        if token_bytes is None:
            return None
        sizes = torch.tensor(token_bytes(), dtype=torch.float64)
        counts = torch.zeros(2, dtype=torch.float64)
        for _, (_, labels) in self._batches():
            targets = labels[labels != IGNORE_INDEX]
            counts += torch.stack([torch.tensor(float(targets.numel()), dtype=torch.float64), sizes[targets].sum()])
        if self.parallel_dims.dp_enabled:
            counts = counts.to(device)
            torch.distributed.all_reduce(counts, group=self.parallel_dims.get_mesh("batch").get_group())
        targets, nbytes = counts.tolist()
        return targets / nbytes if nbytes else None

    @torch.no_grad()
    def _validate_elbo(self, model_parts, step: int) -> None:
        model = model_parts[0]
        model.eval()
        device = next(model.parameters()).device
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        for index, (input_dict, labels) in self._batches():
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            x0, labels = input_dict["input"].to(device), labels.to(device)
            with self.validation_context():
                sums += self.objective.elbo_terms(model, x0, labels, batch_index=index)
        if self.parallel_dims.dp_enabled:
            torch.distributed.all_reduce(sums, group=self.parallel_dims.get_mesh("batch").get_group())
        nelbo, tokens, correct, masked = sums.tolist()
        nelbo /= max(tokens, 1.0)
        self.metrics_processor.log_validation(
            loss=nelbo,
            step=step,
            extra_metrics={"validation_nelbo": nelbo, "validation_masked_accuracy": correct / max(masked, 1.0)},
        )
        model.train()


class _AfterBatches:
    """A data config whose loaders start ``skip`` batches in (the tuning batches follow the
    reported ones): it builds the wrapped config's loader and drops its first batches."""

    def __init__(self, inner, skip: int):
        self.inner, self.skip = inner, max(skip, 0)

    def build(self, **kwargs):
        return itertools.islice(iter(self.inner.build(**kwargs)), self.skip, None)
