"""The comparison table: one line per row of the suite, its seeds averaged, and the targets.

Numbers come from ``muloco.report``'s reading of each run folder (summaries, metrics and the
facts in ``run.json``), never from the suite's own bookkeeping: final validation loss of θ_g
(the NELBO for ``mdlm``) and its bits per byte of the held-out text (``ar`` and ``mdlm`` suites
compare on it), bits per parameter and bytes sent per replica, syncs, wall time.
Gaps are in percent of the row's reference (dense MuLoCo at K=2 with the same outer step:
Nesterov for the dense rows, plain SGD at lr 1 for the compressed ones, whose error feedback is
their momentum) and of the DDP run with the same inner optimizer (AdamW for DDP AdamW and DiLoCo, Muon for the rest); the seed spread is the
largest minus the smallest final loss over the seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from muloco.compare.suites import Planned, Suite
from muloco.report import ReportError, Run, aligned, format_bytes, format_duration, format_number, load_run

COLUMNS = ("run", "method", "final loss", "bits/byte", "vs dense %", "vs DDP %", "bits/param", "sent/replica",
           "syncs", "wall", "seeds", "spread")


@dataclass
class Line:
    label: str
    method: str
    runs: list[Run]

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


def lines(suite: Suite, planned: list[Planned], suite_dir) -> list[Line]:
    """Each row that has at least one finished or partial run, in the suite's order."""
    by_label: dict[str, list[Run]] = {}
    for p in planned:
        folder = suite_dir / p.name
        if folder.is_dir():
            try:
                by_label.setdefault(p.row.label, []).append(load_run(folder))
            except ReportError:  # a run that never logged: nothing to show
                continue
    return [Line(row.label, by_label[row.label][0].method, by_label[row.label])
            for row in suite.rows if by_label.get(row.label)]


def _gap(loss: float | None, base: float | None) -> float | None:
    return None if loss is None or not base else 100.0 * (loss - base) / base


def _ddp_for(line: Line, found: dict[str, Line]) -> Line | None:
    inner = (line.runs[0].facts or {}).get("inner_optimizer", {}).get("name", "")
    return found.get("DDP Muon" if str(inner).lower() == "muon" else "DDP AdamW")


def rows(suite: Suite, found: list[Line]) -> list[dict[str, Any]]:
    """The table's values per line (None where unknown)."""
    by_label = {line.label: line for line in found}
    references = {row.label: row.reference for row in suite.rows}
    out = []
    for line in found:
        ddp = _ddp_for(line, by_label)
        reference = by_label.get(references[line.label])
        out.append({
            "run": line.label, "method": line.method, "final_loss": line.loss,
            "bits_per_byte": line.mean("final_validation_bits_per_byte"),
            "reference": references[line.label],
            "gap_to_reference_pct": _gap(line.loss, reference.loss if reference else None),
            "gap_to_ddp_pct": _gap(line.loss, ddp.loss if ddp else None),
            "bits_per_parameter": line.mean("bits_per_parameter"),
            "bytes_sent_per_replica": line.mean("bytes_sent_per_replica"), "syncs": line.syncs,
            "wall_seconds": line.mean("wall_seconds"), "seeds": len(line.runs), "spread": line.spread,
            "complete": all(r.complete for r in line.runs),
        })
    return out


def text(table_rows: list[dict[str, Any]]) -> str:
    """The table as aligned text, laid out as ``muloco.report``'s (a row still running or failed
    is marked ``(partial)``)."""
    cells = [list(COLUMNS)]
    for r in table_rows:
        cells.append([r["run"] + ("" if r["complete"] else " (partial)"), r["method"],
                      format_number(r["final_loss"], ".4f"), format_number(r["bits_per_byte"], ".4f"),
                      format_number(r["gap_to_reference_pct"], "+.2f"),
                      format_number(r["gap_to_ddp_pct"], "+.2f"), format_number(r["bits_per_parameter"], ".3f"),
                      format_bytes(r["bytes_sent_per_replica"]), format_number(r["syncs"], ".0f"),
                      format_duration(r["wall_seconds"]), str(r["seeds"]), format_number(r["spread"], ".4f")])
    return aligned(cells, left={0, 1})


def targets(suite: Suite, table_rows: list[dict[str, Any]]) -> list[tuple[str, bool | None]]:
    """The issue's targets, each met (True), missed (False) or not measurable here (None)."""
    loss = {r["run"]: r["final_loss"] for r in table_rows}
    gap = {r["run"]: r["gap_to_reference_pct"] for r in table_rows}
    bits = {r["run"]: r["bits_per_parameter"] for r in table_rows}

    def le(a, b):
        return None if loss.get(a) is None or loss.get(b) is None else loss[a] <= loss[b]

    def within(a, pct):
        return None if gap.get(a) is None else gap[a] <= pct

    def both(*checks):
        return None if any(c is None for c in checks) else all(checks)

    found = [
        ("MuLoCo <= DiLoCo at K=2", le("MuLoCo K=2", "DiLoCo K=2")),
        ("MuLoCo <= DiLoCo at K=4", le("MuLoCo K=4", "DiLoCo K=4")),
        ("MuLoCo 2-bit EF within +1% of dense", within("MuLoCo 2-bit EF", 1.0)),
        ("MuLoCo top-k 10% EF within +3%", within("MuLoCo top-k 10% EF", 3.0)),
        ("SparseLoCo at <= 0.3 bits/param and within +2%",
         both(None if bits.get("SparseLoCo") is None else bits["SparseLoCo"] <= 0.3, within("SparseLoCo", 2.0))),
        ("DDP Muon <= DDP AdamW", le("DDP Muon", "DDP AdamW")),
    ]
    for row in suite.rows:
        if row.ef_twin:
            found.append((f"{row.ef_twin} better than its no-EF twin", None if loss.get(row.label) is None
                          or loss.get(row.ef_twin) is None else loss[row.ef_twin] < loss[row.label]))
    return found


def targets_text(checks: list[tuple[str, bool | None]]) -> str:
    word = {True: "met", False: "MISSED", None: "not measured"}
    return "\n".join(f"  {word[ok]:<12} {what}" for what, ok in checks)
