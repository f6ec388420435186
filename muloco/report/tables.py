"""The report's table: runs ordered and marked, their cells formatted (``format_number``,
``format_duration``, ``format_bytes``, ``aligned``: also compare's), as text, markdown and JSON rows,
with the lines for runs in deadline rounds and groups that restarted or healed."""

from __future__ import annotations

import math
from typing import Any

from muloco.report.runs import Run
from muloco.runs.lives import describe as describe_lives
from muloco.utils.link_model import format_rate

# ---------------------------------------------------------------------------- the table


COLUMNS = (
    "",
    "run",
    "method",
    "obj",
    "val loss",
    "val bits/byte",
    "train loss",
    "steps",
    "tokens",
    "bits/param",
    "sent/replica",
    "sync",
    "wall",
)


def ordered(runs: list[Run], metric: str = "validation") -> list[Run]:
    """By method, objective, then final loss (runs without one last), then name."""
    return sorted(
        runs, key=lambda r: (r.method, r.objective, r.final_loss(metric) is None, r.final_loss(metric) or 0.0, r.name)
    )


def best(runs: list[Run], metric: str = "validation") -> set[int]:
    """ids of the lowest-loss run of each method and objective within each sweep (groups of
    two runs or more: a lone run is not "best" of anything)."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        if run.sweep is not None and run.final_loss(metric) is not None:
            groups.setdefault((run.sweep, run.method, run.objective), []).append(run)
    return {id(min(g, key=lambda r: r.final_loss(metric))) for g in groups.values() if len(g) > 1}


def format_number(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 100:
        return f"{seconds:.1f}s"
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


def format_bytes(n: float | None) -> str:
    """Decimal units, as the training logs print them (MB = 1e6 bytes)."""
    if n is None:
        return "-"
    unit, size = next(((u, size) for u, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= size), ("B", 1))
    return f"{n / size:.2f} {unit}"


def _cells(run: Run, marked: bool) -> list[str]:
    return [
        "*" if marked else "",
        run.name + ("" if run.complete else " (no summary)"),
        run.method,
        run.objective,
        format_number(run.final_validation_loss, ".4f"),
        format_number(run.final_validation_bits_per_byte, ".4f"),
        format_number(run.final_train_loss, ".4f"),
        format_number(run.steps, "d"),
        format_number(run.tokens, ",d"),
        format_number(run.bits_per_parameter, ".2f"),
        format_bytes(run.bytes_sent_per_replica),
        "-" if run.sync_share is None else f"{100 * run.sync_share:.1f}%" + _emulated(run),
        format_duration(run.wall_seconds) + _emulated(run),
    ]


def _emulated(run: Run) -> str:
    """What a time of a run over an emulated link (``--outer.link.mbps``) is marked with."""
    link = ((run.facts or {}).get("outer") or {}).get("link")
    return f" (emulated {format_rate(link['mbps'])} link)" if link else ""


def eval_columns(runs: list[Run]) -> list[str]:
    """One column per task and figure any run was evaluated on."""
    return sorted({name for run in runs for name in run.evaluations})


def _header(runs: list[Run]) -> list[str]:
    return [*COLUMNS, *eval_columns(runs)]


def _rows(runs: list[Run], metric: str) -> list[list[str]]:
    marks = best(runs, metric)
    extra = eval_columns(runs)
    return [
        _cells(run, id(run) in marks) + [format_number(run.evaluations.get(c), ".4f") for c in extra]
        for run in ordered(runs, metric)
    ]


def table(runs: list[Run], metric: str = "validation") -> str:
    """An aligned text table, one row per run (text left-aligned, numbers right-aligned), a
    column per downstream evaluation."""
    return aligned([_header(runs), *_rows(runs, metric)], left={0, 1, 2, 3})


def aligned(rows: list[list[str]], left: set[int]) -> str:
    """Rows of cells as text under a rule: columns in ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def rounds_lines(runs: list[Run]) -> list[str]:
    """One line per deadline-rounds run: its progress and each group's rounds, steps and tokens."""
    lines = []
    for run in runs:
        if run.rounds is None:
            continue
        groups = "; ".join(
            f"group {g['group']}: {g['steps']} steps in {g['rounds']} rounds "
            f"({g['min_steps']}-{g['max_steps']} per round), {g['tokens_per_rank']:,.0f} tokens per rank"
            for g in run.rounds["groups"]
        )
        lines.append(f"{run.name}: deadline rounds, {run.rounds['progress']:g} nominal steps; {groups}")
    return lines


def lives_lines(runs: list[Run]) -> list[str]:
    """One line per replica group that restarted or healed: what it did over its lives."""
    return [
        f"{run.name}: replica group {i} {describe_lives(t)}"
        for run in runs
        for i, t in enumerate(run.lives)
        if t is not None and (t["lives"] > 1 or t["heals"])
    ]


def markdown(runs: list[Run], metric: str = "validation") -> str:
    """The same table in Markdown."""
    header = _header(runs)
    rows = [header, ["---"] * len(header), *_rows(runs, metric)]
    return "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows)


def rows_json(runs: list[Run], metric: str = "validation") -> list[dict[str, Any]]:
    """The table's rows with unrounded numbers."""
    marks = best(runs, metric)
    keys = (
        "name",
        "method",
        "objective",
        "replicas",
        "complete",
        "final_validation_loss",
        "final_validation_bits_per_byte",
        "final_train_loss",
        "steps",
        "tokens",
        "bits_per_parameter",
        "bytes_sent_per_replica",
        "sync_share",
        "wall_seconds",
        "evaluations",
        "rounds",
        "lives",
    )
    return [
        {
            **{k: getattr(r, k) for k in keys},
            "folder": str(r.folder),
            "sweep": str(r.sweep) if r.sweep else None,
            "best": id(r) in marks,
            "facts": r.facts,
        }
        for r in ordered(runs, metric)
    ]
