"""DiLoCo end to end: a lighthouse and replica-group processes over gloo, and fault drills."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
from conftest import REPO, read_metrics, run_watched
from drill_train import release
from progress import FolderProgress, until
from replicas import DILOCO_TINY, DRILL_ENTRY, HANG_S, Cluster, losses, summary, syncs, waiting_in_quorum

from muloco.launch.local import LocalJob
from muloco.report.runs import load_run
from muloco.report.tables import lives_lines, rounds_lines
from muloco.runs.lives import UNSAID
from muloco.runs.lives import describe as describe_lives

H = 10


def _args(dump, steps=40, extra=(), config="diloco/diloco"):
    return [
        "--config",
        config,
        *DILOCO_TINY,
        "--training.steps",
        str(steps),
        "--outer.sync_every",
        str(H),
        "--checkpoint.interval",
        "20",
        "--validator.freq",
        "20",
        # waiting for a peer is only a hang timeout (a killed peer's sockets close at once, and a
        # healing one may take its time to join the exchange); a test that needs an order sets it
        "--fault_tolerance.process_group_timeout_ms",
        str(HANG_S * 1000),
        "--fault_tolerance.quorum_timeout_seconds",
        str(HANG_S),
        "--fault_tolerance.start_wait_seconds",
        str(HANG_S),
        "--fault_tolerance.end_wait_seconds",
        str(HANG_S),
        "--dump_folder",
        str(dump),
        *extra,
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


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "k,extra",
    [
        (2, ("--outer.link.mbps", "20", "--outer.link.latency_ms", "2")),  # over an emulated 20 Mbps link
        (3, ("--outer.num_fragments", "2", "--outer.fragment_sync_delay", "2", "--outer.fragment_update_alpha", "0.5")),
        (
            2,
            (
                "--optimizer.name",
                "Muon",
                "--optimizer.lr",
                "0.02",
                "--outer.exchange.codec",
                "quantize",  # MuLoCo
                "--outer.exchange.codec.bits",
                "2",
                "--outer.exchange.skip_pattern",
                r"norm\.weight$",
                "--objective",
                "mdlm",
            ),
        ),  # ... training a masked-diffusion model
        (
            3,
            (
                "--outer.exchange.codec",
                "quantize",
                "--outer.exchange.codec.bits",
                "2",
                "--outer.exchange.strategy",
                "reduce_scatter",
                "--outer.exchange.weighting",
                "tokens",
            ),
        ),
    ],
    ids=["diloco-k2", "streaming-k3", "muloco-2bit-ef-mdlm-k2", "2bit-reduce-scatter-k3-weighted"],
)
def test_replicas_train_and_hold_identical_global_params_after_every_sync(cluster, tmp_path, k, extra):
    c = cluster(k, min_replicas=k)  # a quorum waits for every replica, however slow: all in every sync
    dump = tmp_path / "run"
    for i in range(k):
        c.start_replica(i, _args(dump, extra=extra))
    for i in range(k):
        assert c.wait(f"r{i}", 2 * HANG_S) == 0, c.tail(f"r{i}")
    per_replica = [_committed_hashes(dump, i) for i in range(k)]
    interval = H // (2 if "--outer.num_fragments" in extra else 1)
    assert sorted(per_replica[0]) == list(range(interval, 41, interval))
    for other in per_replica[1:]:
        assert other == per_replica[0]  # bitwise-identical θ_g after every committed sync
    final_validation = set()
    for i in range(k):
        if "mdlm" in extra:  # validation on θ_g reports the negative ELBO per token; 40 steps of batch 4
            # are too few and too noisy for it to fall reliably (tests/test_diffusion.py checks that it does)
            nelbo = [r["validation_nelbo"] for r in read_metrics(dump / f"replica_{i}") if "validation_nelbo" in r]
            assert len(nelbo) >= 2 and all(0 < v < 20 for v in nelbo), nelbo
        else:
            loss = losses(dump, i)
            # 40 steps: sparsified outer updates (top-k 10%) move θ_g less in so few syncs
            assert loss[max(loss)] < loss[min(loss)] - (0.3 if "topk" in extra else 0.5)
        final_validation.add(summary(dump, i)["final_validation_loss"])
        s = summary(dump, i)["diloco"]
        assert s["syncs_committed"] == len(per_replica[0]) and s["syncs_failed"] == 0
        assert s["bytes_sent"] > 0 and s["per_step_fp32_allreduce_bytes"] > s["bytes_sent"]
        if "--outer.exchange.codec" in extra:  # compressed: a small payload, logged per sync
            assert s["payload_bits_per_parameter"] < 4 and s["reduction_vs_dense_fp32"] > 5
            assert all(r["bits_per_parameter"] < 4 for r in syncs(dump, i))
        assert all(r["contributors"] == r["participants"] == k for r in syncs(dump, i))
        assert all(r["tokens"] > 0 for r in syncs(dump, i))  # trained since the last sync, on this rank
        if "tokens" in extra:  # lockstep rounds: every group did the same work, so every weight is 1
            assert all(r["weight"] == 1.0 and [r[f"weight_{j}"] for j in range(k)] == [1.0] * k for r in syncs(dump, i))
            assert [r["tokens"] for r in syncs(dump, i)] == [r["tokens"] for r in syncs(dump, 0)]
        for r in syncs(dump, i):  # the blocked time, part by part, adds up to it
            parts = [v for key, v in r.items() if key.startswith("time_")]
            assert sorted(key[5:] for key in r if key.startswith("time_")) == sorted(SYNC_PARTS)
            assert abs(sum(parts) - r["seconds"]) < 1e-6 and r["peak_extra_bytes"] > 0
            # an emulated link (τ = 0): the sync is held at least as long as the model says its bytes take
            if "--outer.link.mbps" in extra:
                modeled = r["bytes_sent"] * 8 / 20e6 + 2 * (k - 1) * 0.002
                assert r["seconds"] >= modeled
            else:
                assert r["time_link"] == 0
        if "--outer.link.mbps" in extra:  # every printed figure that includes it says so
            assert s["link"] == "emulated link 20 Mbps, 2 ms per round"
            log = c.logs[f"r{i}"].read_text()
            assert "includes the emulated link 20 Mbps" in log and "link (emulated)" in log
            assert "(times include the emulated link 20 Mbps, 2 ms per round)" in log  # each step line
            assert re.search(r"wall time +[\d.]+s  \(includes the emulated link 20 Mbps", log)
        assert summary(dump, i)["final_validation_loss"] is not None
    assert len(final_validation) == 1  # every replica validated the same θ_g on the same data
    if "--outer.link.mbps" in extra:  # the replica that issues last is held (its collective ends at once)
        held = [max(r["time_link"] for r in rows) for rows in zip(*(syncs(dump, i) for i in range(k)))]
        assert held and all(h > 0 for h in held), held


@pytest.mark.timeout(600)
def test_deadline_rounds_let_the_faster_group_train_on_and_every_replica_agrees(cluster, tmp_path):
    """Deadline rounds, K=2: replica 0 reports 10 ms per step and replica 1 20 ms (drills, so the
    budgets are exact). Round 1 knows no pace: 4 steps each. Then the round lasts the slower
    group's 4 steps (80 ms): replica 0 trains 8 (2H, the cap), replica 1 trains 4, and the run
    moves 6 nominal steps per round; round 4 would leave 2 steps, a third of a round, so it takes
    them: 8 steps left of 6, 11 and 6 (rounded up; no whole exchange for 2.5 steps). The tokens
    weigh the merge (1 and 1/2), θ_g is bitwise the same after every sync, both groups end after
    the same round, and the inner lr follows the shared progress."""
    c = cluster(2, min_replicas=2)
    dump = tmp_path / "run"
    extra = (
        "--outer.sync_every",
        "4",
        "--outer.round",
        "deadline",  # weighting auto: tokens
        "--outer.fingerprint",
        "--checkpoint.interval",
        "12",
        "--validator.freq",
        "12",
        "--lr_scheduler.warmup_steps",
        "4",
    )
    env = {"MULOCO_TEST_DRILLS": "pace:0:10,pace:1:20", "MULOCO_TEST_DRILL_DIR": str(tmp_path)}
    for i in range(2):
        c.start_replica(i, _args(dump, steps=24, extra=extra), entry=DRILL_ENTRY, env=env)
    for i in range(2):
        assert c.wait(f"r{i}", 2 * HANG_S) == 0, c.tail(f"r{i}")
    rows = [syncs(dump, i) for i in range(2)]
    assert [r["round_steps"] for r in rows[0]] == [4, 8, 8, 11]
    assert [r["round_steps"] for r in rows[1]] == [4, 4, 4, 6]
    assert [r["progress"] for r in rows[0]] == [4.0, 10.0, 16.0, 24.5] == [r["progress"] for r in rows[1]]
    assert [r["step"] for r in rows[0]] == [4, 12, 20, 31] and [r["step"] for r in rows[1]] == [4, 8, 12, 18]
    assert all(r["committed"] and r["contributors"] == 2 for rs in rows for r in rs)
    weights = [[r["weight_0"], r["weight_1"]] for r in rows[0]]
    assert weights[:3] == [[1.0, 1.0]] + [[1.0, 0.5]] * 2 and weights[3][0] == 1.0
    assert weights[3][1] == pytest.approx(6 / 11, abs=1 / 65536)
    assert [r["global_sha256"] for r in rows[0]] == [r["global_sha256"] for r in rows[1]]
    ends = [summary(dump, i) for i in range(2)]
    assert ends[0]["diloco"]["final_global_sha256"] == ends[1]["diloco"]["final_global_sha256"]
    assert ends[0]["final_validation_loss"] == ends[1]["final_validation_loss"] is not None
    assert [e["diloco"]["round"] for e in ends] == [
        {"mode": "deadline", "rounds": 4, "progress": 24.5, "steps": 31},
        {"mode": "deadline", "rounds": 4, "progress": 24.5, "steps": 18},
    ]
    # the inner lr follows the progress, not the step count: replica 0's step 15 and replica 1's step 10
    # both come after 1/4 of round 3 (10 + 1.5 nominal steps)
    lrs = [
        {m["step"]: m["lr"] for m in read_metrics(dump / f"replica_{i}") if m.get("lr") is not None} for i in range(2)
    ]
    assert lrs[0][15] == pytest.approx(lrs[1][10])
    assert lrs[0][15] > 2 * lrs[1][15]  # the same step number is a different place in the run
    # checkpoints at the rounds whose progress passed a multiple of 12: 16 (round 3) and 24.5 (the end)
    for i, steps in ((0, [20, 31]), (1, [12, 18])):
        saved = sorted(int(d.name.split("-")[1]) for d in (dump / f"replica_{i}" / "checkpoint").glob("step-*"))
        assert saved == steps, (i, saved)
    # the report: each group's rounds, steps and tokens, and θ_g's validations on the run's progress
    run = load_run(dump)
    tokens = [sum(r["tokens"] for r in rows[i]) for i in range(2)]  # one rank per group here
    assert run.rounds == {
        "progress": 24.5,
        "groups": [
            {"group": 0, "rounds": 4, "steps": 31, "min_steps": 4, "max_steps": 11, "tokens_per_rank": tokens[0]},
            {"group": 1, "rounds": 4, "steps": 18, "min_steps": 4, "max_steps": 6, "tokens_per_rank": tokens[1]},
        ],
    }
    assert run.val_steps.tolist() == [16.0, 24.5] and run.sync_steps.tolist() == [4.0, 10.0, 16.0, 24.5]
    assert 0 < run.train_steps[0] < run.train_steps[-1] <= 24.5
    assert rounds_lines([run]) == [
        f"run: deadline rounds, 24.5 nominal steps; group 0: 31 steps in 4 rounds (4-11 per "
        f"round), {tokens[0]:,} tokens per rank; group 1: 18 steps in 4 rounds (4-6 per "
        f"round), {tokens[1]:,} tokens per rank"
    ]


def _paced_job(cluster, dump, k: int, steps: int, extra: tuple, drills: str, tag: str) -> list[int]:
    """K drill replicas (all needed for a quorum) on ``dump`` with ``drills``; their exit codes."""
    c = cluster(k, min_replicas=k)
    markers = dump.parent / f"markers-{tag}"
    markers.mkdir(exist_ok=True)
    env = {"MULOCO_TEST_DRILLS": drills, "MULOCO_TEST_DRILL_DIR": str(markers)}
    for i in range(k):
        c.start_replica(i, _args(dump, steps=steps, extra=extra), entry=DRILL_ENTRY, env=env, tag=f"r{i}-{tag}")
    codes = [c.wait(f"r{i}-{tag}", 2 * HANG_S) for i in range(k)]
    c.close()
    return codes


SYNC_PARTS = (
    "quorum",
    "cut_off",
    "wait_slowest",
    "queued",
    "pseudo_gradient",
    "encode",
    "collective",
    "link",
    "decode",
    "commit",
    "outer_step",
    "pull",
    "other",
)
"""``muloco.outer.exchange.PARTS``, written out: this module imports nothing that loads torch."""


PACED = (
    "--outer.sync_every",
    "4",
    "--outer.round",
    "deadline",
    "--outer.exchange.weighting",
    "tokens",
    "--outer.fingerprint",
    "--checkpoint.interval",
    "12",
    "--validator.freq",
    "12",
)
"""Deadline rounds of H=4 in which replica 0 reports 10 ms per step and replica 1 20 ms (``pace``
drills): after the first round replica 0 trains 8 steps per round, replica 1 4."""


@pytest.mark.timeout(900)
def test_deadline_rounds_resume_from_a_round_checkpoint_exactly(cluster, tmp_path):
    """Both groups killed in round 4 (after the checkpoint of round 3, saved at replica 0's step 20
    and replica 1's step 12) and started again: the rounds state (paces, progress, budgets) comes
    back with θ_g, and the run ends on the uninterrupted run's θ_g, bit for bit."""

    def job(dump, drills, tag):
        return _paced_job(cluster, dump, 2, 24, PACED, drills, tag)

    paced = "pace:0:10,pace:1:20"
    assert job(tmp_path / "straight", paced, "straight") == [0, 0]
    assert job(tmp_path / "resumed", paced + ",mid:0:22,mid:1:14", "killed") == [-9, -9]
    assert job(tmp_path / "resumed", paced, "resumed") == [0, 0]
    for i in range(2):
        straight, resumed = syncs(tmp_path / "straight", i), syncs(tmp_path / "resumed", i)
        assert [r["progress"] for r in resumed] == [4.0, 10.0, 16.0, 24.5]  # rounds 1-3, then round 4 again
        assert [r["global_sha256"] for r in resumed] == [r["global_sha256"] for r in straight]
        assert (
            summary(tmp_path / "resumed", i)["diloco"]["final_global_sha256"]
            == summary(tmp_path / "straight", i)["diloco"]["final_global_sha256"]
        )


PACED3 = (
    "--outer.sync_every",
    "3",
    "--outer.round",
    "deadline",
    "--outer.fingerprint",
    "--checkpoint.interval",
    "6",
    "--validator.freq",
    "6",
)
"""Deadline rounds of H=3, K=3, replicas 0 and 1 at 10 ms per step and replica 2 at 30 ms (``pace``
drills): after the first round (3 steps each) a round lasts the slow group's 3 steps (90 ms); the
fast groups would fit 9 and are capped at 2H = 6, so each round moves (6 + 6 + 3) / 3 = 5 nominal
steps: progress 3, 8, 13, 18 (the end)."""


@pytest.mark.timeout(900)
def test_deadline_rounds_k3_agree_and_resume_from_a_round_checkpoint_exactly(cluster, tmp_path):
    """K=3, one group 3x slower: every replica holds the same θ_g after every round (token weights
    1, 1 and 1/2); then all three are killed in round 4, after the checkpoint of round 3 (progress
    13 passed 12: saved at the fast groups' step 15 and the slow group's step 9), and started again:
    the run ends on the uninterrupted run's θ_g, bit for bit."""

    def job(dump, drills, tag):
        return _paced_job(cluster, dump, 3, 18, PACED3, drills, tag)

    paced = "pace:0:10,pace:1:10,pace:2:30"
    assert job(tmp_path / "straight", paced, "straight") == [0, 0, 0]
    rows = [syncs(tmp_path / "straight", i) for i in range(3)]
    assert [[r["round_steps"] for r in rs] for rs in rows] == [[3, 6, 6, 6], [3, 6, 6, 6], [3, 3, 3, 3]]
    assert all([r["progress"] for r in rs] == [3.0, 8.0, 13.0, 18.0] for rs in rows)
    assert all(r["committed"] and r["contributors"] == 3 for rs in rows for r in rs)
    assert [[r[f"weight_{j}"] for j in range(3)] for r in rows[0]] == [[1.0, 1.0, 1.0]] + [[1.0, 1.0, 0.5]] * 3
    assert (
        [r["global_sha256"] for r in rows[0]]
        == [r["global_sha256"] for r in rows[1]]
        == [r["global_sha256"] for r in rows[2]]
    )
    assert job(tmp_path / "resumed", paced + ",mid:0:17,mid:1:17,mid:2:11", "killed") == [-9, -9, -9]
    assert job(tmp_path / "resumed", paced, "resumed") == [0, 0, 0]
    for i in range(3):
        straight, resumed = syncs(tmp_path / "straight", i), syncs(tmp_path / "resumed", i)
        assert [r["progress"] for r in resumed] == [3.0, 8.0, 13.0, 18.0]  # rounds 1-3, then round 4 again
        assert [r["global_sha256"] for r in resumed] == [r["global_sha256"] for r in straight]
        assert (
            summary(tmp_path / "resumed", i)["diloco"]["final_global_sha256"]
            == summary(tmp_path / "straight", i)["diloco"]["final_global_sha256"]
        )
    # the report counts the rounds of the resumed run as of the uninterrupted one
    assert load_run(tmp_path / "resumed").rounds == load_run(tmp_path / "straight").rounds
    assert [g["steps"] for g in load_run(tmp_path / "straight").rounds["groups"]] == [21, 21, 12]


@pytest.mark.timeout(900)
def test_deadline_rounds_a_killed_group_restarts_heals_and_the_rounds_go_on(tmp_path):
    """The launcher with --max-restarts, K=2, deadline rounds, a failed sync rolled back at once
    (``--fault_tolerance.sync_retries 0``; the K=3 test below tries it again): replica 1 dies inside
    round 3's exchange (its step 12). Replica 0's round-3 sync fails (progress stays at 10), it trains its
    next 8 steps and waits; the restarted replica 1 (no checkpoints: behind) heals from it before
    training, taking its rounds state with θ_g and its step (28), and adds nothing to that sync
    (progress 10 + 8 from replica 0 alone). Then one more round of 8 and 4 ends the run at 24 on
    one θ_g."""
    dump = tmp_path / "run"
    job = LocalJob(
        config="diloco/diloco",
        replicas=2,
        overrides=[
            *_args(dump, steps=24, extra=PACED)[2:],
            "--checkpoint.no-enable",
            "--fault_tolerance.sync_retries",
            "0",
        ],
        max_restarts=1,
        heartbeat_timeout_ms=1000,
        entry=DRILL_ENTRY,
        env={"MULOCO_TEST_DRILLS": "pace:0:10,pace:1:20,exchange:1:12", "MULOCO_TEST_DRILL_DIR": str(tmp_path)},
        console=open(tmp_path / "console.txt", "w"),
    )
    assert job.run() == 0, (tmp_path / "console.txt").read_text()[-3000:]
    restarted = (dump / "logs" / "replica_1.log").read_text().split("=== restart 1 ===")[1]
    assert re.search(r"healed from replica 0 in quorum \d+: step 0 -> 28", restarted), restarted[-3000:]
    r0, r1 = syncs(dump, 0), syncs(dump, 1)
    assert [(r["step"], r["committed"], r["progress"]) for r in r0] == [
        (4, True, 4.0),
        (12, True, 10.0),
        (20, False, 10.0),
        (28, True, 18.0),
        (36, True, 24.0),
    ]
    assert [(r["step"], r["contributors"], r["round_steps"]) for r in r0[-2:]] == [(28, 1, 8), (36, 2, 8)]
    assert [(r["step"], r["progress"], r["round_steps"]) for r in r1[-2:]] == [(28, 18.0, 0), (32, 24.0, 4)]
    sums = [summary(dump, i) for i in range(2)]
    assert sums[0]["diloco"]["final_global_sha256"] == sums[1]["diloco"]["final_global_sha256"]
    assert [s["diloco"]["round"]["progress"] for s in sums] == [24.0, 24.0]


@pytest.mark.timeout(900)
def test_deadline_rounds_k3_the_slow_group_killed_restarts_heals_and_the_rounds_go_on(tmp_path):
    """K=3 (``PACED3``), the launcher with --max-restarts and a quorum of all three: the slow group
    dies inside round 3's exchange (its step 9), so round 3's first try fails on the fast groups
    (progress stays 8). They try it again in a fresh quorum (``--fault_tolerance.sync_retries``),
    which waits for the restarted slow group (no checkpoints): it heals from one of them, taking the
    rounds state with θ_g and their step (15), and adds nothing to that sync, which commits the fast
    groups' round: 8 + (6 + 6) / 2 = 14, no step of theirs thrown away. The last round is scaled to
    the 4 steps left of a 5-step round (6 -> 5, 3 -> 3, rounded up) and ends the run at 14 + 13/3 on
    one θ_g."""
    dump = tmp_path / "run"
    job = LocalJob(
        config="diloco/diloco",
        replicas=3,
        min_replicas=3,
        overrides=[*_args(dump, steps=18, extra=PACED3)[2:], "--checkpoint.no-enable"],
        max_restarts=1,
        heartbeat_timeout_ms=1000,
        entry=DRILL_ENTRY,
        env={
            "MULOCO_TEST_DRILLS": "pace:0:10,pace:1:10,pace:2:30,exchange:2:9",
            "MULOCO_TEST_DRILL_DIR": str(tmp_path),
        },
        console=open(tmp_path / "console.txt", "w"),
    )
    assert job.run() == 0, (tmp_path / "console.txt").read_text()[-3000:]
    restarted = (dump / "logs" / "replica_2.log").read_text().split("=== restart 1 ===")[1]
    assert re.search(r"healed from replica [01] in quorum \d+: step 0 -> 15", restarted), restarted[-3000:]
    rows = [syncs(dump, i) for i in range(3)]
    end = 14 + 13 / 3
    for r in rows[:2]:
        assert [(x["step"], x["committed"], x["retried"], x["progress"]) for x in r] == [
            (3, True, False, 3.0),
            (9, True, False, 8.0),
            (15, False, True, 8.0),
            (15, True, False, 14.0),
            (20, True, False, end),
        ]
        assert [(x["contributors"], x["round_steps"]) for x in r[-2:]] == [(2, 6), (3, 5)]
    assert [(x["step"], x["progress"], x["round_steps"]) for x in rows[2][-2:]] == [(15, 14.0, 0), (18, end, 3)]
    sums = [summary(dump, i) for i in range(3)]
    assert len({s["diloco"]["final_global_sha256"] for s in sums}) == 1
    assert [s["diloco"]["round"]["progress"] for s in sums] == [end] * 3
    # the report: the failed round and the heal count no steps; θ_g's validations at progress 8, 14 and the end
    run = load_run(dump)
    assert [(g["rounds"], g["steps"], g["min_steps"], g["max_steps"]) for g in run.rounds["groups"]] == [
        (4, 20, 3, 6),
        (4, 20, 3, 6),
        (3, 9, 3, 3),
    ]
    assert run.rounds["progress"] == end and run.val_steps.tolist() == [8.0, 14.0, end]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("objective", ["ar", "mdlm"])
def test_one_replica_group_trains_and_its_summary_claims_no_savings(cluster, tmp_path, objective):
    """K=1: nothing crosses a link, so the summary says so (no "…x more" over zero bytes).
    Validation off (torchtitan then builds no validator), for both objectives."""
    c = cluster(1)
    dump = tmp_path / "run"
    c.start_replica(0, _args(dump, steps=20, extra=("--objective", objective, "--validator.no-enable")))
    assert c.wait("r0", 2 * HANG_S) == 0, c.tail("r0")
    full = summary(dump, 0)
    assert full["objective"] == objective and full["final_validation_loss"] is None
    s = full["diloco"]
    assert s["syncs_committed"] == s["syncs"] == 2 and s["bytes_sent"] == 0 and s["reduction_vs_dense_fp32"] is None
    log = c.logs["r0"].read_text()
    assert "(one replica group: nothing to send)" in log and "x more" not in log
    assert f"final θ_g sha256 {s['final_global_sha256']}" in log


@pytest.mark.timeout(900)
def test_replica_killed_in_a_compressed_exchange_survivors_roll_back_and_go_on(cluster, tmp_path):
    """SIGKILL one of three replicas inside a 2-bit reduce-scatter exchange (τ = 3).

    The survivors decode what the failed collective left in their buffers without
    crashing, do not commit that sync, commit again without the dead replica (a majority,
    2 of 3), and the restarted replica heals before it trains and finishes with the same θ_g.
    The test sets the order: the survivors hold after step HOLD until the restarted replica
    waits in their next quorum (the lighthouse lists it), so it heals there, at step HOLD + 7,
    whatever the speed of training or of starting a process. More kill points:
    scripts/fault_drills.py.
    """
    # a live replica is always waited for, and never dropped for a heartbeat late under load
    c = cluster(3, heartbeat_timeout_ms=3000, join_timeout_ms=HANG_S * 1000)
    dump, markers = tmp_path / "run", tmp_path / "drills"
    markers.mkdir()
    steps, hold = 40, 30  # the sync prepared at 27 commits without the dead replica, then they hold
    extra = (
        "--outer.fragment_sync_delay",
        "3",
        "--outer.exchange.codec",
        "quantize",
        "--outer.exchange.codec.bits",
        "2",
        "--outer.exchange.strategy",
        "reduce_scatter",
        # scheduled outer steps: the healed replica takes them up where its peers are
        "--outer.step_schedule.lr.decay",
        "cosine",
        "--outer.step_schedule.lr.final",
        "0.25",
        "--outer.step_schedule.feedback_beta.decay",
        "linear",
        "--outer.step_schedule.feedback_beta.final",
        "0.5",
    )
    drill_step = 17  # prepared at 17, applied at 20 (τ = 3)
    drills = {
        "MULOCO_TEST_DRILLS": f"exchange:2:{drill_step},hold:0:{hold},hold:1:{hold}",
        "MULOCO_TEST_DRILL_DIR": str(markers),
    }
    for i in range(3):
        c.start_replica(i, _args(dump, steps=steps, extra=extra), entry=DRILL_ENTRY, env=drills)
    c.wait_for("r2", r"fault drill: killing", HANG_S)
    c.kill("r2")  # reaps it (the drill already killed it)
    until(
        f"the survivors did not hold after step {hold}:\n{c.tail('r0')}",
        lambda: all((markers / f"hold-r{i}-{hold}").exists() for i in (0, 1)),
        progress=FolderProgress(HANG_S, tmp_path),
    )
    for i in range(2):  # they went on without the dead replica: a committed sync with 2 of 3
        assert any(r["committed"] and r["participants"] == 2 for r in syncs(dump, i)), c.tail(f"r{i}")
    c.start_replica(2, _args(dump, steps=steps, extra=extra), tag="r2b")  # no drill this time
    c.wait_for("r2b", r"this replica group is behind", HANG_S)
    until("the restarted replica did not wait in a quorum", lambda: waiting_in_quorum(c.url) == 1)
    for i in range(2):
        release(markers, i, hold)
    for name in ("r0", "r1", "r2b"):
        assert c.wait(name, 2 * HANG_S) == 0, c.tail(name)
    healed = re.findall(r"healed from replica (\d+) in quorum \d+: step 0 -> (\d+)", c.logs["r2b"].read_text())
    assert healed == [("0", str(hold + 7))], c.tail("r2b")  # in the quorum of the survivors' next prepare
    assert not any("healed from replica" in c.logs[n].read_text() for n in ("r0", "r1"))  # healthy: never healed
    for i in range(3):
        for r in syncs(dump, i):
            if r["committed"]:  # never an average over fewer replicas than announced
                assert 1 <= r["contributors"] <= r["participants"] and r["participants"] >= 2
    for i in range(2):  # the sync r2 died in failed on the survivors, it was not committed
        rec = {r["step"]: r for r in syncs(dump, i)}[drill_step + 3]
        assert not rec["committed"] and rec["failure"], rec
        assert rec["contributors"] is None, rec  # the exchange failed: unknown, never reported as 0
    final = [syncs(dump, i)[-1] for i in range(3)]
    assert all(f["committed"] and f["step"] == steps and f["participants"] == 3 for f in final)
    assert final[0]["global_sha256"] == final[1]["global_sha256"] == final[2]["global_sha256"]
    # the last sync stepped with the schedules' end values on every replica, the healed one too
    assert all(f["outer_lr"] == pytest.approx(0.7 * 0.25) and f["outer_momentum"] == pytest.approx(0.9) for f in final)
    assert all(f["feedback_beta"] == pytest.approx(0.9 * (0.5 + 0.5 * (1 - 37 / 40))) for f in final)  # prepared at 37


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "config,schedules",
    [
        (
            "diloco/diloco",
            (
                "--outer.step_schedule.lr.warmup",
                "0.3",
                "--outer.step_schedule.lr.decay",
                "cosine",
                "--outer.step_schedule.lr.decay_from",
                "0.5",
                "--outer.step_schedule.lr.final",
                "0.2",
                "--outer.step_schedule.momentum.decay",
                "inner",
            ),
        ),
        (
            "diloco/sparseloco",
            ("--outer.step_schedule.feedback_beta.decay", "linear", "--outer.step_schedule.feedback_beta.final", "0.5"),
        ),
    ],
    ids=["diloco-scheduled-outer-step", "sparseloco-scheduled-beta"],
)
def test_whole_job_cold_restart_continues_exactly(cluster, tmp_path, config, schedules):
    """Stop the whole job at a checkpoint, start it again: same losses and θ_g as one run.
    SparseLoCo's error-feedback residual is its outer momentum: each rank's is in its
    checkpoint, or the restarted job would send other top-k entries and drift. The outer
    step's schedules (lr, momentum, error-feedback β) go on where they were."""
    total = ["--lr_scheduler.total_steps", "40", *schedules]

    def job(dump, steps):
        # min_replicas=2: a replica that resumes faster must not sync alone (it would then
        # heal its slower peer, which is correct but not the uninterrupted trajectory)
        c = cluster(2, min_replicas=2)
        for i in range(2):
            c.start_replica(i, _args(dump, steps=steps, extra=total, config=config), tag=f"r{i}-{steps}-{dump.name}")
        for i in range(2):
            name = f"r{i}-{steps}-{dump.name}"
            assert c.wait(name, 2 * HANG_S) == 0, c.tail(name)
        c.close()

    job(tmp_path / "straight", 40)
    job(tmp_path / "restarted", 20)
    job(tmp_path / "restarted", 40)
    for i in range(2):
        trained = [m["step"] for m in read_metrics(tmp_path / "restarted" / f"replica_{i}") if "loss" in m]
        assert len(trained) == len(set(trained)), trained  # resumed after step 20: no step trained twice
        straight, restarted = losses(tmp_path / "straight", i), losses(tmp_path / "restarted", i)
        late = [s for s in straight if s > 20]
        assert late and all(abs(straight[s] - restarted[s]) < 1e-6 for s in late), (straight, restarted)
        a = _committed_hashes(tmp_path / "straight", i)
        b = _committed_hashes(tmp_path / "restarted", i)
        assert a[40] == b[40]  # θ_g after the last sync, bitwise


@pytest.mark.timeout(600)
def test_unreachable_lighthouse_is_a_clear_error_within_the_timeout(tmp_path):
    """Within the connect timeout: every other wait (the quorum timeout) is longer than the
    test waits for the replica to exit."""
    c = Cluster(tmp_path, 1)
    try:
        c.url = f"http://127.0.0.1:{c.ports[0] + 1 if c.ports[0] < 65535 else 1024}"
        c.start_replica(
            0,
            _args(
                tmp_path / "run",
                steps=20,
                extra=(
                    "--fault_tolerance.connect_timeout_seconds",
                    "3",
                    "--fault_tolerance.quorum_timeout_seconds",
                    "3600",
                ),
            ),
        )
        assert c.wait("r0", 2 * HANG_S) == 4
        text = c.logs["r0"].read_text()
        assert "refused the connection" in text and "(tried for 3s)" in text and "./torchft_lighthouse" in text
        assert "Traceback" not in text
        assert not (tmp_path / "run").exists()  # checked before anything is written: no run.json, no empty folders
    finally:
        c.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("k", [1, 2])
def test_lighthouse_killed_mid_run_fails_within_the_connect_timeout(cluster, tmp_path, k):
    """Within the connect timeout, not after the quorum timeout (an hour here, longer than the
    test waits for the replica to exit), whether a replica was training (K=1) or waiting for
    a quorum that cannot form (K=2, the other group never came: the lighthouse is killed once
    it lists the lone group in the quorum it is forming)."""
    c = cluster(k)  # a majority quorum: with K=2 the lone group waits in its quorum
    connect_timeout = 3
    extra = (
        "--fault_tolerance.connect_timeout_seconds",
        str(connect_timeout),
        "--fault_tolerance.quorum_timeout_seconds",
        "3600",
        "--fault_tolerance.start_wait_seconds",
        "0",
    )
    c.start_replica(0, _args(tmp_path / "run", steps=2000, extra=extra))
    if k == 1:
        c.wait_for("r0", r"sync at step 10", HANG_S)
    else:
        until("the lone group never waited in a quorum", lambda: waiting_in_quorum(c.url) == 1)
    c.kill("lighthouse")
    killed = time.monotonic()
    assert c.wait("r0", 2 * HANG_S) == 4, c.tail("r0")
    elapsed = time.monotonic() - killed
    text = c.logs["r0"].read_text()
    assert "lost its quorum" in text and "refused the connection" in text and "Traceback" not in text
    assert f"(for {connect_timeout}s" in text  # the connect timeout ended it
    if k == 2:
        assert "while waiting for a quorum" in text
    print(f"lighthouse killed (K={k}): replica stopped with a clear error after {elapsed:.1f}s")


@pytest.mark.timeout(900)
def test_k2_survivor_pauses_until_the_launcher_restarts_the_dead_replica_which_heals(tmp_path):
    """The README's launcher, with --max-restarts, K=2: replica 1 dies inside an exchange.
    A quorum needs a majority (2 of 2), so replica 0 commits nothing alone: it tries that sync
    (step 30) again in a fresh quorum, which waits (for as long as the restart takes: the quorum
    timeout is only a hang timeout) until the restarted replica 1 (no checkpoints: it starts from
    step 0, behind) joins it and heals from it before training; replica 0's round commits with its
    Δ alone, and both finish on the same θ_g."""
    dump = tmp_path / "run"
    job = LocalJob(
        config="diloco/diloco",
        replicas=2,
        overrides=[*_args(dump, steps=100)[2:], "--checkpoint.no-enable", "--validator.freq", "50"],
        max_restarts=1,
        heartbeat_timeout_ms=1000,
        entry=DRILL_ENTRY,
        env={"MULOCO_TEST_DRILLS": "exchange:1:30", "MULOCO_TEST_DRILL_DIR": str(tmp_path)},
        console=open(tmp_path / "console.txt", "w"),
    )
    assert job.run() == 0, (tmp_path / "console.txt").read_text()[-3000:]
    log = (dump / "logs" / "replica_1.log").read_text()
    assert "fault drill: killing replica 1" in log and "=== restart 1 ===" in log
    restarted = log.split("=== restart 1 ===")[1]
    assert "is behind" in restarted and "healed from replica 0" in restarted
    before, after = map(int, re.search(r"healed from replica 0 in quorum \d+: step (\d+) -> (\d+)", restarted).groups())
    assert (before, after) == (0, 30)  # the step of replica 0's quorum it joined, not the one it had
    assert "healed from replica" not in (dump / "logs" / "replica_0.log").read_text()
    r0 = syncs(dump, 0)
    assert all(r["participants"] == 2 for r in r0 if r["committed"])  # never committed alone
    # the sync replica 1 died in failed, and was tried again with the restart, which healed in it
    at_30 = [(r["committed"], r["retried"], r["contributors"]) for r in r0 if r["step"] == 30]
    assert at_30 == [(False, True, None), (True, False, 1)], at_30
    sums = [summary(dump, i) for i in range(2)]
    assert sums[0]["steps"] == sums[1]["steps"] == 100
    assert sums[0]["diloco"]["final_global_sha256"] == sums[1]["diloco"]["final_global_sha256"]
    assert sums[0]["final_validation_loss"] == sums[1]["final_validation_loss"]
    # counted over its two lives: every sync once, its Δ in all but the one it healed in, and the
    # interval it died in lost (runs/lives.py)
    syncs_run = sums[0]["diloco"]["final_sync"]
    lives = [s["diloco"]["over_lives"] for s in sums]
    assert (
        lives[0]["lives"] == 1 and lives[0]["syncs_contributed"] == syncs_run and lives[0]["steps_contributed"] == 100
    )
    assert lives[1]["lives"] == 2 and lives[1]["restarts"] == [
        {"life": 2, "started_at_step": 0, "previous_ended": UNSAID}
    ], lives[1]
    assert (lives[1]["syncs_committed"], lives[1]["syncs_contributed"], lives[1]["steps_contributed"]) == (
        syncs_run,
        syncs_run - 1,
        100 - H,
    ), lives[1]
    assert re.search(r"DiLoCo replica 1: over 2 lives \(life 2 from step 0 after a death without a word\)", restarted)
    run = load_run(dump)  # the report counts the same: tokens each group trained, not a healed group's peer's counter
    assert run.lives == lives and run.tokens == lives[0]["tokens_trained"] + lives[1]["tokens_trained"]
    assert lives[1]["tokens_trained"] < lives[0]["tokens_trained"] == sums[0]["tokens_seen"]
    assert lives_lines([run]) == [f"run: replica group 1 {describe_lives(lives[1])}"]
    console = (tmp_path / "console.txt").read_text()
    assert "[r0]" in console and "[r1]" in console and "local job finished: 2 replicas ok" in console


@pytest.mark.timeout(900)
def test_sharded_replicas_compress_their_shards_and_resume(tmp_path):
    """K=2 replica groups of 2 FSDP ranks each, MuLoCo with 2-bit error feedback: every rank
    compresses its own shards and exchanges with the same rank of the other group; the
    residuals are saved per rank and a second leg resumes from them. The model is a
    masked-diffusion one: its head runs on FSDP-sharded weights at masked positions only,
    and its ELBO validation sums over both ranks of a group."""
    dump = tmp_path / "run"
    common = [
        sys.executable,
        "-m",
        "muloco.launch.local",
        "--config",
        "diloco/muloco_2bit",
        "--replicas",
        "2",
        "--procs-per-replica",
        "2",
        "--threads",
        "1",
        "--",
    ]
    overrides = [
        *DILOCO_TINY,
        "--outer.sync_every",
        "10",
        "--checkpoint.interval",
        "10",
        "--validator.freq",
        "1000",
        "--objective",
        "mdlm",
        "--dump_folder",
        str(dump),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = run_watched([*common, *overrides, "--training.steps", "20"], cwd=REPO, env=env)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    second = run_watched([*common, *overrides, "--training.steps", "30"], cwd=REPO, env=env)
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
    nelbo = {summary(dump, i)["final_validation_nelbo"] for i in range(2)}
    assert len(nelbo) == 1 and 0 < nelbo.pop() < 20  # θ_g, validated by both ranks of each group


@pytest.mark.timeout(900)
def test_group_back_after_the_others_finished_heals_and_its_summary_counts_it(tmp_path):
    """Group 1 starts only once group 0 has trained its last step (the test sets that order):
    it heals to the final state without training, and its summary says so (healed_from, the
    heal with its phase and bytes, one committed sync, the final sync) instead of claiming it
    never synced."""
    c = Cluster(tmp_path, 2, min_replicas=1)
    try:
        c.start_lighthouse()
        dump, steps = tmp_path / "run", 20
        args = _args(
            dump,
            steps=steps,
            extra=(
                "--fault_tolerance.min_replica_size",
                "1",
                "--fault_tolerance.start_wait_seconds",
                "0",
                "--fault_tolerance.end_wait_seconds",
                "600",
                "--checkpoint.no-enable",
            ),
        )
        c.start_replica(0, args)

        def trained_all() -> bool:
            assert c.procs["r0"].poll() is None, c.tail("r0")  # it waits for group 1 at the end
            return any(r["step"] == steps for r in _rows(dump, 0) if "loss" in r)

        until(
            f"group 0 did not train its last step:\n{c.tail('r0')}",
            trained_all,
            progress=FolderProgress(HANG_S, tmp_path),
        )
        c.start_replica(1, args)
        assert c.wait("r0", 2 * HANG_S) == 0, c.tail("r0")
        assert c.wait("r1", 2 * HANG_S) == 0, c.tail("r1")
        a, b = summary(dump, 0), summary(dump, 1)
        assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]
        assert a["final_validation_loss"] == b["final_validation_loss"] and b["steps"] == steps
        da, db = a["diloco"], b["diloco"]
        assert da["heals"] == 0 and da["healed_from"] == [] and da["syncs_committed"] == steps // H
        assert db["healed_from"] == [0] and db["heals"] == 1 and db["syncs_committed"] == 1
        heal = db["heal_log"][0]
        assert heal["phase"] == "start" and heal["step_from"] == 0 and heal["step_to"] == steps
        assert heal["sync"] == db["final_sync"] == da["final_sync"] and heal["bytes_received"] > 0
        assert "healed 1x: start: from replica 0" in c.logs["r1"].read_text()
    finally:
        c.close()


def _rows(dump, replica):
    path = dump / f"replica_{replica}" / "metrics.jsonl"
    try:
        return read_metrics(path.parent)
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return []
