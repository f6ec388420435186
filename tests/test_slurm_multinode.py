"""Replica groups over two SLURM nodes each, on a real SLURM whose four nodes are four slurmd on
localhost (Debian's build runs several, each with its own name, port and spool).

What it covers: a group's torchrun on each of its nodes (one ``srun`` step per group, a task per
node), the c10d rendezvous on the group's first node reached at SLURM's NodeAddr (the node names
n1..n4 resolve nowhere), gloo between the nodes of a group on the interface ``--socket-ifname``
names (exported to the jobs), each node's lighthouse relay, and DiLoCo across the two groups.
What it does not: a real network between the nodes (all of them share this machine's loopback,
so routing, firewalls and a wrong interface choice cannot show here), GPUs and NCCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TINY
from progress import JOB_QUIET_S, FolderProgress
from replicas import syncs

pytestmark = pytest.mark.timeout(1200)

STEPS = 20


@pytest.fixture(scope="module")
def four_nodes(tmp_path_factory):
    """A SLURM of four two-CPU nodes on localhost, its own daemons and ports, stopped at the end
    (the lighthouse job takes a CPU of one of them: both groups still find two nodes at once)."""
    from slurm_cluster import LocalSlurm, ensure_slurm_installed

    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(f"no local SLURM: {reason}")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm4"), cpus=2, nodes=4)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_two_replica_groups_of_two_nodes_each_train_and_agree(four_nodes, tmp_path):
    cluster = four_nodes
    assert cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split() == [
        "n1",
        "idle",
        "n2",
        "idle",
        "n3",
        "idle",
        "n4",
        "idle",
    ]  # four slurmd, one machine
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "muloco.launch.slurm",
            "array",
            "--config",
            "diloco/muloco",
            "--replicas",
            "2",
            "--nodes-per-replica",
            "2",
            "--gpus-per-node",
            "0",
            "--cpus-per-node",
            "1",
            "--time",
            "15",
            "--socket-ifname",
            "lo",
            "--",
            *TINY,
            "--training.steps",
            str(STEPS),
            "--outer.sync_every",
            "5",
            "--checkpoint.interval",
            "1000",
            "--metrics.log_freq",
            "5",
            "--validator.freq",
            "1000",
            "--dump_folder",
            str(run),
        ],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, **cluster.env},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = dict(
        line[len("submitted ") :].split(" as job ")[::-1]
        for line in proc.stdout.splitlines()
        if line.startswith("submitted ")
    )
    array = next(job for job, path in jobs.items() if path.endswith("groups.sh"))
    states = cluster.wait_jobs_done(jobs, progress=FolderProgress(JOB_QUIET_S, run))
    logs = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(run.rglob("*.log")))
    assert states.get(f"{array}_0") == states.get(f"{array}_1") == "COMPLETED", f"{states}\n{logs}\n{cluster.logs()}"
    script = (run / "slurm" / "groups.sh").read_text()
    assert "export GLOO_SOCKET_IFNAME=lo" in script and "export NCCL_SOCKET_IFNAME=lo" in script
    for r in (0, 1):
        log = (run / "logs" / f"replica_{r}.log").read_text()
        assert f"replica group {r}/2 on 127.0.0.1,127.0.0.1" in log, log[-3000:]  # NodeAddr, not n1
        summary = json.loads((run / f"replica_{r}" / "summary.json").read_text())
        assert summary["steps"] == STEPS, summary
        assert "dp_shard=2" in log, log[-3000:]  # one FSDP world of two ranks: one on each node
        assert all(x["committed"] and x["participants"] == 2 for x in syncs(run, r))
    for task in ("0", "1"):  # each group's task held two nodes
        nodes = cluster.run(["squeue", "-h", "-t", "all", "-j", f"{array}_{task}", "-o", "%N"]).stdout.strip()
        assert len(cluster.run(["scontrol", "show", "hostnames", nodes]).stdout.split()) == 2, nodes
    a, b = (json.loads((run / f"replica_{r}" / "summary.json").read_text()) for r in (0, 1))
    assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]


def test_the_spanning_kind_runs_its_groups_and_lighthouse_as_steps_of_one_job(four_nodes, tmp_path):
    """K=2 groups of one node each and the lighthouse (a step on the first node) in one job: the
    groups reach the lighthouse directly (it cannot move, so no relay) and end on one θ_g."""
    cluster = four_nodes
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "muloco.launch.slurm",
            "spanning",
            "--config",
            "diloco/muloco",
            "--replicas",
            "2",
            "--gpus-per-node",
            "0",
            "--cpus-per-node",
            "2",
            "--time",
            "15",
            "--",
            *TINY,
            "--training.steps",
            "10",
            "--outer.sync_every",
            "5",
            "--checkpoint.interval",
            "1000",
            "--validator.freq",
            "1000",
            "--dump_folder",
            str(run),
        ],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, **cluster.env},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = next(line.rsplit(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("submitted "))
    states = cluster.wait_jobs_done([job], progress=FolderProgress(JOB_QUIET_S, run))
    logs = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(run.rglob("*.log")))
    assert set(states.values()) == {"COMPLETED"}, f"{states}\n{logs}\n{cluster.logs()}"
    a, b = (json.loads((run / f"replica_{r}" / "summary.json").read_text()) for r in (0, 1))
    assert a["steps"] == b["steps"] == 10
    assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]
    for r in (0, 1):
        log = (run / "logs" / f"replica_{r}.log").read_text()
        assert f"replica group {r}/2 on 127.0.0.1, lighthouse http://" in log and "through" not in log, log[-2000:]
