"""DiLoCo end to end: a lighthouse and replica-group processes over gloo, and fault drills."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO
from replicas import DILOCO_TINY, Cluster, losses, summary, syncs

from muloco.launch.local import LocalJob

H = 10


def _args(dump, steps=40, extra=()):
    return [
        "--config", "diloco/diloco", *DILOCO_TINY,
        "--training.steps", str(steps), "--outer.sync_every", str(H),
        "--checkpoint.interval", "20", "--validator.freq", "20",
        "--fault_tolerance.process_group_timeout_ms", "3000",
        "--fault_tolerance.quorum_timeout_seconds", "60",
        "--dump_folder", str(dump), *extra,
    ]


@pytest.fixture
def cluster(tmp_path, request):
    made = []

    def make(k, **kw):
        c = Cluster(tmp_path, k, **kw)
        made.append(c)
        c.start_lighthouse()
        return c

    yield make
    for c in made:
        c.close()


def _committed_hashes(dump, replica):
    return {r["step"]: r["global_sha256"] for r in syncs(dump, replica) if r["committed"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "k,extra",
    [
        (2, ()),
        (3, ("--outer.num_fragments", "2", "--outer.fragment_sync_delay", "2", "--outer.fragment_update_alpha", "0.5")),
        (2, ("--optimizer.name", "Muon", "--optimizer.lr", "0.02")),  # MuLoCo
        (2, ("--optimizer.name", "Muon", "--optimizer.lr", "0.02", "--outer.exchange.codec", "quantize",
             "--outer.exchange.bits", "2", "--outer.exchange.skip_pattern", r"norm\.weight$")),
        (3, ("--outer.exchange.codec", "topk", "--outer.exchange.topk_fraction", "0.1",
             "--outer.exchange.strategy", "reduce_scatter")),
    ],
    ids=["diloco-k2", "streaming-k3", "muloco-k2", "muloco-2bit-ef-k2", "topk-reduce-scatter-k3"],
)
def test_replicas_train_and_hold_identical_global_params_after_every_sync(cluster, tmp_path, k, extra):
    c = cluster(k, join_timeout_ms=20000)  # wait for slow starters: every replica in every sync
    dump = tmp_path / "run"
    for i in range(k):
        c.start_replica(i, _args(dump, extra=extra))
    for i in range(k):
        assert c.wait(f"r{i}", 200) == 0, c.tail(f"r{i}")
    per_replica = [_committed_hashes(dump, i) for i in range(k)]
    interval = H // (2 if "--outer.num_fragments" in extra else 1)
    assert sorted(per_replica[0]) == list(range(interval, 41, interval))
    for other in per_replica[1:]:
        assert other == per_replica[0]  # bitwise-identical θ_g after every committed sync
    for i in range(k):
        loss = losses(dump, i)
        # 40 steps: sparsified outer updates (top-k 10%) move θ_g less in so few syncs
        assert loss[max(loss)] < loss[min(loss)] - (0.3 if "topk" in extra else 0.5)
        s = summary(dump, i)["diloco"]
        assert s["syncs_committed"] == len(per_replica[0]) and s["syncs_failed"] == 0
        assert s["bytes_sent"] > 0 and s["per_step_fp32_allreduce_bytes"] > s["bytes_sent"]
        if "--outer.exchange.codec" in extra:  # compressed: a small payload, logged per sync
            assert s["payload_bits_per_parameter"] < 4 and s["reduction_vs_dense_fp32"] > 5
            assert all(r["bits_per_parameter"] < 4 for r in syncs(dump, i))
        assert all(r["contributors"] == r["participants"] == k for r in syncs(dump, i))
        assert summary(dump, i)["final_validation_loss"] is not None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["random", "exchange", "exchange-compressed"])
def test_killed_replica_survivors_go_on_and_restart_heals(cluster, tmp_path, when):
    """SIGKILL one of three replicas, at a random step or frozen inside an exchange.

    The survivors must commit again within the heartbeat timeout plus a margin,
    never commit an incomplete average, and the restarted replica must heal from a
    peer and finish with the same θ_g.
    """
    heartbeat_s = 1.0
    c = cluster(3, heartbeat_timeout_ms=int(heartbeat_s * 1000), join_timeout_ms=20000)
    dump = tmp_path / "run"
    steps = 240  # long enough that the survivors are still training when the restart heals
    extra = ("--outer.fragment_sync_delay", "3") if when.startswith("exchange") else ()
    if when == "exchange-compressed":  # two-phase reduce-scatter, top-k with error feedback: the
        # survivors decode what a failed collective left in their buffers and must not crash
        extra += ("--outer.exchange.codec", "topk", "--outer.exchange.topk_fraction", "0.25",
                  "--outer.exchange.strategy", "reduce_scatter")
    drill_step = 17  # prepared at 17, applied at 20 (τ = 3)
    for i in range(3):
        env = {"MULOCO_DRILL_KILL_IN_EXCHANGE": f"2:{drill_step}"} if when.startswith("exchange") else {}
        c.start_replica(i, _args(dump, steps=steps, extra=extra), env=env)
    if when == "random":
        c.wait_for("r2", r"sync at step 10", 120)
        time.sleep(random.Random().uniform(0.0, 2.0))
    else:
        c.wait_for("r2", r"fault drill: killing", 120)
    killed_at = time.time()
    c.kill("r2")  # no-op if the drill already killed it
    before = len(syncs(dump, 0))
    # survivors: a committed sync without the dead replica, soon
    deadline = killed_at + heartbeat_s + 60
    while time.time() < deadline:
        recs = syncs(dump, 0)[before:]
        if any(r["committed"] and r["participants"] == 2 for r in recs):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"survivor did not commit without the dead replica:\n{c.tail('r0')}")
    resumed_after = time.time() - killed_at
    c.start_replica(2, _args(dump, steps=steps, extra=extra), tag="r2b")  # no drill this time
    for name in ("r0", "r1", "r2b"):
        assert c.wait(name, 240) == 0, c.tail(name)
    assert "healed from a peer" in c.logs["r2b"].read_text()
    for i in range(3):
        for r in syncs(dump, i):
            if r["committed"]:  # never an average over fewer replicas than announced
                assert r["contributors"] <= r["participants"]
                assert r["contributors"] >= 1
    if when.startswith("exchange"):  # the sync r2 died in must have failed on the survivors, not committed
        for i in range(2):
            rec = {r["step"]: r for r in syncs(dump, i)}[drill_step + 3]
            assert not rec["committed"], rec
    final = [syncs(dump, i)[-1] for i in range(3)]
    assert all(f["committed"] and f["step"] == steps for f in final)
    assert final[0]["global_sha256"] == final[1]["global_sha256"] == final[2]["global_sha256"]
    print(f"kill ({when}): survivors committed again {resumed_after:.1f}s after the kill")


@pytest.mark.timeout(300)
def test_whole_job_cold_restart_continues_exactly(cluster, tmp_path):
    """Stop the whole job at a checkpoint, start it again: same losses and θ_g as one run."""
    total = ["--lr_scheduler.total_steps", "40"]

    def job(dump, steps):
        # min_replicas=2: a replica that resumes faster must not sync alone (it would then
        # heal its slower peer, which is correct but not the uninterrupted trajectory)
        c = cluster(2, join_timeout_ms=20000, min_replicas=2)
        for i in range(2):
            c.start_replica(i, _args(dump, steps=steps, extra=total), tag=f"r{i}-{steps}-{dump.name}")
        for i in range(2):
            name = f"r{i}-{steps}-{dump.name}"
            assert c.wait(name, 200) == 0, c.tail(name)
        c.close()

    job(tmp_path / "straight", 40)
    job(tmp_path / "restarted", 20)
    job(tmp_path / "restarted", 40)
    for i in range(2):
        straight, restarted = losses(tmp_path / "straight", i), losses(tmp_path / "restarted", i)
        late = [s for s in straight if s > 20]
        assert late and all(abs(straight[s] - restarted[s]) < 1e-6 for s in late), (straight, restarted)
        a = _committed_hashes(tmp_path / "straight", i)
        b = _committed_hashes(tmp_path / "restarted", i)
        assert a[40] == b[40]  # θ_g after the last sync, bitwise


@pytest.mark.timeout(120)
def test_unreachable_lighthouse_is_a_clear_error_within_the_timeout(tmp_path):
    c = Cluster(tmp_path, 1)
    try:
        c.url = f"http://127.0.0.1:{c.ports[0] + 1 if c.ports[0] < 65535 else 1024}"
        started = time.time()
        c.start_replica(0, _args(tmp_path / "run", steps=20, extra=("--fault_tolerance.connect_timeout_seconds", "3")))
        assert c.wait("r0", 90) == 4
        text = c.logs["r0"].read_text()
        assert "cannot reach the torchft lighthouse" in text and "./torchft_lighthouse" in text
        assert time.time() - started < 60
    finally:
        c.close()


@pytest.mark.timeout(180)
def test_lighthouse_killed_mid_run_is_a_clear_error_within_the_timeout(cluster, tmp_path):
    c = cluster(1)
    quorum_timeout = 5
    c.start_replica(
        0,
        _args(tmp_path / "run", steps=2000, extra=("--fault_tolerance.quorum_timeout_seconds", str(quorum_timeout))),
    )
    c.wait_for("r0", r"sync at step 10", 120)
    c.kill("lighthouse")
    killed = time.time()
    assert c.wait("r0", 120) == 4, c.tail("r0")
    elapsed = time.time() - killed
    text = c.logs["r0"].read_text()
    assert "lost its quorum" in text and "lighthouse" in text
    assert elapsed < quorum_timeout + 60, elapsed
    print(f"lighthouse killed: replica stopped with a clear error after {elapsed:.1f}s")


@pytest.mark.timeout(300)
def test_launcher_restarts_a_dead_replica_which_heals_and_finishes(tmp_path):
    """The README's launcher, with --max-restarts: replica 1 dies inside an exchange once."""
    dump = tmp_path / "run"
    job = LocalJob(
        config="diloco/diloco",
        replicas=2,
        # long enough that the peer is still training when the restarted replica comes back
        overrides=[*_args(dump, steps=600)[2:], "--checkpoint.no-enable", "--validator.freq", "200"],
        max_restarts=1,
        heartbeat_timeout_ms=1000,
        join_timeout_ms=20000,
        env={"MULOCO_DRILL_KILL_IN_EXCHANGE": "1:30"},
        console=open(tmp_path / "console.txt", "w"),
    )
    assert job.run() == 0, (tmp_path / "console.txt").read_text()[-3000:]
    log = (dump / "logs" / "replica_1.log").read_text()
    assert "fault drill: killing replica 1" in log and "=== restart 1 ===" in log
    assert "healed from a peer" in log.split("=== restart 1 ===")[1]
    final = [syncs(dump, i)[-1] for i in range(2)]
    assert final[0]["step"] == final[1]["step"] == 600
    assert final[0]["global_sha256"] == final[1]["global_sha256"]
    console = (tmp_path / "console.txt").read_text()
    assert "[r0]" in console and "[r1]" in console and "local job finished: 2 replicas ok" in console


@pytest.mark.timeout(300)
def test_sharded_replicas_compress_their_shards_and_resume(tmp_path):
    """K=2 replica groups of 2 FSDP ranks each, MuLoCo with 2-bit error feedback: every rank
    compresses its own shards and exchanges with the same rank of the other group; the
    residuals are saved per rank and a second leg resumes from them."""
    dump = tmp_path / "run"
    common = [sys.executable, "-m", "muloco.launch.local", "--config", "diloco/muloco_2bit",
              "--replicas", "2", "--procs-per-replica", "2", "--threads", "1", "--"]
    overrides = [*DILOCO_TINY, "--outer.sync_every", "10", "--checkpoint.interval", "10",
                 "--validator.freq", "1000", "--dump_folder", str(dump)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.run([*common, *overrides, "--training.steps", "20"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=200)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    second = subprocess.run([*common, *overrides, "--training.steps", "30"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=200)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    assert "Training starts at step 21" in second.stdout
    hashes = [_committed_hashes(dump, i) for i in range(2)]
    assert sorted(hashes[0]) == [10, 20, 30] and hashes[0] == hashes[1]
    from muloco import compat

    compat.apply()
    from muloco.models import ModelConfig, build_model_spec

    flavor = DILOCO_TINY[DILOCO_TINY.index("--model.flavor") + 1]
    model_params = sum(p.numel() for p in build_model_spec(ModelConfig(flavor=flavor), 2048).model.build().parameters())
    for i in range(2):
        recs = syncs(dump, i)
        assert all(r["committed"] and r["bits_per_parameter"] < 3 for r in recs)
        # rank 0 compressed and sent its own shards only: about half of the model
        assert all(0.4 * model_params < r["numel"] < 0.6 * model_params for r in recs), (recs, model_params)
