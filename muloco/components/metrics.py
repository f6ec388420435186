"""Training metrics: one console line per log step, a JSONL file, TensorBoard, optional W&B.

torchtitan's console line has no learning rate, step time or ETA, and it keeps no
machine-readable record unless TensorBoard or W&B is on. This processor computes
the same throughput and memory figures, adds those, writes every record to
``<dump_folder>/<jsonl_file>`` (one JSON object per line; nothing secret goes in:
no config values, no environment) and forwards the record to torchtitan's
TensorBoard/W&B loggers. The last training and validation losses are kept for the
end-of-run summary.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from muloco.runs.manifest import complete_steps
from muloco.utils import optional
from muloco.utils.atomic_file import write_atomically
from muloco.utils.values import require_steps_or_fraction


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


_PART_LABELS = {
    "quorum": "quorum",
    "cut_off": "cut off (lighthouse unreachable)",
    "wait_slowest": "waiting for the slowest",
    "queued": "queued (device)",
    "pseudo_gradient": "Δ",
    "encode": "encode",
    "collective": "collective",
    "link": "link (emulated)",
    "decode": "decode/average",
    "commit": "commit",
    "outer_step": "outer step",
    "pull": "pull",
    "other": "other",
}


def _breakdown(record: dict[str, Any]) -> str:
    """The sync's blocked time by part (``time_*`` entries; parts under 1 ms left out)."""
    parts = [(label, record.get(f"time_{part}") or 0.0) for part, label in _PART_LABELS.items()]
    shown = ", ".join(f"{label} {1000 * s:,.0f}" for label, s in parts if s >= 0.0005)
    return f"ms: {shown or 'all parts under 1'}"


def _is_metrics_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


WANDB_ID_FILE = "wandb_run_id"


def keep_wandb_run(dump_folder: str, rank_suffix: str = "", *, resuming: bool) -> str:
    """One W&B run per run folder across restarts, requeues and resubmissions: its id is kept in
    ``<dump_folder>/wandb_run_id`` and exported as ``WANDB_RUN_ID`` with ``WANDB_RESUME=allow``,
    which torchtitan's ``WandBLogger`` and the W&B SDK read, so a run ``resuming`` from a
    checkpoint continues its curves instead of starting a new W&B run. A run starting from step 0
    gets a new id (W&B would drop its steps below the old run's last one). A ``WANDB_RUN_ID`` the
    user set wins."""
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    path = os.path.join(dump_folder, WANDB_ID_FILE + rank_suffix)
    os.makedirs(dump_folder, exist_ok=True)
    if not (resuming and os.path.exists(path)):
        write_atomically(path, uuid.uuid4().hex[:16] + "\n")
    with open(path) as f:
        run_id = f.read().strip()
    os.environ["WANDB_RUN_ID"] = run_id
    os.environ.setdefault("WANDB_RESUME", "allow")
    return run_id


class MulocoMetrics(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_file: str = "metrics.jsonl"
        """Per-run JSONL record of every logged step, relative to dump_folder ('' = off)."""
        log_freq: int | float = 10
        """Steps between logged steps, or a fraction of training.steps (0.05: twenty lines a run)."""

        def validate(self) -> None:
            require_steps_or_fraction("metrics.log_freq", self.log_freq)
            if self.enable_wandb:
                try:
                    optional.require("wandb", "metrics.enable_wandb")
                except optional.MissingExtra as err:
                    raise ValueError(str(err)) from None

    validation_seconds_total: float = 0.0
    """Seconds this process spent validating so far (each validation record carries it, so the
    time to a loss can leave validation out: ``muloco/compare/timing.py``)."""
    validation_started: float | None = None
    """``perf_counter`` when the validation in progress began (set by the validator)."""
    emulated_link: str | None = None
    """Set when the run trains over an emulated link (``--outer.link.mbps``): its waits are in the
    step times, tokens/s and wall time, which then say so."""

    def __init__(self, config: Config, *, dump_folder: str = "./outputs", **kwargs):
        if config.enable_wandb and (_is_metrics_rank() or config.save_for_all_ranks):
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            checkpoints = os.path.join(dump_folder, "checkpoint")
            resuming = os.path.isdir(checkpoints) and bool(complete_steps(checkpoints))
            keep_wandb_run(dump_folder, f"-rank{rank}" if rank else "", resuming=resuming)
        super().__init__(config, dump_folder=dump_folder, **kwargs)
        self.total_steps = 0
        self.start_step = 0
        self.last_logged_step = 0
        self.last_train_loss: float | None = None
        self.last_validation_loss: float | None = None
        self.last_validation_step: int | None = None
        self.last_validation_extra: dict[str, float] = {}
        self.validation_targets_per_byte: float | None = None
        """Validation targets per byte of the text they spell (set by the validator): turns a
        loss in nats per target into bits per byte, a figure every objective and tokenizer share."""
        self.tokens_per_second: list[float] = []
        self._jsonl = None
        if config.jsonl_file and _is_metrics_rank():
            path = os.path.join(dump_folder, config.jsonl_file)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._jsonl = open(path, "a", buffering=1)
        self.jsonl_path = os.path.abspath(self._jsonl.name) if self._jsonl else None

    def begin(self, *, start_step: int, total_steps: int) -> None:
        """Called when the training loop starts (after a possible resume)."""
        self.start_step = self.last_logged_step = start_step
        self.total_steps = total_steps
        self.time_last_log = time.perf_counter()
        if self._jsonl is not None:  # JSONL only: where training (re)started, for timing a run's curve
            self._jsonl.write(json.dumps({"step": start_step, "time": time.time(), "session_start": True}) + "\n")

    def should_log(self, step: int) -> bool:
        """Also the last step: the run's final loss is logged and is the summary's final
        train loss, whether or not ``training.steps`` is a multiple of ``log_freq``."""
        return super().should_log(step) or step == self.total_steps

    def _record(self, record: dict[str, Any], step: int) -> None:
        # TensorBoard/W&B take numbers only; the JSONL keeps everything.
        numeric = {k: float(v) for k, v in record.items() if isinstance(v, (int, float))}
        self.logger.log(numeric, step)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        now = time.perf_counter()
        elapsed = now - self.time_last_log
        steps = max(1, step - self.last_logged_step)
        tps = self.ntokens_since_last_log / (elapsed * self.parallel_dims.non_data_parallel_size)
        step_time = elapsed / steps
        eta = step_time * max(0, self.total_steps - step)
        mem = self.device_memory_monitor.get_peak_stats()
        extra = dict(extra_metrics or {})
        lrs = [v for k, v in extra.items() if k.startswith("lr/")]
        record = {
            "loss": global_avg_loss,
            "loss_max": global_max_loss,
            "grad_norm": grad_norm,
            "lr": lrs[-1] if lrs else None,
            "tokens_per_second": tps,
            "step_time_s": step_time,
            "data_time_s": sum(self.data_loading_times) / max(1, len(self.data_loading_times)),
            "memory_peak_gib": mem.max_reserved_gib,
            "eta_s": eta,
            **extra,
        }
        if self.device_memory_monitor.device.type == "cuda" and not self.has_quantization:
            record["mfu_pct"] = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
        self._record(record, step)
        self.last_train_loss = global_avg_loss
        if step > self.start_step + 1:  # the first step includes start-up costs
            self.tokens_per_second.append(tps)
        lr = f"{record['lr']:.3e}" if record["lr"] is not None else "n/a"
        logger.info(
            f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  "
            f"loss {global_avg_loss:7.4f}  lr {lr}  grad_norm {grad_norm:6.3f}  "
            f"tok/s {tps:,.0f}  step {step_time * 1000:,.0f}ms  "
            f"mem {mem.max_reserved_gib:.2f}GiB  eta {_fmt_duration(eta)}"
            + (f"  (times include the {self.emulated_link})" if self.emulated_link else "")
        )
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.last_logged_step = step
        self.device_memory_monitor.reset_peak_stats()

    def log_validation(self, loss: float, step: int, extra_metrics=None):
        ppl = math.exp(loss) if loss < 50 else float("inf")
        extra = dict(extra_metrics or {})
        if self.validation_targets_per_byte is not None:
            extra["validation_bits_per_byte"] = loss * self.validation_targets_per_byte / math.log(2)
        if self.validation_started is not None:
            self.validation_seconds_total += time.perf_counter() - self.validation_started
            self.validation_started = None
        self._record(
            {
                "validation_loss": loss,
                "validation_ppl": ppl,
                **extra,
                "validation_seconds_total": self.validation_seconds_total,
            },
            step,
        )
        self.last_validation_loss = loss
        self.last_validation_step = step
        self.last_validation_extra = extra
        bpb = f"  {extra['validation_bits_per_byte']:.4f} bits/byte" if "validation_bits_per_byte" in extra else ""
        if "validation_masked_accuracy" in extra:
            logger.info(
                f"validation at step {step}: NELBO {loss:7.4f} nats/token  ppl bound {ppl:,.2f}{bpb}  "
                f"masked-token accuracy {extra['validation_masked_accuracy']:.3f}"
            )
            return
        logger.info(f"validation at step {step}: loss {loss:7.4f}  ppl {ppl:,.2f}{bpb}")

    def log_sync(self, record: dict[str, Any], step: int) -> None:
        """One outer sync: JSONL/TensorBoard under ``sync/`` and one console line."""
        self._record({f"sync/{k}": v for k, v in record.items()}, step)
        mb = 1e6
        healed = f", healed from replica {record['healed_from']}" if record.get("healed_from") is not None else ""
        if record.get("heal_failure"):
            healed = f", {record['heal_failure']}"
        if record["committed"]:
            logger.info(
                f"sync at step {step} (fragment {record['fragment']}): committed, "
                f"{record['contributors']}/{record['participants']} replicas contributed, "
                f"quorum #{record['quorum_id']}{healed}, {record['seconds'] * 1000:,.0f}ms, "
                f"sent {record['bytes_sent'] / mb:,.2f}MB received {record['bytes_received'] / mb:,.2f}MB, "
                f"{record.get('bits_per_parameter', 32.0):.2f} bits/parameter; {_breakdown(record)}"
            )
            return
        outcome = "tried again" if record.get("retried") else "rolled back"
        logger.warning(
            f"sync at step {step} (fragment {record['fragment']}): NOT committed, {outcome}: "
            f"{record.get('failure') or 'unknown reason'}; {record['participants']} replicas in quorum "
            f"#{record['quorum_id']}{healed}, {record['seconds'] * 1000:,.0f}ms, "
            f"{record['bytes_sent'] / mb:,.2f}MB handed to the collectives were discarded"
        )

    def close(self):
        super().close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
