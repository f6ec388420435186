"""Run the whole fault-drill matrix (tests/drills.py) and print one line per run and a table.

    .venv/bin/python scripts/fault_drills.py                 # every drill, 3 seeds each
    .venv/bin/python scripts/fault_drills.py --runs 5 --only exchange healing
    .venv/bin/python scripts/fault_drills.py --keep /tmp/drills   # keep the run folders

Each run is a K=3 job (K=2 for one-sync-behind) under the local launcher with real SIGKILLs (about 35 s each on a quiet
2-core CPU), paced by the test (a killed replica comes back, and heals, where its drill says,
whatever the speed of the machine). CI runs a subset (tests/test_fault_drills.py). Exit status
0 only if every run ended with identical final θ_g hashes and validation losses, no minority
commit, no healthy replica healed, each killed replica healed where its drill says, no sync
rolled back that a kill did not make fail, the last sync committed everywhere, and no step
trained twice where the drill says so. The table reports syncs committed, rolled back and
steps trained twice per run (one number per seed).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from drills import DRILLS, DrillResult, describe, run_drill  # noqa: E402


def _table(results: list[DrillResult]) -> str:
    rows = [
        "| drill | what | K | runs | passed | identical θ_g and loss | healed (killed replicas only) | syncs "
        "committed (all groups) | rolled back | steps trained twice | seconds per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, drill in DRILLS.items():
        mine = [r for r in results if r.drill == name]
        if not mine:
            continue
        ok = sum(r.ok for r in mine)
        agree = sum(
            bool(r.final_hashes) and len(set(r.final_hashes)) == 1 and len(set(r.final_losses)) == 1 for r in mine
        )
        healed = sum(bool(r.healed) for r in mine)
        secs = sorted(r.seconds for r in mine)
        committed = "/".join(str(r.committed) for r in mine)
        rolled = "/".join(str(len(r.rolled_back)) for r in mine)
        twice = "/".join(str(r.trained_twice) for r in mine)
        rows.append(
            f"| {name} | {drill.what} | {drill.replicas} | {len(mine)} | {ok}/{len(mine)} | {agree}/{len(mine)} | "
            f"{healed}/{len(mine)} | {committed} | {rolled} | {twice} | {secs[len(secs) // 2]:.0f} (median) |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="seeds per drill (default %(default)s)")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--only", nargs="*", choices=sorted(DRILLS), help="these drills only")
    p.add_argument("--keep", type=Path, default=None, help="keep run folders here (default: a temp folder, removed)")
    args = p.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="muloco-drills-"))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for name in args.only or list(DRILLS):
            for seed in range(args.first_seed, args.first_seed + args.runs):
                result = run_drill(name, seed, root)
                results.append(result)
                print(("OK   " if result.ok else "FAIL ") + describe(result), flush=True)
    finally:
        if args.keep is None and all(r.ok for r in results):
            shutil.rmtree(root, ignore_errors=True)
        elif results:
            print(f"run folders kept in {root}")
    print(_table(results))
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
