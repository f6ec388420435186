"""Wall-clock to a target loss over emulated links: ``python -m muloco.compare ... --link 100mbps,1gbps``.

Each row with replica groups runs again once per link with ``--outer.link.mbps`` (its own
folder, ``..._link100mbps``; DDP rows have one group and no link), validating θ_g at every
sync so the time to a loss is read at the sync it was reached. The emulated link changes no
number of the training (the same steps, the same θ_g), only when each step happens.

Per run and link, from its folder (replica 0's ``metrics.jsonl`` and every replica's summary):

- **time to target**: seconds from the start of its first step to the first validation of θ_g
  at or below the target loss, less the time spent validating (each validation record carries
  the seconds validated so far); the target is the dense DiLoCo K=2 run's final loss *of the same
  seed*, or ``--target``, reached within a relative 1e-4 (GPU kernels are not bitwise
  reproducible); None when the run never reached it. A run that was interrupted and resumed
  (its log shows training start more than once, or steps logged again) is not timed: its clock
  would include the downtime and the redone steps; rerun it whole;
- **link share**: the emulated link's part of the sync time over the wall time (mean over the
  replica groups);
- the wall time of the whole run (its slowest replica group's).

Every figure here includes the emulated link's waits and is labelled so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muloco.report.tables import aligned, format_duration, format_number
from muloco.utils import optional
from muloco.utils.link_model import format_rate

DILOCO_REFERENCE = "DiLoCo K=2"
"""The row whose final loss is the target unless ``--target`` is given."""


REACHED_TOLERANCE = 1e-4
"""A validation within this relative distance above the target counts as reaching it."""


@dataclass
class Curve:
    """Validation of θ_g against training seconds since the first step began (validation left out)."""

    seconds: list[float]
    loss: list[float]
    resumed: bool = False
    """The run was interrupted and resumed: its seconds include the downtime (not timed)."""


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a live writer's half line
        if isinstance(record, dict):
            out.append(record)
    return out


def _first_replica(folder: Path) -> Path:
    replica = folder / "replica_0"
    return replica if replica.is_dir() else folder


def curve(folder: Path) -> Curve | None:
    """The run's validation losses against wall-clock seconds (None before its first step)."""
    records = _records(_first_replica(folder) / "metrics.jsonl")
    steps = [r for r in records if "loss" in r and "time" in r and "step_time_s" in r]
    if not steps:
        return None
    resumed = (
        sum(1 for r in records if r.get("session_start")) > 1  # training (re)started more than once
        or any(b["step"] <= a["step"] for a, b in zip(steps, steps[1:]))
    )  # steps logged again
    first = steps[0]
    start = first["time"] - first["step_time_s"] * first["step"]  # log lines carry the mean step time since the last
    points = [
        (
            r["time"] - start - float(r.get("validation_seconds_total", 0.0)),
            float(r.get("validation_nelbo", r.get("validation_loss"))),
        )
        for r in records
        if ("validation_loss" in r or "validation_nelbo" in r) and "time" in r
    ]
    points.sort()
    return Curve([p[0] for p in points], [p[1] for p in points], resumed)


def time_to(c: Curve | None, target: float) -> float | None:
    """Seconds to the first validation at or below ``target`` (None: never, or a resumed run)."""
    if c is None or c.resumed:
        return None
    limit = target + REACHED_TOLERANCE * abs(target)
    return next((s for s, loss in zip(c.seconds, c.loss) if loss <= limit), None)


def link_share(folder: Path) -> tuple[float | None, float | None]:
    """(share of the wall time spent held by the emulated link, the mean over the replica groups;
    the run's wall seconds, its slowest group's: the run lasts until its last group ends, and a
    group that started first and waited for the others has the longest clock)."""
    shares, walls = [], []
    for path in sorted(folder.glob("replica_*/summary.json")) or [folder / "summary.json"]:
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        wall = summary.get("wall_seconds")
        link = (summary.get("diloco") or {}).get("sync_seconds_by_part", {}).get("link")
        if wall:
            walls.append(float(wall))
            if link is not None:
                shares.append(float(link) / float(wall))
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return mean(shares), max(walls, default=None)


@dataclass
class Timed:
    label: str
    mbps: float
    seed: int
    folder: Path

    def row(self, target: float) -> dict[str, Any]:
        c = curve(self.folder)
        share, wall = link_share(self.folder)
        return {
            "run": self.label,
            "link_mbps": self.mbps,
            "seed": self.seed,
            "target": target,
            "time_to_target_s": time_to(c, target),
            "resumed": bool(c and c.resumed),
            "link_share": share,
            "wall_seconds": wall,
            "final_loss": c.loss[-1] if c and c.loss else None,
        }


def mean_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (run, link): seeds averaged (time to target only if every seed reached it)."""
    grouped: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault((r["run"], r["link_mbps"]), []).append(r)
    out = []
    for (run, mbps), group in grouped.items():

        def mean(key, group=group):
            values = [g[key] for g in group]
            return None if any(v is None for v in values) else sum(values) / len(values)

        out.append(
            {
                "run": run,
                "link_mbps": mbps,
                "seeds": len(group),
                "time_to_target_s": mean("time_to_target_s"),
                "resumed": any(g["resumed"] for g in group),
                "link_share": mean("link_share"),
                "wall_seconds": mean("wall_seconds"),
                "final_loss": mean("final_loss"),
            }
        )
    return out


def text(rows: list[dict[str, Any]], target: float, source: str) -> str:
    cells = [["link (emulated)", "run", "time to target", "link share", "wall", "final loss", "seeds"]]
    for r in sorted(rows, key=lambda r: r["link_mbps"]):
        reached = r["time_to_target_s"]
        cells.append(
            [
                format_rate(r["link_mbps"]),
                r["run"],
                "resumed: not timed"
                if r["resumed"]
                else "not reached"
                if reached is None
                else format_duration(reached),
                format_number(None if r["link_share"] is None else 100 * r["link_share"], ".1f") + "%",
                format_duration(r["wall_seconds"]),
                format_number(r["final_loss"], ".4f"),
                str(r["seeds"]),
            ]
        )
    head = (
        f"wall-clock to loss {target:.4f} ({source}) over emulated links (every time includes the emulated "
        "link's waits; time to target: training time to the first validation of θ_g at or below it, "
        "validation left out)"
    )
    return head + "\n" + aligned(cells, left={0, 1})


def orderings(rows: list[dict[str, Any]]) -> list[str]:
    """Per link, the runs from fastest to target (those that never reached it last)."""
    out = []
    for mbps in sorted({r["link_mbps"] for r in rows}):
        at = [r for r in rows if r["link_mbps"] == mbps]
        at.sort(key=lambda r: (r["time_to_target_s"] is None, r["time_to_target_s"] or 0.0))
        out.append(
            f"  {format_rate(mbps)}: "
            + " < ".join(r["run"] + ("" if r["time_to_target_s"] is not None else " (not reached)") for r in at)
        )
    return out


def plot(timed: list[Timed], folder: Path, target: float) -> list[Path]:
    """loss_vs_wallclock_<link>.png: validation of θ_g against training seconds, one curve per row
    (seed 0); ``target`` (seed 0's) as a dashed line; none without the plots extra."""
    if not optional.installed("matplotlib"):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for mbps in sorted({t.mbps for t in timed}):
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        for i, t in enumerate(x for x in timed if x.mbps == mbps and x.seed == 0):
            c = curve(t.folder)
            if c:
                ax.plot(c.seconds, c.loss, "o-", color=f"C{i % 10}", ms=3, lw=1.2, label=t.label)
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.4f}")
        ax.set_xlabel("wall-clock seconds since the first step (emulated link included, validation left out)")
        ax.set_ylabel("validation loss of θ_g (mdlm: NELBO)")
        ax.set_title(f"loss vs wall-clock over an emulated {format_rate(mbps)} link", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"loss_vs_wallclock_{format_rate(mbps).replace(' ', '').lower()}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
