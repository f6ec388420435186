"""Bad config, bad data, a bad dump folder or a corrupt checkpoint: one line, no traceback, nothing written.

Every case runs the real entry point as a user would (``muloco.train``'s ``main`` with the
command line) and checks the exit status (2: bad input, 3: a checkpoint that cannot be loaded),
that stderr is exactly one line starting with ``error:`` and naming the problem, that no
traceback is printed, and that no file appeared (the case's folder is listed before and after; a
dump folder that did not exist still does not). Most cases run in the test's process
(``in_process.py``: 0.1 s against ~5 s of CPU for a fresh process importing torch and
torchtitan), with the trainer's build refused, so that a case that passes its pre-flight fails
instead of training; two run as real ``python -m muloco.train`` processes (a config error and a
corrupt checkpoint), which also shows that a fresh process prints nothing else. The checkpoint
cases share one short run that wrote the checkpoints (each corrupts its own copy); it and the
real processes start in the background as soon as the first test needs them.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from conftest import TINY, read_metrics, run_train
from in_process import run_in_process

MANIFEST = ".muloco-checksums.json"
UNWRITABLE = "/proc/muloco-test-out"  # we run as root: only a read-only filesystem refuses


def _jsonl(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


def _docs(n: int) -> list[str]:
    return [json.dumps({"text": f"document {i} with a few words"}) for i in range(n)]


# -------------------------------------------------------- checkpoint corruptions


def _garble_metadata(step: Path) -> None:
    (step / ".metadata").write_bytes(b"not a pickle" * 8)


def _garble_data(step: Path) -> None:
    shard = step / "__0_0.distcp"
    shard.write_bytes(os.urandom(shard.stat().st_size))


def _flip_tensor_bytes(step: Path) -> None:
    """Same length, different bytes, in the middle of the file: tensor data."""
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    shard.write_bytes(bytes(data))


def _truncate_data(step: Path) -> None:
    """As after a full disk."""
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])


def _remove_manifest(step: Path) -> None:
    (step / MANIFEST).unlink()


@dataclass(frozen=True)
class Case:
    id: str
    args: list[str]
    """Command line; ``{dir}`` is the case's own folder, which holds ``files``."""
    says: str
    """Text the one error line must contain (``{dir}`` as above)."""
    code: int = 2
    files: dict[str, str | bytes] = field(default_factory=dict)
    dump: str = "{dir}/out"
    corrupt: Callable[[Path], None] | None = None
    """Checkpoint cases: applied to step-7 of a copy of the written run in ``{dir}/out``."""
    real_process: bool = False
    """Run as ``python -m muloco.train`` instead of in the test's process."""

    def fill(self, text: str, folder: Path) -> str:
        return text.replace("{dir}", str(folder))


BAD_INPUTS = [
    # 1. non-finite floats: three through the command line (a value, a negative value with
    # "=", a nested setting); every float setting of every section is checked in process by
    # test_every_float_setting_rejects_inf_and_nan
    Case("inner-lr-inf", ["--config", "ddp/adamw", "--optimizer.lr", "inf"], "optimizer.lr is inf", real_process=True),
    Case(
        "weight-decay-minus-inf",
        ["--config", "ddp/adamw", "--optimizer.weight_decay=-inf"],
        "optimizer.weight_decay is -inf",
    ),
    Case(
        "ef-beta-nan",
        ["--config", "diloco/muloco_2bit", "--outer.exchange.error_feedback.beta", "nan"],
        "outer.exchange.error_feedback.beta is nan",
    ),
    # 1b. a setting of another codec than the chosen one, and an unknown codec
    Case(
        "codec-setting-of-another-codec",
        ["--config", "diloco/muloco_2bit", "--outer.exchange.codec.fraction", "0.1"],
        "outer.exchange.codec is quantize, which has no setting 'fraction'",
    ),
    Case(
        "codec-unknown",
        ["--config", "diloco/muloco_2bit", "--outer.exchange.codec", "zip"],
        "--outer.exchange.codec must be one of dense, quantize, topk; got 'zip'",
    ),
    # 1c. the objective's settings
    Case(
        "objective-eps-outside-0-1",
        ["--config", "ddp/adamw", "--objective", "mdlm", "--objective.eps", "1"],
        "objective.eps is 1.0; it must be in (0, 1)",
    ),
    # 2. more fragments than layer units (d2: embedding, 2 blocks, head = 4)
    Case(
        "feedback-beta-schedule-on-a-lossless-exchange",
        ["--config", "diloco/diloco", "--outer.step_schedule.feedback_beta.decay", "linear"],
        "outer.step_schedule.feedback_beta schedules the error-feedback β, but this exchange keeps no error feedback",
    ),
    Case(
        "diloco-job-into-a-ddp-run-folder",
        ["--config", "diloco/diloco", *TINY],
        "{dir}/out holds a DDP run (ddp-adamw), and this DiLoCo job would write its replica groups' folders",
        files={"out/run.json": json.dumps({"facts": {"method": "ddp-adamw", "outer": None}})},
    ),
    Case(
        "ddp-run-into-a-diloco-job-folder",
        ["--config", "ddp/adamw", *TINY],
        "{dir}/out holds a DiLoCo job (replica_<i>/ folders), and this DDP run would write beside them",
        files={"out/replica_0/run.json": json.dumps({"facts": {"method": "diloco"}})},
    ),
    Case(
        "deadline-min-steps-over-the-rounds-most",
        [
            "--config",
            "diloco/diloco",
            "--outer.round",
            "deadline",
            "--outer.sync_every",
            "10",
            "--outer.round.min_steps",
            "50",
        ],
        "outer.round.min_steps 50 is more than a round's most steps, 20 (outer.round.max_steps 0: twice",
    ),
    Case(
        "tuning-batches-past-the-held-out-split",
        ["--config", "ddp/adamw", *TINY, "--validator.tuning_steps", "100000"],
        "validator.steps 2 + validator.tuning_steps 100000 batches of 4 rows on 1 rank(s) need 400008: the tuning "
        "batches would wrap around into the reported ones. Give at most --validator.tuning_steps",
    ),
    Case(
        "lives-ledger-garbled",
        ["--config", "diloco/diloco", *TINY],
        "{dir}/out/replica_0/lives.json is not a lives ledger",
        files={"out/replica_0/lives.json": "{not json"},
    ),
    Case(
        "fragments-over-layer-units",
        ["--config", "diloco/diloco", *TINY, "--outer.num_fragments", "5"],
        "outer.num_fragments is 5, more than the 4 layer units",
    ),
    # 3. regular expressions
    Case(
        "muon-pattern-not-a-regex",
        ["--config", "ddp/muon", "--optimizer.muon_pattern", "("],
        "optimizer.muon_pattern '(' is not a valid regular expression",
    ),
    Case(
        "skip-pattern-not-a-regex",
        ["--config", "diloco/muloco_2bit", "--outer.exchange.skip_pattern", "[a"],
        "outer.exchange.skip_pattern '[a' is not a valid regular expression",
    ),
    # 4. data
    Case(
        "jsonl-empty-file",
        [
            "--config",
            "ddp/adamw",
            "--dataloader.source",
            "jsonl",
            "--dataloader.source.dataset_path",
            "{dir}/empty.jsonl",
        ],
        "has no document in its train split",
        files={"empty.jsonl": ""},
    ),
    Case(
        "jsonl-invalid-line",
        [
            "--config",
            "ddp/adamw",
            "--dataloader.source",
            "jsonl",
            "--dataloader.source.dataset_path",
            "{dir}/bad.jsonl",
        ],
        "{dir}/bad.jsonl:2: not a JSON object",
        files={"bad.jsonl": _jsonl(_docs(1)[0], "{not json", *_docs(20))},
    ),
    Case(
        "jsonl-latin-1",
        [
            "--config",
            "ddp/adamw",
            "--dataloader.source",
            "jsonl",
            "--dataloader.source.dataset_path",
            "{dir}/latin.jsonl",
        ],
        "{dir}/latin.jsonl:1: not UTF-8 text (byte 0xe9 at byte 14 of the line); JSONL files must be UTF-8",
        files={"latin.jsonl": _jsonl(*_docs(20)).replace("document 0 ", "caf\xe9 0 ").encode("latin-1")},
    ),
    Case(
        "jsonl-folder-without-files",
        ["--config", "ddp/adamw", "--dataloader.source", "jsonl", "--dataloader.source.dataset_path", "{dir}/data"],
        "is a directory without *.jsonl files",
        files={"data/notes.txt": "not jsonl"},
    ),
    Case(
        "jsonl-glob-matches-nothing",
        ["--config", "ddp/adamw", "--dataloader.source", "jsonl", "--dataloader.source.dataset_path", "{dir}/*.jsonl"],
        "matches no file as a glob",
    ),
    # few.jsonl's first held-out line (5% hash split) is line 8: no validation data.
    Case(
        "jsonl-no-validation-documents",
        [
            "--config",
            "ddp/adamw",
            "--dataloader.source",
            "jsonl",
            "--dataloader.source.dataset_path",
            "{dir}/few.jsonl",
        ],
        "has no document in its validation split",
        files={"few.jsonl": _jsonl(*_docs(5))},
    ),
    Case(
        "validation-source-not-followed",
        [
            "--config",
            "ddp/adamw",
            "--validator.dataloader.source",
            "jsonl",
            "--validator.dataloader.source.dataset_path",
            "{dir}/empty.jsonl",
        ],
        "validator.dataloader is set but not read: validation follows the training data's held-out split "
        "(validator.follow_training_data). Add --validator.no-follow-training-data",
        files={"empty.jsonl": ""},
    ),
    Case(
        "outer-loop-key-on-a-ddp-config",
        ["--config", "ddp/adamw", "--outer.sync_every", "10"],
        "unknown config key '--outer.sync_every': ddp/adamw has no outer loop (it trains one data-parallel group); "
        "the outer-loop settings belong to a DiLoCo config such as --config diloco/diloco",
    ),
    # 5. dump folder
    Case("dump-folder-unwritable", ["--config", "ddp/adamw"], "cannot be created or written", dump=UNWRITABLE),
    Case("dump-folder-is-a-file", ["--config", "ddp/adamw"], "is a file", files={"a-file": "x"}, dump="{dir}/a-file"),
    Case(
        "dump-folder-under-a-file",
        ["--config", "ddp/adamw"],
        "is under {dir}/a-file, which is a file",
        files={"a-file": "x"},
        dump="{dir}/a-file/run",
    ),
    # 6. config modules
    Case(
        "config-syntax-error",
        ["--config", "{dir}/syntax.py"],
        "config module {dir}/syntax.py, line 3: syntax error",
        files={"syntax.py": "from muloco.config import load_config\n\ndef config(:\n    return load_config('base')\n"},
    ),
    Case(
        "config-raises",
        ["--config", "{dir}/raises.py"],
        "config module {dir}/raises.py, line 5: AttributeError",
        files={
            "raises.py": "from muloco.config import load_config\n\ndef config():\n"
            "    c = load_config('base')\n    c.training.no_such_field += 1\n    return c\n"
        },
    ),
    Case(
        "config-wrong-type",
        ["--config", "{dir}/wrong.py"],
        "config() returned dict, not a trainer config",
        files={"wrong.py": "def config():\n    return {'training': {'steps': 3}}\n"},
    ),
    Case(
        "config-without-config-function",
        ["--config", "{dir}/empty.py"],
        "has no function config()",
        files={"empty.py": "STEPS = 3\n"},
    ),
]

RESUME = ["--config", "base", *TINY, "--training.steps", "9", "--validator.freq", "1000"]

BAD_CHECKPOINTS = [
    Case("metadata-garbled", RESUME, "{dir}/out/checkpoint/step-7/.metadata has", code=3, corrupt=_garble_metadata),
    Case(
        "data-file-garbled",
        RESUME,
        "{dir}/out/checkpoint/step-7/__0_0.distcp does not match",
        code=3,
        corrupt=_garble_data,
    ),
    Case(
        "tensor-bytes-overwritten",
        RESUME,
        "{dir}/out/checkpoint/step-7/__0_0.distcp does not match",
        code=3,
        corrupt=_flip_tensor_bytes,
    ),
    Case(
        "data-file-truncated",
        RESUME,
        "checkpoint {dir}/out/checkpoint/step-7 is corrupt: {dir}/out/checkpoint/step-7/__0_0.distcp has 100 bytes",
        code=3,
        corrupt=_truncate_data,
        real_process=True,
    ),
    Case(
        "explicit-step-incomplete",
        [*RESUME, "--checkpoint.load_step", "7"],
        "checkpoint {dir}/out/checkpoint/step-7 is incomplete",
        code=3,
        corrupt=_remove_manifest,
    ),
    Case(
        "resume-another-flavor",
        [*RESUME, "--model.flavor", "llama3-w128-d4-h2"],
        "{dir}/out holds a run of another config (model.flavor llama3-w64-d2-h2 there, llama3-w128-d4-h2 here)",
        corrupt=lambda step: None,
    ),
    Case(
        "resume-another-config",
        [*RESUME[:1], "ddp/muon", *RESUME[2:]],
        "{dir}/out holds a run of another config (optimizer.name AdamW there, Muon here)",
        corrupt=lambda step: None,
    ),
    Case(
        "resume-another-data-source",
        [*RESUME, "--dataloader.source", "jsonl", "--dataloader.source.dataset_path", "{dir}/docs.jsonl"],
        "{dir}/out holds a run of another config (dataloader.source stdlib there, jsonl here), and this command would "
        "resume its checkpoint step-7: resume it with the settings in its run.json, or give a new --dump_folder (to "
        "start from its weights: --checkpoint.initial_load_path {dir}/out/checkpoint/step-7)",
        files={"docs.jsonl": _jsonl(*_docs(40))},
        corrupt=lambda step: None,
    ),
    Case(
        "explicit-step-missing",
        [*RESUME, "--checkpoint.load_step", "5"],
        "checkpoint step 5 does not exist in {dir}/out/checkpoint; steps present: 6, 7",
        code=3,
        corrupt=lambda step: None,
    ),
]

CASES = {case.id: case for case in BAD_INPUTS + BAD_CHECKPOINTS}


def _listing(folder: Path) -> dict[str, int]:
    """Every path under ``folder`` with its size (folders: -1)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1) for p in folder.rglob("*")}


def _write_checkpoints(folder: Path) -> subprocess.CompletedProcess:
    """7 steps, a checkpoint every 2 (and the last), keep 2, log every 5."""
    return run_train(
        [
            "--config",
            "base",
            *TINY,
            "--training.steps",
            "7",
            "--checkpoint.interval",
            "2",
            "--checkpoint.keep_latest_k",
            "2",
            "--metrics.log_freq",
            "5",
            "--validator.freq",
            "1000",
            "--dump_folder",
            str(folder),
        ]
    )


@dataclass
class Outcome:
    proc: subprocess.CompletedProcess
    folder: Path
    before: dict[str, int]
    after: dict[str, int]


class Runs:
    """The checkpoint writer and the real processes of the selected cases, two at a time in the
    background (the machine has two cores); the other cases run in the test that checks them."""

    def __init__(self, root: Path, cases: list[Case]):
        self.root = root
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.written = root / "written"
        self.writer = self.pool.submit(_write_checkpoints, self.written)
        checkpoint_cases_last = sorted((c for c in cases if c.real_process), key=lambda c: c.corrupt is not None)
        self.outcomes: dict[str, Future] = {c.id: self.pool.submit(self._run, c) for c in checkpoint_cases_last}

    def written_run(self) -> Path:
        proc = self.writer.result()
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return self.written

    def _prepare(self, case: Case) -> tuple[Path, list[str]]:
        """The case's folder with its files (and corrupted checkpoint); its command line."""
        folder = self.root / case.id
        folder.mkdir()
        for name, text in case.files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        if case.corrupt is not None:
            shutil.copytree(self.written_run(), folder / "out")
            case.corrupt(folder / "out" / "checkpoint" / "step-7")
        return folder, [*(case.fill(a, folder) for a in case.args), "--dump_folder", case.fill(case.dump, folder)]

    def _run(self, case: Case) -> Outcome:
        folder, args = self._prepare(case)
        before = _listing(folder)
        proc = run_train(args, quiet_s=240)
        return Outcome(proc, folder, before, _listing(folder))

    def outcome(self, case: Case, capfd, monkeypatch) -> Outcome:
        """The case's outcome: from its real process, or run here now."""
        if case.real_process:
            return self.outcomes[case.id].result()
        import muloco.train as train

        def refuse_to_train(config):
            raise AssertionError(f"{case.id}: the command passed its pre-flight checks and would train")

        monkeypatch.setattr(train, "_lock_run_folder", refuse_to_train)
        monkeypatch.setattr(train, "_exit_now", sys.exit)  # os._exit would end the test process
        folder, args = self._prepare(case)
        before = _listing(folder)
        proc = run_in_process(lambda: train.main(args), capfd, argv0="muloco.train", args=args)
        return Outcome(proc, folder, before, _listing(folder))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Runs:
    selected = [
        CASES[item.callspec.id]
        for item in request.session.items
        if item.module is request.module and getattr(item, "callspec", None) is not None and item.callspec.id in CASES
    ]
    runs = Runs(tmp_path_factory.mktemp("bad-inputs"), selected)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)


def _assert_one_clear_line(case: Case, outcome: Outcome) -> None:
    proc = outcome.proc
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == case.code, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("muloco train: error: "), proc.stderr
    assert case.fill(case.says, outcome.folder) in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "weights_only" not in lines[0]
    assert outcome.after == outcome.before, "the failed run wrote files"  # a new dump folder included
    assert not Path(UNWRITABLE).exists()


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.id for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_writes_nothing(runs, case, capfd, monkeypatch):
    _assert_one_clear_line(case, runs.outcome(case, capfd, monkeypatch))


@pytest.mark.parametrize("case", BAD_CHECKPOINTS, ids=[c.id for c in BAD_CHECKPOINTS])
def test_bad_checkpoint_is_one_line_and_writes_nothing(runs, case, capfd, monkeypatch):
    _assert_one_clear_line(case, runs.outcome(case, capfd, monkeypatch))


def test_keep_latest_k_leaves_exactly_k_complete_checkpoints(runs):
    checkpoints = runs.written_run() / "checkpoint"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-6", "step-7"]  # saved: 2, 4, 6, 7
    assert all((checkpoints / step / MANIFEST).is_file() for step in ("step-6", "step-7"))
    manifest = json.loads((checkpoints / "step-7" / MANIFEST).read_text())
    assert {".metadata", "__0_0.distcp"} <= manifest["files"].keys()
    entry = manifest["files"]["__0_0.distcp"]
    assert entry["size"] == (checkpoints / "step-7" / "__0_0.distcp").stat().st_size and len(entry["sha256"]) == 64


def test_final_train_loss_is_the_last_steps(runs):
    """7 steps with log_freq 5: the last step is logged, and the summary reports it."""
    folder = runs.written_run()
    losses = {r["step"]: r["loss"] for r in read_metrics(folder) if "loss" in r}
    assert sorted(losses) == [1, 5, 7]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["final_train_loss"] == pytest.approx(losses[7])


def test_resume_skips_an_incomplete_checkpoint(runs, tmp_path):
    """A save killed before it was sealed (here: its manifest removed) is skipped, with one
    warning line, and the run resumes from the newest complete checkpoint."""
    out = tmp_path / "out"
    shutil.copytree(runs.written_run(), out)
    _remove_manifest(out / "checkpoint" / "step-7")
    proc = run_train([*RESUME, "--training.steps", "8", "--dump_folder", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if "skipping incomplete checkpoint" in line]
    assert len(warnings) == 1 and "step-7" in warnings[0] and "resuming from step 6" in warnings[0], log[-3000:]
    assert "Training starts at step 7" in log


def test_async_saves_are_sealed_when_they_finish(tmp_path):
    """checkpoint.async_mode 'async': each save gets its manifest once it has finished, and
    keep_latest_k counts them like synchronous ones."""
    out = tmp_path / "out"
    proc = run_train(
        [
            "--config",
            "base",
            *TINY,
            "--training.steps",
            "5",
            "--checkpoint.interval",
            "2",
            "--checkpoint.async_mode",
            "async",
            "--validator.freq",
            "1000",
            "--dump_folder",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoints = out / "checkpoint"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4", "step-5"]  # saved: 2, 4 (async), 5 (last)
    assert all((checkpoints / step / MANIFEST).is_file() for step in ("step-4", "step-5"))


# ------------------------------------------------------------- in-process checks


def test_every_float_setting_rejects_inf_and_nan():
    from muloco import compat

    compat.apply()
    from muloco.config import ConfigError, load_config
    from muloco.config.checks import check_config
    from muloco.config.cli import valid_keys

    keys = [k for k, v in valid_keys(load_config("diffusion/muloco_2bit")).items() if isinstance(v, float)]
    assert {
        "optimizer.lr",
        "optimizer.beta1",
        "training.max_norm",
        "outer.optimizer.lr",
        "outer.fragment_update_alpha",
        "optimizer.head_lr_factor",
        "outer.exchange.bucket_mb",
        "outer.exchange.error_feedback.beta",
        "objective.eps",
        "objective.cart_p",
    } <= set(keys)
    for key in keys:
        for bad in (math.inf, -math.inf, math.nan):
            config = load_config("diffusion/muloco_2bit")
            section, _, leaf = key.rpartition(".")
            target = config
            for part in section.split("."):
                target = getattr(target, part) if part else target
            setattr(target, leaf, bad)
            with pytest.raises(ConfigError, match=f"^{key} is {bad!r}; it must be a finite number"):
                check_config(config)


@pytest.mark.parametrize("flavor", ["llama3-w64-d2-h2", "llama3-w128-d4-h2_qk_torch-rmsnorm_pa_pf"])
def test_layer_units_match_the_built_model(flavor):
    """The preflight count (depth + 2) is what the outer loop's fragment split sees."""
    from muloco import compat

    compat.apply()
    import torch

    from muloco.config.checks import model_units
    from muloco.models import ModelConfig, build_model_config
    from muloco.outer.schedule import _units, model_fragments

    with torch.device("meta"):
        model = build_model_config(ModelConfig(flavor=flavor), vocab_size=512).build()
    assert model_units(flavor) == len(_units(model))
    assert len(model_fragments(model, model_units(flavor))) == model_units(flavor)


def test_unpickling_error_never_suggests_weights_only_false():
    from muloco import compat

    compat.apply()
    from muloco.compat.checkpoint_safety import UnsafeCheckpointError, _load_plain

    with pytest.raises(UnsafeCheckpointError) as err:
        _load_plain(io.BytesIO(b"\x80\x02garbage that is not a pickle" * 10))
    assert "weights_only" not in str(err.value) and "refusing to unpickle" in str(err.value)


# ------------------------------------------------------------- optional extras


def test_a_missing_extra_is_one_error_naming_it(monkeypatch, tmp_path, capsys):
    """The core install has no matplotlib, wandb, transformers or lm-eval: a command that needs one
    names the extra that installs it; the report still writes its tables without plots."""
    from muloco import compat
    from muloco.utils import optional

    compat.apply()
    from muloco.config import ConfigError, load_config
    from muloco.config.checks import check_config
    from muloco.report.plots import write_plots

    for module, extra in optional.EXTRAS.items():
        monkeypatch.setitem(sys.modules, module, None)  # taken away, as in an install without the extra
        assert not optional.installed(module)
        with pytest.raises(optional.MissingExtra, match=rf"needs the optional extra '{extra}' .*muloco\[{extra}\]"):
            optional.require(module, "this command")
    config = load_config("diloco/muloco_2bit")
    config.metrics.enable_wandb = True
    with pytest.raises(ConfigError, match=r"^metrics.enable_wandb needs the optional extra 'wandb'"):
        check_config(config)
    assert write_plots([], tmp_path / "plots") == [] and not list((tmp_path / "plots").iterdir())
    assert "no plots: the report's plots needs the optional extra 'plots'" in capsys.readouterr().err


def test_files_written_atomically_are_readable_as_the_umask_says(tmp_path):
    """tempfile makes 0600 files; run.json, checkpoint manifests and sweep manifests take the mode
    a normal file would have, so a teammate on a shared cluster can read them."""
    from muloco.utils.atomic_file import umask, write_atomically

    for mask, mode in ((0o022, 0o644), (0o027, 0o640), (0o077, 0o600)):
        old = os.umask(mask)
        try:
            assert umask() == mask
            write_atomically(tmp_path / f"run-{mask:o}.json", "{}")
        finally:
            os.umask(old)
        assert (tmp_path / f"run-{mask:o}.json").stat().st_mode & 0o777 == mode


def test_a_utf16_jsonl_line_is_named_as_such():
    from muloco.data.corpus import DataError, parse_jsonl_line

    with pytest.raises(DataError, match=r"f.jsonl:3: UTF-16 text .* convert the file, e.g. `iconv -f utf-16"):
        parse_jsonl_line('{"text": "x"}'.encode("utf-16"), Path("f.jsonl"), 3, "text")
