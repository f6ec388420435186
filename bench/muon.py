"""Muon's cost: Newton–Schulz efficiency and optimizer step time against AdamW.

    .venv/bin/python bench/muon.py [--flavors F1,F2] [--repeats 7] [--threads 1]
        [--device auto|cpu|cuda] [--batch 8] [--seq-len 256] [--smoke]

1. **Newton–Schulz efficiency.** For every hidden-matrix shape of each flavor, batched
   as the optimizer batches them (same-shape matrices stacked), time ``orthogonalize``
   and, in the same run, the bare bfloat16 matrix multiplies it performs (X·Xᵀ, S·S and
   P·X per iteration, on the same shapes, with ``torch.matmul``). Both do the same
   FLOPs, steps·b·(4m²n + 2m³) for b matrices of m×n (m ≤ n), so
   efficiency = FLOP rate of Newton–Schulz / FLOP rate of bare matmul = t_matmul / t_NS.
   Target ≥ 0.8: the iteration adds little around the multiplies it needs.
2. **Optimizer step.** The real model of each flavor with random gradients, the real
   optimizer container (``MulocoOptimizers``, as the trainer builds it) for AdamW and
   for Muon (hidden matrices; AdamW for the rest): the median ``step()`` time, the
   Muon/AdamW ratio, and each as a share of a whole training step (forward, backward,
   optimizer step, zero_grad) timed the same way.

Medians over ``--repeats`` after warm-up; AdamW and Muon alternate so drift hits both.
One torch thread by default (``--threads``): the machine is shared and a multi-threaded
run stalls whenever another process holds a core. On CUDA every timing synchronizes.
Nothing here asserts; the figures are printed with the machine's load. ``--smoke`` (CI):
both parts for ``llama3-w64-d2-h2`` at batch 2 × 64, one repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from machine import loadavg  # bench/ is on sys.path when a bench script runs

from muloco import compat

compat.apply()

from muloco.config import load_config  # noqa: E402
from muloco.models import ModelConfig, build_model_spec  # noqa: E402
from muloco.optim import MulocoOptimizers  # noqa: E402
from muloco.optim.container import HIDDEN_MATRIX_PATTERN  # noqa: E402
from muloco.optim.newton_schulz import orthogonalize  # noqa: E402

TARGET_EFFICIENCY = 0.8
SMOKE = {"flavors": "llama3-w64-d2-h2", "repeats": 1, "batch": 2, "seq_len": 64}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------ Newton–Schulz


def ns_flops(batch: int, m: int, n: int, steps: int) -> int:
    m, n = min(m, n), max(m, n)
    return steps * batch * (4 * m * m * n + 2 * m**3)


def bare_matmuls(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The multiplies of ``steps`` Newton–Schulz iterations and nothing else."""
    if x.size(-2) > x.size(-1):
        x = x.mT.contiguous()
    for _ in range(steps):
        s = torch.matmul(x, x.mT)
        p = torch.matmul(s, s)
        x = torch.matmul(p, x)
    return x


def ns_efficiency(shapes: Counter, device, repeats: int, steps: int) -> list[dict]:
    rows = []
    for (m, n), count in sorted(shapes.items()):
        g = torch.randn(count, m, n, device=device)
        x16 = g.to(torch.bfloat16)
        t_ns = median_time(lambda: orthogonalize(g, "keller", steps), device, repeats)
        t_mm = median_time(lambda: bare_matmuls(x16, steps), device, repeats)
        flops = ns_flops(count, m, n, steps)
        rows.append({"shape": f"{count}x{m}x{n}", "flops": flops, "t_ns": t_ns, "t_mm": t_mm})
    return rows


# ------------------------------------------------------------------ optimizer step


def build_model(flavor: str, vocab: int, device) -> torch.nn.Module:
    model = build_model_spec(ModelConfig(flavor=flavor), vocab).model.build().to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def hidden_shapes(model: torch.nn.Module) -> Counter:
    import re

    pattern = re.compile(HIDDEN_MATRIX_PATTERN)
    # Batched as Muon batches them: same shape up to transposition (tall ones as wide).
    return Counter(tuple(sorted(p.shape)) for n, p in model.named_parameters() if pattern.search(n))


def optimizer_for(name: str, model) -> MulocoOptimizers:
    base = load_config("ddp/muon" if name == "Muon" else "ddp/adamw").optimizer
    return base.build(model_parts=[model])


def step_times(model, name: str, device, repeats: int, batch: int, seq_len: int, vocab: int) -> dict:
    opt = optimizer_for(name, model)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    t_opt = median_time(opt.step, device, repeats)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), device=device)

    def train_step():
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    t_step = median_time(train_step, device, max(3, repeats // 2), warmup=1)
    return {"opt": t_opt, "step": t_step}


# ------------------------------------------------------------------ report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--flavors",
        default="llama3-w128-d4-h2,llama3-w512-d6-h4",
        help="comma-separated model-map flavors (default: the tiny default and a ~20M one)",
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--ns-steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="both parts for a tiny flavor: checks the bench runs (CI)")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    cfg = load_config("base")
    vocab = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path).get_vocab_size()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"device {device} ({name}), torch threads {torch.get_num_threads()}, load {loadavg()}, "
        f"repeats {args.repeats}, batch {args.batch}x{args.seq_len}"
    )

    summary = []
    for flavor in args.flavors.split(","):
        model = build_model(flavor, vocab, device)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\n== {flavor}: {n_params / 1e6:.2f}M parameters")
        rows = ns_efficiency(hidden_shapes(model), device, args.repeats, args.ns_steps)
        print(
            f"{'NS batch (b x m x n)':>22} {'GFLOP':>8} {'NS ms':>9} {'matmul ms':>10} "
            f"{'NS GFLOP/s':>11} {'mm GFLOP/s':>11} {'efficiency':>10}"
        )
        for r in rows:
            print(
                f"{r['shape']:>22} {r['flops'] / 1e9:8.3f} {r['t_ns'] * 1e3:9.2f} {r['t_mm'] * 1e3:10.2f} "
                f"{r['flops'] / r['t_ns'] / 1e9:11.2f} {r['flops'] / r['t_mm'] / 1e9:11.2f} "
                f"{r['t_mm'] / r['t_ns']:10.3f}"
            )
        flops = sum(r["flops"] for r in rows)
        eff = sum(r["t_mm"] for r in rows) / sum(r["t_ns"] for r in rows)
        print(
            f"{'all hidden matrices':>22} {flops / 1e9:8.3f} {sum(r['t_ns'] for r in rows) * 1e3:9.2f} "
            f"{sum(r['t_mm'] for r in rows) * 1e3:10.2f} {'':>11} {'':>11} {eff:10.3f}  "
            f"(target >= {TARGET_EFFICIENCY}: {'met' if eff >= TARGET_EFFICIENCY else 'NOT met'})"
        )

        times = {}
        for name_ in ("AdamW", "Muon", "AdamW", "Muon"):  # alternate; keep the second pass
            times[name_] = step_times(model, name_, device, args.repeats, args.batch, args.seq_len, vocab)
        a, m = times["AdamW"], times["Muon"]
        print(f"{'optimizer':>10} {'step() ms':>10} {'train step ms':>14} {'share':>7}")
        for name_, t in (("AdamW", a), ("Muon", m)):
            print(f"{name_:>10} {t['opt'] * 1e3:10.2f} {t['step'] * 1e3:14.1f} {t['opt'] / t['step']:7.1%}")
        print(f"Muon/AdamW: optimizer step {m['opt'] / a['opt']:.2f}x, training step {m['step'] / a['step']:.2f}x")
        summary.append(
            (
                flavor,
                n_params,
                eff,
                m["opt"] / a["opt"],
                m["opt"] / m["step"],
                a["opt"] / a["step"],
                m["step"] / a["step"],
            )
        )

    print("\nsummary")
    print(
        f"{'flavor':>26} {'params':>8} {'NS eff':>7} {'Muon/AdamW opt':>15} {'Muon share':>11} "
        f"{'AdamW share':>12} {'step ratio':>11}"
    )
    for flavor, n, eff, ratio, ms, as_, sr in summary:
        print(f"{flavor:>26} {n / 1e6:7.2f}M {eff:7.3f} {ratio:14.2f}x {ms:11.1%} {as_:12.1%} {sr:10.2f}x")
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
