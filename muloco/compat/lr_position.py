"""Putting a torch learning-rate scheduler at a given step.

Deadline rounds (:mod:`muloco.outer.rounds`) set each group's inner learning rate from its place
in the round, not from how many steps it took, so the scheduler has to jump to a step rather than
count one more. torch 2.13 has no public call for that: ``step(epoch)`` is deprecated (it warns on
every call) and also counts a step. Its private ``_update_lr(epoch)`` does exactly the jump (sets
``last_epoch``, writes every group's lr from the scheduler's own rule, and the last lr that
``get_last_lr`` reports); this module is the one place that calls it."""

from __future__ import annotations

from torch.optim.lr_scheduler import LRScheduler


def set_position(scheduler: LRScheduler, position: float) -> None:
    """The scheduler and its optimizer's lrs as if it had been stepped to ``position`` (for a
    closed-form rule such as torchtitan's LambdaLR, the same values a scheduler stepped
    ``position`` times holds), without a warning and without counting a step. A fractional
    position (a group part-way through a deadline round: P + j/H_i of its planned progress) is
    the rule's value there, which torchtitan's warmup-decay lambda computes as it would at a step."""
    scheduler._update_lr(position)
