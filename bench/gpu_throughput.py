"""GPU throughput: our trainer against stock torchtitan, and the K=2 sync by θ_g placement.

    python bench/gpu_throughput.py [--part all|throughput|sync] [--shapes 416m[,158m]]
        [--compile on[,off]] [--objectives ar[,mdlm]] [--placements device[,cpu]] [--timings host[,device]]
        [--repeats 2] [--steps 40] [--warmup 10] [--batch 16] [--no-warmup-run]
        [--sync-steps 120] [--sync-batch 4] [--timeout 400] [--json PATH] [--smoke]

Part 1 (throughput): bench/trainer_overhead.py's alternating runs (each a fresh process,
ours, stock, ours, stock, ... after one discarded run) of ``muloco.trainer.MulocoTrainer``
and stock ``torchtitan.trainer.Trainer`` on the same model, data, optimizer (AdamW),
precision, compile setting and batch, for every shape and compile setting asked for. On
CUDA the shape is the paper's ``llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf`` at seq 2048,
bf16 (the CUDA default), batch 16 (the model map's largest micro-batch for it): ``416m``
builds it for Llama 3's vocabulary (128,256; token ids come from the embedded corpus, a
subset, which does not change the work), ``158m`` for the embedded 2,048-token one.
``--objectives ar,mdlm`` adds our trainer with the masked-diffusion objective to each
round; stock torchtitan has no diffusion objective, so that ratio is to its next-token run.
Prints tokens/s, ratio ours/stock (target >= 0.97) and MFU (torchtitan's FLOPs per token,
ours counting the objective's head, over the device's peak; target >= 45%).

Part 2 (sync): K=2 MuLoCo 2-bit (``config/diloco/muloco_2bit.py``) with both replica
groups on the one GPU, H=30, seq 2048, batch 4, with θ_g on the GPU (``--outer.backup_device
device``, the CUDA default) and in pinned CPU memory (``--outer.backup_device cpu``), run by
bench/sync_overhead.py's ``run_job`` (the local launcher: its lighthouse and two replica groups,
one torchrun each, sharing the GPU). The model is the 158M shape (embedded vocabulary; the issue's baseline was
taken on it). Per placement: the share = time blocked in syncs / training loop (the worse
replica, first sync (process group set-up) left out; targets <= 3% (GPU) and <= 6%
(pinned CPU)), the time of a sync by part (``sync_overhead.sync_parts``: quorum, waiting
for the slowest, Δ, encode, collective, decode, commit, outer step, pull) and the largest
peak of a sync's own buffers (the exchange's peak memory, as the trainer records it).
``--timings host,device`` adds runs with ``--outer.exchange.timing device``: each part waits for
the device work queued before it (``queued``) and for its own kernels, so the table says where
a sync's time goes on the GPU (host timing puts a kernel's time where the host first waits for
it); those runs serialise the sync, so their share is no verdict.

On a machine without CUDA both parts run a tiny flavor in fp32 and say so: the figures
then show the bench works, not what a GPU does. There, compile runs with torch.compile's
``eager`` backend (graph capture without code generation: inductor's C++ build takes
minutes on a CPU), and θ_g in pinned CPU memory is skipped (host memory is the device).
``--smoke`` (CI) runs every part at the smallest size: the trainer runs in process (``416m``
with an 8,192-token vocabulary), the job 4 steps at H=2. ``--json PATH`` appends one JSON
line per finished row (shape and compile setting, or placement): bench/gpu_suite.py reads
them, and a part stopped at its time limit keeps the rows it finished. Rows come compile
setting first (all shapes compiled, then all eager), so the GPU targets come first.
Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import sync_overhead  # bench/ is on sys.path when a bench script runs
import trainer_overhead
from machine import exit_on_sigterm, loadavg

FLAVOR_416M = "llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf"
LLAMA3_VOCAB = 128256
SHAPES = {"416m": LLAMA3_VOCAB, "158m": None}
"""Shape name -> the vocabulary the model is built for (None: the embedded tokenizer's)."""
SMOKE_VOCAB = {"416m": 8192, "158m": None}
"""--smoke: the larger vocabulary scaled down with the model (Llama 3's would make a tiny model's step slow)."""
TINY = "llama3-w64-d2-h2"
TARGET_MFU = 45.0
TARGET_SHARE = {"device": 0.03, "cpu": 0.06}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _emit(args, row: dict) -> None:
    """Append one finished row to --json (one JSON object per line)."""
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------- part 1: throughput


def _trainer_argv(args, cuda: bool, shape: str, compiled: bool) -> list[str]:
    """bench/trainer_overhead.py's arguments for one shape and compile setting."""
    argv = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--threads",
        "0",
        "--timeout",
        str(args.timeout),
        "--objectives",
        ",".join(args.objectives),
    ]
    vocab = (SMOKE_VOCAB if args.smoke else SHAPES)[shape]
    if vocab:
        argv += ["--vocab-size", str(vocab)]
    if compiled:
        argv += ["--compile"] + ([] if cuda else ["--compile-backend", "eager"])
    if not args.warmup_run:
        argv.append("--no-warmup-run")
    if args.smoke:
        return argv + ["--smoke"]
    if cuda:
        return argv + ["--flavor", FLAVOR_416M, "--seq-len", "2048", "--batch", str(args.batch)]
    return argv + ["--flavor", TINY, "--seq-len", "128", "--batch", "4"]


def part_throughput(args, cuda: bool) -> list[dict]:
    """One trainer_overhead comparison per shape and compile setting; a row each."""
    rows = []
    for compiled in args.compile:  # compile settings outermost: the first rows are the GPU targets
        for shape in args.shapes:
            argv = _trainer_argv(args, cuda, shape, compiled)
            where = "CUDA" if cuda else "CPU: tiny flavor, not GPU figures"
            print(
                f"\n== Part 1: ours vs stock torchtitan, {shape} shape, compile {'on' if compiled else 'off'} "
                f"({where}) ==\n   bench/trainer_overhead.py {shlex.join(argv)}",
                flush=True,
            )
            result = trainer_overhead.compare(trainer_overhead._parse(argv))
            first = result["first"]
            row = {
                "part": "throughput",
                "shape": shape,
                "compile": compiled,
                "flavor": first["flavor"],
                "parameters": first["parameters"],
                "precision": first["precision"],
                "compile_backend": first["compile_backend"] if compiled else None,
                "seq_len": first["seq_len"],
                "batch": first["batch"],
                "sides": result["sides"],
            }
            _emit(args, row)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------- part 2: sync


def _sync_settings(args, cuda: bool) -> tuple[str, dict[str, int]]:
    """The flavor and the trainer settings of the sync jobs."""
    if args.smoke:
        return TINY, {
            "training.steps": 4,
            "outer.sync_every": 2,
            "training.seq_len": 64,
            "training.local_batch_size": 2,
            "lr_scheduler.warmup_steps": 1,
            "metrics.log_freq": 2,
        }
    return FLAVOR_416M if cuda else TINY, {
        "training.steps": args.sync_steps,
        "outer.sync_every": 30,
        "training.seq_len": 2048 if cuda else 128,
        "training.local_batch_size": args.sync_batch if cuda else 4,
        "lr_scheduler.warmup_steps": 10,
        "metrics.log_freq": 30,
    }


def _sync_run(args, root: Path, placement: str, timing: str, rep: int, flavor: str, overrides: list[str]) -> dict:
    """One K=2 job with θ_g at ``placement``; the worse replica's figures and the replicas' records."""
    job = sync_overhead.run_job(
        root,
        f"{placement}-{timing}-{rep}",
        flavor,
        overrides + ["--outer.backup_device", placement, "--outer.exchange.timing", timing],
        args.timeout,
        config="diloco/muloco_2bit",
    )
    figures = [sync_overhead._replica_figures(r) for r in job["replicas"]]
    notes = sync_overhead._check_syncs(job)
    worse = max(figures, key=lambda f: f["share_rest"])
    print(
        f"  run {rep + 1} θ_g on {placement:<6} ({timing} timing): share w/o 1st sync {100 * worse['share_rest']:.2f}% "
        f"(with it {100 * worse['share']:.2f}%), per sync median w/o 1st "
        f"{1000 * worse['median_rest']:.0f} ms, step {1000 * worse['step_s']:.0f} ms, "
        f"{worse['bytes_per_sync'] / 1e6:.1f} MB sent per sync, "
        f"{worse['committed']}/{worse['syncs']} committed" + (f"; note: {notes[0]}" if notes else ""),
        flush=True,
    )
    return {"worse": worse, "replicas": job["replicas"]}


def _sync_row(args, placement: str, timing: str, flavor: str, runs: list[dict]) -> dict:
    """A placement's figures over its runs (emitted as soon as its last run is done)."""
    row = {
        "part": "sync",
        "placement": placement,
        "timing": timing,
        "flavor": flavor,
        **sync_overhead.sync_parts([r for run in runs for r in run["replicas"]]),
        "share": sync_overhead._med([run["worse"]["share_rest"] for run in runs]),
        "bytes_per_sync": runs[0]["worse"]["bytes_per_sync"],
    }
    _emit(args, row)
    return row


def part_sync(args, cuda: bool) -> list[dict]:
    """K=2 MuLoCo 2-bit jobs per θ_g placement: share, time by part, peak; a row each."""
    flavor, settings = _sync_settings(args, cuda)
    overrides = [x for key, value in settings.items() for x in (f"--{key}", str(value))]
    placements = [p for p in args.placements if cuda or p == "device"]
    if "cpu" in args.placements and not cuda:
        print(
            "\nθ_g in pinned CPU memory (--outer.backup_device cpu): needs CUDA (on a CPU host the device "
            "is host memory); not run"
        )
        _emit(args, {"part": "sync", "placement": "cpu", "skipped": "needs CUDA (on a CPU the device is host memory)"})
    print(
        f"\n== Part 2: K=2 MuLoCo 2-bit sync at H={settings['outer.sync_every']}, {flavor}, seq "
        f"{settings['training.seq_len']}, batch {settings['training.local_batch_size']}, "
        f"{settings['training.steps']} steps ({'both replicas on one GPU' if cuda else 'CPU: tiny flavor'}) ==",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="muloco-gpu-bench-"))
    cases = [(p, t) for t in args.timings for p in placements]
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in cases}
    rows = []
    try:
        for rep in range(args.repeats):  # placements alternate, so drift hits both
            for placement, timing in cases:
                runs[placement, timing].append(_sync_run(args, root, placement, timing, rep, flavor, overrides))
                if rep == args.repeats - 1:
                    rows.append(_sync_row(args, placement, timing, flavor, runs[placement, timing]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sync_overhead.print_parts_table(
        {f"θ_g on {row['placement']}" + (", device timing" if row["timing"] == "device" else ""): row for row in rows}
    )
    return rows


# ---------------------------------------------------------------------------- main


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "throughput", "sync"), default="all")
    p.add_argument(
        "--shapes",
        type=lambda v: v.split(","),
        default=["416m"],
        help=f"throughput shapes, comma-separated from {', '.join(SHAPES)} (default 416m)",
    )
    p.add_argument(
        "--compile",
        type=lambda v: [x == "on" for x in v.split(",")],
        default=None,
        help="throughput compile settings, comma-separated from on, off (default: on with CUDA, off without)",
    )
    p.add_argument(
        "--objectives",
        type=lambda v: v.split(","),
        default=["ar"],
        help="our trainer's objectives in the throughput part, from ar, mdlm (default ar)",
    )
    p.add_argument(
        "--placements",
        type=lambda v: v.split(","),
        default=["device", "cpu"],
        help="θ_g placements of the sync part, from device, cpu (default both)",
    )
    p.add_argument(
        "--timings",
        type=lambda v: v.split(","),
        default=["host"],
        help="sync part: how parts are timed, from host, device (--outer.exchange.timing; default host)",
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per side / placement (default 2)")
    p.add_argument(
        "--steps",
        type=int,
        default=40,
        help="steps per throughput run, a multiple of log_freq 20 so both trainers log equally often (default 40)",
    )
    p.add_argument("--warmup", type=int, default=10, help="steps left out (compile) (default 10)")
    p.add_argument("--batch", type=int, default=16, help="micro-batch of the throughput runs on CUDA")
    p.add_argument(
        "--no-warmup-run", dest="warmup_run", action="store_false", help="skip trainer_overhead's discarded first run"
    )
    p.add_argument("--sync-steps", type=int, default=120, help="steps per sync run (default 120: 4 syncs)")
    p.add_argument("--sync-batch", type=int, default=4, help="micro-batch of the sync runs on CUDA")
    p.add_argument("--timeout", type=int, default=400, help="seconds per run before it counts as hung")
    p.add_argument("--json", default=None, help="append one JSON line per finished row to this file")
    p.add_argument("--smoke", action="store_true", help="every part at the smallest size (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    for name, allowed in (
        ("shapes", set(SHAPES)),
        ("objectives", {"ar", "mdlm"}),
        ("placements", {"device", "cpu"}),
        ("timings", {"host", "device"}),
    ):
        if set(getattr(args, name)) - allowed:
            p.error(f"--{name}: choose from {', '.join(sorted(allowed))}")
    return args


def _summary(throughput: list[dict], sync: list[dict], cuda: bool) -> None:
    print(
        "\n== summary =="
        + ("" if cuda else " (CPU, tiny flavor: the targets are for an H100, these verdicts only show the bench works)")
    )
    for row in throughput:
        stock = row["sides"]["stock"]
        for side, fig in row["sides"].items():
            if side == "stock":
                continue
            target = trainer_overhead.TARGET_RATIO if fig["objective"] == "ar" else None
            verdict = (
                "" if target is None else f" (target >= {target}: {'met' if fig['ratio'] >= target else 'MISSED'})"
            )
            print(
                f"{row['shape']} compile {'on' if row['compile'] else 'off'} {side}: {fig['tokens_per_s']:,.0f} "
                f"tok/s, stock {stock['tokens_per_s']:,.0f}: ratio {fig['ratio']:.3f}{verdict}"
            )
            if fig["mfu_percent"] is not None:
                print(
                    f"  MFU {side} {fig['mfu_percent']:.1f}%, stock {stock['mfu_percent']:.1f}% "
                    f"(target >= {TARGET_MFU:.0f}%: {'met' if fig['mfu_percent'] >= TARGET_MFU else 'MISSED'})"
                )
    for row in sync:
        placement, share = row["placement"], row["share"]
        if row.get("timing") == "device":
            print(
                f"sync, θ_g on {placement}, device timing: {1000 * row['seconds']:.0f} ms per sync (serialised: "
                f"no verdict); by part: " + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in row["parts"].items() if v)
            )
            continue
        verdict = "met" if share <= TARGET_SHARE[placement] else "MISSED"
        where = (
            "the training device"
            if placement == "device" and not cuda
            else "GPU"
            if placement == "device"
            else "pinned CPU"
        )
        print(
            f"sync share, θ_g on {where}: {100 * share:.2f}% (target <= {100 * TARGET_SHARE[placement]:.0f}%: "
            f"{verdict}; median over runs, worse replica); {1000 * row['seconds']:.0f} ms per sync, "
            f"peak {row['peak'] / 1e6:.1f} MB"
        )


def main(argv=None) -> int:
    exit_on_sigterm()
    args = _parse(argv)
    cuda = _cuda()
    if args.compile is None:
        args.compile = [cuda]
    t0 = time.perf_counter()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    if cuda:
        import torch

        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, load average {loadavg()}")
    else:
        print(
            "no CUDA device: tiny flavor on CPU, fp32, compile (if asked) with the eager backend; "
            "these are not GPU figures"
        )
    throughput = part_throughput(args, cuda) if args.part in ("all", "throughput") else []
    sync = part_sync(args, cuda) if args.part in ("all", "sync") else []
    _summary(throughput, sync, cuda)
    print(f"total {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
