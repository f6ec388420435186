"""From a pretrained AR model to a diffusion LM, measured on the embedded corpus (issue 57).

    .venv/bin/python bench/conversion.py [--out DIR] [--seeds 0,1] [--ar-steps 600] [--steps 400]
        [--eval-every 50] [--recipes full,dream,block] [--sft-steps 120] [--skip-sft] [--json PATH] [--smoke]

(``--out`` defaults to outputs/bench-conversion; runs already finished there are reused.)

1. Conversion. A tiny AR model is trained with muloco (``ddp/adamw``) and exported to a Hugging
   Face folder; masked-diffusion runs (``diffusion/ddp_adamw``, same shapes: ``--model.flavor
   hf:EXPORT``) then start from it with each recipe (``--objective.recipe full|dream|block``) and,
   as the baseline, from scratch, for ``--steps`` steps with validation every ``--eval-every``,
   per seed. The table gives validation NELBO (nats/token, the mean over seeds, ± half the range)
   at each validation step, and for each AR-initialised recipe the first step whose mean reaches
   scratch's final mean (target: <= 0.5x the steps with at least one recipe). Caveat printed with
   it: ``block``'s NELBO bounds the likelihood of a block-wise model (each block given the clean
   ones before it), ``dream``'s leaves out a row's first token; both are bounds on the NLL of the
   text, not the same estimator as ``full``'s.
2. LoRA under K=2 MuLoCo (``diffusion/muloco``, Muon inside), SFT of the converted model on
   prompt/response rows made from the standard library's documented functions (prompt: the
   signature and docstring; response: the body): full fine-tune, LoRA r=8 with AdamW on A/B
   (the default: A and B are not Muon's hidden matrices) and LoRA r=8 with Muon on A/B
   (``--optimizer.muon_pattern``), per seed: final validation loss and bytes sent per sync, and
   the ratio to the full fine-tune's.

Every run is a real job (``muloco.train``, ``muloco.launch.local`` for K=2) in ``--out``; the
commands are printed. ``--smoke``: the tiny flavor, a few steps, one seed, the last recipe given (each
recipe's own smoke is tests/test_recipes.py) and the LoRA-AdamW SFT row alone (its ratios against
itself; tests/test_convert_job.py runs a full conversion job). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def run(cmd: list[str], log: Path) -> None:
    """One job, its output to ``log``; a failure stops the bench with the log's tail."""
    print("$ " + " ".join(cmd), flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        sys.exit(f"{cmd[2]} exited {code}; {log}:\n" + log.read_text()[-3000:])


def validation(folder: Path) -> dict[int, float]:
    """step → validation loss from a run's metrics.jsonl."""
    out = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "validation_loss" in row:
            out[row["step"]] = row["validation_loss"]
    return out


def sft_rows(path: Path, limit: int) -> int:
    """Prompt/response lines from documented functions of the standard library."""
    rows = []
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            source = file.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node) or len(node.body) < 2:
                continue
            lines = source.splitlines()
            split = node.body[1].lineno - 1
            prompt = "\n".join(lines[node.lineno - 1 : split]) + "\n"
            response = "\n".join(lines[split : node.end_lineno]) + "\n"
            if 20 < len(response) < 600:
                rows.append({"prompt": prompt, "response": response})
        if len(rows) >= limit:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:limit]))
    return min(len(rows), limit)


def mean_spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (max(values) - min(values)) / 2


def conversion(args, out: Path, shape: list[str]) -> tuple[Path, dict]:
    ar, export = out / "ar", out / "ar-hf"
    if not export.is_dir():
        run(
            [
                PY,
                "-m",
                "muloco.train",
                "--config",
                "ddp/adamw",
                *shape,
                *args.ar_flavor,
                "--training.steps",
                str(args.ar_steps),
                "--checkpoint.interval",
                str(args.ar_steps),
                "--validator.freq",
                str(args.ar_steps),
                "--dump_folder",
                str(ar),
            ],
            out / "ar.log",
        )
        run([PY, "-m", "muloco.export", str(ar), "--out", str(export)], out / "ar-export.log")
    start = ["--model.flavor", f"hf:{export}", "--tokenizer.path", str(export)]
    load = [
        "--checkpoint.initial_load_path",
        str(export),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_model_only",
    ]
    recipes = {"scratch": [], **{r: [*load, "--objective.recipe", r, *RECIPE_FLAGS.get(r, [])] for r in args.recipes}}
    curves: dict[str, list[dict[int, float]]] = {}
    for name, flags in recipes.items():
        for seed in args.seeds:
            folder = out / f"{name}-seed{seed}"
            if not (folder / "summary.json").is_file():
                run(
                    [
                        PY,
                        "-m",
                        "muloco.train",
                        "--config",
                        "diffusion/ddp_adamw",
                        *shape,
                        *start,
                        *flags,
                        "--training.steps",
                        str(args.steps),
                        "--validator.freq",
                        str(args.eval_every),
                        "--checkpoint.interval",
                        str(args.steps),
                        "--debug.seed",
                        str(seed),
                        "--objective.seed",
                        str(seed),
                        "--dump_folder",
                        str(folder),
                    ],
                    out / f"{name}-seed{seed}.log",
                )
            curves.setdefault(name, []).append(validation(folder))
    return export, curves


RECIPE_FLAGS = {"dream": ["--objective.weight", "cart"], "block": ["--objective.recipe.block_size", "16"]}


def conversion_table(curves: dict, steps: int) -> dict:
    points = sorted(curves["scratch"][0])
    print("\nvalidation NELBO (nats/token), mean over seeds ± half range")
    print(f"{'run':<10}" + "".join(f"{'step ' + str(s):>16}" for s in points))
    means = {}
    for name, runs in curves.items():
        means[name] = {s: mean_spread([r[s] for r in runs]) for s in points}
        print(f"{name:<10}" + "".join(f"{m:>9.4f} ±{h:.3f}" for m, h in means[name].values()))
    target = means["scratch"][points[-1]][0]
    print(f"\nscratch's final NELBO {target:.4f} at step {points[-1]}; AR-initialised, first step reaching it:")
    reached = {}
    for name in curves:
        if name == "scratch":
            continue
        step = next((s for s in points if means[name][s][0] <= target), None)
        reached[name] = step
        ratio = "not reached" if step is None else f"step {step} = {step / steps:.2f}x the steps"
        print(f"  {name:<8} {ratio}{'  (target <= 0.5x: met)' if step is not None and step / steps <= 0.5 else ''}")
    print("  (block's NELBO bounds a block-wise model's likelihood, dream's leaves out each row's first token)")
    return {"means": {n: {str(s): v for s, v in m.items()} for n, m in means.items()}, "reached": reached}


def lora_sft(args, out: Path, shape: list[str], export: Path) -> dict:
    data = out / "sft.jsonl"
    if not data.is_file():
        print(f"SFT rows: {sft_rows(data, 3000 if not args.smoke else 200)} from the standard library's functions")
    base = [
        "--model.flavor",
        f"hf:{export}",
        "--tokenizer.path",
        str(export),
        "--checkpoint.initial_load_path",
        str(export),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_model_only",
        "--dataloader.source",
        "sft",
        "--dataloader.source.dataset_path",
        str(data),
        "--objective.normaliser",
        "sequence",
        "--objective.no-document-mask",
        "--objective.truncate_probability",
        "0",
    ]
    variants = {
        "full": [],
        "lora-adamw": ["--model.lora.rank", "8"],
        "lora-muon": ["--model.lora.rank", "8", "--optimizer.muon_pattern", r"lora_[AB]\.weight$"],
    }
    if args.smoke:  # the same pipeline, one K=2 run: the LoRA row (its ratio against itself)
        del variants["lora-muon"], variants["full"]
    results: dict[str, list[tuple[float, float]]] = {}
    for name, flags in variants.items():
        for seed in args.seeds:
            folder = out / f"sft-{name}-seed{seed}"
            if not (folder / "replica_0" / "summary.json").is_file():
                run(
                    [
                        PY,
                        "-m",
                        "muloco.launch.local",
                        "--config",
                        "diffusion/muloco",
                        "--replicas",
                        "2",
                        "--",
                        *shape,
                        *base,
                        *flags,
                        "--training.steps",
                        str(args.sft_steps),
                        "--outer.sync_every",
                        str(max(1, args.sft_steps // 4)),
                        "--validator.freq",
                        str(args.sft_steps),
                        "--checkpoint.interval",
                        str(args.sft_steps),
                        "--debug.seed",
                        str(seed),
                        "--objective.seed",
                        str(seed),
                        "--dump_folder",
                        str(folder),
                    ],
                    out / f"sft-{name}-seed{seed}.log",
                )
            summary = json.loads((folder / "replica_0" / "summary.json").read_text())
            syncs = summary["diloco"]["syncs_committed"]
            results.setdefault(name, []).append(
                (summary["final_validation_loss"], summary["diloco"]["bytes_sent"] / max(syncs, 1))
            )
    print("\nSFT under K=2 MuLoCo (diffusion/muloco), from the AR export (recipe full)")
    print(f"{'run':<12}{'val loss (mean ± half range)':>30}{'bytes/sync':>14}{'bytes ratio':>13}{'loss gap':>10}")
    base = results.get("full") or next(iter(results.values()))  # --smoke runs no full row
    full_loss, _ = mean_spread([r[0] for r in base])
    full_bytes = statistics.fmean(r[1] for r in base)
    table = {}
    for name, rows in results.items():
        loss, half = mean_spread([r[0] for r in rows])
        sent = statistics.fmean(r[1] for r in rows)
        table[name] = {"loss": loss, "half_range": half, "bytes_per_sync": sent}
        print(f"{name:<12}{loss:>22.4f} ±{half:.4f}{sent:>14,.0f}{full_bytes / sent:>12.1f}x{loss - full_loss:>+10.4f}")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="default outputs/bench-conversion (--smoke: a temporary folder)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--ar-steps", type=int, default=600)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--recipes", default="full,dream,block")
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--skip-sft", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.recipes = args.recipes.split(",")
    shape = ["--training.seq_len", "256", "--training.local_batch_size", "8", "--validator.steps", "8"]
    if args.smoke:
        args.seeds, args.ar_steps, args.steps, args.eval_every, args.sft_steps = [0], 4, 4, 2, 4
        args.recipes = args.recipes[-1:]  # the pipeline once; tests/test_recipes.py runs every recipe
        shape = [
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--validator.steps",
            "2",
            "--lr_scheduler.warmup_steps",
            "1",
        ]
    args.ar_flavor = ["--model.flavor", "llama3-w64-d2-h2"] if args.smoke else []
    if args.out is None and args.smoke:  # a smoke run leaves nothing behind
        with tempfile.TemporaryDirectory(prefix="bench-conversion-") as folder:
            return _run(args, Path(folder), shape)
    return _run(args, Path(args.out or "outputs/bench-conversion").resolve(), shape)


def _run(args, out: Path, shape: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    export, curves = conversion(args, out, shape)
    results = {"conversion": conversion_table(curves, args.steps)}
    if not args.skip_sft:
        results["sft"] = lora_sft(args, out, shape, export)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
