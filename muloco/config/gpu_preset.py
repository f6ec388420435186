"""GPU sizing for the presets in config/gpu/: shape, batch, steps and precision from the model map.

One place decides how a flavor is trained on GPU nodes, so every preset (DDP AdamW, DDP
Muon, DiLoCo, MuLoCo, MuLoCo 2-bit) trains the same model on the same tokens:

- seq 2048, a global batch of 512 sequences per step summed over all replica groups
  (MuLoCo's setting): each of K groups takes 512/K, as micro-batches of the model map's
  ``max_local_batch`` per GPU with gradient accumulation (torchtitan's
  ``training.global_batch_size``), so the preset runs on any number of GPUs per group
  that divides it;
- steps that spend the model map's 20-tokens-per-parameter budget at that batch
  (``steps_for_batch``, Llama 3 vocabulary), rounded up to a whole number of syncs;
- bf16 compute with fp32 master weights on CUDA (``mixed_precision_param`` auto) and
  ``torch.compile``; activation checkpointing (selective, per op) only for shapes whose
  micro-batch the model map caps at 8 or fewer, where activations are what runs out;
- the inner learning rate tuned for the method in MuLoCo's launchers where the map has one
  (tuned at K=8), and the tuned weight decay for the optimizer.

Override anything on the command line; the tiny CPU check in tests/test_gpu_presets.py
does (``--model.flavor llama3-w64-d2-h2 --compile.no-enable`` ...).
"""

from __future__ import annotations

from torchtitan.distributed.activation_checkpoint import SelectiveAC

from muloco.models.flavors import parse_flavor, steps_for_batch

PAPER_416M = "llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf"
SEQ_LEN = 2048
GLOBAL_BATCH = 512
AC_AT_OR_BELOW_BATCH = 8


def size_for_gpu(c, *, flavor: str = PAPER_416M, weight_decay_key: str, lr_key: str | None = None):
    """Set ``c`` (a trainer config) up for ``flavor`` on GPU nodes; returns it."""
    shape = parse_flavor(flavor).shape
    c.model.flavor = flavor
    c.training.seq_len = SEQ_LEN
    c.training.local_batch_size = shape.max_local_batch
    c.training.batch_over_groups = GLOBAL_BATCH  # split over the K the launcher gives (split_batch_over_groups)
    c.training.global_batch_size = -1
    steps = steps_for_batch(flavor, GLOBAL_BATCH, SEQ_LEN)
    outer = getattr(c, "outer", None)
    interval = outer.sync_every // outer.num_fragments if outer is not None else 1
    c.training.steps = -(-steps // interval) * interval  # DiLoCo: the run ends on a sync
    c.training.mixed_precision_param = "auto"
    c.compile.enable = True
    c.activation_checkpoint = SelectiveAC.Config() if shape.max_local_batch <= AC_AT_OR_BELOW_BATCH else None
    c.lr_scheduler.warmup_steps = max(1, c.training.steps // 50)
    if weight_decay_key in shape.weight_decay:
        c.optimizer.weight_decay = shape.weight_decay[weight_decay_key]
    if lr_key is not None and lr_key in shape.tuned_lr:
        c.optimizer.lr = shape.tuned_lr[lr_key]
    c.metrics.log_freq = 10
    c.checkpoint.interval = 20 * interval if interval > 1 else 500  # on a sync boundary
    c.validator.freq = c.checkpoint.interval
    c.validator.steps = 50
    return c


def split_batch_over_groups(c) -> None:
    """``training.batch_over_groups`` B (set, and no explicit ``global_batch_size``): each of the K
    replica groups (``fault_tolerance.group_size``; 1 without an outer loop) takes B / K sequences
    per step, so a launcher's ``--replicas 8`` keeps the presets' 512 in all instead of 8 x 256.
    Applied right after the command line is parsed, where K is known."""
    t = c.training
    if not t.batch_over_groups or t.global_batch_size != -1:
        return
    k = c.fault_tolerance.group_size if getattr(c, "outer", None) is not None else 1
    if k < 1 or t.batch_over_groups % k or (t.batch_over_groups // k) % t.local_batch_size:
        raise ValueError(
            f"training.batch_over_groups {t.batch_over_groups} does not split over {k} replica "
            f"group(s) into multiples of training.local_batch_size {t.local_batch_size}: pick K or "
            "--training.local_batch_size so it does, or set --training.global_batch_size per group"
        )
    t.global_batch_size = t.batch_over_groups // k
