"""GPU throughput: our trainer against stock torchtitan, and the K=2 sync share by θ_g placement.

    python bench/gpu_throughput.py [--part all|throughput|sync] [--repeats 2] [--steps 40]
        [--warmup 10] [--batch 16] [--sync-steps 120] [--sync-batch 4]

Part 1 (throughput): bench/trainer_overhead.py's alternating runs (each a fresh process,
ours, stock, ours, stock, ... after one discarded run) of ``muloco.trainer.MulocoTrainer``
and stock ``torchtitan.trainer.Trainer`` on the same model, data, optimizer (AdamW),
precision, compile setting and batch. On CUDA: the paper's 416M flavor
``llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf`` built for Llama 3's vocabulary (128,256;
token ids come from the embedded corpus, a subset, which does not change the work), seq
2048, bf16 (the CUDA default), ``torch.compile``, batch 16 (the model map's largest
micro-batch for this shape). Prints tokens/s, ratio ours/stock (target >= 0.97) and
MFU (torchtitan's FLOPs per token over the device's peak; target >= 45%).

Part 2 (sync share): K=2 MuLoCo 2-bit (``config/diloco/muloco_2bit.py``) with both
replica groups on the one GPU, H=30, seq 2048, batch 4, with θ_g on the GPU
(``--outer.backup_device device``, the CUDA default) and in pinned CPU memory
(``--outer.backup_device cpu``), run by bench/sync_overhead.py's ``run_job`` (a real
lighthouse and two ``muloco.train`` processes). The model is the same shape with the
embedded 2,048-token vocabulary (158M parameters; the issue's baseline was taken on it).
Share = time blocked in syncs / training loop, the worse replica, first sync (process
group set-up) left out; targets <= 3% (GPU) and <= 6% (pinned CPU).

On a machine without CUDA both parts run a tiny flavor in fp32 without compile and say
so: the figures then show the bench works, not what a GPU does. Nothing here asserts
on timing.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import sync_overhead  # bench/ is on sys.path when a bench script runs
import trainer_overhead
from machine import loadavg

FLAVOR_416M = "llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf"
LLAMA3_VOCAB = 128256
TINY = "llama3-w64-d2-h2"
TARGET_MFU = 45.0
TARGET_SHARE = {"device": 0.03, "cpu": 0.06}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def part_throughput(args, cuda: bool) -> dict:
    argv = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
            "--threads", "0", "--timeout", str(args.timeout)]
    if cuda:
        argv += ["--flavor", FLAVOR_416M, "--vocab-size", str(LLAMA3_VOCAB), "--seq-len", "2048",
                 "--batch", str(args.batch), "--compile"]
    else:
        argv += ["--flavor", TINY, "--seq-len", "128", "--batch", "4"]
    print(f"\n== Part 1: ours vs stock torchtitan ({'CUDA' if cuda else 'CPU: tiny flavor, not GPU figures'}) ==")
    print(f"   bench/trainer_overhead.py {shlex.join(argv)}", flush=True)
    result = trainer_overhead.compare(trainer_overhead._parse(argv))
    return result


def part_sync(args, cuda: bool) -> dict:
    flavor = FLAVOR_416M if cuda else TINY
    seq, batch = ("2048", str(args.sync_batch)) if cuda else ("128", "4")
    overrides = ["--training.steps", str(args.sync_steps), "--outer.sync_every", "30",
                 "--training.seq_len", seq, "--training.local_batch_size", batch,
                 "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "30"]
    print(f"\n== Part 2: K=2 MuLoCo 2-bit sync share at H=30, {flavor}, seq {seq}, batch {batch}, "
          f"{args.sync_steps} steps ({'both replicas on one GPU' if cuda else 'CPU: tiny flavor'}) ==", flush=True)
    root = Path(tempfile.mkdtemp(prefix="muloco-gpu-bench-"))
    shares: dict[str, list[dict]] = {"device": [], "cpu": []}
    try:
        for rep in range(args.repeats):
            for placement in ("device", "cpu"):
                job = sync_overhead.run_job(root, f"{placement}-{rep}", flavor,
                                            overrides + ["--outer.backup_device", placement],
                                            args.timeout, config="diloco/muloco_2bit")
                figures = [sync_overhead._replica_figures(r) for r in job["replicas"]]
                notes = sync_overhead._check_syncs(job)
                worse = max(figures, key=lambda f: f["share_rest"])
                shares[placement].append(worse)
                print(f"  run {rep + 1} θ_g on {placement:<6}: share w/o 1st sync {100 * worse['share_rest']:.2f}% "
                      f"(with it {100 * worse['share']:.2f}%), per sync median w/o 1st "
                      f"{1000 * worse['median_rest']:.0f} ms, step {1000 * worse['step_s']:.0f} ms, "
                      f"{worse['bytes_per_sync'] / 1e6:.1f} MB sent per sync, "
                      f"{worse['committed']}/{worse['syncs']} committed"
                      + (f"; note: {notes[0]}" if notes else ""), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {p: sync_overhead._med([f["share_rest"] for f in fs]) for p, fs in shares.items()}


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "throughput", "sync"), default="all")
    p.add_argument("--repeats", type=int, default=2, help="runs per side / placement (default 2)")
    p.add_argument("--steps", type=int, default=40,
                   help="steps per throughput run, a multiple of log_freq 20 so both trainers "
                        "log equally often (default 40)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out (compile) (default 10)")
    p.add_argument("--batch", type=int, default=16, help="micro-batch of the throughput runs on CUDA")
    p.add_argument("--sync-steps", type=int, default=120, help="steps per sync-share run (default 120: 4 syncs)")
    p.add_argument("--sync-batch", type=int, default=4, help="micro-batch of the sync-share runs on CUDA")
    p.add_argument("--timeout", type=int, default=400, help="seconds per run before it counts as hung")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    cuda = _cuda()
    t0 = time.perf_counter()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    if cuda:
        import torch

        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, load average {loadavg()}")
    else:
        print("no CUDA device: tiny flavor on CPU, fp32, no compile; these are not GPU figures")
    throughput = sync = None
    if args.part in ("all", "throughput"):
        throughput = part_throughput(args, cuda)
    if args.part in ("all", "sync"):
        sync = part_sync(args, cuda)
    print("\n== summary ==" + ("" if cuda else " (CPU, tiny flavor: the targets are for an H100, "
                                              "these verdicts only show the bench works)"))
    if throughput is not None:
        verdict = "met" if throughput["ratio"] >= trainer_overhead.TARGET_RATIO else "MISSED"
        print(f"tokens/s ours {throughput['ours_tokens_per_s']:,.0f}, stock {throughput['stock_tokens_per_s']:,.0f}: "
              f"ratio {throughput['ratio']:.3f} (target >= {trainer_overhead.TARGET_RATIO}: {verdict})")
        if throughput["ours_mfu"] is not None:
            verdict = "met" if throughput["ours_mfu"] >= TARGET_MFU else "MISSED"
            print(f"MFU ours {throughput['ours_mfu']:.1f}%, stock {throughput['stock_mfu']:.1f}% "
                  f"(target >= {TARGET_MFU:.0f}%: {verdict})")
    if sync is not None:
        for placement, share in sync.items():
            verdict = "met" if share <= TARGET_SHARE[placement] else "MISSED"
            where = ("the training device" if placement == "device" and not cuda else "GPU"
                     if placement == "device" else "pinned CPU" if cuda else "CPU")
            print(f"sync share, θ_g on {where}: {100 * share:.2f}% "
                  f"(target <= {100 * TARGET_SHARE[placement]:.0f}%: {verdict}; median over runs, worse replica)")
    print(f"total {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
