"""One GPU command: what the GPU targets need, in one table, within 9.5 minutes.

    python bench/gpu_suite.py [--log-dir DIR] [--only throughput,sync,codecs]
    python bench/gpu_suite.py --smoke        # the same pipeline at a tiny size, on a CPU (CI)

Runs the existing benches as time-boxed parts, one after the other (each a process of its
own, so a part's CUDA memory, compile caches and children end with it), and prints ONE
table of their figures:

- **throughput** (bench/gpu_throughput.py --part throughput, i.e. bench/trainer_overhead.py):
  tokens/s and MFU of muloco's trainer against stock torchtitan's ``Trainer`` in the same run,
  each run a fresh process: the 416M shape (``llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf``
  with Llama 3's 128,256-token vocabulary) and the same shape with the embedded 2,048-token
  vocabulary (158M), seq 2048, batch 16, bf16, compile on and off, our trainer with the
  ``ar`` and the ``mdlm`` objective (stock torchtitan has only next-token prediction: the
  ``mdlm`` ratio is to it). Targets: ours/stock >= 0.97, MFU >= 45%.
- **sync** (bench/gpu_throughput.py --part sync, i.e. bench/sync_overhead.py's jobs): K=2
  MuLoCo 2-bit replica groups sharing the GPU (the local launcher: its lighthouse and two
  replica groups, one torchrun each), 158M, seq 2048, batch 4, H=30, 90 steps, with θ_g on the GPU and in pinned CPU
  memory (``--outer.backup_device device|cpu``): each sync's blocked time by part (median
  after the first sync) and the share of the training loop (targets <= 3% / 6%).
- **memory**: from the same jobs, the largest peak of a sync's own buffers (Δ, averages,
  buckets in flight; the trainer's ``sync/peak_extra_bytes``) against the fp32 model: the
  exchange's peak memory, O(n) + a bucket. (bench/exchange_memory.py measures the same path
  at K=3 on host memory against another checkout; it runs on CPUs, not here.)
- **codecs** (bench/codecs.py): encode and decode of the exchange's codecs on a 100M-element
  tensor against a ``clone()`` of it, eager and ``torch.compile``d, with the check that the
  compiled payload is the eager one byte for byte. Target <= 2x clone.

- **diffusion** (bench/diffusion.py, throughput only): training tokens/s of the ``mdlm`` and
  ``ar`` objectives on the 158M shape, seq 2048, batch 4, with the GPU paths against what they
  replace in the same run: document masks through FlexAttention against SDPA with a dense
  boolean mask (the default, ``mask_kernel`` sdpa: flex becomes the CUDA default if this row
  shows it faster),
  and the fixed-capacity masked gather against ``pred[masked]``; then forward passes alone with
  either kernel.

- **generate** (bench/generate.py): diffusion sampling tokens/s of muloco's sampler against
  LLaDA's loop written plainly (same fresh 158M-shape model; the tokens must be the same), for
  block lengths 8-64, batch 1 and 8 and 8-token outputs, with the speed-up and agreement of
  ``--threshold`` parallel decoding and the ``--cache prefix`` block cache.

Each part has a time box (throughput 290 s, sync 130 s, codecs 45 s, generate 45 s, diffusion 60 s:
9.5 minutes together);
a part may also use what the parts before it left unused, never what the parts after it
are owed. A part that outlives its box gets SIGTERM (its benches then stop their own
children), then SIGKILL; the rows it finished stay (the benches append a JSON line per
finished row) and the table names the part that timed out, failed or was skipped. Every
part's output goes to ``--log-dir`` (default: a temporary folder, printed at the end).

On the offline GPU host (how to bring torch 2.13 there: ``../shared/gpu/README.md``) run it
as one job: ``source .device/env.sh && PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py
--log-dir $OUT/gpu_suite``. Measured there before this suite existed (H100, 2026-11-22;
158M shape, embedded vocabulary, seq 2048, one replica): bf16 + compile batch 16 328,700
tokens/s (41.2% MFU), batch 8 285,800 (35.8%), without compile 240,100 (30.1%); K=2
MuLoCo 2-bit, batch 4, H=30: 128-134 ms per sync with θ_g on the GPU (5.7% of the loop),
0.9-1.2 s with θ_g in pinned CPU memory (22%); codecs on 4M elements 10-29x a clone to
encode. The part boxes are estimates from those figures. The suite's parts first ran on an H200 on
2026-11-26 (``docs/gpu.md``): throughput ran past its box after 6 of its 8 rows, sync took
100 s, codecs 28 s, generate and diffusion together about a minute.

Without CUDA, a plain run says so and exits 2: these are GPU figures. ``--smoke`` runs the
same parts with the benches' ``--smoke`` (a tiny flavor in fp32, compile through the
``eager`` backend, a 4-step K=2 job, 65,536-element codecs) and prints the same table: it
shows the pipeline works, not what a GPU does. Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import exit_on_sigterm, loadavg  # bench/ is on sys.path when a bench script runs

from muloco.outer.exchange.pipeline import PARTS as SYNC_PARTS

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TERM_GRACE_S = 30
"""After SIGTERM, how long a part has to stop its children before SIGKILL."""


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    script: str
    argv: tuple[str, ...]
    box_s: int
    """Seconds this part is owed; the boxes of all parts add up to the suite's 9.5 minutes."""


PARTS = (
    Part(
        "throughput",
        "gpu_throughput.py",
        (
            "--part",
            "throughput",
            "--shapes",
            "416m,158m",
            "--compile",
            "on,off",
            "--objectives",
            "ar,mdlm",
            "--repeats",
            "1",
            "--no-warmup-run",
            "--steps",
            "40",
            "--warmup",
            "10",
            "--batch",
            "16",
            "--timeout",
            "200",
        ),
        290,
    ),
    Part(
        "sync",
        "gpu_throughput.py",
        (
            "--part",
            "sync",
            "--placements",
            "device,cpu",
            "--repeats",
            "1",
            "--sync-steps",
            "90",
            "--sync-batch",
            "4",
            "--timeout",
            "120",
        ),
        130,
    ),
    Part(
        "codecs",
        "codecs.py",
        ("--numel", "0", "--large-numel", "100000000", "--large-repeats", "3", "--kernels", "both"),
        45,
    ),
    Part(
        "generate",
        "generate.py",
        (
            "--flavor",
            "llama3-w1024-d12-h8",
            "--length",
            "64",
            "--blocks",
            "8",
            "16",
            "32",
            "64",
            "--batches",
            "1",
            "8",
            "--short",
            "8",
            "--repeats",
            "1",
            "--threads",
            "0",
        ),
        45,
    ),
    Part(
        "diffusion",
        "diffusion.py",
        (
            "--flavor",
            "llama3-w1024-d12-h8",
            "--seq-len",
            "2048",
            "--batch",
            "4",
            "--steps",
            "4",
            "--repeats",
            "3",
            "--skip-variance",
            "--threads",
            "0",
        ),
        60,
    ),
)


# -------------------------------------------------------------------- running parts


@dataclasses.dataclass
class Outcome:
    part: Part
    status: str  # ok | timed out after N s | failed (exit N) | skipped: why
    records: list[dict]
    seconds: float


def _part_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (its benches stop their own children), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_part(part: Part, smoke: bool, limit_s: float, log_dir: Path) -> Outcome:
    """The part's bench in its own session, under ``limit_s``; the rows it finished."""
    if limit_s <= 0:
        return Outcome(part, "skipped: the suite's time was spent", [], 0.0)
    out = log_dir / f"{part.name}.jsonl"
    cmd = [sys.executable, str(BENCH / part.script), *part.argv, "--json", str(out), *(["--smoke"] if smoke else [])]
    print(f"\n== {part.name}: up to {limit_s:.0f} s: {shlex.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    with open(log_dir / f"{part.name}.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_part_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=limit_s)
            status = "ok" if code == 0 else f"failed (exit {code}; see {part.name}.log)"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit_s:.0f} s"
        finally:
            _stop(proc)
    seconds = time.monotonic() - t0
    print(f"   {status}, {seconds:.0f} s", flush=True)
    return Outcome(part, status, _records(out), seconds)


def run_parts(parts: tuple[Part, ...], smoke: bool, log_dir: Path) -> list[Outcome]:
    """Each part in turn; a part may use what earlier parts left, never what later ones are owed."""
    deadline = time.monotonic() + sum(p.box_s for p in parts)
    outcomes = []
    for i, part in enumerate(parts):
        owed_later = sum(p.box_s for p in parts[i + 1 :])
        outcomes.append(run_part(part, smoke, deadline - time.monotonic() - owed_later, log_dir))
    return outcomes


# -------------------------------------------------------------------------- table


def _tok(side: dict) -> str:
    mfu = f" ({side['mfu_percent']:.1f}% MFU)" if side["mfu_percent"] is not None else ""
    return f"{side['tokens_per_s']:,.0f} tok/s{mfu}"


def throughput_rows(rec: dict) -> list[tuple[str, str]]:
    compile_ = f"compile {rec['compile_backend']}" if rec["compile"] else "no compile"
    stock = rec["sides"]["stock"]
    rows = []
    for side, fig in rec["sides"].items():
        if side != "stock":
            rows.append(
                (
                    f"{rec['shape']} {fig['objective']}, {compile_}, {rec['precision']}, "
                    f"{rec['parameters'] / 1e6:.1f}M, batch {rec['batch']}x{rec['seq_len']}",
                    f"ours {_tok(fig)}; stock (ar) {_tok(stock)}; ratio {fig['ratio']:.3f}",
                )
            )
    return rows


def sync_rows(rec: dict) -> list[tuple[str, str, str]]:
    parts = ", ".join(f"{name} {1000 * rec['parts'][name]:.1f}" for name in SYNC_PARTS if rec["parts"][name] > 0)
    model = 4 * rec["params"]
    return [
        (
            "sync",
            f"θ_g on {rec['placement']}, {rec['params'] / 1e6:.1f}M, {rec['n']} syncs",
            f"{1000 * rec['seconds']:.1f} ms per sync ({parts} ms); {100 * rec['share']:.2f}% of the loop",
        ),
        (
            "memory",
            f"sync buffers, θ_g on {rec['placement']}",
            f"peak {rec['peak'] / 1e6:.1f} MB = {rec['peak'] / model:.2f}x the fp32 model ({model / 1e6:.1f} MB)",
        ),
    ]


def codec_rows(rec: dict) -> list[tuple[str, str]]:
    if rec.get("table") != "codecs":
        return []
    same = {True: "; payload identical to eager", False: "; payload DIFFERS from eager"}.get(rec.get("identical"), "")
    return [
        (
            f"{rec['codec']}, {rec['kernels']}, {rec['numel'] / 1e6:g}M",
            f"encode {1000 * rec['encode']:.2f} ms = {rec['encode'] / rec['clone']:.1f}x clone, decode "
            f"{1000 * rec['decode']:.2f} ms = {rec['decode'] / rec['clone']:.1f}x; {rec['bits']:.2f} bits/param{same}",
        )
    ]


def generate_rows(rec: dict) -> list[tuple[str, str]]:
    tps, agree = rec["tokens_per_s"], rec["agreement"]
    options = "; ".join(f"{v} {tps[v] / tps['sampler']:.2f}x ({100 * agree[v]:.0f}% same tokens)" for v in agree)
    return [
        (
            f"length {rec['length']}, block {rec['block']}, batch {rec['batch']}, fresh {rec['model']}",
            f"sampler {tps['sampler']:,.0f} tok/s = {tps['sampler'] / tps['reference']:.2f}x LLaDA's loop "
            f"({'same tokens' if rec['same'] else 'TOKENS DIFFER'}); {options}",
        )
    ]


DIFFUSION_PAIRS = (
    ("mdlm flex", "mdlm", "document mask: FlexAttention / SDPA dense mask"),
    ("ar+docmask flex", "ar+docmask", "causal document mask: FlexAttention / SDPA dense mask"),
    ("mdlm", "mdlm exact-gather", "masked positions: fixed capacity / pred[masked]"),
    ("mdlm", "ar", "mdlm / ar (target >= 0.97)"),
)


def diffusion_rows(rec: dict) -> list[tuple[str, str]]:
    """The paths' ratios from the last round's medians (each round appends the medians so far)."""
    tps = rec["tokens_per_s"]
    case = (
        f"{rec['flavor']}, {rec['parameters'] / 1e6:.1f}M, batch {rec['batch']}x{rec['seq_len']}, "
        f"{rec['rounds']} rounds"
    )
    return [
        (f"{what}, {case}", f"{tps[a]:,.0f} / {tps[b]:,.0f} tok/s = {tps[a] / tps[b]:.3f}")
        for a, b, what in DIFFUSION_PAIRS
        if a in tps and b in tps
    ]


def attention_rows(rec: dict) -> list[tuple[str, str]]:
    tps = rec["tokens_per_s"]
    return [
        (
            f"document mask, forward only, {rec['flavor']}, batch {rec['batch']}x{rec['seq_len']}",
            f"flex {tps['flex']:,.0f} / sdpa {tps['sdpa']:,.0f} tok/s = {tps['flex'] / tps['sdpa']:.3f}"
            f"{' (flex eager)' if rec['eager'] else ''}",
        )
    ]


def _last_of_each_table(records: list[dict]) -> list[dict]:
    """A bench that appends its figures after every round: only the last line of each table counts."""
    return list({rec.get("table"): rec for rec in records}.values())


def table_rows(outcome: Outcome) -> list[tuple[str, str, str, str]]:
    """(part, case, figures, status) for each finished row, and one for a part cut short."""
    rows: list[tuple[str, str, str]] = []
    skipped = []
    records = _last_of_each_table(outcome.records) if outcome.part.name == "diffusion" else outcome.records
    for rec in records:
        if "skipped" in rec:
            case = rec.get("case") or f"θ_g on {rec['placement']}"
            skipped.append((outcome.part.name, case, "-", f"skipped: {rec['skipped']}"))
        elif outcome.part.name == "sync":
            rows += sync_rows(rec)
        elif outcome.part.name == "throughput":
            rows += [("throughput", *row) for row in throughput_rows(rec)]
        elif outcome.part.name == "generate":
            rows += [("generate", *row) for row in generate_rows(rec)]
        elif outcome.part.name == "diffusion":
            table = attention_rows if rec.get("table") == "attention" else diffusion_rows
            rows += [("diffusion", *row) for row in table(rec)]
        else:
            rows += [(outcome.part.name, *row) for row in codec_rows(rec)]
    status = "ok" if outcome.status == "ok" else "done before the part stopped"
    out = [(part, case, figures, status) for part, case, figures in rows] + skipped
    if outcome.status != "ok" or not rows:
        out.append((outcome.part.name, "(the rest)" if rows else "(all)", "-", outcome.status))
    return out


def print_table(outcomes: list[Outcome]) -> None:
    rows = [("part", "case", "figures", "status")] + [r for o in outcomes for r in table_rows(o)]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    print()
    for part, case, figures, status in rows:
        print(f"{part:<{widths[0]}}  {case:<{widths[1]}}  {figures}  [{status}]")


# --------------------------------------------------------------------------- main


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the same parts at a tiny size, on a CPU too (CI)")
    p.add_argument(
        "--only",
        type=lambda v: v.split(","),
        default=[part.name for part in PARTS],
        help=f"run these parts only, from {', '.join(part.name for part in PARTS)}",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="each part's log and rows (default: a temporary folder)")
    args = p.parse_args(argv)
    if set(args.only) - {part.name for part in PARTS}:
        p.error(f"--only: choose from {', '.join(part.name for part in PARTS)}")
    return args


def main(argv=None) -> int:
    exit_on_sigterm()
    args = _parse(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(
            "gpu_suite: no CUDA device here, and its figures are GPU targets. `python bench/gpu_suite.py "
            "--smoke` runs the same pipeline at a tiny size on this CPU.",
            file=sys.stderr,
        )
        return 2
    device = torch.cuda.get_device_name() if cuda else "CPU (smoke: tiny sizes, not GPU figures)"
    print(
        f"gpu_suite on {device}, torch {torch.__version__}, load average {loadavg()}{', smoke' if args.smoke else ''}",
        flush=True,
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="muloco-gpu-suite-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    outcomes = run_parts(tuple(part for part in PARTS if part.name in args.only), args.smoke, log_dir)
    print_table(outcomes)
    print(
        f"\ntotal {time.monotonic() - t0:.0f} s of {sum(p.box_s for p in PARTS if p.name in args.only)} s; "
        f"load average {loadavg()}"
    )
    if args.smoke and args.log_dir is None and all(o.status == "ok" for o in outcomes):
        shutil.rmtree(log_dir)
    else:
        print(f"logs and rows: {log_dir}")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
