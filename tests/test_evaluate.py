"""``python -m muloco.evaluate``: lm-evaluation-harness on a six-item local task
(tests/data/lm_eval/) gives, for a next-token and a masked-diffusion run, the accuracy that
scoring the choices by hand with muloco's scorer gives; a folder exported from the run scores
the same; results land in eval/<task>.json and the report shows them; bad input is one error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, run_train

from muloco import compat

compat.apply()

from muloco.evaluate.__main__ import main  # noqa: E402
from muloco.objectives.likelihood import autoregressive_nll, diffusion_nll  # noqa: E402
from muloco.trained_model import load_config, load_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # hang timeouts: trainings and evaluations on 2 cores

TASKS = REPO / "tests" / "data" / "lm_eval"
TASK = "muloco_tiny_mc"
ITEMS = [json.loads(line) for line in (TASKS / f"{TASK}.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path_factory):
    """The task's data path is relative to the repository; datasets stay offline, cached in a temp folder."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf-datasets"))


def _train(folder: Path, *objective: str) -> Path:
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *objective,
            *TINY,
            "--training.steps",
            "4",
            "--checkpoint.interval",
            "4",
            "--validator.freq",
            "4",
            "--dump_folder",
            str(folder),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("eval") / "ar")


def _evaluate(source: Path, *extra: str) -> dict:
    assert main([str(source), "--tasks", TASK, "--include-path", str(TASKS), *extra]) == 0
    return json.loads((source / "eval" / f"{TASK}.json").read_text())


def _by_hand(nll) -> tuple[float, float]:
    """acc and acc_norm from −log p of each choice (lm-eval's tokenization: context and
    " " + choice encoded together, then split; acc_norm divides by the choice's bytes)."""
    right = right_norm = 0
    for item in ITEMS:
        scores = [nll(item["question"], " " + choice) for choice in item["choices"]]
        right += min(range(len(scores)), key=scores.__getitem__) == item["answer"]
        norm = [s / len((" " + c).encode()) for s, c in zip(scores, item["choices"])]
        right_norm += min(range(len(norm)), key=norm.__getitem__) == item["answer"]
    return right / len(ITEMS), right_norm / len(ITEMS)


def _split(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    ctx = tokenizer.encode(context, add_bos=True)
    return ctx, tokenizer.encode(context + continuation, add_bos=True)[len(ctx) :]


def test_an_ar_run_scores_as_by_hand_and_its_export_scores_the_same(ar_run, tmp_path, capsys):
    result = _evaluate(ar_run)
    assert result["model"] == {"source": "run", "objective": "ar", "step": 4, "weights": "model"}
    assert result["n_samples"]["effective"] == len(ITEMS) and result["mc_samples"] is None
    model, tokenizer, *_ = load_model(ar_run, load_config(ar_run), None, torch.device("cpu"))
    acc, acc_norm = _by_hand(lambda c, t: autoregressive_nll(model, *_split(tokenizer, c, t), torch.device("cpu")))
    assert (result["metrics"]["acc"], result["metrics"]["acc_norm"]) == (acc, acc_norm)
    assert "muloco_tiny_mc" in capsys.readouterr().out

    from muloco.report.__main__ import main as report

    assert report([str(ar_run), "--out", str(tmp_path / "report")]) == 0
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert header.split()[-2:] == [TASK, "acc_norm"] and row.split()[-1] == f"{acc_norm:.4f}"
    assert json.loads((tmp_path / "report" / "report.json").read_text())["rows"][0]["evaluations"] == {
        f"{TASK} acc_norm": acc_norm
    }

    from muloco.export.__main__ import main as export

    assert export([str(ar_run), "--out", str(tmp_path / "hf")]) == 0
    exported = _evaluate(tmp_path / "hf")
    assert exported["model"]["source"] == "huggingface" and exported["metrics"] == result["metrics"]
    elsewhere = tmp_path / "results" / "hf"  # --out: the results go there, the model's folder is left as it was
    assert main([str(tmp_path / "hf"), "--tasks", TASK, "--include-path", str(TASKS), "--out", str(elsewhere)]) == 0
    assert json.loads((elsewhere / f"{TASK}.json").read_text())["metrics"] == result["metrics"]


def test_an_mdlm_run_scores_as_by_hand_with_the_same_monte_carlo_draws(tmp_path):
    run = _train(tmp_path / "mdlm", "--objective", "mdlm")
    result = _evaluate(run, "--mc-samples", "8", "--batch-size", "4", "--seed", "3")
    assert result["model"]["objective"] == "mdlm" and result["mc_samples"] == 8
    model, tokenizer, *_ = load_model(run, load_config(run), None, torch.device("cpu"))

    def nll(context: str, continuation: str) -> float:
        return diffusion_nll(
            model,
            *_split(tokenizer, context, continuation),
            tokenizer.mask_id,
            samples=8,
            batch=4,
            generator=torch.Generator().manual_seed(3),
            device=torch.device("cpu"),
        )

    assert (result["metrics"]["acc"], result["metrics"]["acc_norm"]) == _by_hand(nll)


def test_a_generation_task_gets_the_greedy_text_muloco_samples(ar_run, tmp_path):
    """generate_until: greedy tokens from muloco's sampler, cut at the task's stop string."""
    from muloco.objectives.sampling import sample_autoregressive, until_eos

    gen = "muloco_tiny_gen"
    assert main([str(ar_run), "--tasks", gen, "--include-path", str(TASKS), "--log-samples"]) == 0
    record = json.loads((ar_run / "eval" / f"{gen}.json").read_text())
    model, tokenizer, *_ = load_model(ar_run, load_config(ar_run), None, torch.device("cpu"))
    items = [json.loads(line) for line in (TASKS / f"{gen}.jsonl").read_text().splitlines()]
    expected = []
    for item in items:
        tokens = sample_autoregressive(
            model,
            tokenizer.encode(item["prompt"], add_bos=True),
            tokenizer.eos_id,
            12,
            0.0,
            torch.Generator().manual_seed(0),
            torch.device("cpu"),
        )
        expected.append(tokenizer.decode(until_eos(tokens, tokenizer.eos_id)).split("\n")[0])
    assert record["samples"] == expected
    assert record["metrics"]["exact_match"] == sum(e == i["answer"] for e, i in zip(expected, items)) / len(items)


def test_a_bad_option_or_an_unwritable_out_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    """Checked before lm-eval indexes its tasks or any model loads: no run is needed to be refused."""
    assert main([str(tmp_path), "--tasks", TASK, "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "muloco evaluate: error: --batch-size 0: must be at least 1"
    monkeypatch.setattr("muloco.evaluate.__main__._task_manager", None)  # never reached
    assert main([str(tmp_path), "--tasks", TASK, "--out", "/proc/muloco-eval"]) == 2
    assert "cannot write the results to /proc/muloco-eval" in capsys.readouterr().err


def test_an_unknown_task_a_bad_option_and_a_missing_harness_are_one_error(ar_run, capsys, monkeypatch):
    assert main([str(ar_run), "--tasks", "no_such_task_xyz", "--include-path", str(TASKS)]) == 2
    err = capsys.readouterr().err
    assert "no task 'no_such_task_xyz'" in err and "--include-path" in err and err.count("\n") == 1
    assert main([str(ar_run), "--tasks", TASK[:-1] + "x", "--include-path", str(TASKS)]) == 2  # a typo
    assert f"Did you mean {TASK}" in capsys.readouterr().err
    assert main([str(ar_run), "--tasks", TASK, "--mc-samples", "0"]) == 2
    assert "--mc-samples 0" in capsys.readouterr().err
    assert main([str(ar_run), "--tasks", TASK, "--limit", "nan"]) == 2
    assert "--limit nan: must be a number of items" in capsys.readouterr().err
    out = ar_run / "elsewhere" / "eval"
    assert (
        main(
            [
                str(ar_run),
                "--tasks",
                "muloco_tiny_gen",
                "--include-path",
                str(TASKS),
                "--block-length",
                "5",
                "--out",
                str(out),
            ]
        )
        == 2
    )  # refused on the task's config, before the model loads
    assert "--block-length 5 does not divide task muloco_tiny_gen's max_gen_toks 12" in capsys.readouterr().err
    assert not (ar_run / "elsewhere").exists()
    monkeypatch.setattr("muloco.evaluate.__main__._task_manager", None)  # an --out it cannot write is refused first
    assert main([str(ar_run), "--tasks", TASK, "--out", "/proc/muloco-eval"]) == 2
    assert "cannot write the results to /proc/muloco-eval" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if the optional extra were not installed
    assert main([str(ar_run), "--tasks", TASK]) == 2
    assert "pip install 'muloco[eval]'" in capsys.readouterr().err
