"""The comparison table: one line per row of the suite, its seeds averaged, and the targets.

Numbers come from ``muloco.report``'s reading of each run folder (summaries, metrics and the
facts in ``run.json``), never from the suite's own bookkeeping: final validation loss of θ_g
(the NELBO for ``mdlm``) and its bits per byte of the held-out text (``ar`` and ``mdlm`` suites
compare on it), bits per parameter and bytes sent per replica, syncs, wall time.
The table says how it was made (:func:`setup`: steps, H, warmup, seeds, and with ``--tune`` each
grid point's tuning loss) and what each gap is against (:func:`reference_note`).

Gaps are in percent of the row's reference (dense MuLoCo at K=2 with the same outer step:
Nesterov for the dense rows, plain SGD at lr 1 for the compressed ones, whose error feedback is
their momentum) and of the DDP run with the same inner optimizer (AdamW for DDP AdamW and DiLoCo, Muon for the rest);
the seed spread is the
largest minus the smallest final loss over the seeds.

With ``--tune`` each row with an outer step ran at every point of its grid; the table shows,
per row, the point with the lowest mean *tuning* loss (θ_g on held-out batches apart from the
reported ones) and its reported validation loss, with the chosen setting beside it. Gaps are
then measured against the best tuned dense K=2 row (the same tokens), and a target whose
margin is inside the seed spread is a tie, not met or missed. A target that compares a loss of
one seed has no spread: a margin within ``SINGLE_SEED_MARGIN`` of the compared loss is a tie, and
the target is marked ``[1 seed]``.
"""

from __future__ import annotations

from typing import Any

from muloco.compare import tuning
from muloco.compare.line import Line
from muloco.compare.suites import AVERAGING, DENSE_SGD, SPARSELOCO_PUBLISHED, Planned, Suite, nesterov_label
from muloco.report.runs import ReportError, Run, load_run
from muloco.report.tables import aligned, format_bytes, format_duration, format_number

COLUMNS = (
    "run",
    "method",
    "outer step",
    "final loss",
    "bits/byte",
    "vs dense %",
    "vs DDP %",
    "bits/param",
    "sent/replica",
    "syncs",
    "wall",
    "seeds",
    "spread",
)
BEST_DENSE = "best tuned dense K=2"
ONE_SEED = " [1 seed]"
"""Appended to a target whose verdict rests on a loss of one seed."""
SINGLE_SEED_MARGIN = 0.01
"""With one seed, a target's margin within this share of the compared loss is a tie: the seed
spreads measured on the CPU suites (0.002–0.03 on losses near 5, docs/compression.md) reach ~0.6%."""


def lines(suite: Suite, planned: list[Planned], suite_dir, tuning_seeds: set[int] | None = None) -> list[Line]:
    """Each row that has at least one finished or partial run, in the suite's order; a tuned
    row as its grid point with the lowest mean tuning loss: of the ``tuning_seeds`` only (then its
    reported runs are the other seeds'), or over the seeds every point ran (None: each seed tuned)."""
    by_label: dict[str, list[Run]] = {}
    points: dict[str, dict[str, str]] = {}  # tuned row -> {grid point label: setting}
    for p in planned:
        if p.row.tunes:
            points.setdefault(p.row.tunes, {})[p.row.label] = p.row.setting
        folder = suite_dir / p.name
        if folder.is_dir():
            try:
                run = load_run(folder)
            except ReportError:  # a run that never logged: nothing to show
                continue
            if run.folder not in {r.folder for r in by_label.get(p.row.label, [])}:  # a run planned twice: once
                by_label.setdefault(p.row.label, []).append(run)
    out = []
    for row in suite.rows:
        if row.label in points:
            line = tuning.choose(row.label, points[row.label], by_label, tuning_seeds)
            if line is not None:
                out.append(line)
        elif by_label.get(row.label):
            out.append(Line(row.label, by_label[row.label][0].method, by_label[row.label]))
    return out


def _gap(loss: float | None, base: float | None) -> float | None:
    return None if loss is None or not base else 100.0 * (loss - base) / base


def _ddp_for(line: Line, found: dict[str, Line]) -> Line | None:
    inner = (line.runs[0].facts or {}).get("inner_optimizer", {}).get("name", "")
    return found.get("DDP Muon" if str(inner).lower() == "muon" else "DDP AdamW")


def _best_dense(suite: Suite, found: list[Line]) -> Line | None:
    """The tuned dense K=2 row with the lowest tuning loss (chosen like the grid points, never by
    the reported loss): every tuned row's reference (the same tokens)."""
    dense = {row.label for row in suite.rows if row.grid == "nesterov" and row.replicas == 2}
    tuned = [line for line in found if line.setting and line.label in dense and line.loss is not None]
    return min(tuned, key=lambda line: line.grid[line.setting]) if tuned else None


def rows(suite: Suite, found: list[Line]) -> list[dict[str, Any]]:
    """The table's values per line (None where unknown)."""
    by_label = {line.label: line for line in found}
    references = {row.label: row.reference for row in suite.rows}
    best = _best_dense(suite, found)
    out = []
    for line in found:
        ddp = _ddp_for(line, by_label)
        name = f"{BEST_DENSE} ({best.label})" if line.setting and best else references[line.label]
        reference = best if line.setting and best else by_label.get(references[line.label])
        out.append(
            {
                "run": line.label,
                "method": line.method,
                "outer_step": line.setting,
                "tuning_grid": line.grid,
                "grid_loss": {s: Line(line.label, line.method, runs).loss for s, runs in line.points.items()},
                "grid_spread": {s: Line(line.label, line.method, runs).spread for s, runs in line.points.items()},
                "final_loss": line.loss,
                "bits_per_byte": line.mean("final_validation_bits_per_byte"),
                "reference": name,
                "reference_loss": reference.loss if reference else None,
                "reference_spread": reference.spread if reference else None,
                "gap_to_reference_pct": _gap(line.loss, reference.loss if reference else None),
                "gap_to_ddp_pct": _gap(line.loss, ddp.loss if ddp else None),
                "bits_per_parameter": line.mean("bits_per_parameter"),
                "bytes_sent_per_replica": line.mean("bytes_sent_per_replica"),
                "syncs": line.syncs,
                "wall_seconds": line.mean("wall_seconds"),
                "seeds": len(line.runs),
                "spread": line.spread,
                "tuning_seed_loss": Line(line.label, line.method, line.tuning_runs).loss if line.tuning_runs else None,
                "complete": all(r.complete for r in line.runs),
            }
        )
    return out


def text(table_rows: list[dict[str, Any]]) -> str:
    """The table as aligned text, laid out as ``muloco.report``'s (a row still running or failed
    is marked ``(partial)``)."""
    cells = [list(COLUMNS)]
    for r in table_rows:
        cells.append(
            [
                r["run"] + ("" if r["complete"] else " (partial)"),
                r["method"],
                r["outer_step"] or "as configured",
                format_number(r["final_loss"], ".4f"),
                format_number(r["bits_per_byte"], ".4f"),
                format_number(r["gap_to_reference_pct"], "+.2f"),
                format_number(r["gap_to_ddp_pct"], "+.2f"),
                format_number(r["bits_per_parameter"], ".3f"),
                format_bytes(r["bytes_sent_per_replica"]),
                format_number(r["syncs"], ".0f"),
                format_duration(r["wall_seconds"]),
                str(r["seeds"]),
                format_number(r["spread"], ".4f"),
            ]
        )
    return aligned(cells, left={0, 1, 2})


Verdict = bool | str | None
"""True met, False missed, "tie" (the margin is inside the seed spread), None not measured."""


def _verdict(diff: float, spread: float) -> Verdict:
    """``diff`` ≤ 0 is met; a ``diff`` within ``spread`` of 0 either way is a tie."""
    if spread > 0 and abs(diff) <= spread:
        return "tie"
    return diff <= 0


def targets(suite: Suite, table_rows: list[dict[str, Any]]) -> list[tuple[str, Verdict]]:
    """The issue's targets, each met, missed, tied inside the seed spread, or not measurable here
    (none for an experiment suite)."""
    if not suite.targets:
        return []
    by_run = {r["run"]: r for r in table_rows}
    on_one_seed = [False]  # whether the target being judged compares a loss of one seed

    def one_seed(r) -> bool:
        """A row (dict) of one seed, or a reference's spread (None: it ran one seed)."""
        return r.get("seeds", 0) <= 1 and not r.get("spread") if isinstance(r, dict) else r is None

    def spread(*runs) -> float:
        measured = max((r.get("spread") or 0.0) if isinstance(r, dict) else (r or 0.0) for r in runs)
        if not any(one_seed(r) for r in runs):
            return measured
        on_one_seed[0] = True
        losses = [r["final_loss"] for r in runs if isinstance(r, dict) and r.get("final_loss") is not None]
        return max(measured, SINGLE_SEED_MARGIN * max(losses, default=0.0))

    def le(a, b) -> Verdict:
        ra, rb = by_run.get(a), by_run.get(b)
        if not ra or not rb or ra["final_loss"] is None or rb["final_loss"] is None:
            return None
        return _verdict(ra["final_loss"] - rb["final_loss"], spread(ra, rb))

    def within(a, pct) -> Verdict:
        ra = by_run.get(a)
        if not ra or ra["final_loss"] is None or ra.get("reference_loss") is None:
            return None
        allowed = ra["reference_loss"] * (1 + pct / 100)
        return _verdict(ra["final_loss"] - allowed, spread(ra, ra.get("reference_spread")))

    def sparse_target(label) -> Verdict:
        row = by_run.get(label)
        if not row or row["bits_per_parameter"] is None:
            return None
        return le(label, "DiLoCo K=2") if row["bits_per_parameter"] <= 0.3 else False

    def nesterov_vs_averaging() -> Verdict:
        """Tuned: the grid's best point with momentum against its averaging point (reported losses,
        both seeds); as configured: the row against the averaging row."""
        row = by_run.get("MuLoCo K=2")
        if not row or not row.get("outer_step"):
            return le("MuLoCo K=2", DENSE_SGD)
        grid = {s: v for s, v in row["tuning_grid"].items() if v is not None and s != AVERAGING}
        losses, spreads = row.get("grid_loss", {}), row.get("grid_spread", {})
        best = min(grid, key=grid.get) if grid else None
        if best is None or losses.get(best) is None or losses.get(AVERAGING) is None:
            return None
        margin = max(spreads.get(best) or 0.0, spreads.get(AVERAGING) or 0.0)
        if spreads.get(best) is None or spreads.get(AVERAGING) is None:  # a point of one seed
            on_one_seed[0] = True
            margin = max(margin, SINGLE_SEED_MARGIN * losses[AVERAGING])
        return _verdict(losses[best] - losses[AVERAGING], margin)

    def judged(what: str, judge) -> tuple[str, Verdict]:
        """(what, verdict), ``what`` marked when the verdict rests on a loss of one seed."""
        on_one_seed[0] = False
        verdict = judge()
        return (what + (ONE_SEED if on_one_seed[0] and verdict is not None else ""), verdict)

    order = {True: 3, "tie": 2, False: 1, None: 0}
    found = [
        judged("the best dense Nesterov step within its spread of averaging, or better", nesterov_vs_averaging),
        judged("MuLoCo <= DiLoCo at K=2", lambda: le("MuLoCo K=2", "DiLoCo K=2")),
        judged("MuLoCo <= DiLoCo at K=4", lambda: le("MuLoCo K=4", "DiLoCo K=4")),
        judged("MuLoCo 2-bit EF within +1% of dense", lambda: within("MuLoCo 2-bit EF", 1.0)),
        judged("MuLoCo top-k 10% EF within +3%", lambda: within("MuLoCo top-k 10% EF", 3.0)),
        judged(
            "SparseLoCo (ours or as published) at <= 0.3 bits/param no worse than DiLoCo K=2",
            lambda: max((sparse_target("SparseLoCo"), sparse_target(SPARSELOCO_PUBLISHED)), key=order.get),
        ),
        judged("DDP Muon <= DDP AdamW", lambda: le("DDP Muon", "DDP AdamW")),
    ]
    for row in suite.rows:
        if row.ef_twin:
            found.append(
                judged(f"{row.ef_twin} better than its no-EF twin", lambda row=row: le(row.ef_twin, row.label))
            )
    return found


def targets_text(checks: list[tuple[str, Verdict]]) -> str:
    """One line per target; a footnote when a verdict rests on a loss of one seed."""
    word = {True: "met", False: "MISSED", None: "not measured", "tie": "tie"}
    lines = [f"  {word[ok]:<12} {what}" for what, ok in checks]
    if any(what.endswith(ONE_SEED) for what, _ in checks):
        lines.append(
            f"  {ONE_SEED.strip()}: a loss of one seed has no spread to judge by; a margin within "
            f"{100 * SINGLE_SEED_MARGIN:g}% of the loss is a tie (--seeds 2 or more for verdicts)"
        )
    return "\n".join(lines)


def describe_outer(row: dict[str, Any], runs: list[Run] | None = None) -> str:
    """The outer step a row ran with: the tuned setting, or the configured one from its facts."""
    if row.get("outer_step"):
        return row["outer_step"]
    outer = ((runs[0].facts or {}).get("outer") or {}) if runs else {}
    opt = outer.get("optimizer") or {}
    if not opt:
        return "no outer step (DDP)" if runs else "as configured"
    if str(opt.get("name")).lower() == "none":
        return "averaging (no outer optimizer)"
    if str(opt.get("name")).lower() == "nesterov":  # named as the tuning grid names its points
        return nesterov_label(float(opt.get("lr", 0)), float(opt.get("momentum", 0)))
    name = {"sgd": "SGD"}.get(str(opt.get("name")).lower(), str(opt.get("name")))
    momentum = f" μ{opt['momentum']:g}" if opt.get("momentum") else ""
    return f"{name} η{opt.get('lr', 0):g}{momentum}"


def reference_note(table_rows: list[dict[str, Any]], found: list[Line]) -> str:
    """What the "vs dense %" gaps are against, row by row where they differ, with the outer step."""
    runs = {line.label: line.runs for line in found}
    by_run = {r["run"]: r for r in table_rows}
    against: dict[str, list[str]] = {}
    for r in table_rows:
        ref = r.get("reference")
        if not ref or r["gap_to_reference_pct"] is None:
            continue
        base = ref.split(" (")[-1].rstrip(")") if ref.startswith(BEST_DENSE) else ref
        step = describe_outer(by_run[base], runs.get(base)) if base in by_run else "?"
        against.setdefault(f"{ref}, outer step {step}", []).append(r["run"])
    if not against:
        return "gaps: no reference row in this table"
    parts = [f"{', '.join(rows)} against {ref}" for ref, rows in against.items()]
    return "gaps (vs dense %): " + "; ".join(parts)


def setup(
    planned: list, suite: Suite, *, objective: str, data: str, tuning_seeds: set[int] | None, tuned: bool
) -> dict[str, Any]:
    """How the table was made, from the runs' resolved configs: steps, H, warmup and seeds (each as
    the set of values its runs used), what the suite and data were."""

    def values(attr: str) -> list:
        return sorted({getattr(p, attr) for p in planned if getattr(p, attr) is not None})

    return {
        "suite": suite.name,
        "objective": objective,
        "data": data,
        "steps": values("steps"),
        "H": values("sync_every"),
        "warmup": values("warmup"),
        "seeds": values("seed"),
        "local_batch": values("local_batch"),
        "tuned": tuned,
        "tuning_seeds": sorted(tuning_seeds) if tuned and tuning_seeds is not None else None,
    }


def setup_text(facts: dict[str, Any]) -> str:
    """The setup in one line: ``suite paper-mini (ar on stdlib): 300 steps, H 30, warmup 30, seeds 0-1``."""

    def show(v: list) -> str:
        return "/".join(map(str, v)) if v else "-"

    seeds = facts["seeds"]
    seeds_text = (f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}") if seeds else "no seeds"
    tuned = ""
    if facts["tuned"]:
        tuned = (
            f"; outer steps tuned on seed {show(facts['tuning_seeds'])}"
            if facts["tuning_seeds"] is not None
            else "; outer steps tuned on every seed"
        )
    return (
        f"suite {facts['suite']} ({facts['objective']} on {facts['data']}): {show(facts['steps'])} steps, "
        f"H {show(facts['H'])}, warmup {show(facts['warmup'])}, local batch {show(facts['local_batch'])}, "
        f"{seeds_text}{tuned}"
    )


def grid_text(table_rows: list[dict[str, Any]]) -> str | None:
    """Each tuned row's grid: every point's mean tuning loss, the chosen one marked (None: no tuning)."""
    cells = [["run", "grid point", "tuning loss", ""]]
    for r in table_rows:
        grid = r.get("tuning_grid") or {}
        for point, loss in grid.items():
            mark = (
                ("chosen" if len(grid) > 1 else "the only point: nothing was chosen")
                if point == r["outer_step"]
                else ""
            )
            cells.append([r["run"], point, format_number(loss, ".4f"), mark])
    return aligned(cells, left={0, 1, 3}) if len(cells) > 1 else None
