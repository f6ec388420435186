"""Codec figures: payload size, error and speed of every pseudo-gradient codec.

    .venv/bin/python bench/codecs.py [--numel 4194304] [--repeats 9] [--threads 1]
        [--device auto|cpu|cuda] [--seed 0]

For each codec configuration (identity fp32/bf16; quantize statistical, absmax and
minmax at 1/2/4/8 bits with their default blocks and ranges; top-k at fractions 0.01 and
0.1 with bfloat16 values and with 4-bit values), on one Gaussian tensor of ``--numel``
elements:

- **bits/param**: 8 · payload bytes / numel, metadata (scales, tables, indices) included;
- **rel err**: ‖decode(encode(x)) − x‖ / ‖x‖;
- **encode / decode**: median time, and as a ratio against ``x.clone()`` of the same tensor
  timed alongside (a clone reads and writes the tensor once: the floor for any codec that
  touches every element). Target ≤ 2x clone.

Medians over ``--repeats`` after warm-up; clone, encode and decode take turns, so drift
hits all three.

Where CPU time goes (one thread): every eager torch op is one pass over memory, so a codec
costs roughly its op count in clones; on top of that the statistical centroids need one
segmented sum (``bincount``, a serial scatter, ~4 clones) and top-k a per-chunk selection
(``torch.topk``, ~20-40 clones). Those are the encodes furthest from the target there.

One torch thread by default (``--threads``): the machine is shared. On CUDA every timing
synchronizes. Nothing here asserts; the figures are printed with the machine's load.

The table is ``codec_table(args)``; ``main()`` prints the header and then each table, so a
further table (e.g. per-replica bytes per sync against the number of replicas) is one more
function and one more call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from machine import loadavg  # bench/ is on sys.path when a bench script runs
from muloco.compress import make_codec

TARGET_RATIO = 2.0

CODECS: list[tuple[str, dict]] = [
    ("identity", {"dtype": "float32"}),
    ("identity", {"dtype": "bfloat16"}),
    *[("quantize", {"scheme": scheme, "bits": bits})
      for scheme in ("statistical", "absmax", "minmax") for bits in (1, 2, 4, 8)],
    *[("topk", {"fraction": fraction, **values})
      for fraction in (0.01, 0.1) for values in ({"value_dtype": "bfloat16"}, {"value_bits": 4})],
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


def codec_table(args) -> list[dict]:
    """Print and return one row per codec configuration (see the module docstring)."""
    device = args.device
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.randn(args.numel, device=device, generator=gen)
    print(f"\n== codecs on a Gaussian tensor of {args.numel} float32 elements")
    print(f"{'codec':>48} {'bits/param':>10} {'rel err':>8} {'clone ms':>9} {'encode ms':>10} {'x clone':>8} "
          f"{'decode ms':>10} {'x clone':>8}")
    rows = []
    for kind, settings in CODECS:
        codec = make_codec(kind, **settings)
        payload = codec.encode(x)
        error = ((codec.decode(payload, x.numel()) - x).norm() / x.norm()).item()
        t = median_times({"clone": x.clone, "encode": lambda: codec.encode(x),
                          "decode": lambda: codec.decode(payload, x.numel())}, device, args.repeats)
        t_clone, t_enc, t_dec = t["clone"], t["encode"], t["decode"]
        row = {"codec": codec.describe(), "bits": codec.bits_per_element(x.numel()), "error": error,
               "clone": t_clone, "encode": t_enc, "decode": t_dec}
        rows.append(row)
        print(f"{row['codec']:>48} {row['bits']:10.3f} {error:8.4f} {t_clone * 1e3:9.2f} {t_enc * 1e3:10.2f} "
              f"{t_enc / t_clone:7.1f}x {t_dec * 1e3:10.2f} {t_dec / t_clone:7.1f}x")
    met = [r["codec"] for r in rows if max(r["encode"], r["decode"]) <= TARGET_RATIO * r["clone"]]
    print(f"within {TARGET_RATIO:g}x clone for both encode and decode: {len(met)} of {len(rows)}"
          + (f" ({', '.join(met)})" if met else ""))
    return rows


def exchange_table(args) -> list[dict]:
    """Per-replica bytes per sync against K, from the wire format (``wire_bytes``, which the
    3-process tests check against the bytes actually handed to the collectives)."""
    from muloco import compat

    compat.apply()
    from muloco.compress.build import make_codec
    from muloco.config import load_config
    from muloco.outer.compressed_exchange import wire_bytes

    cfg = load_config("diloco/muloco_2bit")
    codecs = {"2-bit statistical": cfg.outer.exchange.make_codec(),
              "top-k 10% bf16": make_codec("topk", fraction=0.1, chunk_size=4096, value_dtype="bfloat16")}
    n, n_dense = args.exchange_numel, args.exchange_dense
    print(f"\nper-replica bytes per sync, {n / 1e6:.2f}M compressed + {n_dense:,} dense fp32 elements "
          f"(max over ranks; sent = received); ring = dense fp32 ring all-reduce 2(K-1)/K x 4N")
    print(f"{'codec':>18} {'K':>3} {'ring MB':>9} {'allgather MB':>13} {'x less':>7} {'reduce-scatter MB':>18} {'x less':>7}")
    rows = []
    for label, codec in codecs.items():
        for k in (2, 4, 8, 16):
            ring = 2 * (k - 1) / k * 4 * (n + n_dense)
            ag = max(wire_bytes("allgather", k, codec, n, n_dense, rank=r)["sent"] for r in range(k))
            rs = max(max(wire_bytes("reduce_scatter", k, codec, n, n_dense, rank=r)[d] for d in ("sent", "received"))
                     for r in range(k))
            rows.append(dict(codec=label, k=k, ring=ring, allgather=ag, reduce_scatter=rs))
            print(f"{label:>18} {k:>3} {ring / 1e6:9.2f} {ag / 1e6:13.2f} {ring / ag:7.1f} {rs / 1e6:18.2f} {ring / rs:7.1f}")
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=4 * 1024 * 1024, help="elements of the test tensor")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exchange-numel", type=int, default=1_327_104,
                    help="compressed elements for the bytes-vs-K table (default: the default job's model without norms)")
    ap.add_argument("--exchange-dense", type=int, default=1_152, help="elements sent dense (the norms)")
    ap.add_argument("--skip-codecs", action="store_true", help="only the bytes-vs-K table")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    args.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                               ("cpu" if args.device == "auto" else args.device))
    name = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU"
    print(f"device {args.device} ({name}), torch threads {torch.get_num_threads()}, load {loadavg()}, "
          f"repeats {args.repeats}")
    if not args.skip_codecs:
        codec_table(args)
    exchange_table(args)
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
