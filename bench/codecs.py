"""Codec figures: payload size, error, speed and memory of every pseudo-gradient codec.

    .venv/bin/python bench/codecs.py [--numel 4194304] [--large-numel 100000000] [--repeats 9]
        [--threads 1] [--device auto|cpu|cuda] [--kernels auto|eager|compiled|both] [--seed 0]
        [--json PATH] [--smoke]

For each codec configuration (dense fp32/bf16; quantize statistical, absmax and minmax at
1/2/4/8 bits with their default blocks and ranges; top-k at fractions 0.01 and 0.1 with
bfloat16 values and with 4-bit values), on one Gaussian tensor of ``--numel`` elements,
then for the exchange's main codecs on ``--large-numel`` elements (100M: what one bucket
stream of a billion-parameter model looks like to a codec; fewer repeats):

- **bits/param**: 8 · payload bytes / numel, metadata (scales, tables, indices) included;
- **rel err**: ‖decode(encode(x)) − x‖ / ‖x‖;
- **encode / decode**: median time, and as a ratio against ``x.clone()`` of the same tensor
  timed alongside (a clone reads and writes the tensor once: the floor for any codec that
  touches every element). Target ≤ 2x clone;
- **peak MB**: the peak of the memory the encode (resp. decode) allocates, beyond its input
  and output: on CUDA the allocator's ``max_memory_allocated``; on a CPU every storage aten
  allocates on this thread, alive until freed (``live_bytes.py``).

Kernels (``--kernels``): ``eager`` (the reference), ``compiled`` (``torch.compile`` of the
same functions: fused Triton kernels on a GPU, C++ loops on a CPU; compilation happens in
warm-up and is not timed), or ``both`` (each codec twice, and a check that the payloads are
the same bytes; the eager reference of that check sums statistics as integers, as the
compiled kernels do, where ``auto`` would take float sums on a CPU). ``auto``: both on CUDA,
eager on a CPU (inductor's C++ build of every codec takes minutes there; ``--kernels both``
does it). Statistical quantization runs with
its device's default statistics (float sums in eager CPU kernels, exact integer sums
otherwise; see ``muloco/compress/quantize.py``).

``--numel 0`` (or ``--large-numel 0``) leaves a table out. ``--json PATH`` appends one JSON
line per row (bench/gpu_suite.py reads them). ``--smoke`` (CI): 4,096 and 65,536 elements
(a table left out stays out), one repeat, eager kernels only on a CPU: every table in seconds.

Medians over ``--repeats`` after warm-up; clone, encode and decode take turns, so drift
hits all three. One torch thread by default (``--threads``): the machine is shared. On
CUDA every timing synchronizes. Nothing here asserts; the figures are printed with the
machine's load.

Where CPU time goes (one thread): every eager torch op is one pass over memory, so a codec
costs roughly its op count in clones; on top of that the statistical centroids need one
segmented sum (``bincount``, a serial scatter, ~4 clones) and top-k a per-chunk selection
(``torch.topk``, ~20-40 clones). Those are the encodes furthest from the target there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
from live_bytes import LiveBytes  # bench/ is on sys.path when a bench script runs
from machine import loadavg

from muloco.compress import Dense, Quantizer, TopK

TARGET_RATIO = 2.0

CODECS = [
    Dense.Config(dtype="float32"),
    Dense.Config(dtype="bfloat16"),
    *[
        Quantizer.Config(scheme=scheme, bits=bits)
        for scheme in ("statistical", "absmax", "minmax")
        for bits in (1, 2, 4, 8)
    ],
    *[
        TopK.Config(fraction=fraction, **values)
        for fraction in (0.01, 0.1)
        for values in ({"value_dtype": "bfloat16"}, {"value_bits": 4})
    ],
    SPARSELOCO := TopK.Config(
        fraction=64 / 4096,
        value_bits=2,
        value_scheme="statistical",
        value_block_chunks=64,
        index_bits=12,
        mean_over_selectors=True,
    ),  # diloco/sparseloco's codec
]
LARGE = [
    Quantizer.Config(bits=2),
    Quantizer.Config(bits=4),
    Quantizer.Config(bits=2, scheme="absmax"),
    TopK.Config(fraction=0.1),
    SPARSELOCO,
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_times(fns: dict, device: torch.device, repeats: int, warmup: int = 3) -> dict:
    """Median time of each function, the functions taking turns so drift hits them all."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def peak_bytes(fn, device: torch.device) -> int:
    """Memory ``fn`` allocates at its peak (its result included)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del result
        return peak
    with LiveBytes() as live:
        result = fn()
    del result
    return live.peak


def _kernels(args) -> list[bool]:
    """The ``compiled`` flags to build each codec with."""
    if args.kernels == "both" or (args.kernels == "auto" and args.device.type == "cuda"):
        return [False, True]
    return [args.kernels == "compiled"]


def _emit(args, row: dict) -> None:
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


def codec_table(args, configs=CODECS, numel: int | None = None, repeats: int | None = None) -> list[dict]:
    """Print and return one row per codec configuration and kernel (see the module docstring)."""
    device = args.device
    numel = numel or args.numel
    repeats = repeats or args.repeats
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.randn(numel, device=device, generator=gen)
    print(f"\n== codecs on a Gaussian tensor of {numel:,} float32 elements ({repeats} repeats)")
    print(
        f"{'codec':>48} {'kernels':>8} {'bits/param':>10} {'rel err':>8} {'clone ms':>9} {'encode ms':>10} "
        f"{'x clone':>8} {'decode ms':>10} {'x clone':>8} {'enc MB':>8} {'dec MB':>8}"
    )
    rows = []
    for config in configs:
        payloads = {}
        for compiled in _kernels(args):
            codec = config.build(compiled=compiled)
            payload = codec.encode(x)  # compiles here, outside the timings
            codec.decode(payload, numel)
            payloads[compiled] = payload
            error = ((codec.decode(payload, numel) - x).norm() / x.norm()).item()
            t = median_times(
                {"clone": x.clone, "encode": lambda: codec.encode(x), "decode": lambda: codec.decode(payload, numel)},
                device,
                repeats,
            )
            mem_enc = peak_bytes(lambda: codec.encode(x), device)
            mem_dec = peak_bytes(lambda: codec.decode(payload, numel), device)
            row = {
                "table": "codecs",
                "numel": numel,
                "codec": codec.describe(),
                "kernels": "compiled" if compiled else "eager",
                "bits": codec.bits_per_element(numel),
                "error": error,
                "clone": t["clone"],
                "encode": t["encode"],
                "decode": t["decode"],
                "mem_encode": mem_enc,
                "mem_decode": mem_dec,
            }
            rows.append(row)
            print(
                f"{row['codec']:>48} {row['kernels']:>8} {row['bits']:10.3f} {error:8.4f} {t['clone'] * 1e3:9.2f} "
                f"{t['encode'] * 1e3:10.2f} {t['encode'] / t['clone']:7.1f}x {t['decode'] * 1e3:10.2f} "
                f"{t['decode'] / t['clone']:7.1f}x {mem_enc / 1e6:8.1f} {mem_dec / 1e6:8.1f}"
            )
        if len(payloads) == 2:
            rows[-1]["identical"] = same = torch.equal(_eager_reference(config, x, payloads), payloads[True])
            print(f"{'':>48} {'':>8} compiled payload {'identical to' if same else 'DIFFERS FROM'} the eager one")
        for row in rows[-len(payloads) :]:
            _emit(args, row)
    met = [f"{r['codec']} ({r['kernels']})" for r in rows if max(r["encode"], r["decode"]) <= TARGET_RATIO * r["clone"]]
    print(
        f"within {TARGET_RATIO:g}x clone for both encode and decode: {len(met)} of {len(rows)}"
        + (f" ({', '.join(met)})" if met else "")
    )
    print(
        f"(input {4 * numel / 1e6:.1f} MB; peak MB includes the result: a decode's output is another "
        f"{4 * numel / 1e6:.1f} MB)"
    )
    return rows


def _eager_reference(config, x: torch.Tensor, payloads: dict) -> torch.Tensor:
    """The eager payload to compare the compiled one with: with integer statistics, which the
    compiled kernels always use (``statistics`` auto takes float sums in eager CPU kernels)."""
    if getattr(config, "statistics", None) != "auto" or x.device.type != "cpu":
        return payloads[False]
    return dataclasses.replace(config, statistics="exact").build(compiled=False).encode(x)


def exchange_table(args) -> list[dict]:
    """Per-replica bytes per sync against K, from the wire format (``Exchange.wire_bytes``,
    which the 3-process tests check against the bytes actually handed to the collectives)."""
    from muloco import compat

    compat.apply()
    from muloco.config import load_config
    from muloco.outer.exchange import Exchange, ReduceScatter

    base = load_config("diloco/muloco_2bit").outer.exchange
    configs = {"2-bit statistical": base.codec, "top-k 10% bf16": TopK.Config(fraction=0.1), "SparseLoCo": SPARSELOCO}
    n, n_dense = args.exchange_numel, args.exchange_dense
    print(
        f"\nper-replica bytes per sync, {n / 1e6:.2f}M compressed + {n_dense:,} dense fp32 elements "
        f"(max over ranks; sent = received); ring = dense fp32 ring all-reduce 2(K-1)/K x 4N"
    )
    print(
        f"{'codec':>18} {'K':>3} {'ring MB':>9} {'allgather MB':>13} {'x less':>7} "
        f"{'reduce-scatter MB':>18} {'x less':>7}"
    )
    rows = []
    for label, codec in configs.items():
        # top-k goes over all-gather only (a reduce-scatter owner's re-encode would drop coordinates)
        strategies = (("allgather", None),) + (
            () if isinstance(codec, TopK.Config) else (("reduce_scatter", ReduceScatter.Config()),)
        )
        exchanges = {
            name: Exchange.Config(codec=codec, skip_pattern=base.skip_pattern, strategy=strategy).build()
            for name, strategy in strategies
        }
        for k in (2, 4, 8, 16):
            ring = 2 * (k - 1) / k * 4 * (n + n_dense)
            ag = max(exchanges["allgather"].wire_bytes(k, n, n_dense, rank=r)["sent"] for r in range(k))
            rs = None
            if "reduce_scatter" in exchanges:
                rs = max(
                    max(exchanges["reduce_scatter"].wire_bytes(k, n, n_dense, rank=r)[d] for d in ("sent", "received"))
                    for r in range(k)
                )
            rows.append(dict(table="exchange", codec=label, k=k, ring=ring, allgather=ag, reduce_scatter=rs))
            _emit(args, rows[-1])
            scatter = f"{rs / 1e6:18.2f} {ring / rs:7.1f}" if rs else f"{'- (all-gather only)':>18} {'-':>7}"
            print(f"{label:>18} {k:>3} {ring / 1e6:9.2f} {ag / 1e6:13.2f} {ring / ag:7.1f} {scatter}")
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=4 * 1024 * 1024, help="elements of the test tensor")
    ap.add_argument("--large-numel", type=int, default=100_000_000, help="elements of the large case (0: skip it)")
    ap.add_argument("--large-repeats", type=int, default=3)
    ap.add_argument("--kernels", default="auto", choices=["auto", "eager", "compiled", "both"])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--exchange-numel",
        type=int,
        default=1_327_104,
        help="compressed elements for the bytes-vs-K table (default: the default job's model without norms)",
    )
    ap.add_argument("--exchange-dense", type=int, default=1_152, help="elements sent dense (the norms)")
    ap.add_argument("--skip-codecs", action="store_true", help="only the bytes-vs-K table")
    ap.add_argument("--json", default=None, help="append one JSON line per row to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny tensors, one repeat: every table in seconds (CI)")
    return ap


SMOKE = {"numel": 4096, "large_numel": 65536, "repeats": 1, "large_repeats": 1}


def _smoke(args) -> None:
    """--smoke sizes; a table left out stays out; eager only where compiling means a C++ build."""
    for key, value in SMOKE.items():
        setattr(args, key, value if getattr(args, key) else 0)
    if args.device.type == "cpu" and args.kernels != "eager":
        print(
            "compiled kernels and their byte-identity check: need CUDA in --smoke (on a CPU inductor builds "
            "C++ for every codec, minutes); eager only"
        )
        _emit(args, {"table": "codecs", "case": "compiled kernels, byte identity", "skipped": "needs CUDA in --smoke"})
        args.kernels = "eager"


def main() -> int:
    args = build_parser().parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    args.device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    if args.smoke:
        _smoke(args)
    name = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU"
    print(
        f"device {args.device} ({name}), torch threads {torch.get_num_threads()}, load {loadavg()}, "
        f"repeats {args.repeats}"
    )
    if args.kernels == "auto" and args.device.type == "cpu":
        print(
            "compiled kernels and their byte-identity check: --kernels both on a CPU (inductor builds C++ "
            "for every codec, minutes); eager here"
        )
    if not args.skip_codecs:
        if args.numel:
            codec_table(args)
        if args.large_numel:
            codec_table(args, LARGE, args.large_numel, args.large_repeats)
    exchange_table(args)
    print(f"load after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
