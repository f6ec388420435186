"""The paper's comparisons in one command.

    python -m muloco.compare [--suite paper-mini|paper-long|outer-steps|paper-158m] [--objective ar|mdlm] [--data
    stdlib|shakespeare|PATH]
                             [--seeds 2] [--device cpu|cuda] [--out DIR] [--dry-run] [--only LABEL ...]
                             [--tune [--tune-points POINT ...]]
                             [--link 100mbps,1gbps [--link-latency-ms L] [--target LOSS]]
                             [-- trainer overrides for every run]

Runs, with one model and one token budget per replica group, DDP AdamW and DDP Muon, DiLoCo
and MuLoCo at K=2 and K=4 (dense), dense MuLoCo with the compressed configs' outer step, MuLoCo 2-bit and 4-bit with
and without error feedback,
top-k 10% with and without, SparseLoCo and streaming MuLoCo (``muloco.compare.suites``); then
prints one table (final θ_g validation loss or NELBO, gaps to dense MuLoCo with the same outer
step and to DDP in %,
bits per parameter, bytes per replica, syncs, wall time, seed spread), checks the targets,
and writes ``compare.md``, ``compare.json`` and the report's PNGs (loss vs steps, tokens and
bytes sent) into the suite folder (default ``outputs/compare/<suite>-<objective>-<data>``).
Running it again reuses finished runs and resumes interrupted ones. ``--dry-run`` prints every
run's folder name and command and starts nothing. ``--link`` runs the rows with replica groups
again over each emulated link and adds the wall-clock to the target loss (``timing.py``).
``--tune`` runs every row with an outer step at each point of its grid (``suites.GRIDS``), picks
the point with the lowest θ_g loss on tuning batches held apart from the reported validation
batches, shows the chosen step beside each row and measures gaps against the best tuned dense
K=2 row; a target whose margin is inside the seed spread is reported as a tie. ``--tune-points``
tries only the named points of each grid (a K=4 row costs twice a K=2 one: a cheaper first look).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from muloco.compare import runner, table, timing, tuning
from muloco.compare.suites import DATA, SUITES, Planned, SuiteError, over_links, plan
from muloco.launch.group import TrainerConfigError, load_trainer_config
from muloco.runs.lock import DumpFolderBusy, DumpFolderLock
from muloco.runs.names import run_name
from muloco.utils.command_line import UsageError, failed, parse, run_main
from muloco.utils.link_model import parse_rate

PROG = "python -m muloco.compare"


@dataclass
class CompareOptions:
    """Run a comparison suite on this machine and print its table."""

    suite: str = "paper-mini"
    """paper-mini (tiny model, sized for a 2-core CPU) | paper-long (the same model, 900 steps, H=15) |
    outer-steps (paper-long's shape: outer optimizers and steps, no targets) | paper-158m (one GPU
    per replica group)."""
    objective: str = "ar"
    """ar (autoregressive) | mdlm (masked diffusion; the table shows the NELBO)."""
    data: str = "stdlib"
    """stdlib (embedded) | shakespeare (python -m muloco.data.fetch shakespeare first) | a JSONL path."""
    seeds: int = 1
    """Seeds per run (0, 1, ...): init and data order."""
    device: str = ""
    """cpu | cuda (default: the suite's device; cpu hides the GPUs from the runs)."""
    out: str = ""
    """Suite folder (default outputs/compare/<suite>-<objective>-<data>); one compare holds it at a time."""
    only: list[str] = field(default_factory=list)
    """Run only these rows (labels as the table prints them)."""
    steps: int | None = None
    """Steps per replica group instead of the suite's."""
    tune: bool = False
    """Tune each row's outer step on its grid (lr and momentum, or lr and error-feedback β), chosen by
    θ_g's loss on tuning batches apart from the reported validation ones: on seed 0, after which the
    other seeds run only the chosen point."""
    tune_points: list[str] = field(default_factory=list)
    """With --tune: try only these grid points (as the dry run prints them after '@', e.g.
    "averaging (η1 μ0)" "Nesterov η0.5 μ0.5"); default: every point of each row's grid."""
    tune_every_seed: bool = False
    """With --tune and --seeds > 1: run the whole grid on every seed and choose by the mean over the
    seeds (each seed costs the grid instead of one run per row)."""
    dry_run: bool = False
    """Print the runs and their commands; start nothing."""
    link: list[str] = field(default_factory=list)
    """Emulated links to time the runs over, e.g. 100mbps,1gbps,10gbps: each row with replica groups
    runs again per link, and a table gives the wall-clock to the target loss."""
    link_latency_ms: float = 0.0
    """Latency per collective round of the emulated links, in milliseconds."""
    target: float | None = None
    """The loss the time-to-target is measured to (default: the dense DiLoCo K=2 run's final loss)."""


def _check_out(folder: Path) -> None:
    """The suite's folder can be made and written (a file, /proc, a path below a file: one line now,
    not a traceback from the first run)."""
    from muloco.config.checks import check_dump_folder
    from muloco.config.loader import ConfigError

    try:
        check_dump_folder(str(folder), flag="--out")
    except ConfigError as err:
        raise UsageError(str(err)) from None


def _in_compare_terms(message: str) -> str:
    """A trainer's message with compare's own flag for what compare sets: ``--steps`` sets every run's
    ``training.steps``."""
    return re.sub(
        r"try --training\.steps (\d+)", r"try --steps \1 (compare's --steps sets every run's training.steps)", message
    )


def _resolve(p: Planned) -> None:
    """Parse the run's trainer config once: its folder name (``runs.names.run_name`` and the seed),
    its steps and local batch."""

    cfg = load_trainer_config(
        p.row.config, p.overrides, replicas=None if p.row.ddp else p.row.replicas, who=PROG, prog=PROG
    )
    p.name = f"{run_name(cfg)}_seed{p.seed}"
    p.steps, p.local_batch = cfg.training.steps, cfg.training.local_batch_size
    p.warmup = cfg.lr_scheduler.warmup_steps
    p.sync_every = cfg.outer.sync_every if hasattr(cfg, "outer") else None


def _later_seeds(
    suite,
    args: CompareOptions,
    extra: list[str],
    chosen: dict[str, set[str]] | None,
    points: dict[str, set[str]] | None = None,
) -> list[Planned]:
    """Seeds 1 and up of a tuned suite: each tuned row at its points in ``chosen`` (``tuning.later_points``:
    the chosen one, and averaging and the best with momentum on the Nesterov grid; a row seed 0
    could not score is left out), the rows without an outer step as they are; resolved.
    ``chosen`` None (a dry run): each tuned row's first point (of ``points``, ``--tune-points``) and
    its averaging point stand in."""
    later = plan(
        suite,
        objective=args.objective,
        data=args.data,
        seeds=args.seeds,
        steps=args.steps,
        extra=extra,
        only=args.only,
        tune=True,
        first_seed=1,
        chosen=chosen if chosen is not None else points,
    )
    if chosen is None:
        later = tuning.stand_ins(later)
    for p in later:
        _resolve(p)
    return later


def _check(args: CompareOptions) -> None:
    if args.suite not in SUITES:
        raise UsageError(f"--suite {args.suite!r}: use one of {', '.join(SUITES)}")
    if args.device not in ("", "cpu", "cuda"):
        raise UsageError(f"--device {args.device!r}: use cpu or cuda")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps {args.steps}: must be at least 1")
    if not (0 <= args.link_latency_ms < float("inf")):
        raise UsageError(f"--link-latency-ms {args.link_latency_ms}: must be a finite number >= 0")
    if args.link_latency_ms and not args.link:
        raise UsageError("--link-latency-ms applies to emulated links: give --link too (e.g. --link 100mbps)")
    if args.target is not None and not (0 < args.target < float("inf")):
        raise UsageError(f"--target {args.target}: must be a positive finite loss")
    if args.target is not None and not args.link:
        raise UsageError("--target is the loss the runs over --link are timed to: give --link too")
    if args.tune_every_seed and not args.tune:
        raise UsageError("--tune-every-seed says how --tune spends its seeds: give --tune too")
    if args.tune_points and not args.tune:
        raise UsageError("--tune-points narrows --tune's grids: give --tune too")


def _links(values: list[str]) -> list[float]:
    """``--link 100mbps,1gbps`` (or as separate values) in megabits per second."""
    try:
        links = [parse_rate(v) for value in values for v in value.split(",") if v.strip()]
    except ValueError as err:
        raise UsageError(f"--link: {err}") from None
    if len(set(links)) != len(links):
        raise UsageError(f"--link {','.join(values)}: a link speed is given twice")
    return links


def _check_device(device: str, suite_name: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                f"{suite_name} runs on CUDA and this machine has no CUDA device; use "
                f"--suite paper-mini, or --device cpu to run it here anyway (slowly)"
            )


def _share_gpus(device: str, planned: list[Planned]) -> bool:
    """Whether the K-group runs must share GPUs: on CUDA with fewer GPUs than the largest K.
    Says so, since the wall times then include the sharing."""
    if device != "cuda":
        return False
    import torch

    groups = max((p.row.replicas for p in planned), default=1)
    gpus = torch.cuda.device_count()
    if gpus >= groups:
        return False
    print(
        f"note: {gpus} GPU(s) for up to {groups} replica groups: the groups share GPUs "
        f"(--share-gpus), so wall times include the sharing",
        file=sys.stderr,
    )
    return True


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _environment(device: str) -> dict[str, str]:
    """What the runs' environment adds to this process's (only that is written to disk)."""
    return {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}


def _targets(
    args: CompareOptions, planned: list[Planned], linked: list[Planned], folder: Path
) -> tuple[dict[int, float], str]:
    """The loss each seed's time to target is measured to (that seed's dense DiLoCo K=2 final loss,
    from its run without a link or else over a link; or ``--target``), and where it came from."""
    from muloco.report.runs import ReportError, load_run  # start-up: the report's readers, once runs ended

    seeds = sorted({p.seed for p in linked})
    if args.target is not None:
        return dict.fromkeys(seeds, args.target), "--target"
    found: dict[int, float] = {}
    for p in [*planned, *linked]:  # without a link first
        if p.row.label == timing.DILOCO_REFERENCE and p.seed not in found and (folder / p.name).is_dir():
            try:
                loss = load_run(folder / p.name).final_validation_loss
            except ReportError:
                continue
            if loss is not None:
                found[p.seed] = loss
    missing = [s for s in seeds if s not in found]
    if missing:
        raise UsageError(
            f"no finished {timing.DILOCO_REFERENCE} run of seed(s) {missing} to take the target loss "
            "from: add it to --only or give --target"
        )
    return found, f"{timing.DILOCO_REFERENCE}'s final loss, seed by seed"


def _finish_links(args: CompareOptions, planned: list[Planned], linked: list[Planned], folder: Path) -> dict:
    targets, source = _targets(args, planned, linked, folder)
    timed = [timing.Timed(p.row.label, p.link_mbps, p.seed, folder / p.name) for p in linked]
    rows = timing.mean_rows([t.row(targets[t.seed]) for t in timed])
    shown = sum(targets.values()) / len(targets)
    text = timing.text(rows, shown, source + (" (mean shown)" if len(set(targets.values())) > 1 else ""))
    order = "\n".join(timing.orderings(rows))
    print(f"\n{text}\n\nfastest to target, per link:\n{order}")
    timing.plot(timed, folder, targets[min(targets)])
    with open(folder / "compare.md", "a") as f:
        f.write(f"\nTime to target over emulated links:\n\n```\n{text}\n\nfastest to target, per link:\n{order}\n```\n")
    return {
        "target": shown,
        "targets_by_seed": {str(k): v for k, v in targets.items()},
        "target_source": source,
        "rows": rows,
    }


def _finish(suite, planned: list[Planned], folder: Path, args: CompareOptions | None = None) -> None:
    """Print and write the table, the targets and the plots (and the links' table)."""
    from muloco.report.plots import write_plots  # start-up: the report's readers, once runs ended

    linked = [p for p in planned if p.link_mbps is not None]
    planned = [p for p in planned if p.link_mbps is None]
    args = args or CompareOptions()
    tuning_seeds = {0} if args.tune and not args.tune_every_seed else None
    found = table.lines(suite, planned, folder, tuning_seeds)
    values = table.rows(suite, found)
    checks = table.targets(suite, values)
    made = table.setup(
        planned, suite, objective=args.objective, data=args.data, tuning_seeds=tuning_seeds, tuned=args.tune
    )
    text = f"{table.setup_text(made)}\n\n{table.text(values)}"
    tuned = tuning.note(found, tuning_seeds)
    if tuned:
        text += f"\n{tuned}"
    grid = table.grid_text(values)
    if grid:
        text += f"\n\ntuning grid (each point's mean tuning loss on the tuning seeds):\n{grid}"
    text += f"\n\n{table.reference_note(values, found)}"
    targets = table.targets_text(checks)
    print(text)
    if suite.shape.note:
        print(f"\nnote: {suite.shape.note}")
    if checks:
        print(f"\ntargets:\n{targets}")
    seed0 = [dataclasses.replace(line.runs[0], name=line.label) for line in found]  # one curve per row
    if seed0:
        write_plots(seed0, folder)
    note = f"\n{suite.shape.note}\n" if suite.shape.note else ""
    shown = f"\nTargets:\n\n```\n{targets}\n```\n" if checks else ""
    (folder / "compare.md").write_text(f"# {folder.name}\n\n```\n{text}\n```\n{note}{shown}")
    word = {True: "met", False: "missed", "tie": "tie", None: "not measured"}
    result = {
        "suite": suite.name,
        "setup": made,
        "rows": values,
        "targets": [
            {"target": t.removesuffix(table.ONE_SEED), "verdict": word[ok], "one_seed": t.endswith(table.ONE_SEED)}
            for t, ok in checks
        ],
    }
    try:
        if linked:
            result["links"] = _finish_links(args, planned, linked, folder)
    except UsageError as err:
        result["links"] = {"error": str(err)}
        raise
    finally:
        (folder / "compare.json").write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    try:
        args, extra = parse(
            CompareOptions,
            list(sys.argv[1:] if argv is None else argv),
            prog=PROG,
            description=__doc__.split("\n\n")[0],
        )
        _check(args)
        suite = SUITES[args.suite]
        device = args.device or suite.device
        if not args.dry_run:
            _check_device(device, suite.name)
        data_label = args.data if args.data in DATA else Path(args.data).stem
        folder = Path(args.out or f"outputs/compare/{suite.name}-{args.objective}-{data_label}")
        _check_out(folder)
        staged = args.tune and args.seeds > 1 and not args.tune_every_seed
        points = tuning.check_points(suite, args.only, args.tune_points)
        planned = plan(
            suite,
            objective=args.objective,
            data=args.data,
            seeds=1 if staged else args.seeds,
            steps=args.steps,
            extra=extra,
            only=args.only,
            tune=args.tune,
            chosen=points,
        )
        if args.tune and args.link:
            raise UsageError(
                "--tune and --link: tune first, then time the chosen settings over links "
                "(give the chosen setting as trainer overrides after --)"
            )
        linked = over_links(suite, planned, _links(args.link), args.link_latency_ms, extra)
        if args.link and not linked:
            raise UsageError("--link: none of the chosen rows has replica groups (DDP rows have no link)")
        if linked and args.target is None and timing.DILOCO_REFERENCE not in {p.row.label for p in planned}:
            raise UsageError(
                f"--link times runs to the {timing.DILOCO_REFERENCE} run's final loss: add "
                f'"{timing.DILOCO_REFERENCE}" to --only, or give --target LOSS'
            )
        planned += linked
        for p in planned:
            _resolve(p)
    except (UsageError, SuiteError) as err:
        return failed("compare", err)
    except TrainerConfigError as err:  # a run's trainer config does not parse (tyro said why)
        if err.status:
            failed("compare", _in_compare_terms(str(err)))
        return err.status
    if args.dry_run:
        later = _later_seeds(suite, args, extra, None, points) if staged else []
        made = table.setup(
            [p for p in [*planned, *later] if p.link_mbps is None],
            suite,
            objective=args.objective,
            data=args.data,
            tuning_seeds={0} if staged else None,
            tuned=args.tune,
        )
        print(table.setup_text(made))
        share = _share_gpus(device, planned) if device == "cuda" and _cuda_available() else False
        for p in planned:
            command = runner.command(p, folder / p.name, share_gpus=share)
            print(f"{p.row.label} (seed {p.seed}): {folder / p.name}\n  {shlex.join(command)}")
        if later:
            rows = len(later) // (args.seeds - 1)
            print(
                f"then seeds 1 to {args.seeds - 1}: each tuned row at the point seed 0 chooses (a Nesterov row also "
                f"at averaging and its best point with momentum), the other rows as they are (about {rows} runs "
                f"per seed)"
            )
        print(f"{len(planned) + len(later)} runs; nothing started (--dry-run)")
        return 0
    try:
        with DumpFolderLock(str(folder), option="--out"):  # a second compare on the folder would train its runs twice
            runner.stop_on_sigterm()
            return _run_suite(suite, planned, folder, args, extra, device, staged)
    except DumpFolderBusy as err:
        return failed("compare", err)


def _run_suite(suite, planned: list[Planned], folder: Path, args, extra: list[str], device: str, staged: bool) -> int:
    """Train what is not finished, the later seeds at the points seed 0 chose, then the table."""
    env, share = _environment(device), _share_gpus(device, planned)
    states = runner.run_all(planned, folder, extra_env=env, share_gpus=share)
    if staged:  # the other seeds at the points seed 0 chose
        found = [line for line in table.lines(suite, planned, folder, {0}) if line.setting]
        print("tuned on seed 0: " + "; ".join(f"{line.label}: {line.setting}" for line in found), file=sys.stderr)
        chosen = {line.label: tuning.later_points(line) for line in found}
        later = _later_seeds(suite, args, extra, chosen)
        states.update(runner.run_all(later, folder, extra_env=env, share_gpus=share))
        planned += later
    try:
        _finish(suite, planned, folder, args)
    except UsageError as err:
        return failed("compare", err)
    unfinished = [name for name, state in states.items() if state != "COMPLETED"]
    if unfinished:
        print(
            f"{PROG}: {len(unfinished)} run(s) failed: {', '.join(unfinished)}; logs in {folder / 'logs'}; "
            f"run the same command again to retry them",
            file=sys.stderr,
        )
        return 1
    print(f"wrote compare.md, compare.json and the plots to {folder}")
    return 0


if __name__ == "__main__":
    run_main(main)
