"""Peak memory of one sync's exchange at K=3, against a baseline checkout of the project.

    .venv/bin/python bench/exchange_memory.py [--numel 20000000] [--baseline-repo /path/to/old/checkout]
        [--bucket-mb 64] [--rounds 2] [--smoke]

Three replica processes (each its own torchft Manager and gloo group, a lighthouse in this
process) take ``--rounds`` syncs of a fragment of ``--numel`` float32 parameters (eight
tensors) for each codec and strategy, one case after the other in the same processes:
Δ = θ_g − θ_local, encode, exchange, decode and average. Each process measures the peak of
the memory its sync allocates (every storage aten allocates, alive until freed:
``live_bytes.py``; the exchange's worker runs inline on the measuring thread), Δ included,
and prints it as a multiple of the fragment's float32 size. With ``--baseline-repo`` the
same is measured with that checkout's code in the same run (its own three processes, after
this checkout's), e.g. the commit before bucketing (``git worktree add /tmp/old <commit>``).
Rounds after each case's first are reported (the first also sets up the process group and
the case's buffers). ``--smoke`` (CI): 80,000 parameters in buckets of 0.1 MB (several
buckets per sync), the three cases, two rounds: the whole path in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from machine import exit_on_sigterm  # bench/ is on sys.path when a bench script runs

REPO = Path(__file__).resolve().parents[1]
K = 3

WORKER = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import torch
    sys.path.insert(0, sys.argv[7])
    from live_bytes import LiveBytes
    from muloco import compat; compat.apply()
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    url, r, k, cases, numel, rounds = sys.argv[1:7]
    r, k, numel, rounds, cases = int(r), int(k), int(numel), int(rounds), json.loads(cases)
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), load_state_dict=None, state_dict=None,
        min_replica_size=k, use_async_quorum=False, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=url, replica_id=f"mem_{r}", init_sync=False,
        timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120))
    names = [f"layers.{i}.w.weight" for i in range(8)]
    shapes = [(numel // 8,)] * 8
    g = torch.Generator().manual_seed(r)
    globals_ = [torch.randn(s, generator=g) for s in shapes]
    locals_ = [t + 1e-3 * torch.randn(t.shape, generator=g) for t in globals_]
    from muloco.outer import exchange as ex_module
    new_api = hasattr(ex_module, "pipeline")  # the bucketed exchange (a package)
    if new_api:
        from live_bytes import exchange_worker_inline
        from muloco.compress import Quantizer, TopK
        from muloco.outer.exchange import Exchange, ReduceScatter

        inline = exchange_worker_inline()  # kept: dropping it would close it and undo the patch
        inline.__enter__()
    else:
        from muloco.outer.exchange import Exchange

    def build(case):
        if new_api:
            codec = Quantizer.Config(bits=2) if case["codec"] == "quantize" else TopK.Config(fraction=0.1)
            exchange = Exchange.Config(codec=codec, strategy=ReduceScatter.Config() if case["strategy"] ==
                                       "reduce_scatter" else None, bucket_mb=case["bucket_mb"]).build()

            def sync():
                def fill(views):
                    torch._foreach_copy_(views, globals_)
                    torch._foreach_sub_(views, locals_)
                return exchange.start(manager, names, fill, True).wait()
        else:
            settings = dict(codec=case["codec"], strategy=case["strategy"])
            if case["codec"] == "topk":
                settings["topk_fraction"] = 0.1
            exchange = Exchange.Config(**settings).build()

            def sync():
                deltas = torch._foreach_sub(globals_, locals_)
                return exchange.start(manager, names, deltas, True).wait()
        exchange.allocate(names, [torch.zeros(s) for s in shapes])
        return sync

    for index, case in enumerate(cases):
        sync = build(case)
        peaks = []
        for t in range(rounds):
            manager.start_quorum()
            with LiveBytes() as live:
                avg = sync()
            del avg
            assert manager.should_commit()
            peaks.append(live.peak)
        print("PEAKS", index, json.dumps(peaks), flush=True)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    import os
    os._exit(0)  # no interpreter teardown: torchft's and gloo's threads can stall it for seconds
    """
)

CASES = [
    {"codec": "quantize", "strategy": "allgather"},
    {"codec": "quantize", "strategy": "reduce_scatter"},
    {"codec": "topk", "strategy": "allgather"},
]


def run(repo: Path, cases: list[dict], numel: int, rounds: int, tmp: Path) -> list[list[float]]:
    """Per case, the peak bytes per round of a sync (max over the replicas), with ``repo``'s code."""
    from muloco.launch.lighthouse import start_lighthouse

    script = tmp / "worker.py"
    script.write_text(WORKER)
    lighthouse = start_lighthouse("127.0.0.1:0", min_replicas=K, join_timeout_ms=1000)
    url = lighthouse.url
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                url,
                str(r),
                str(K),
                json.dumps(cases),
                str(numel),
                str(rounds),
                str(REPO / "bench"),
            ],
            cwd=tmp,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(K)
    ]
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        lighthouse.shutdown()
    per_replica = []
    for p, out in zip(procs, outs):
        lines = [line.split(maxsplit=2) for line in out.splitlines() if line.startswith("PEAKS ")]
        if p.returncode != 0 or len(lines) != len(cases):
            raise RuntimeError(f"replica failed ({p.returncode}):\n{out[-3000:]}")
        per_replica.append([json.loads(peaks) for _, _, peaks in lines])
    return [[max(col) for col in zip(*case)] for case in zip(*per_replica)]


SMOKE = {"numel": 80_000, "bucket_mb": 0.1, "rounds": 2}


def main() -> int:
    exit_on_sigterm()  # a time limit's SIGTERM still runs the finally that stops the replicas
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=20_000_000)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-repo", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="80,000 parameters, 0.1 MB buckets: the path in seconds (CI)")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first round of each case is not reported)")
    fragment = 4 * args.numel
    print(
        f"K={K}, one fragment of {args.numel:,} float32 parameters ({fragment / 1e6:.2f} MB); peak memory of a "
        f"sync (Δ included), max over replicas, rounds 2..{args.rounds}; buckets of {args.bucket_mb:g} MB"
    )
    repos = {"this checkout": REPO} | ({"baseline": args.baseline_repo.resolve()} if args.baseline_repo else {})
    cases = [{**case, "bucket_mb": args.bucket_mb} for case in CASES]
    with tempfile.TemporaryDirectory(prefix="exchange-memory-") as tmp:
        peaks = {name: run(repo, cases, args.numel, args.rounds, Path(tmp)) for name, repo in repos.items()}
    print(f"{'codec':>9} {'strategy':>15} " + "".join(f"{name:>26}" for name in repos))
    for i, case in enumerate(CASES):
        cells = [max(peaks[name][i][1:]) for name in repos]
        print(
            f"{case['codec']:>9} {case['strategy']:>15} "
            + "".join(f"{f'{peak / 1e6:>12.2f} MB {peak / fragment:>6.2f}x Δ':>26}" for peak in cells),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
