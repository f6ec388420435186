"""Throughput of muloco's trainer against stock torchtitan's, on identical work.

    .venv/bin/python bench/trainer_overhead.py [--steps 40] [--warmup 5] [--repeats 3]
        [--flavor F] [--seq-len L] [--batch B] [--config base] [--objectives ar[,mdlm]]
        [--compile [--compile-backend inductor]] [--in-process] [--smoke]

Both sides start from the resolved ``base`` config (``muloco.config.load_config``):
same model spec, tokenizer, dataloader, optimizer (AdamW, same hyperparameters),
LR schedule, training settings, activation checkpointing and loss. The only
difference is the trainer: ``muloco.trainer.MulocoTrainer`` with its own metrics,
checkpoint and validator components, against ``torchtitan.trainer.Trainer`` with
torchtitan's (stock ``MetricsProcessor``, ``CheckpointManager``, ``Validator``).
Checkpointing, validation, TensorBoard and the JSONL record are off in both, and
both log at the same frequency; both runs' outputs go to a temporary folder.

Every measured run is a fresh subprocess (under a timeout, so a hang fails the
bench) that applies ``muloco.compat.apply()`` before torchtitan is imported, runs
``trainer.train()`` for ``--steps`` steps and times each ``train_step`` call with
the same wrapper on both trainers. tokens/s = local_batch_size * seq_len * (timed
steps) / (time inside those train_step calls), over the steps after the warm-up.
The time between the starts of consecutive steps (the whole loop iteration:
gc, train_step, checkpoint/validation checks, profiler) is reported as "loop tok/s".
Runs alternate ours, stock, ours, stock, ..., after one discarded run of the
trainer that goes second (the first run of a session is slower, and so every
measured run follows one of the other trainer); the medians and the ratio
ours/stock are printed, with cross-checks (median step time, whole loop, tokens per
CPU-second of the process) and the run-to-run spread, which says how far the ratio
can be trusted. Nothing here asserts on timing.

Each run uses one torch thread by default (``--threads``): on a small machine that
other work shares, OpenMP's barriers make a multi-threaded run many times slower
whenever another process holds a core, which swamps any trainer difference.
``--threads 0`` keeps torch's default. Each run's ``cpu/wall`` (CPU seconds of the
process per wall second in the timed steps) shows whether it had its cores.
``--profile-dir DIR`` writes a cProfile of each run's ``train()`` for a closer look.

``--objectives ar,mdlm`` adds a run of our trainer per extra objective (``mdlm``: masked
diffusion, bidirectional attention) to each round; stock torchtitan has no diffusion
objective, so its runs are next-token prediction and the ratio of an ``mdlm`` run to them is
what the objective costs on top of the trainer. ``--in-process`` runs every trainer in this
process, one after the other (fresh trainer, same interpreter): cheaper, but the runs share
warm caches, so its figures are for smoke tests, not for the ratio. ``--smoke`` is that at a
tiny size (``llama3-w64-d2-h2``, seq 64, batch 2, 4 steps, one round, no discarded run): it
goes through both trainers and the tables in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import exit_on_sigterm, loadavg  # bench/ is on sys.path when a bench script runs

REPO = Path(__file__).resolve().parents[1]
RESULT_MARKER = "@@BENCH_RESULT@@ "
TARGET_RATIO = 0.97


# --------------------------------------------------------------------------- child


def _configure(args, dump_folder: str):
    """The resolved muloco config both trainers start from."""
    from muloco.compat.cpu_device import device_type
    from muloco.components.precision import resolve_precision
    from muloco.config import load_config

    c = load_config(args.config)
    if args.flavor:
        c.model.flavor = args.flavor
    if args.seq_len:
        c.training.seq_len = args.seq_len
    if args.batch:
        c.training.local_batch_size = args.batch
    c.training.steps = args.steps
    c.training.mixed_precision_param = resolve_precision(args.precision, device_type())  # same for both
    c.compile.enable = args.compile
    c.compile.backend = args.compile_backend
    if args.child == "ours" and args.objective != "ar":
        from muloco.objectives import MaskedDiffusion

        c.objective = MaskedDiffusion.Config()  # stock torchtitan has only next-token prediction
    c.dump_folder = dump_folder
    c.checkpoint.enable = False
    c.validator.enable = False
    c.metrics.enable_tensorboard = False
    c.metrics.enable_wandb = False
    c.metrics.jsonl_file = ""
    c.metrics.log_freq = args.log_freq
    c.profiler.enable_profiling = False
    c.profiler.enable_memory_snapshot = False
    return c


def _stock_config(c):
    """A ``torchtitan.trainer.Trainer.Config`` with muloco's data, model, optimizer
    and training choices, and torchtitan's own trainer-side components."""
    import dataclasses

    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.validate import Validator
    from torchtitan.trainer import Trainer

    from muloco.models import build_model_spec

    tokenizer = c.tokenizer.build(tokenizer_path=c.hf_assets_path)
    c.model_spec = build_model_spec(c.model, tokenizer.get_vocab_size())
    kwargs = {f.name: getattr(c, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    # Trainer-side components: torchtitan's own, set up like ours.
    kwargs["metrics"] = MetricsProcessor.Config(
        log_freq=c.metrics.log_freq,
        enable_tensorboard=False,
        enable_wandb=False,
        disable_color_printing=c.metrics.disable_color_printing,
    )
    kwargs["checkpoint"] = CheckpointManager.Config(enable=False)
    kwargs["validator"] = Validator.Config(enable=False)
    return Trainer.Config(**kwargs)


@contextlib.contextmanager
def _patched(obj, name: str, value):
    """``obj.name = value`` while the block runs (in-process runs follow each other)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class _NoSleepTime:
    """torchtitan's ``train()`` sleeps 2 s after the loop "for other ranks"; a world of one
    has none, and the sleep is outside the measured steps. Same for both trainers."""

    perf_counter = staticmethod(time.perf_counter)
    time = staticmethod(time.time)
    sleep = staticmethod(lambda _s: None)


def measure(args) -> dict:
    """One trainer run (``args.child``: ours | stock) in this process; its figures."""
    from muloco import compat

    compat.apply()  # before anything imports torchtitan

    import torch
    import torchtitan.trainer as tt_trainer
    from torchtitan.tools.logging import init_logger

    from muloco.data.tokenizer import MulocoTokenizer
    from muloco.train import ensure_single_process_env

    init_logger()
    ensure_single_process_env()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # --vocab-size, e.g. Llama 3's 128,256: the model's size, whatever the tokens' ids.
    vocab = (lambda self: args.vocab_size) if args.vocab_size else MulocoTokenizer.get_vocab_size
    with (
        _patched(tt_trainer, "time", _NoSleepTime),
        _patched(MulocoTokenizer, "get_vocab_size", vocab),
        tempfile.TemporaryDirectory(prefix="muloco-bench-", dir=args.dump_root) as tmp,
    ):
        return _timed_run(args, os.path.join(tmp, "outputs"))


def _child(args) -> int:
    print(RESULT_MARKER + json.dumps(measure(args)), flush=True)
    return 0


def _timed_run(args, dump_folder: str) -> dict:
    """Build the trainer, run ``train()`` with every ``train_step`` timed; the figures."""
    import torch

    c = _configure(args, dump_folder)
    config = c if args.child == "ours" else _stock_config(c)
    t_build = time.perf_counter()
    trainer = config.build()
    build_s = time.perf_counter() - t_build
    assert type(trainer).__name__ == ("MulocoTrainer" if args.child == "ours" else "Trainer")
    step_s: list[float] = []
    step_cpu_s: list[float] = []
    starts: list[float] = []
    inner = trainer.train_step  # bound method of the class

    def timed_train_step(data_iterator):
        c0 = time.process_time()
        t0 = time.perf_counter()
        starts.append(t0)
        inner(data_iterator)
        step_s.append(time.perf_counter() - t0)
        step_cpu_s.append(time.process_time() - c0)

    trainer.train_step = timed_train_step  # same wrapper on both trainers
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        trainer.train()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    tokens_per_step = config.training.local_batch_size * config.training.seq_len
    w = args.warmup
    timed = step_s[w:]
    if not timed:
        raise SystemExit(f"no steps after the warm-up ({len(step_s)} steps ran, warm-up {w})")
    loop_span = starts[-1] - starts[w] if len(starts) > w + 1 else float("nan")
    return {
        "trainer": args.child,
        "objective": args.objective if args.child == "ours" else "ar",
        "class": f"{type(trainer).__module__}.{type(trainer).__qualname__}",
        "steps": len(step_s),
        "timed_steps": len(timed),
        "tokens_per_step": tokens_per_step,
        "ntokens_seen": trainer.ntokens_seen,
        "tokens_per_s": tokens_per_step * len(timed) / sum(timed),
        "loop_tokens_per_s": tokens_per_step * (len(starts) - 1 - w) / loop_span,
        "median_step_ms": 1000 * statistics.median(timed),
        "median_tokens_per_s": tokens_per_step / statistics.median(timed),
        # CPU time of this process per wall second in the timed steps: about the
        # thread count when the machine is otherwise idle, lower under contention.
        "cpu_per_wall": sum(step_cpu_s[w:]) / sum(timed),
        # tokens per CPU-second of this process: blind to time spent descheduled.
        "cpu_tokens_per_s": tokens_per_step * len(timed) / sum(step_cpu_s[w:]),
        "build_s": build_s,
        "precision": config.training.mixed_precision_param,
        "compile": config.compile.enable,
        "compile_backend": config.compile.backend,
        "parameters": sum(p.numel() for m in trainer.model_parts for p in m.parameters()),
        "mfu_percent": _mfu(trainer, tokens_per_step * len(timed) / sum(timed)),
        "torch_threads": torch.get_num_threads(),
        "flavor": c.model.flavor,
        "seq_len": config.training.seq_len,
        "batch": config.training.local_batch_size,
    }


def _mfu(trainer, tokens_per_s: float) -> float | None:
    """torchtitan's model FLOPs utilisation (its FLOPs per token and device peak); None off CUDA."""
    import torch

    mp = trainer.metrics_processor
    if not torch.cuda.is_available() or mp.num_flops_per_token <= 0:
        return None
    return 100 * mp.num_flops_per_token * tokens_per_s / mp.gpu_peak_flops


# -------------------------------------------------------------------------- parent


def _label(trainer: str, objective: str = "ar") -> str:
    """A side of the comparison: ours, stock, ours-mdlm (stock is always next-token)."""
    return trainer if objective == "ar" else f"{trainer}-{objective}"


def _sides(args) -> list[str]:
    ours = [_label("ours", o) for o in args.objectives]
    return ["stock", *ours] if args.stock_first else [*ours, "stock"]


def _child_argv(label: str, args) -> list[str]:
    trainer, _, objective = label.partition("-")
    argv = ["--_child", trainer, "--objective", objective or "ar"]
    for flag, value in (
        ("--config", args.config),
        ("--steps", args.steps),
        ("--warmup", args.warmup),
        ("--flavor", args.flavor),
        ("--seq-len", args.seq_len),
        ("--batch", args.batch),
        ("--log-freq", args.log_freq),
        ("--threads", args.threads),
        ("--precision", args.precision),
        ("--vocab-size", args.vocab_size),
        ("--compile-backend", args.compile_backend),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.compile:
        argv.append("--compile")
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        argv += ["--profile", os.path.join(args.profile_dir, f"{label}-{_run_one.counter}.prof")]
    _run_one.counter += 1
    return argv


def _run_one(label: str, args) -> dict:
    """One run of a side: a fresh process (or, with --in-process, a fresh trainer here)."""
    argv = _child_argv(label, args)
    if args.in_process:
        return measure(_parse(argv))
    scratch = tempfile.mkdtemp(prefix="muloco-bench-")  # removed even if the child is killed
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--dump-root", scratch]
    env = dict(os.environ)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each child is its own world of one, on a free port
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        tail = err.stderr or ""
        if isinstance(tail, bytes):
            tail = tail.decode(errors="replace")
        raise SystemExit(f"{label} run timed out after {args.timeout}s\n{tail[-3000:]}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    raise SystemExit(f"{label} run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


_run_one.counter = 0

SMOKE = {
    "flavor": "llama3-w64-d2-h2",
    "seq_len": 64,
    "batch": 2,
    "steps": 4,
    "warmup": 1,
    "log_freq": 2,
    "repeats": 1,
    "warmup_run": False,
    "in_process": True,
    "threads": 1,
}
"""--smoke: every code path (both trainers, each objective asked for, the tables) in seconds."""


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the figure (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of ours/stock runs (default 3)")
    p.add_argument("--flavor", default=None, help="model flavor (default: the config's)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the config's)")
    p.add_argument("--batch", type=int, default=None, help="local batch size (default: the config's)")
    p.add_argument("--config", default="base", help="muloco config module (default base)")
    p.add_argument(
        "--objectives",
        default="ar",
        type=lambda v: v.split(","),
        help="our trainer's objectives, comma-separated from ar, mdlm (default ar); "
        "stock torchtitan always runs next-token prediction",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="training.mixed_precision_param in both (default auto: bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile in both (compile.enable)")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="compile.backend in both (default inductor; eager: graph capture only)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="build the model for this vocabulary size (default: the tokenizer's)",
    )
    p.add_argument("--log-freq", type=int, default=20, help="metrics.log_freq in both (default 20)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads in both runs (default 1; 0 = torch's default). One "
        "thread keeps the figures stable on a small shared machine: with every core in "
        "use, OpenMP's barriers make a multi-threaded run slower by whatever else runs",
    )
    p.add_argument(
        "--no-warmup-run",
        dest="warmup_run",
        action="store_false",
        help="skip the discarded first run (of the trainer that goes second)",
    )
    p.add_argument("--stock-first", action="store_true", help="alternate stock, ours, ... instead of ours, stock, ...")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every trainer in this process (cheap; shared caches: not for the ratio)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny, in process, one round: checks that the bench runs (size flags are ignored)",
    )
    p.add_argument("--timeout", type=int, default=180, help="seconds per run before it counts as hung")
    p.add_argument("--profile-dir", default=None, help="write a cProfile of each run's train() here")
    p.add_argument("--_child", dest="child", choices=["ours", "stock"], help=argparse.SUPPRESS)
    p.add_argument("--objective", default="ar", choices=["ar", "mdlm"], help=argparse.SUPPRESS)
    p.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dump-root", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    unknown = set(args.objectives) - {"ar", "mdlm"}
    if unknown:
        p.error(f"--objectives: unknown {', '.join(sorted(unknown))} (choose from ar, mdlm)")
    if args.warmup >= args.steps - 1:
        p.error("--warmup must be smaller than --steps - 1")
    return args


def main(argv=None) -> int:
    exit_on_sigterm()
    args = _parse(argv)
    if args.child:
        return _child(args)
    if args.steps % args.log_freq:
        print(
            f"note: --steps {args.steps} is not a multiple of --log-freq {args.log_freq}: our "
            f"trainer also logs the last step, stock torchtitan does not, so the two runs do "
            f"not do the same work; the median-step ratio below is the fair one",
            flush=True,
        )
    compare(args)
    return 0


def compare(args) -> dict:
    """Alternate the sides' runs (ours per objective, stock); print every run, the medians
    and the ratios to stock; return them."""
    t0 = time.perf_counter()
    load_before = loadavg()
    order = _sides(args)
    runs: list[dict] = []
    print(
        f"trainer overhead: {args.repeats} x ({', '.join(order)}), {args.steps} steps per run, "
        f"first {args.warmup} left out{', in process (smoke figures)' if args.in_process else ''}; "
        f"load average before: {load_before}",
        flush=True,
    )
    if args.warmup_run:
        # Untimed: the first run of a session is slower (cold caches), and with it
        # every measured run follows a run of another side.
        r = _run_one(order[-1], args)
        print(f"  run  0  {order[-1]:<9}  {r['tokens_per_s']:>10,.0f} tok/s  (warm-up run, discarded)", flush=True)
    for _ in range(args.repeats):
        for label in order:
            r = _run_one(label, args)
            r["run"], r["side"] = len(runs) + 1, label
            runs.append(r)
            print(f"  run {r['run']:>2}  {label:<9}  {r['tokens_per_s']:>10,.0f} tok/s", flush=True)
    return _report(args, runs, order, t0)


def _report(args, runs: list[dict], order: list[str], t0: float) -> dict:
    """Print the runs, the medians per side and each side's ratio to stock; return
    ``{"first": run, "sides": {label: medians, "ratio", "mfu"}}``."""
    first = runs[0]
    print()
    print(
        f"flavor {first['flavor']}  seq_len {first['seq_len']}  batch {first['batch']}  "
        f"steps {args.steps} (timed {first['timed_steps']} after {args.warmup} warm-up)  "
        f"torch threads {first['torch_threads']}  log_freq {args.log_freq}"
    )
    print(
        f"{first['parameters']:,} parameters  precision {first['precision']}  "
        f"compile {'on (' + first['compile_backend'] + ')' if first['compile'] else 'off'}"
    )
    for trainer in ("ours", "stock"):
        print(f"{trainer + ':':<6} {next(r['class'] for r in runs if r['trainer'] == trainer)}")
    print()
    print(
        f"{'run#':>4}  {'side':<9}  {'tokens/s':>10}  {'median-step tok/s':>17}  "
        f"{'loop tok/s':>10}  {'step ms (median)':>16}  {'cpu/wall':>8}  {'build s':>7}"
    )
    for r in runs:
        print(
            f"{r['run']:>4}  {r['side']:<9}  {r['tokens_per_s']:>10,.0f}  "
            f"{r['median_tokens_per_s']:>17,.0f}  {r['loop_tokens_per_s']:>10,.0f}  "
            f"{r['median_step_ms']:>16.1f}  {r['cpu_per_wall']:>8.2f}  {r['build_s']:>7.2f}"
        )

    def med(side: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["side"] == side]
        return None if None in values else statistics.median(values)

    print()
    sides = {}
    for side in order:
        sides[side] = {
            key: med(side, key)
            for key in ("tokens_per_s", "median_tokens_per_s", "loop_tokens_per_s", "cpu_tokens_per_s", "mfu_percent")
        }
        sides[side]["objective"] = next(r["objective"] for r in runs if r["side"] == side)
        print(
            f"median {side:<9}  {sides[side]['tokens_per_s']:>10,.0f} tok/s   (median-step "
            f"{sides[side]['median_tokens_per_s']:,.0f}, loop {sides[side]['loop_tokens_per_s']:,.0f})"
        )
    stock = sides["stock"]
    for side in (s for s in order if s != "stock"):
        ours = sides[side]
        ours["ratio"] = ours["tokens_per_s"] / stock["tokens_per_s"]
        target = f" (target >= {TARGET_RATIO})" if ours["objective"] == "ar" else " (stock: next-token)"
        print(f"ratio {side}/stock = {ours['ratio']:.3f}{target}")
        print(
            f"  cross-checks: median-step {ours['median_tokens_per_s'] / stock['median_tokens_per_s']:.3f}, "
            f"loop {ours['loop_tokens_per_s'] / stock['loop_tokens_per_s']:.3f}, "
            f"per CPU-second {ours['cpu_tokens_per_s'] / stock['cpu_tokens_per_s']:.3f}"
        )
    if first["mfu_percent"] is not None:
        print(
            "MFU (torchtitan's FLOPs/token, device peak): "
            + ", ".join(f"{side} {sides[side]['mfu_percent']:.1f}%" for side in order)
        )
    spreads = []
    for side in order:
        tps = [r["tokens_per_s"] for r in runs if r["side"] == side]
        spreads.append(f"{side} {min(tps):,.0f}..{max(tps):,.0f} ({100 * (max(tps) / min(tps) - 1):.1f}%)")
    print(f"  run-to-run spread: {', '.join(spreads)}")
    threads = first["torch_threads"]
    noisy = [r["run"] for r in runs if r["cpu_per_wall"] < 0.8 * threads]
    if noisy:
        print(
            f"  note: runs {noisy} got under 80% of {threads} cores (cpu/wall): other "
            "processes competed for the CPU, so their figures are noisy"
        )
    print(f"load average after: {loadavg()}; total bench time {time.perf_counter() - t0:.0f}s")
    return {"first": first, "sides": sides}


if __name__ == "__main__":
    sys.exit(main())
