"""The report's three plots: loss against steps, tokens and bytes sent (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from muloco.report.runs import Run, warn
from muloco.utils import optional

# ---------------------------------------------------------------------------- plots


def _validation_x(run: Run, axis: str) -> np.ndarray:
    """Validation steps mapped onto the x axis, through the train records' step -> tokens or
    the syncs' step -> bytes."""
    if axis == "steps":
        return run.val_steps
    if axis == "tokens":
        ok = ~np.isnan(run.train_tokens)
        return np.interp(run.val_steps, np.r_[0.0, run.train_steps[ok]], np.r_[0.0, run.train_tokens[ok]])
    return _bytes_at(run, run.val_steps)


def _bytes_at(run: Run, steps: np.ndarray) -> np.ndarray:
    return np.r_[0.0, run.sync_bytes][np.searchsorted(run.sync_steps, steps, side="right")]


def _train_xy(run: Run, axis: str) -> tuple[np.ndarray, np.ndarray]:
    """The train-loss line. Against bytes, which grow only at syncs, one point per sync (the
    train loss there), from the first sync on: before it nothing was sent, and a segment from
    "0 bytes" to the first sync would draw a slope that is not there."""
    if axis == "steps":
        return run.train_steps, run.train_loss
    if axis == "tokens":
        return run.train_tokens, run.train_loss
    if not len(run.train_steps):
        return np.zeros(0), np.zeros(0)
    at = run.sync_steps[run.sync_steps >= run.train_steps[0]]
    return _bytes_at(run, at), np.interp(at, run.train_steps, run.train_loss)


def _plot(runs: list[Run], axis: str, path: Path, note: str = "") -> None:
    """One figure: each run's train loss as a line and its validation of θ_g as dots, same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "steps": "inner steps (deadline rounds: the run's nominal steps)",
        "tokens": "tokens (all replica groups)",
        "bytes": "bytes sent per replica (cumulative)",
    }
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for i, run in enumerate(runs):
        color = f"C{i % 10}" if len(runs) <= 10 else plt.cm.tab20(i % 20)
        ax.plot(*_train_xy(run, axis), color=color, lw=1.2, label=f"{run.name} ({run.method}, {run.objective})")
        x = _validation_x(run, axis)
        sent = x > 0 if axis == "bytes" else np.ones(len(x), dtype=bool)  # a log axis has no 0: after the first sync
        ax.plot(x[sent], run.val_loss[sent], "o", color=color, ms=4)
    if note:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=9)
    if axis == "bytes":  # compressed and dense runs are decades apart: a log axis, from the first sync
        ax.set_xscale("log")
    ax.set_xlabel(labels[axis])
    ax.set_ylabel("loss (nats/token; mdlm: NELBO)")
    ax.set_title(f"loss vs {axis}: lines train loss, dots validation of θ_g", fontsize=10)
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def without_bytes(runs: list[Run]) -> list[Run]:
    """Runs that recorded no exchanged bytes (one replica group, or no sync yet)."""
    return [r for r in runs if not len(r.sync_steps)]


def write_plots(runs: list[Run], out_dir: Path | str) -> list[Path]:
    """loss_vs_steps.png, loss_vs_tokens.png and loss_vs_bytes.png (runs without byte counts
    left out of the last, with a warning) in ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        optional.require("matplotlib", "the report's plots")
    except optional.MissingExtra as err:  # the tables are the report; the plots an extra
        warn(f"no plots: {err}")
        return []
    paths = [out / "loss_vs_steps.png", out / "loss_vs_tokens.png", out / "loss_vs_bytes.png"]
    _plot(runs, "steps", paths[0])
    _plot(runs, "tokens", paths[1])
    skipped = without_bytes(runs)
    if skipped:
        warn(
            f"{paths[2].name}: left out {len(skipped)} run(s) without byte counts: "
            + ", ".join(r.name for r in skipped)
        )
    kept = [r for r in runs if r not in skipped]
    _plot(kept, "bytes", paths[2], note="" if kept else "no run recorded bytes sent (no outer syncs)")
    return paths


# ---------------------------------------------------------------------------- main
