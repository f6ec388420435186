"""DiLoCo end to end: a lighthouse and replica-group processes over gloo, and fault drills."""

from __future__ import annotations

import random
import signal
import time

import pytest
from replicas import DILOCO_TINY, Cluster, losses, summary, syncs

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
@pytest.mark.parametrize("k,extra", [(2, ()), (3, ("--outer.num_fragments", "2", "--outer.fragment_sync_delay", "2", "--outer.fragment_update_alpha", "0.5"))])
def test_replicas_train_and_hold_identical_global_params_after_every_sync(cluster, tmp_path, k, extra):
    c = cluster(k, join_timeout_ms=20000)  # wait for slow starters: every replica in every sync
    dump = tmp_path / "run"
    for i in range(k):
        c.start_replica(i, _args(dump, extra=extra))
    for i in range(k):
        assert c.wait(f"r{i}", 200) == 0, c.tail(f"r{i}")
    per_replica = [_committed_hashes(dump, i) for i in range(k)]
    interval = H // (2 if extra else 1)
    assert sorted(per_replica[0]) == list(range(interval, 41, interval))
    for other in per_replica[1:]:
        assert other == per_replica[0]  # bitwise-identical θ_g after every committed sync
    for i in range(k):
        loss = losses(dump, i)
        assert loss[max(loss)] < loss[min(loss)] - 0.5
        s = summary(dump, i)["diloco"]
        assert s["syncs_committed"] == len(per_replica[0]) and s["syncs_failed"] == 0
        assert s["bytes_sent"] > 0 and s["per_step_fp32_allreduce_bytes"] > s["bytes_sent"]
        assert all(r["contributors"] == r["participants"] == k for r in syncs(dump, i))
        assert summary(dump, i)["final_validation_loss"] is not None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["random", "exchange"])
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
    extra = ("--outer.fragment_sync_delay", "3") if when == "exchange" else ()
    drill_step = 17  # prepared at 17, applied at 20 (τ = 3)
    for i in range(3):
        env = {"MULOCO_DRILL_KILL_IN_EXCHANGE_AT_STEP": str(drill_step)} if when == "exchange" and i == 2 else {}
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
    c.start_replica(2, _args(dump, steps=steps, extra=extra), tag="r2b")
    for name in ("r0", "r1", "r2b"):
        assert c.wait(name, 240) == 0, c.tail(name)
    assert "healed from a peer" in c.logs["r2b"].read_text()
    for i in range(3):
        for r in syncs(dump, i):
            if r["committed"]:  # never an average over fewer replicas than announced
                assert r["contributors"] <= r["participants"]
                assert r["contributors"] >= 1
    if when == "exchange":  # the sync r2 died in must have failed on the survivors, not committed
        for i in range(2):
            rec = {r["step"]: r for r in syncs(dump, i)}[drill_step + 3]
            assert not rec["committed"], rec
    final = [syncs(dump, i)[-1] for i in range(3)]
    assert all(f["committed"] and f["step"] == steps for f in final)
    assert final[0]["global_sha256"] == final[1]["global_sha256"] == final[2]["global_sha256"]
    print(f"kill ({when}): survivors committed again {resumed_after:.1f}s after the kill")
