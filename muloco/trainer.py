"""The muloco trainer: torchtitan's Trainer wired to muloco's models, data and metrics.

What muloco adds lives in :class:`MulocoTrainerMixin`, so the fault-tolerant trainer
(torchft replica groups) can combine it with torchtitan's ``FaultTolerantTrainer``
the same way :class:`MulocoTrainer` combines it with ``Trainer``. The nested
``Config`` must be declared on every subclass (torchtitan's ``Configurable`` builds
the class that declares the Config).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torchtitan.trainer
import tyro
from torchtitan.components.loss import BaseLoss, CrossEntropyLoss
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from muloco.compat import lone_rank_sleep
from muloco.compat.cpu_device import device_type
from muloco.components.checkpoint import MulocoCheckpointManager
from muloco.components.metrics import MulocoMetrics
from muloco.components.precision import MulocoTrainingConfig, resolve_precision
from muloco.components.preemption import RunPreempted, StopRequest
from muloco.components.validate import MulocoValidator
from muloco.data.loader import PackedTextDataLoader
from muloco.data.tokenizer import MulocoTokenizer
from muloco.models import ModelConfig, build_model_spec
from muloco.objectives import Autoregressive, NoiseKey, Objective, ObjectiveConfig, Prepared, SpecialTokens
from muloco.optim import MulocoOptimizers
from muloco.runs.facts import facts_of, update_run_record

lone_rank_sleep.apply(torchtitan.trainer)


def _shapes(value) -> tuple:
    """Shapes and dtypes of a dict of tensors (nested dicts, block masks by their shape)."""
    if isinstance(value, dict):
        return tuple((key, _shapes(v)) for key, v in sorted(value.items()))
    if torch.is_tensor(value):
        return tuple(value.shape), value.dtype
    return type(value).__name__, tuple(getattr(value, "shape", ()))


class MulocoTrainerMixin:
    """Behaviour shared by the plain and the fault-tolerant trainer."""

    config: Any
    metrics_processor: MulocoMetrics

    def _resolve(self, config) -> None:
        """Settings derived from others: the model from the tokenizer's vocabulary and the
        objective (its attention direction), the loader rows from the objective, the
        validation data from the training data, the precision from the device."""
        training = config.training
        self.requested_precision = training.mixed_precision_param
        training.mixed_precision_param = resolve_precision(training.mixed_precision_param, device_type())
        objective_class = config.objective._owner
        config.dataloader.next_token = objective_class.next_token
        config.validator.resolve(config.dataloader)
        tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
        config.model_spec = build_model_spec(config.model, tokenizer.get_vocab_size(), objective_class.causal)

    def _build_objective(self) -> None:
        """The objective, after torchtitan built the model: with a masked-only head the model
        returns hidden states and the objective applies ``lm_head`` where it scores."""
        tokenizer = self.tokenizer
        dp_world = getattr(self.dataloader, "dp_world_size", 1)
        self.objective: Objective = self.config.objective.build(
            tokens=SpecialTokens(bos=tokenizer.bos_id, eos=tokenizer.eos_id, mask=tokenizer.mask_id),
            # the rows of one optimizer step: every rank's micro-batches, accumulation included
            rows_per_step=self.config.training.local_batch_size * dp_world * self.gradient_accumulation_steps,
        )
        self.objective.use_loss(self.loss_fn, self.config.compile)
        model = self.model_parts[0]
        if self.objective.skip_lm_head:
            model._skip_lm_head = True
            self.objective.lm_head = model.lm_head
        mp = self.metrics_processor
        mp.num_flops_per_token = self.objective.flops_per_token(mp.num_flops_per_token, model.lm_head.weight.numel())
        if self.config.validator.enable:  # torchtitan builds no validator when validation is off
            self.validator.objective = self.objective
        self._micro = (None, 0)

    def _noise_key(self) -> NoiseKey:
        step, micro = self._micro
        micro = micro + 1 if step == self.step else 0
        self._micro = (self.step, micro)
        return NoiseKey(
            replica=self._replica_index(),
            step=self.step,
            micro=micro,
            rank=getattr(self.dataloader, "dp_rank", 0),
            world=getattr(self.dataloader, "dp_world_size", 1),
        )

    def _replica_index(self) -> int:
        return 0

    def train_step(self, data_iterator):
        """torchtitan's step over micro-batches the objective may cut as they are fetched: torchtitan
        counts the step's valid tokens (the loss normaliser, summed over ranks and accumulation
        steps) from what it fetched, so a cut step is divided by the tokens that remain."""
        return super().train_step(self._cut_batches(data_iterator))  # type: ignore[misc]

    def _cut_batches(self, data_iterator):
        micro = 0
        for input_dict, labels in data_iterator:
            key = NoiseKey(replica=self._replica_index(), step=self.step, micro=micro, rank=0, world=1)
            length = labels.shape[1]
            inputs, labels = self.objective.truncate(input_dict["input"], labels, key)
            if labels.shape[1] != length:  # per-token extras (positions) are cut alike
                input_dict = {
                    k: v[:, : labels.shape[1]] if torch.is_tensor(v) and v.dim() > 1 and v.shape[1] == length else v
                    for k, v in input_dict.items()
                }
            yield {**input_dict, "input": inputs}, labels
            micro += 1

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        """torchtitan's step with the objective preparing the batch and scoring the output.

        The forward and backward run through torchtitan's ``fwd_bwd_fn``: on CUDA it records
        them once as a CUDA graph and replays it, unless ``--training.disable_cuda_graphs``.
        Without the graph every kernel is launched from Python each step, and at 158M on an H200
        that host time outlasted the GPU's step (docs/gpu.md). The objective's draws happen in
        ``prepare``, outside the graph; what its loss reads goes in as tensors. A step whose
        shapes differ from the recorded ones (a cut step of masked diffusion) runs eagerly."""
        if self.parallel_dims.pp_enabled:
            raise NotImplementedError("pipeline parallelism is not supported by muloco's objectives")
        inputs, labels, extra = self.post_dataloading_process(input_dict, labels)
        batch = self.objective.prepare(inputs, labels, self._noise_key())
        loss_inputs = self.objective.loss_inputs(batch)
        if extra.keys() & batch.model_kwargs.keys():
            raise ValueError(
                f"the objective's model arguments {sorted(batch.model_kwargs)} overlap "
                f"torchtitan's {sorted(extra)}: one would silently replace the other"
            )
        if loss_inputs is not None:
            kwargs = {"model": {**extra, **batch.model_kwargs}, "loss": loss_inputs}
            if self._recorded_shapes(batch, kwargs):
                return self.fwd_bwd_fn(batch.inputs, batch.labels, global_valid_tokens, kwargs)
        return self._score(batch, extra, global_valid_tokens)

    def _recorded_shapes(self, batch, kwargs) -> bool:
        """Whether this step's tensors have the shapes of the first recorded step (torchtitan's
        graph refuses others)."""
        shapes = _shapes({"inputs": batch.inputs, "labels": batch.labels, **kwargs})
        recorded = self.__dict__.setdefault("_graph_shapes", shapes)
        return shapes == recorded

    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
        """torchtitan's recorded body (``fwd_bwd_fn``) with the objective's loss."""
        batch = self.objective.batch_from(inputs, labels, extra_kwargs["model"], extra_kwargs["loss"])
        return self._score(batch, {}, global_valid_tokens)

    def _score(self, batch: Prepared, extra: dict, global_valid_tokens) -> torch.Tensor:
        with self.train_context():
            pred = self.model_parts[0](batch.inputs, **extra, **batch.model_kwargs)
            loss = self.objective.loss(pred, batch, global_valid_tokens)
            del pred
            loss.backward()
        return loss

    def _log_start(self) -> None:
        n = sum(p.numel() for m in self.model_parts for p in m.parameters())
        trainable = sum(p.numel() for m in self.model_parts for p in m.parameters() if p.requires_grad)
        self._record_facts(n)
        lora = self.config.model.lora
        adapters = (
            f"; LoRA r={lora.rank} alpha={lora.alpha:g} on {', '.join(lora.target_modules)}: {trainable:,} "
            f"trainable ({trainable / n:.2%}), the rest frozen"
            if lora.rank
            else ""
        )
        logger.info(
            f"model {self.config.model.flavor}: {n:,} parameters "
            f"({'causal' if self.objective.causal else 'bidirectional'} attention{adapters})"
        )
        logger.info(f"objective: {self.objective.name} {self.config.objective}")
        t = self.config.training
        how = "auto for " + device_type() if self.requested_precision == "auto" else "forced"
        logger.info(
            f"precision: {t.mixed_precision_param} parameters in compute ({how}), fp32 master weights, "
            f"{t.mixed_precision_reduce} reductions"
        )
        describe = getattr(self.dataloader, "describe", None)
        if describe is not None:
            logger.info(f"data: {describe()}")

    def _record_facts(self, parameters: int) -> None:
        """Rank 0 records what this run is (from the resolved config) in its ``run.json``:
        what the report and the sweeps read instead of guessing from names."""
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        update_run_record(self.config.dump_folder, facts=facts_of(self.config, parameters=parameters))

    preempted: bool = False
    """Stopped on request (:mod:`muloco.components.preemption`) with a checkpoint, before ``training.steps``."""

    def should_continue_training(self) -> bool:
        if not getattr(self, "_loop_started", False):
            self._loop_started = True  # first call: after any checkpoint was loaded
            self._stop = StopRequest.from_environment()
            self._on_loop_start()
        if not self._steps_left():
            return False
        if self._stop_requested():
            self._stop_with_checkpoint()
            return False
        return True

    def _steps_left(self) -> bool:
        """torchtitan's rule: steps until ``training.steps`` (a DiLoCo trainer in deadline rounds counts progress)."""
        return super().should_continue_training()  # type: ignore[misc]

    def _stop_requested(self) -> bool:
        """Whether to stop after this step (asked on every step; a DiLoCo group: at sync boundaries)."""
        return self._stop.agreed() and self._can_stop()

    def _can_stop(self) -> bool:
        """A run without checkpoints could not resume: it trains on (and says so once)."""
        if self.checkpointer.enable:
            return True
        if not getattr(self, "_said_cannot_stop", False):
            self._said_cannot_stop = True
            logger.warning("stop requested, but checkpoints are off (--checkpoint.enable): training on")
        return False

    def _stop_with_checkpoint(self) -> None:
        self.preempted = True
        saved = self.checkpointer.save_now(self.step)
        logger.info(
            f"stop requested: {'checkpoint written' if saved else 'the checkpoint is already there'} "
            f"at step {self.step} in {self.checkpointer.folder}; stopping (the same command resumes)"
        )

    def _on_loop_start(self) -> None:
        total = self.config.training.steps
        self.metrics_processor.begin(start_step=self.step, total_steps=total)
        if self.step >= total:
            logger.info(
                f"the checkpoint in {self.config.dump_folder} is already at step "
                f"{self.step} of {total}: nothing to train. Delete that folder or pass "
                "--dump_folder to start afresh, or raise --training.steps to continue."
            )

    def train(self):
        """torchtitan's loop, then a final validation and a summary."""
        wall_start = time.perf_counter()
        super().train()  # type: ignore[misc]
        if self.preempted:
            raise RunPreempted(self.step, self.checkpointer.folder)
        if self.config.validator.enable and self.metrics_processor.last_validation_step != self.step:
            self.validator.validate(self.model_parts, self.step)
        self.summary = self._summarize(time.perf_counter() - wall_start)
        self._report(self.summary)

    def _summarize(self, wall_seconds: float) -> dict[str, Any]:
        mp = self.metrics_processor
        tps = mp.tokens_per_second
        cfg = self.config
        summary = {
            "objective": self.objective.name,
            "steps": self.step,
            "precision": cfg.training.mixed_precision_param,
            "tokens_seen": self.ntokens_seen,
            "final_train_loss": mp.last_train_loss,
            "final_validation_loss": mp.last_validation_loss,
            "tokens_per_second": sum(tps) / len(tps) if tps else None,
            "wall_seconds": wall_seconds,
            "dump_folder": os.path.abspath(cfg.dump_folder),
            "metrics_jsonl": mp.jsonl_path,
            "tensorboard": (
                os.path.abspath(os.path.join(cfg.dump_folder, cfg.metrics.save_tb_folder))
                if cfg.metrics.enable_tensorboard
                else None
            ),
            "checkpoints": (
                os.path.abspath(os.path.join(cfg.dump_folder, cfg.checkpoint.folder)) if cfg.checkpoint.enable else None
            ),
        }
        for key in ("final_train_loss", "final_validation_loss"):
            loss = summary[key]
            summary[key.replace("loss", "ppl")] = math.exp(loss) if loss is not None and loss < 50 else None
        # bits per byte of the held-out text: comparable across objectives and tokenizers
        summary["final_validation_bits_per_byte"] = mp.last_validation_extra.get("validation_bits_per_byte")
        if "tuning_loss" in mp.last_validation_extra:  # validator.tuning_steps: what compare --tune picks by
            summary["final_tuning_loss"] = mp.last_validation_extra["tuning_loss"]
        if "validation_masked_accuracy" in mp.last_validation_extra:
            # masked diffusion: the validation loss is the negative ELBO per token, its exp a bound
            summary["final_validation_nelbo"] = summary["final_validation_loss"]
            summary["final_validation_ppl_bound"] = summary["final_validation_ppl"]
            summary["final_masked_accuracy"] = mp.last_validation_extra["validation_masked_accuracy"]
        return summary

    def _train_loss_note(self) -> str:
        """What the summary's train loss is of, where that is not the whole run's model."""
        return ""

    def _report(self, s: dict[str, Any]) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        with open(os.path.join(self.config.dump_folder, "summary.json"), "w") as f:
            json.dump(s, f, indent=2)

        def num(x, fmt):
            return format(x, fmt) if x is not None else "n/a"

        link = getattr(self.metrics_processor, "emulated_link", None)
        emulated = f"  (includes the {link})" if link else ""

        lines = [
            "=" * 64,
            f"run summary ({s['objective']} objective)",
            f"  steps                 {s['steps']}",
            f"  precision             {s['precision']}",
            f"  tokens seen           {s['tokens_seen']:,}",
            f"  final train loss      {num(s['final_train_loss'], '.4f')}  (ppl {num(s['final_train_ppl'], ',.2f')})"
            + self._train_loss_note(),
            self._validation_line(s, num),
            f"  tokens/s              {num(s['tokens_per_second'], ',.0f')}{emulated}",
            f"  wall time             {s['wall_seconds']:.1f}s{emulated}",
            f"  outputs               {s['dump_folder']}",
            f"  metrics (JSONL)       {s['metrics_jsonl'] or 'off'}",
            f"  TensorBoard           {s['tensorboard'] or 'off'}",
            f"  checkpoints           {s['checkpoints'] or 'off'}",
            "=" * 64,
        ]
        logger.info("\n".join(lines))

    @staticmethod
    def _validation_line(s: dict[str, Any], num) -> str:
        bpb = f"{num(s.get('final_validation_bits_per_byte'), '.4f')} bits/byte"
        if "final_validation_nelbo" in s:
            return (
                f"  final validation NELBO {num(s['final_validation_nelbo'], '.4f')} nats/token, {bpb}  "
                f"(ppl bound {num(s['final_validation_ppl_bound'], ',.2f')}, masked-token accuracy "
                f"{num(s['final_masked_accuracy'], '.3f')})"
            )
        return (
            f"  final validation loss {num(s['final_validation_loss'], '.4f')}, {bpb}  "
            f"(ppl {num(s['final_validation_ppl'], ',.2f')})"
        )


class MulocoTrainer(MulocoTrainerMixin, Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        hf_assets_path: str = ""
        """Not read: the tokenizer comes from --tokenizer.path, HF weights from --checkpoint.initial_load_path."""
        model: ModelConfig = field(default_factory=ModelConfig)
        """Model flavor from the model map and attention direction."""
        tokenizer: MulocoTokenizer.Config = field(default_factory=MulocoTokenizer.Config)
        dataloader: PackedTextDataLoader.Config = field(default_factory=PackedTextDataLoader.Config)
        optimizer: MulocoOptimizers.Config = field(default_factory=MulocoOptimizers.Config)
        metrics: MulocoMetrics.Config = field(default_factory=MulocoMetrics.Config)
        checkpoint: MulocoCheckpointManager.Config = field(default_factory=MulocoCheckpointManager.Config)
        validator: MulocoValidator.Config = field(default_factory=MulocoValidator.Config)
        loss: BaseLoss.Config = field(default_factory=CrossEntropyLoss.Config)
        training: MulocoTrainingConfig = field(default_factory=MulocoTrainingConfig)
        """torchtitan's training settings; mixed_precision_param ``auto`` fits the device."""
        objective: tyro.conf.AvoidSubcommands[ObjectiveConfig] = field(default_factory=Autoregressive.Config)
        """ar | mdlm: pick with ``--objective NAME`` (it sets the attention direction), then
        set its own settings as ``--objective.SETTING``."""

    def __init__(self, config: Config):
        self._resolve(config)
        super().__init__(config)
        self._build_objective()
        self._log_start()
