"""How many inner steps each replica group trains in a deadline round: plain arithmetic shared by
the outer loop's round mode and the link planner (``muloco/sizing/link_plan.py``), so a plan and
a run agree (no torch here: the planner starts in a fraction of a second).

A lockstep round: every group trains H inner steps, then the quorum waits for the slowest group.
A deadline round ends at D = H × the ``quantile`` of the groups' step times (1.0, the default:
the slowest group's H steps, so no group trains fewer than H), and group i trains
H_i = clamp(⌊D / s_i⌋, min_steps, max_steps) steps in it: a faster group fills the time it
would have waited (up to ``max_steps``), and with a quantile below 1 a slower one trains fewer
steps (down to ``min_steps``) instead of holding up the round. The budgets are a pure function
of numbers every replica holds (``s_i``: the step times the quorum has agreed), so every replica
and every rank computes the same ones.

The run's progress is counted in nominal steps: a round adds Σ H_i / K (H in lockstep), and the
run ends when it reaches the configured steps: the same tokens as a lockstep run of that length.
"""

from __future__ import annotations

import math

EXACT = 1e-9
"""⌊D / s_i⌋ with D = H·s_i must be H: a relative nudge against the division's rounding."""


def deadline(sync_every: int, step_seconds: list[float], quantile: float = 1.0) -> float:
    """D: H times the ``quantile`` of the step times (the ⌈q·K⌉-th smallest; q = 1: the slowest)."""
    ordered = sorted(step_seconds)
    return sync_every * ordered[max(0, math.ceil(quantile * len(ordered) - EXACT) - 1)]


def budgets(
    sync_every: int, step_seconds: list[float], quantile: float = 1.0, min_steps: int = 1, max_steps: int | None = None
) -> list[int]:
    """H_i for each group: the steps of its own pace that fit in the round's deadline, clamped."""
    most = max_steps if max_steps is not None else 2 * sync_every
    end = deadline(sync_every, step_seconds, quantile)
    return [min(most, max(min_steps, math.floor(end / s * (1 + EXACT)))) for s in step_seconds]


def progress(steps: list[int]) -> float:
    """Nominal inner steps a round adds to the run: Σ H_i / K (H when every group trains H)."""
    return sum(steps) / len(steps)


def round_seconds(steps: list[int], step_seconds: list[float]) -> float:
    """A round's compute time: the last group to finish its steps."""
    return max(h * s for h, s in zip(steps, step_seconds))


def idle_seconds(steps: list[int], step_seconds: list[float]) -> float:
    """Group-seconds per round spent waiting for the last group to finish."""
    end = round_seconds(steps, step_seconds)
    return sum(end - h * s for h, s in zip(steps, step_seconds))


LAST_ROUND_AT_LEAST = 0.5
"""The shortest last round, in full rounds: a shorter one is merged into the round before it (a
whole exchange for a few inner steps costs more than it adds)."""


def last_round(steps: list[int], done: float, total: int) -> list[int]:
    """The budgets scaled (rounded up, each group at least 1 step) so that this round ends the
    run, reaching ``total`` nominal steps, when a full round would go past it, or when it would
    leave less than ``LAST_ROUND_AT_LEAST`` of a round after it (this round then takes those
    steps too, up to 1.5x its budgets, past ``max_steps`` if need be: it is the run's last); unchanged
    otherwise."""
    left = total - done
    full = progress(steps)
    if full + LAST_ROUND_AT_LEAST * full <= left + EXACT:
        return list(steps)
    return [max(1, math.ceil(h * left / full - EXACT)) for h in steps]
