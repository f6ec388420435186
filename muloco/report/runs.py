"""Reading run folders and sweeps back: a :class:`Run` per run (its facts, final and per-step
losses, tokens, bytes, rounds and lives) from what ``muloco.train`` wrote (``summary.json``,
``metrics.jsonl``, ``run.json``, ``lives.json``, ``eval/``), and a sweep's runs through its manifest.
The report (``muloco/report/__main__.py``) and compare's tables read runs through this module;
what a run folder holds, and how a DiLoCo job's replicas are read as one run, is in the report's
docstring (``python -m muloco.report --help``)."""

from __future__ import annotations

import json
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from muloco.runs.facts import RUN_FILE, dump_folder_in, method_of, missing_facts
from muloco.runs.lives import Lives
from muloco.utils.errors import BadInput

RUN_FILES = ("summary.json", "metrics.jsonl")
METRICS = ("validation", "train")


class ReportError(BadInput):
    """Bad input: main prints it as one line and exits 2."""


@dataclass
class Run:
    """One training run (a DiLoCo job counts as one run) as read from its folder."""

    folder: Path
    name: str
    method: str
    objective: str
    facts: dict[str, Any] | None = None
    """What run.json recorded the run to be (None: it recorded no facts)."""
    replicas: int = 1
    complete: bool = False
    """Every replica wrote its summary (the run finished)."""
    sweep: Path | None = None
    """The sweep folder it was found in; None when it was named directly."""
    final_validation_loss: float | None = None
    final_validation_bits_per_byte: float | None = None
    """Bits per byte of the held-out text: comparable across objectives (ar, mdlm) and tokenizers."""
    final_tuning_loss: float | None = None
    """θ_g's loss on the tuning batches (``validator.tuning_steps``), apart from the reported one."""
    final_train_loss: float | None = None
    steps: int | None = None
    tokens: int | None = None
    bits_per_parameter: float | None = None
    bytes_sent_per_replica: float | None = None
    sync_share: float | None = None
    wall_seconds: float | None = None
    train_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    train_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))
    train_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    val_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    val_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))
    evaluations: dict[str, float] = field(default_factory=dict)
    """Downstream scores ``python -m muloco.evaluate`` wrote to ``eval/<task>.json``: "<task> <metric>"."""
    sync_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    sync_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Cumulative bytes sent per replica after each sync (mean over replicas)."""
    rounds: dict[str, Any] | None = None
    """Deadline rounds (``--outer.round deadline``): the run's progress in nominal steps and each
    group's rounds, steps and tokens (``_rounds``); the curves' steps are then that progress."""
    lives: list[dict[str, Any] | None] = field(default_factory=list)
    """Per replica group: its ledger's totals over its lives (``runs/lives.py``), None without one."""

    def final_loss(self, metric: str = "validation") -> float | None:
        return self.final_train_loss if metric == "train" else self.final_validation_loss


# ---------------------------------------------------------------------------- reading files


def _json_lines(path: Path, tolerate_partial_tail: bool) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each line of a JSONL file. A live writer may have left its
    last line half written: that one is skipped with a warning when ``tolerate_partial_tail``;
    any other bad line is an error naming the file and line."""
    lines = path.read_text(errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if tolerate_partial_tail and number == len(lines):
                warn(f"{path}:{number}: skipped a partial last line (a run still writing?)")
                continue
            raise ReportError(f"{path}:{number}: not valid JSON ({err.msg}); fix or delete that line") from None
        if not isinstance(record, dict):
            raise ReportError(f"{path}:{number}: expected a JSON object per line; fix or delete that line")
        records.append((number, record))
    return records


def _json_file(path: Path) -> dict[str, Any] | None:
    """A JSON object file, None when absent; malformed is an error naming file and line."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}:{err.lineno}: not valid JSON ({err.msg}); rerun or delete the file") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}:1: expected a JSON object; rerun or delete the file")
    return data


def warn(message: str) -> None:
    """One line on stderr: what the report left out or could not read, and why."""
    print(f"warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------- method


def _facts(folder: Path, run_json: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's recorded facts; a run.json without them (an older muloco, or a run that
    stopped before its model was built) is said, with what is unknown, and nothing is guessed."""
    missing = missing_facts(run_json)
    if missing:
        what = "no run.json" if run_json is None else f"run.json records no {', '.join(missing)}"
        warn(
            f"{folder}: {what} (written by an older muloco, or the run stopped before its model was "
            "built): its method is shown as '?'; resume or rerun it with this version to record them"
        )
        return None
    return run_json["facts"]


def _objective(facts: dict[str, Any] | None, summary: dict[str, Any] | None) -> str:
    """ar or mdlm, as the summary or the facts recorded it."""
    if summary and summary.get("objective"):
        return str(summary["objective"])
    return str(facts["objective"]) if facts else "?"


# ---------------------------------------------------------------------------- one replica


@dataclass
class _Replica:
    """What one replica group's folder recorded."""

    summary: dict[str, Any] | None
    train: dict[int, tuple[float, float]]  # step -> (loss, tokens so far in this group)
    validation: dict[int, float]
    syncs: dict[tuple[int, int], tuple[float, float, float]]  # (step, fragment) -> bytes, payload, numel (all tries)
    bits_per_byte: dict[int, float] = field(default_factory=dict)  # validation step -> bits per byte
    tuning: dict[int, float] = field(default_factory=dict)  # validation step -> loss on the tuning batches
    rounds: dict[int, tuple[float, int, float, bool]] = field(default_factory=dict)
    """Deadline rounds: sync step -> (the run's progress after it, this group's steps and its rank's
    tokens in the round, committed), of the group's current timeline only (``_file_round``)."""
    restarted_at: int | None = None
    """The step a new process of this group started training at, until its first sync is filed."""
    lives: dict[str, Any] | None = None
    """Its ledger's totals over every process it ran as (``runs/lives.py``; None: no ledger)."""
    tried: set[tuple[int, int]] = field(default_factory=set)
    """Syncs whose last record was a failed try that was tried again (its bytes join the next one's)."""


def _read_replica(folder: Path) -> _Replica:
    """One folder's summary and metrics; a step logged twice (a resumed run) keeps its last record."""
    summary = _json_file(folder / "summary.json")
    metrics = folder / "metrics.jsonl"
    records = _json_lines(metrics, tolerate_partial_tail=True) if metrics.is_file() else []
    replica = _Replica(summary, {}, {}, {})
    try:
        ledger = Lives.read(folder)
    except ValueError as err:
        raise ReportError(str(err)) from None
    replica.lives = ledger.totals() if ledger is not None else None
    for number, record in records:
        try:
            _add_record(replica, record)
        except (KeyError, TypeError, ValueError) as err:
            raise ReportError(
                f"{metrics}:{number}: a missing or mistyped field ({err}); fix or delete that line"
            ) from None
    return replica


def _add_record(replica: _Replica, r: dict[str, Any]) -> None:
    """File one metrics.jsonl record: a train log, a validation, or a sync."""
    step = int(r["step"])
    if r.get("loss") is not None:
        replica.train[step] = (float(r["loss"]), float(r.get("n_tokens_seen") or math.nan))
    if r.get("validation_loss") is not None:
        replica.validation[step] = float(r.get("validation_nelbo", r["validation_loss"]))
    if r.get("validation_bits_per_byte") is not None:
        replica.bits_per_byte[step] = float(r["validation_bits_per_byte"])
    if r.get("tuning_loss") is not None:
        replica.tuning[step] = float(r["tuning_loss"])
    if r.get("session_start"):
        replica.restarted_at = step
    if r.get("sync/progress") is not None:
        _file_round(replica, step, r)
    if r.get("sync/bytes_sent") is not None:
        key = (step, int(r.get("sync/fragment") or 0))
        sent = (float(r["sync/bytes_sent"]), float(r.get("sync/payload_bytes") or 0), float(r.get("sync/numel") or 0))
        if key in replica.tried:  # the sync's earlier try sent its bytes too: they count with it
            sent = tuple(a + b for a, b in zip(sent, replica.syncs[key]))
        replica.syncs[key] = sent
        (replica.tried.add if r.get("sync/retried") else replica.tried.discard)(key)


def _file_round(replica: _Replica, step: int, r: dict[str, Any]) -> None:
    """A deadline round's sync record. The first one after a restart drops the rounds the group
    will not stand on again: those after the checkpoint it resumed from (their budgets followed
    paces measured again, so a redone round need not end at the same step), or, when that sync
    healed it from a peer, those from the peer's step on (a healed group takes the peer's step)."""
    if replica.restarted_at is not None:
        cut = step - 1 if r.get("sync/healed_from") is not None else replica.restarted_at
        replica.rounds = {s: v for s, v in replica.rounds.items() if s <= cut}
        replica.restarted_at = None
    replica.rounds[step] = (
        float(r["sync/progress"]),
        int(r.get("sync/round_steps") or 0),
        float(r.get("sync/tokens") or 0),
        bool(r.get("sync/committed")),
    )


EVAL_METRICS = ("acc_norm", "acc", "exact_match", "word_perplexity")
"""The one figure of a task the table shows, the first of these the task reported."""


def _evaluations(folder: Path) -> dict[str, float]:
    """Each task's headline figure from ``eval/<task>.json`` (a file that does not parse is named
    and skipped)."""
    found = {}
    for path in sorted(folder.glob("eval/*.json")):
        try:
            record = _json_file(path)
        except ReportError as err:
            warn(f"{err}; skipped")
            continue
        if not record or not isinstance(record.get("metrics"), dict):
            warn(f"{path}: not an evaluation record; skipped")
            continue
        metrics = record["metrics"]
        numbers = [k for k, v in metrics.items() if isinstance(v, (int, float)) and "_stderr" not in k]
        name = next((k for m in EVAL_METRICS for k in numbers if k.split("/")[0] == m), None)  # "/": a filter
        if name:
            found[f"{record.get('task', path.stem)} {name}"] = float(metrics[name])
    return found


def _replica_folders(folder: Path) -> list[Path]:
    """A DiLoCo job's ``replica_<i>/`` run folders, by replica id."""
    found = [p for p in folder.glob("replica_*") if p.name[len("replica_") :].isdigit() and _is_run_folder(p)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def _is_run_folder(folder: Path) -> bool:
    return any((folder / name).is_file() for name in RUN_FILES)


# ---------------------------------------------------------------------------- one run


def _mean(values: list[Any]) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _committed_rounds(rep: _Replica) -> tuple[list[int], list[float]]:
    """This group's committed syncs' steps and the run's progress after each (both increasing)."""
    steps = sorted(s for s, v in rep.rounds.items() if v[3])
    return steps, [rep.rounds[s][0] for s in steps]


def _progress_at(rep: _Replica, steps) -> np.ndarray:
    """Deadline rounds: this group's steps as the run's progress in nominal steps, from its committed
    syncs' (step, progress), linear within a round as its inner schedule is."""
    xs, ys = _committed_rounds(rep)
    return np.interp(np.asarray(steps, dtype=float), np.r_[0.0, xs], np.r_[0.0, ys])


def _on_progress(rep: _Replica) -> _Replica:
    """The group's records keyed by the run's progress instead of its own step; records after its
    last committed sync (a run still going) have no place yet and are left out."""
    xs, _ = _committed_rounds(rep)
    last = xs[-1] if xs else -1

    def move(d):
        kept = {s: v for s, v in d.items() if s <= last}
        return dict(zip(_progress_at(rep, list(kept)).tolist(), kept.values())) if kept else {}

    kept = [k for k in rep.syncs if k[0] <= last]  # (progress, step): a failed sync shares its progress
    syncs = {(p, k[0]): rep.syncs[k] for p, k in zip(_progress_at(rep, [k[0] for k in kept]).tolist(), kept)}
    return _Replica(
        rep.summary, move(rep.train), move(rep.validation), syncs, move(rep.bits_per_byte), move(rep.tuning), rep.rounds
    )


def _train_curve(reps: list[_Replica], on_progress: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, mean loss and summed tokens: at the x every group logged (lockstep: steps); on
    progress, the first group's points up to where every group got, the others interpolated
    (a group with no train records yet is left out)."""
    if len(reps) == 1 or not on_progress:
        common = sorted(set.intersection(*(set(r.train) for r in reps)))
        loss = np.array([[r.train[s][0] for s in common] for r in reps]).reshape(len(reps), -1)
        tokens = np.array([[r.train[s][1] for s in common] for r in reps]).reshape(len(reps), -1)
        return np.array(common, dtype=float), loss.mean(axis=0), tokens.sum(axis=0)
    logged = [r for r in reps if r.train]
    if not logged:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    end = min(max(r.train) for r in logged)
    grid = np.array(sorted(x for x in logged[0].train if x <= end), dtype=float)
    loss, tokens = [], []
    for r in logged:
        xs = np.array(sorted(r.train), dtype=float)
        loss.append(np.interp(grid, xs, [r.train[x][0] for x in xs]))
        tokens.append(np.interp(grid, xs, [r.train[x][1] for x in xs]))
    return grid, np.mean(loss, axis=0), np.sum(tokens, axis=0)


def _curves(reps: list[_Replica], on_progress: bool = False) -> dict[str, np.ndarray]:
    """Train loss (mean over replicas) and tokens (sum) at the steps every replica logged,
    validation points of θ_g, and cumulative bytes sent per replica at each sync step. In
    deadline rounds (``on_progress``) the x is the run's progress (nominal steps), not a group's
    own step."""
    if on_progress:
        reps = [_on_progress(r) for r in reps]
    steps, loss, tokens = _train_curve(reps, on_progress)
    validation = {s: v for r in reps for s, v in r.validation.items()}
    sync_steps = np.array(sorted({s for r in reps for s, _ in r.syncs}), dtype=float)
    per_replica = [_cumulative_bytes(r, sync_steps) for r in reps if r.syncs]
    return {
        "train_steps": steps,
        "train_loss": loss,
        "train_tokens": tokens,
        "val_steps": np.array(sorted(validation), dtype=float),
        "val_loss": np.array([validation[s] for s in sorted(validation)]),
        "sync_steps": sync_steps if per_replica else np.zeros(0),
        "sync_bytes": np.mean(per_replica, axis=0) if per_replica else np.zeros(0),
    }


def _deadline(facts: dict[str, Any] | None, reps: list[_Replica]) -> bool:
    """Deadline rounds (the groups' step counts differ, so the run's progress is the common axis):
    as run.json's facts say, else from the sync records."""
    mode = (((facts or {}).get("outer") or {}).get("round") or {}).get("mode")
    return mode == "deadline" if mode else bool(reps) and all(r.rounds for r in reps)


def _rounds(reps: list[_Replica]) -> dict[str, Any] | None:
    """Deadline rounds: each group's committed rounds, its inner steps (in all, fewest and most in
    a round) and its tokens (those of each of its ranks: the work record is a rank's), from its
    sync records."""
    groups = []
    for i, r in enumerate(reps):
        trained = [v for v in r.rounds.values() if v[3] and v[1] > 0]
        steps = [v[1] for v in trained]
        groups.append(
            {
                "group": i,
                "rounds": len(trained),
                "steps": sum(steps),
                "min_steps": min(steps, default=0),
                "max_steps": max(steps, default=0),
                "tokens_per_rank": sum(v[2] for v in trained),
            }
        )
    return {"progress": max((v[0] for r in reps for v in r.rounds.values() if v[3]), default=0.0), "groups": groups}


def _cumulative_bytes(rep: _Replica, at_steps: np.ndarray) -> np.ndarray:
    """Bytes this replica had handed to the collectives by each of ``at_steps`` (failed syncs
    count: the bytes were sent)."""
    keys = sorted(rep.syncs)
    steps = np.array([k[0] for k in keys], dtype=float)
    total = np.concatenate([[0.0], np.cumsum([rep.syncs[k][0] for k in keys])])
    return total[np.searchsorted(steps, at_steps, side="right")]


def _scalars(reps: list[_Replica], curves: dict[str, np.ndarray]) -> dict[str, Any]:
    """The table's numbers: from the summaries when written, else from the metrics."""
    sums = [r.summary for r in reps if r.summary is not None]
    val = next((s.get("final_validation_nelbo", s.get("final_validation_loss")) for s in sums), None)
    bpb = next((s["final_validation_bits_per_byte"] for s in sums if s.get("final_validation_bits_per_byte")), None)
    logged = {step: v for r in reps for step, v in r.bits_per_byte.items()}
    tuned = {step: v for r in reps for step, v in r.tuning.items()}
    tuning = next((s["final_tuning_loss"] for s in sums if s.get("final_tuning_loss") is not None), None)
    return {
        "final_tuning_loss": tuning if tuning is not None else (tuned[max(tuned)] if tuned else None),
        "final_validation_loss": val if val is not None else _last(curves["val_loss"]),
        "final_validation_bits_per_byte": bpb if bpb is not None else (logged[max(logged)] if logged else None),
        "final_train_loss": _mean([s.get("final_train_loss") for s in sums]) if sums else _last(curves["train_loss"]),
        "steps": max((int(s["steps"]) for s in sums), default=None) or _max_step(reps),
        "tokens": _tokens(reps),
        "wall_seconds": max(
            (float(s["wall_seconds"]) for s in sums if s.get("wall_seconds") is not None), default=None
        ),
        **_traffic(reps, [s["diloco"] for s in sums if "diloco" in s]),
    }


def _tokens(reps: list[_Replica]) -> int | None:
    """Tokens trained by all replica groups: each group's over its lives from its ledger (a heal
    hands a group its peer's counter), else its last ``n_tokens_seen`` (summed over its ranks,
    where the summary's ``tokens_seen`` is rank 0's alone), else its summary."""
    per_group = []
    for r in reps:
        if r.lives is not None and not r.lives.get("first_started_at_step"):  # a ledger from the run's start
            per_group.append(r.lives["tokens_trained"])
            continue
        logged = r.train[max(r.train)][1] if r.train else math.nan
        per_group.append(logged if not math.isnan(logged) else (r.summary or {}).get("tokens_seen"))
    return int(sum(per_group)) if all(t is not None for t in per_group) else None


def _traffic(reps: list[_Replica], outer: list[dict[str, Any]]) -> dict[str, float | None]:
    """Bits per parameter and bytes sent, each the mean over replicas, summed over the sync
    records of metrics.jsonl (one per sync: a resumed run's earlier processes count, a sync redone
    after a restart counts once); from the summaries' ``diloco`` section where a run logged no
    sync records. The sync share comes from the summaries (the last process's)."""
    share = _mean([o.get("sync_share_of_wall_time") for o in outer]) if outer else None
    totals = [np.sum(list(r.syncs.values()), axis=0) for r in reps if r.syncs]  # bytes, payload, numel
    if totals:
        return {
            "bits_per_parameter": _mean([8 * t[1] / max(1.0, t[2]) for t in totals]),
            "bytes_sent_per_replica": _mean([t[0] for t in totals]),
            "sync_share": share,
        }
    return {
        "bits_per_parameter": _mean([o.get("payload_bits_per_parameter") for o in outer]),
        "bytes_sent_per_replica": _mean([o.get("bytes_sent") for o in outer]),
        "sync_share": share,
    }


def _last(values: np.ndarray) -> float | None:
    return float(values[-1]) if len(values) else None


def _max_step(reps: list[_Replica]) -> int | None:
    steps = [s for r in reps for s in (*r.train, *r.validation)]
    return max(steps) if steps else None


def load_run(folder: Path | str) -> Run:
    """Read one run folder, or a DiLoCo job folder (its ``replica_<i>/`` folders), into a Run
    named after the folder."""
    folder = Path(folder)
    parts = [folder] if _is_run_folder(folder) else _replica_folders(folder)
    if not parts:
        raise ReportError(
            f"{folder}: not a run folder (no summary.json or metrics.jsonl, no replica_<i>/); "
            "pass a run's --dump_folder"
        )
    reps = [_read_replica(p) for p in parts]
    run_json = _json_file(parts[0] / RUN_FILE)
    summary = next((r.summary for r in reps if r.summary is not None), None)
    try:
        facts = _facts(parts[0], run_json)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ReportError(
            f"{folder}: run.json has a missing or mistyped field ({err!r}); rerun or delete the file"
        ) from None
    deadline = _deadline(facts, reps)
    curves = _curves(reps, on_progress=deadline)
    try:
        return Run(
            folder=folder,
            name=folder.resolve().name,
            method=method_of(facts) if facts else "?",
            objective=_objective(facts, summary),
            facts=facts,
            replicas=len(parts),
            evaluations=_evaluations(folder),
            rounds=_rounds(reps) if deadline else None,
            lives=[r.lives for r in reps],
            complete=all(r.summary is not None for r in reps),
            **_scalars(reps, curves),
            **curves,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ReportError(
            f"{folder}: summary.json or run.json has a missing or mistyped field ({err!r}); rerun or delete the file"
        ) from None


# ---------------------------------------------------------------------------- finding runs


def _run_folders(folder: Path) -> list[Path]:
    """Run folders at or below ``folder`` (a DiLoCo job folder counts once); hidden folders
    and symbolic links are not entered."""
    if _is_run_folder(folder) or _replica_folders(folder):
        return [folder]
    children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))
    return [run for child in children for run in _run_folders(child)]


def _manifest_names(sweep: Path) -> dict[Path, str]:
    """{resolved run folder: name} from every ``manifest.jsonl`` in the sweep."""
    names: dict[Path, str] = {}
    for manifest in sorted(sweep.rglob("manifest.jsonl")):
        for number, line in _json_lines(manifest, tolerate_partial_tail=True):
            if "name" not in line:
                raise ReportError(f'{manifest}:{number}: a manifest line needs a "name"; add one')
            names.update((folder, str(line["name"])) for folder in _manifest_folders(manifest.parent, line))
    return names


def _manifest_folders(base: Path, line: dict[str, Any]) -> list[Path]:
    """Where a manifest line's run may be: its folder key (``run_dir``, as ``muloco.launch.sweeps``
    writes, ``dump_folder``, ``folder``, ``path``), the ``--dump_folder`` of its overrides, and the
    folder called ``name`` next to the manifest (relative paths may be relative to either the
    manifest or the directory the sweep was started from, so all are candidates)."""
    overrides = line.get("overrides") or []
    if isinstance(overrides, str):
        overrides = shlex.split(overrides)
    if isinstance(overrides, dict):
        overrides = [part for k, v in overrides.items() for part in (f"--{str(k).lstrip('-')}", str(v))]
    given = [line.get(k) for k in ("run_dir", "dump_folder", "folder", "path")]
    given += [dump_folder_in([str(o) for o in overrides]), line["name"]]
    paths = {Path(str(g)) for g in given if g}
    return [p.resolve() for p in paths] + [(base / p).resolve() for p in paths if not p.is_absolute()]


def find_runs(paths: list[Path | str]) -> list[Run]:
    """Every run under the given paths: a path that is a run is one run named after its folder;
    any other folder is a sweep, its runs named by its manifest or by their path in it."""
    runs: list[Run] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ReportError(f"{path}: no such file or folder; pass a run's --dump_folder or a sweep folder")
        if not path.is_dir():
            raise ReportError(f"{path}: not a folder; pass the run folder that holds it ({path.parent})")
        folders = _run_folders(path)
        if not folders:
            raise ReportError(
                f"{path}: no runs found (a run folder holds summary.json or metrics.jsonl, a DiLoCo "
                "job replica_<i>/ folders); pass a run's --dump_folder or a folder above runs"
            )
        if folders == [path]:
            runs.append(load_run(path))
            continue
        names = _manifest_names(path)
        for folder in folders:
            run = load_run(folder)
            run.sweep = path
            run.name = names.get(folder.resolve(), folder.relative_to(path).as_posix())
            runs.append(run)
    return _distinct_names(runs)


def _distinct_names(runs: list[Run]) -> list[Run]:
    """Two runs with one name (the same sub-folder in two sweeps): label those by their path."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.name] = counts.get(run.name, 0) + 1
    for run in runs:
        if counts[run.name] > 1:
            run.name = f"{run.folder}"
    return runs
