"""``--tune``'s flow in one place: the grid points a run of the suite tries (``--tune-points``
checked against the chosen rows' grids, ``suites.GRIDS``), the point each tuned row takes (the
lowest mean tuning loss, θ_g on batches held apart from the reported ones, on the tuning seeds),
what later seeds run (the chosen point, and averaging and the best point with momentum on a grid
with averaging), the dry run's stand-ins for choices not made yet, and the table's note on which
seeds chose and which report. The runner runs what this decides; ``table.py`` shows it."""

from __future__ import annotations

import shlex

from muloco.compare.line import Line
from muloco.compare.suites import AVERAGING, GRIDS, Planned, Suite
from muloco.report.runs import Run
from muloco.utils.command_line import UsageError


def check_points(suite: Suite, only: list[str], wanted: list[str]) -> dict[str, set[str]] | None:
    """``--tune-points`` as ``plan``'s ``chosen`` ({tuned row: points}); None: every point. Each
    point must be on the grid of a chosen row, and each chosen row with a grid must keep one."""
    if not wanted:
        return None
    rows = [r for r in suite.rows if r.grid and (not only or r.label in only)]
    known = {setting for r in rows for setting, _ in GRIDS[r.grid]}
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise UsageError(
            f"--tune-points {' '.join(map(shlex.quote, unknown))}: not a point of the chosen rows' grids; "
            "their points, quoted as --tune-points takes them: " + " ".join(map(shlex.quote, sorted(known)))
        )
    bare = [r.label for r in rows if not {s for s, _ in GRIDS[r.grid]} & set(wanted)]
    if bare:
        raise UsageError(
            f"--tune-points leaves no point for {', '.join(bare)}: add one of its grid's points, or "
            "leave the row out of --only"
        )
    return {r.label: set(wanted) for r in rows}


def stand_ins(later: list[Planned]) -> list[Planned]:
    """A dry run's later seeds, before any choice: each tuned row's first planned point and its
    averaging point stand in for the choice; rows without an outer step as they are."""
    firsts: dict[str, str] = {}
    for p in later:
        if p.row.tunes:
            firsts.setdefault(p.row.tunes, p.row.setting)
    return [p for p in later if not p.row.tunes or p.row.setting in (firsts[p.row.tunes], AVERAGING)]


def tuning_losses(runs: list[Run]) -> dict[int, float]:
    """{seed: final tuning loss} of a grid point's runs (runs without one left out)."""
    return {
        r.facts.get("seed", 0) if r.facts else 0: r.final_tuning_loss for r in runs if r.final_tuning_loss is not None
    }


def seed_of(run: Run) -> int:
    return run.facts.get("seed", 0) if run.facts else 0


def choose(
    label: str, points: dict[str, str], by_label: dict[str, list[Run]], tuning_seeds: set[int] | None = None
) -> Line | None:
    """The grid point of ``label`` with the lowest mean tuning loss: on the ``tuning_seeds`` only
    (whatever other seeds ran, as ``--tune-points`` may make them run every point), else over the
    seeds that every scored point ran; a point without a tuning loss is not chosen. With tuning
    seeds, the line reports the chosen point's other seeds (confirmation) and keeps the tuning
    seeds' runs apart."""
    scores = {p: tuning_losses(by_label.get(p, [])) for p in points}
    if tuning_seeds is not None:
        scores = {p: {s: v for s, v in got.items() if s in tuning_seeds} for p, got in scores.items()}
    scored = [p for p in points if scores[p]]
    if not scored:
        return None
    common = set.intersection(*(set(scores[p]) for p in scored))
    if not common:  # no seed every point ran: each point's own mean
        common = set().union(*(set(scores[p]) for p in scored))

    def mean(p: str) -> float | None:
        values = [scores[p][s] for s in common if s in scores[p]]
        return sum(values) / len(values) if values else None

    grid = {points[p]: mean(p) for p in points}
    best = min((p for p in scored if grid[points[p]] is not None), key=lambda p: grid[points[p]])
    runs = by_label[best]
    tuning = [r for r in runs if tuning_seeds is not None and seed_of(r) in tuning_seeds]
    confirming = [r for r in runs if r not in tuning]
    return Line(
        label,
        runs[0].method,
        confirming or tuning,
        setting=points[best],
        grid=grid,
        points={points[p]: by_label[p] for p in points if by_label.get(p)},
        tuning_runs=tuning if confirming else [],
    )


def best_nesterov(grid: dict[str, float | None]) -> str | None:
    """The grid's best point with momentum (lowest tuning loss, averaging left out)."""
    scored = [s for s, v in grid.items() if v is not None and s != AVERAGING]
    return min(scored, key=grid.get) if scored else None


def later_points(line: Line) -> set[str]:
    """What seeds after the tuning seed run of a tuned line: the chosen point and, on a grid with
    averaging, averaging and the best point with momentum (the literature's-order target needs both)."""
    points = {line.setting}
    if AVERAGING in line.grid:
        best = best_nesterov(line.grid)
        points |= {AVERAGING, *([best] if best else [])}
    return points


def note(found: list[Line], tuning_seeds: set[int] | None) -> str | None:
    """Which seeds a tuned row's outer step was chosen on and which its loss is of (None: nothing tuned)."""
    tuned = [line for line in found if line.setting]
    if not tuned:
        return None
    if tuning_seeds is None:
        return (
            "tuned rows: each outer step chosen by the mean tuning loss over all seeds, which the reported losses "
            "share their training noise with (every seed is a tuning seed: --tune-every-seed)"
        )
    seeds = ", ".join(map(str, sorted(tuning_seeds)))
    confirmed = [line.label for line in tuned if line.tuning_runs]
    chosen = f"tuned rows: each outer step chosen on seed {seeds}'s tuning batches"
    if len(confirmed) == len(tuned):
        return (
            f"{chosen}; their final loss, spread and seeds are the other seeds' (confirmation runs: no choice saw "
            f"them); seed {seeds}'s own loss is tuning_seed_loss in compare.json"
        )
    if not confirmed:
        return (
            f"{chosen}, and the final loss shown is of that same seed (no confirmation seed: the choice's luck is "
            "in it; --seeds 2 adds one)"
        )
    return (
        f"{chosen}; {', '.join(confirmed)} report their confirmation seeds (no choice saw them), the other tuned "
        f"rows seed {seeds}'s own loss (no confirmation run yet: the choice's luck is in it)"
    )
