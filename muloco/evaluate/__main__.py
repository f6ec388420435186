"""Evaluate a run or a Hugging Face folder with lm-evaluation-harness.

    python -m muloco.evaluate RUN_FOLDER|HF_DIR --tasks hellaswag,arc_easy [--limit N] [--batch-size B]
        [--num-fewshot K] [--mc-samples 128] [--include-path DIR] [--step N] [--replica i]
        [--device auto] [--seed 0] [--block-length L] [--log-samples] [--max-length N] [--out DIR]

A run folder is scored from its newest complete checkpoint (θ_g for a DiLoCo run), a Hugging
Face folder (``muloco.export``'s, or a Llama-family model's) from its weights; both as
muloco's own model (:mod:`muloco.evaluate.source`) through :class:`muloco.evaluate.harness.MulocoLM`.
Each task's figures go to ``<folder>/eval/<task>.json`` or ``--out DIR`` (written atomically; a run's folder
is the one holding ``run.json``), where ``python -m muloco.report`` shows them as columns.
``--include-path`` adds a folder of task YAMLs (your own tasks on local data). lm-eval is an
optional extra: ``pip install -e '.[eval]'``.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from muloco.utils.atomic_file import write_atomically
from muloco.utils.command_line import UsageError, failed, parse, run_main, tyro
from muloco.utils.created_dirs import make_dirs, remove_dirs
from muloco.utils.errors import BAD_INPUT, MulocoError

# torch, torchtitan and lm-eval are imported once the command line is parsed (in ``main`` and
# ``evaluate``): ``--help`` and a usage error answer without them.

PROG = "python -m muloco.evaluate"


@dataclass
class EvaluateOptions:
    """Evaluate a run or a Hugging Face folder with lm-evaluation-harness."""

    source: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN_FOLDER|HF_DIR")]]
    """A run's dump folder (or replica folder, or checkpoint/step-N), or a Hugging Face model folder."""
    tasks: str
    """Comma-separated lm-eval task names (globs allowed)."""
    limit: float | None = None
    """Items per task (a fraction if below 1)."""
    batch_size: int = 8
    """Requests per forward (causal) / Monte Carlo rows per forward (diffusion)."""
    num_fewshot: int | None = None
    """Few-shot examples (default: the task's)."""
    mc_samples: int = 128
    """Diffusion: Monte Carlo rows per log-likelihood."""
    block_length: int | None = None
    """Diffusion generation: semi-AR block length."""
    include_path: str | None = None
    """A folder of extra task YAMLs."""
    max_length: int | None = None
    """Longest sequence scored, contexts cut on the left (default: the model's training length).
    Lower it when a long-context model's logits would not fit in memory."""
    step: int | None = None
    """A run's checkpoint step (default: the newest complete)."""
    replica: int | None = None
    """A DiLoCo run's replica folder (default 0)."""
    adapter: str | None = None
    """A peft LoRA adapter folder to apply to the Hugging Face folder (a LoRA run's export writes one in
    adapter/); one muloco exported must go onto the base it was trained on."""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda, cuda:N."""
    log_samples: bool = False
    """Also keep each item's answer in eval/<task>.json (generated text, or choice scores)."""
    seed: int = 0
    """Seed of the Monte Carlo draws, sampling and few-shot picks."""
    out: str | None = None
    """Folder for the results (default: the source's eval/)."""


def _check(args: EvaluateOptions) -> list[str]:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UsageError("--tasks names no task; give lm-eval task names, e.g. --tasks hellaswag,arc_easy")
    for name, low in (
        ("batch_size", 1),
        ("mc_samples", 1),
        ("num_fewshot", 0),
        ("step", 0),
        ("block_length", 1),
        ("max_length", 2),
    ):
        value = getattr(args, name)
        if value is not None and value < low:
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be at least {low}")
    if args.limit is not None and not math.isfinite(args.limit):
        raise UsageError(f"--limit {args.limit}: must be a number of items, or a fraction below 1")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit {args.limit:g}: must be positive (items, or a fraction below 1)")
    if args.include_path and not Path(args.include_path).is_dir():
        raise UsageError(f"--include-path {args.include_path}: not a folder of task YAMLs")
    return tasks


@functools.lru_cache(maxsize=4)
def _task_index(include_path: str | None, _version: float):
    """lm-eval's ``TaskManager``, which indexes every task YAML lm-eval ships (about 4 s): built once
    per include path (and its folder's modification time, ``_version``) in a process that evaluates
    more than once (a notebook, a test)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _task_manager(include_path: str | None, tasks: list[str]):
    folder = Path(include_path) if include_path else None  # its newest change: an edited YAML is read again
    version = max((p.stat().st_mtime for p in (folder, *folder.rglob("*"))), default=0.0) if folder else 0.0
    manager = _task_index(include_path, version)
    found = manager.match_tasks(tasks)
    missing = [t for t in tasks if t not in found and not fnmatch.filter(found, t)]
    if missing:
        close = difflib.get_close_matches(missing[0], manager.all_tasks, n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UsageError(
            f"--tasks: lm-eval knows no task {missing[0]!r}.{hint} See `lm-eval ls tasks`, or pass "
            f"--include-path DIR for a folder of your own task YAMLs"
        )
    return manager


def _check_block_length(manager, tasks: list[str], block_length: int | None) -> None:
    """``--block-length`` must divide every generation task's ``max_gen_toks``: checked on the
    tasks' configs before any model loads (the tasks load again, from the cache, in the run)."""
    if block_length is None:
        return
    from muloco.evaluate.harness import DEFAULT_GEN_TOKENS  # torch-bound: imported once the command line parsed

    for name, task in manager.load(tasks)["tasks"].items():
        if task.get_config("output_type") != "generate_until":
            continue
        length = int((task.get_config("generation_kwargs") or {}).get("max_gen_toks", DEFAULT_GEN_TOKENS))
        if length % block_length:
            raise UsageError(
                f"--block-length {block_length} does not divide task {name}'s max_gen_toks {length}; "
                f"choose a divisor of it"
            )


def _check_block_model(manager, tasks: list[str], source) -> None:
    """A block-wise diffusion model generates but does not score continuations yet: its
    log-likelihood tasks are refused before any task runs."""
    if not source.readout.block_size:
        return
    for name, task in manager.load(tasks)["tasks"].items():
        if task.get_config("output_type") != "generate_until":
            raise UsageError(
                f"task {name} scores continuations ({task.get_config('output_type')}); "
                f"{source.results_dir} is a block-wise diffusion model (--objective.recipe block), whose bound "
                "muloco does not "
                "score yet: evaluate it on generation tasks"
            )


def _writable(folder: Path) -> None:
    """Fail before the evaluation, not after it, when its results could not be written; the
    folders the probe made are removed again (a failed evaluation leaves no empty ``eval/``)."""
    try:
        created = make_dirs(str(folder))
        probe = folder / ".muloco-write-probe"
        probe.write_text("")
        probe.unlink()
        remove_dirs(created)
    except OSError as e:
        raise UsageError(
            f"cannot write the results to {folder} ({e.strerror}); give --out DIR, or evaluate a copy of the folder "
            "in a place you can write to"
        ) from None


def results_folder(source, args: EvaluateOptions) -> Path:
    """``--out``, or the source's own ``eval/`` folder."""
    return Path(args.out) if args.out else Path(source.results_dir) / "eval"


def _file_name(task: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", task) + ".json"


def _metrics(reported: dict) -> dict[str, float]:
    """lm-eval's ``"acc,none"`` keys as ``acc`` (``acc/<filter>`` under a filter), numbers only."""
    out = {}
    for key, value in reported.items():
        name, _, flt = key.partition(",")
        if flt and isinstance(value, (int, float)):
            out[name if flt == "none" else f"{name}/{flt}"] = value
    return out


def _answer(item: dict):
    """One logged item's answer after the task's filters: the text generated, or the choices'
    (log-likelihood, is-greedy) pairs."""
    answer = item["filtered_resps"]
    return answer[0] if isinstance(answer, list) and len(answer) == 1 and isinstance(answer[0], str) else answer


def write_results(results: dict, source, args: EvaluateOptions, seconds: float) -> list[Path]:
    """One ``eval/<task>.json`` per task lm-eval reported."""
    import lm_eval

    folder = results_folder(source, args)
    make_dirs(str(folder))
    written = []
    for task, metrics in results["results"].items():
        record = {
            "task": task,
            "metrics": _metrics(metrics),
            "n_samples": results.get("n-samples", {}).get(task),
            "num_fewshot": results.get("n-shot", {}).get(task),
            "limit": args.limit,
            "mc_samples": None if source.causal else args.mc_samples,
            "seed": args.seed,
            "model": source.facts,
            "lm_eval": lm_eval.__version__,
            "seconds": round(seconds, 1),
        }
        if args.log_samples and task in results.get("samples", {}):
            record["samples"] = [_answer(item) for item in sorted(results["samples"][task], key=lambda i: i["doc_id"])]
        path = folder / _file_name(task)
        write_atomically(path, json.dumps(record, indent=2, default=str) + "\n")
        written.append(path)
    return written


def _summary(written: list[Path]) -> str:
    lines = []
    for path in written:
        record = json.loads(path.read_text())
        metrics = record["metrics"]
        for name, value in metrics.items():
            if name.endswith("_stderr") or "_stderr/" in name:
                continue
            err = metrics.get(name.replace("/", "_stderr/", 1) if "/" in name else f"{name}_stderr")
            spread = f" ± {err:.4f}" if isinstance(err, (int, float)) else ""
            lines.append(f"{record['task']:30s} {name:20s} {value:.4f}{spread}")
    return "\n".join(lines)


def evaluate(args: EvaluateOptions) -> tuple[dict, list[Path]]:
    tasks = _check(args)
    if args.out:  # before lm-eval indexes its tasks and the model loads (minutes under load)
        _writable(Path(args.out))
    try:
        from lm_eval import simple_evaluate
    except ImportError:
        raise UsageError(
            "lm-evaluation-harness is not installed; it is the optional extra 'eval': "
            "pip install 'muloco[eval]' (in a clone: .venv/bin/pip install -e '.[eval]')"
        ) from None
    # torch-bound, so imported only once the command line parsed (--help and usage errors stay fast)
    from muloco import compat

    compat.apply()  # before torchtitan is imported
    import torch

    from muloco.evaluate.harness import MulocoLM
    from muloco.evaluate.source import load

    manager = _task_manager(args.include_path, tasks)
    _check_block_length(manager, tasks, args.block_length)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    source = load(args.source, step=args.step, replica=args.replica, device=device, adapter=args.adapter)
    _check_block_model(manager, tasks, source)
    if args.max_length is not None:
        source.max_length = min(source.max_length, args.max_length)
    _writable(results_folder(source, args))
    lm = MulocoLM(
        source, batch_size=args.batch_size, mc_samples=args.mc_samples, seed=args.seed, block_length=args.block_length
    )
    began = time.monotonic()
    results = simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        task_manager=manager,
        log_samples=args.log_samples,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    return results, write_results(results, source, args, time.monotonic() - began)


def main(argv: list[str] | None = None) -> int:
    try:
        args, _ = parse(
            EvaluateOptions,
            list(sys.argv[1:] if argv is None else argv),
            prog=PROG,
            description=__doc__.split("\n\n")[0],
            overrides=False,
        )
    except UsageError as err:
        return failed("evaluate", err)
    # torch-bound, so imported only once the command line parsed (--help and usage errors stay fast)
    from muloco import compat

    compat.apply()  # before torchtitan is imported
    try:
        results, written = evaluate(args)
    except MulocoError as err:
        return failed("evaluate", err)
    except ValueError as err:  # a library's refusal of the input (lm-eval's task options)
        return failed("evaluate", err, BAD_INPUT)
    print(_summary(written))
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    run_main(main)
