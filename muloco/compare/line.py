"""One line of the comparison table: a row of the suite, its runs (its seeds), and with ``--tune``
the grid point chosen for it (``tuning.py``) and every point's tuning loss."""

from __future__ import annotations

from dataclasses import dataclass, field

from muloco.report.runs import Run


@dataclass
class Line:
    label: str
    method: str
    runs: list[Run]
    setting: str = ""
    """The outer step chosen by ``--tune`` (empty: the row as configured)."""
    grid: dict[str, float | None] = field(default_factory=dict)
    """``--tune``: each grid point's mean tuning loss (None: not scored)."""
    points: dict[str, list[Run]] = field(default_factory=dict)
    """``--tune``: each grid point's runs (every seed it ran)."""
    tuning_runs: list[Run] = field(default_factory=list)
    """``--tune`` on a tuning seed: the chosen point's runs on it, kept apart from ``runs`` (the
    confirmation seeds, whose losses no choice saw) when there are any."""

    @property
    def loss(self) -> float | None:
        values = [r.final_validation_loss for r in self.runs if r.final_validation_loss is not None]
        return sum(values) / len(values) if values else None

    @property
    def spread(self) -> float | None:
        values = [r.final_validation_loss for r in self.runs if r.final_validation_loss is not None]
        return max(values) - min(values) if len(values) > 1 else None

    def mean(self, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]
        return sum(values) / len(values) if values else None

    @property
    def syncs(self) -> float | None:
        counts = [len(r.sync_steps) for r in self.runs if r.facts and r.facts.get("outer")]
        return sum(counts) / len(counts) if counts else None
