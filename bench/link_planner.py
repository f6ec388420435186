"""The link planner against the emulated link: projected and measured sync time, per config and link.

    .venv/bin/python bench/link_planner.py [--links 10mbps,100mbps] [--configs
    diloco/diloco,diloco/muloco_2bit,diloco/sparseloco]
        [--latency-ms 0] [--steps 60] [--sync-every 10] [--smoke] [--timeout 600] [--keep]

Per config and link, a real K=2 job on this machine (the local launcher users run: a lighthouse
and two replica groups, one torchrun each, one thread each) trains the tiny model
(``llama3-w128-d4-h2``, ~1.3M parameters, seq 256, batch 8) with ``--outer.link.mbps``; each sync
it records is read from ``replica_i/metrics.jsonl`` (``sync/seconds``, ``sync/time_link``).
The planner (``python -m muloco.model_map --link-mbps``, ``muloco/sizing/link_plan.py``) projects the
same sync from the config's exchange and the run's parameter count. Printed per config and
link: the projection, the measured sync time (per sync the replica that arrived last, i.e. the
smaller of the two replicas' times, which leaves out waiting for the other; median over the
syncs after the first, which also sets up the process group), its emulated-link part, and the
ratio measured / projected. The target: within 10% (0.90–1.10) at two link speeds. The measured
sync also holds the quorum, encoding, decoding and the outer step, which the planner leaves
out, so at fast links (where they are not small beside the link) the ratio grows above 1.

``--shaped`` (root and iproute2) runs each job a second time on the network testbed instead of
the emulated link (``muloco.launch.local --netns --link RATE``: each group on a host of its own, its
link shaped by ``tc tbf`` both ways, no ``--outer.link``) and prints that sync time, its bytes/s
and the job's wall-clock beside the emulated one's, with the ratios shaped / projected and
shaped / emulated (target: within 15%).

``--smoke`` (what CI runs): ``llama3-w64-d2-h2``, seq 64, batch 2, 6 steps, H=2, one config,
one link (20 Mbps). Outputs go to a temporary folder removed at the end (``--keep`` leaves it).
Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from local_run import add_job_options, run_local_job  # bench/ is on sys.path when a bench script runs
from machine import exit_on_sigterm, loadavg

from muloco.models.flavors import count_parameters, parse_flavor
from muloco.utils.link_model import format_rate, parse_rate

K = 2


def run_job(
    root: Path, name: str, config: str, overrides: list[str], timeout: float, launch: dict | None = None
) -> list[dict]:
    """One local job to completion; per replica its summary, sync rows and the job's wall-clock."""
    job = run_local_job(root / name, config, K, overrides, timeout, launch=launch)
    return [
        {
            "summary": r["summary"],
            "wall": job.wall_s,
            "syncs": sorted((x for x in r["rows"] if "sync/step" in x), key=lambda x: x["sync/step"]),
        }
        for r in job.replicas
    ]


def vocabulary(flavor: str, parameters: int) -> int:
    """The run's vocabulary, from its parameter count (embedding and head: 2 · vocab · dim)."""
    dim = parse_flavor(flavor).shape.dim
    vocab, rest = divmod(parameters - count_parameters(flavor, 0), 2 * dim)
    assert rest == 0, f"{parameters} parameters do not fit {flavor}"
    return vocab


def measure(replicas: list[dict]) -> dict:
    """Per sync after the first: the smaller replica's time (the last to arrive) and its link part."""
    steps = sorted({r["sync/step"] for r in replicas[0]["syncs"]})[1:]
    by_step = [[next(r for r in rep["syncs"] if r["sync/step"] == s) for rep in replicas] for s in steps]
    last = [min(rows, key=lambda r: r["sync/seconds"]) for rows in by_step]
    return {
        "syncs": len(last),
        "seconds": statistics.median(r["sync/seconds"] for r in last),
        "link": statistics.median(r.get("sync/time_link", 0.0) for r in last),
        "bytes": statistics.median(r.get("sync/bytes_sent", 0) for r in last),
        "committed": all(r["sync/committed"] for rows in by_step for r in rows),
        "wall": replicas[0]["wall"],
    }


def project(config_name: str, flavor: str, vocab: int, mbps: float, latency_ms: float, sync_every: int) -> float:
    from muloco import compat
    from muloco.sizing import link_plan

    compat.apply()
    from muloco.config import load_config

    exchange = load_config(config_name).outer.exchange
    inputs = link_plan.Inputs(
        flavor=flavor,
        replicas=K,
        mbps=mbps,
        latency_ms=latency_ms,
        sync_every=sync_every,
        step_seconds=1.0,
        global_batch=K,
        vocab=vocab,
    )
    return link_plan.project_sync(inputs, config=exchange).seconds


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", default="10mbps,100mbps")
    p.add_argument("--configs", default="diloco/diloco,diloco/muloco_2bit,diloco/sparseloco")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--shaped", action="store_true", help="also on the network testbed's tbf-shaped links (root)")
    add_job_options(p, timeout=600)
    args = p.parse_args()
    try:
        links = [parse_rate(v) for v in args.links.split(",")]
    except ValueError as err:
        p.error(f"--links: {err}")
    flavor, shape = "llama3-w128-d4-h2", []
    configs = args.configs.split(",")
    if args.smoke:
        flavor, shape, links, configs = (
            "llama3-w64-d2-h2",
            ["--training.seq_len", "64", "--training.local_batch_size", "2"],
            [20.0],
            configs[:1],
        )
        args.steps, args.sync_every = 6, 2
    root = Path(tempfile.mkdtemp(prefix="link_planner_"))
    print(
        f"machine load average at start: {loadavg()}; K={K}, {flavor}, {args.steps} steps, H={args.sync_every}, "
        f"latency {args.latency_ms:g} ms per round"
    )
    rows, shaped = [], {}
    if args.shaped:
        from muloco.launch.netns import unavailable

        if unavailable():
            p.error(f"--shaped: {unavailable()}")
    try:
        for config in configs:
            for mbps in links:
                name = f"{config.replace('/', '-')}-{format_rate(mbps).replace(' ', '')}"
                replicas = run_job(
                    root,
                    name,
                    config,
                    [
                        "--model.flavor",
                        flavor,
                        *shape,
                        "--training.steps",
                        str(args.steps),
                        "--outer.sync_every",
                        str(args.sync_every),
                        "--outer.link.mbps",
                        f"{mbps:g}",
                        "--outer.link.latency_ms",
                        f"{args.latency_ms:g}",
                    ],
                    args.timeout,
                )
                vocab = vocabulary(flavor, replicas[0]["summary"]["diloco"]["outer_parameters"])
                planned = project(config, flavor, vocab, mbps, args.latency_ms, args.sync_every)
                rows.append((config, mbps, planned, measure(replicas)))
                if args.shaped:
                    common = [
                        "--model.flavor",
                        flavor,
                        *shape,
                        "--training.steps",
                        str(args.steps),
                        "--outer.sync_every",
                        str(args.sync_every),
                    ]
                    shaped[(config, mbps)] = measure(
                        run_job(
                            root,
                            name + "-shaped",
                            config,
                            common,
                            args.timeout,
                            launch={"netns": True, "link": f"{mbps:g}mbit"},
                        )
                    )
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{'config':<22}{'link (emulated)':>16}{'projected s':>13}{'measured s':>12}{'link part s':>13}"
        f"{'syncs':>7}{'ratio':>8}  within 10%"
    )
    for config, mbps, planned, m in rows:
        ratio = m["seconds"] / planned
        print(
            f"{config:<22}{format_rate(mbps):>16}{planned:>13.3f}{m['seconds']:>12.3f}{m['link']:>13.3f}"
            f"{m['syncs']:>7}{ratio:>8.3f}  {'yes' if abs(ratio - 1) <= 0.10 else 'no'}"
            + ("" if m["committed"] else "  (a sync did not commit)")
        )
    if shaped:
        print(
            f"\n{'config':<22}{'link':>10}{'projected s':>13}{'emulated s':>12}{'shaped s':>10}{'shaped MB/s':>13}"
            f"{'wall emu s':>12}{'wall shaped s':>15}{'shaped/proj':>13}{'shaped/emu':>12}  within 15%"
        )
        for config, mbps, planned, m in rows:
            t = shaped[(config, mbps)]
            rate = t["bytes"] / t["seconds"] / 1e6 if t["seconds"] else 0.0
            vs_plan, vs_emu = t["seconds"] / planned, t["seconds"] / m["seconds"]
            print(
                f"{config:<22}{format_rate(mbps):>10}{planned:>13.3f}{m['seconds']:>12.3f}{t['seconds']:>10.3f}"
                f"{rate:>13.2f}{m['wall']:>12.1f}{t['wall']:>15.1f}{vs_plan:>13.3f}{vs_emu:>12.3f}  "
                f"{'yes' if abs(vs_plan - 1) <= 0.15 else 'no'}"
                + ("" if t["committed"] else "  (a sync did not commit)")
            )
    print(
        f"\nmachine load average at the end: {loadavg()}; measured: per sync the replica that arrived last, "
        "median over the syncs after the first; projected: the planner (bytes / bandwidth + rounds x latency)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
