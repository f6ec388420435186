"""Results reader: one table and three plots for run folders and sweeps.

Usage::

    python -m muloco.report RUN_OR_SWEEP_DIR... [--out DIR] [--metric validation|train]

A *run folder* holds ``summary.json`` or ``metrics.jsonl`` (what ``muloco.train`` writes to
``--dump_folder``). A DiLoCo job's dump folder holds one such folder per replica group,
``replica_<i>/``; it is read as one run (validation of θ_g from any replica, they agree; train
loss the mean over replicas; tokens the sum; bytes per replica the mean). A *sweep folder* is any
folder with run folders somewhere below it. A sweep may carry a ``manifest.jsonl``, one JSON
object per line with at least ``name`` (and ``overrides``; ``muloco.launch.sweeps`` writes one);
a line names the run found in its ``run_dir``/``dump_folder``/``folder``/``path`` key, in the
``--dump_folder`` of its overrides, or in the sub-folder called ``name``.

For every run the table shows its method and objective as the run recorded them in the facts
of its ``run.json`` (``muloco.runs.facts``: from the resolved config, never from a file or folder
name; a run without facts shows ``?`` and a warning naming what is unknown), the final
validation loss of θ_g (the NELBO for ``mdlm``) and its bits per byte of the held-out text (the
one figure that compares ``ar`` with ``mdlm`` runs and runs with different tokenizers), the
final train loss, steps, tokens (all replica
groups together; a DiLoCo group's over every process it ran as, from its ``lives.json``, since a
heal hands a group its peer's counter), bits per parameter and bytes sent per replica (DiLoCo only), the share of wall
time spent in syncs and the wall time; ``-`` where the run did not record the value (a run still
going has no summary: no sync share, no wall time). Rows are sorted by method, objective, then
final loss; within a sweep the lowest final loss of each method (with at least two runs) is
marked ``*``. ``--metric train`` ranks by the final train loss instead.

A run in deadline rounds (``--outer.round deadline``: its groups train different numbers of steps
per round) gets one more line under the table: its progress in nominal steps and each group's
committed rounds, inner steps (in all, and the fewest and most in a round) and tokens, from the
groups' sync records (``rounds`` in ``report.json``). Its curves are drawn against that progress,
where every group's step means the same place in the run, instead of against a group's own step.

A replica group that restarted or healed gets a line too: its lives (each restart, and how the
life before it ended), the syncs it took part in and those its Δ is in, and the steps and tokens it
trained and those in committed syncs (``muloco/runs/lives.py``; ``lives`` in ``report.json``).

Writes ``loss_vs_steps.png``, ``loss_vs_tokens.png``, ``loss_vs_bytes.png`` (train loss as lines,
validation as dots, one colour per run), ``report.md`` and ``report.json`` into ``--out``
(default ``<first path>/report/``), and nothing else. Bad input is exit status 2 with one line
naming the path: a path that does not exist, a folder without runs, a malformed line in a
summary, metrics or manifest file. The last line of a ``metrics.jsonl`` that does not parse is a
live run's partial write: it is skipped with a warning.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from muloco.report.plots import without_bytes, write_plots
from muloco.report.runs import METRICS, ReportError, Run, find_runs
from muloco.report.tables import lives_lines, markdown, rounds_lines, rows_json, table
from muloco.utils.command_line import UsageError, failed, parse, run_main, tyro

REPORT_FILES = ("loss_vs_steps.png", "loss_vs_tokens.png", "loss_vs_bytes.png", "report.md", "report.json")
"""What the report writes into its folder, and nothing else."""


def _write_text(runs: list[Run], out: Path, metric: str) -> list[Path]:
    """report.md (the table, which plot left out what) and report.json (the rows)."""
    skipped = without_bytes(runs)
    note = (
        f"\n\n`loss_vs_bytes.png` leaves out runs without byte counts: {', '.join(r.name for r in skipped)}."
        if skipped
        else ""
    )
    plots = "\n".join(f"![{name}]({name})" for name in REPORT_FILES[:3])
    rounds = "".join(f"\n- {line}" for line in rounds_lines(runs))
    rounds = f"\n\nReplica groups in deadline rounds:\n{rounds}" if rounds else ""
    lives = "".join(f"\n- {line}" for line in lives_lines(runs))
    rounds += f"\n\nReplica groups that restarted or healed:\n{lives}" if lives else ""
    md = (
        f"# Runs\n\nFinal loss: {metric} (`*`: lowest of its method within a sweep).\n\n"
        f"{markdown(runs, metric)}{note}{rounds}\n\n{plots}\n"
    )
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(json.dumps({"metric": metric, "rows": rows_json(runs, metric)}, indent=2) + "\n")
    return [out / "report.md", out / "report.json"]


PROG = "python -m muloco.report"


@dataclass
class ReportOptions:
    """Results reader: one table and three plots for run folders and sweeps."""

    paths: tyro.conf.Positional[
        Annotated[tuple[Path, ...], tyro.conf.arg(metavar="RUN_OR_SWEEP_DIR...", help_behavior_hint="(required)")]
    ]
    """Run folders and sweep folders, one or more."""
    out: Path | None = None
    """Report folder (default: <first path>/report/)."""
    metric: Literal[METRICS] = "validation"
    """Final loss that ranks runs and marks the best: validation of θ_g or train."""


def parse_args(argv: list[str]) -> ReportOptions:
    """The options, or a UsageError (a misspelt option, no folder)."""
    args, _ = parse(ReportOptions, argv, prog=PROG, description=__doc__.split("\n\n")[0], overrides=False)
    if not args.paths:  # tyro lets a positional sequence be empty
        raise UsageError(f"give one or more run or sweep folders: {PROG} RUN_OR_SWEEP_DIR... (see --help)")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        return failed("report", err)
    out = args.out or args.paths[0] / "report"
    try:
        runs = find_runs(args.paths)
        if out.exists() and not out.is_dir():
            raise ReportError(f"{out}: exists and is not a folder; pass another --out")
        print(table(runs, args.metric))
        for line in (*rounds_lines(runs), *lives_lines(runs)):
            print(line)
        written = [*write_plots(runs, out), *_write_text(runs, out, args.metric)]
    except ReportError as err:
        return failed("report", err)
    print(f"wrote {', '.join(p.name for p in written)} to {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
