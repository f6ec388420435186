"""Deadline rounds' state by hand (``muloco/outer/rounds/deadline.py``): the paces the quorum agrees, the
progress, the budgets, the schedules' positions, and the state a checkpoint or a healing peer
carries. The real jobs are in tests/test_diloco.py: agreement, a resume from a round's checkpoint,
and a killed group that restarts and heals, each at K=2 and K=3 with one slowed group."""

from __future__ import annotations

import pytest
import torch

from muloco import compat

compat.apply()  # before the config modules (torchtitan) are imported

from muloco.compress import Dense  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.config.loader import ConfigError  # noqa: E402
from muloco.outer.exchange import Exchange  # noqa: E402
from muloco.outer.loop import OuterLoop  # noqa: E402
from muloco.outer.rounds import DeadlineRounds, Lockstep  # noqa: E402
from muloco.outer.schedule import SyncSchedule  # noqa: E402


def _rounds(**settings) -> DeadlineRounds:
    config = DeadlineRounds.Config(
        **{k: v for k, v in settings.items() if k in ("quantile", "min_steps", "max_steps", "pace_memory")}
    )
    return config.build(
        schedule=SyncSchedule(settings.get("h", 10)),
        total_steps=settings.get("total", 100),
        groups=settings.get("groups", 2),
        group=settings.get("group", 0),
    )


def _row(group: int, steps: int, seconds: float, flag: float = 1.0, tokens: float = 0.0) -> list[float]:
    return [flag, tokens, float(steps), seconds, float(group)]


def test_paces_progress_and_budgets_by_hand():
    r = _rounds(h=10, total=100, pace_memory=0.5)
    assert r.budget == 10 and r.planned_progress() == 10  # no pace known: lockstep's H
    r.commit([_row(0, 10, 1.0), _row(1, 10, 3.0)])  # 0.1 s and 0.3 s per step
    assert r.paces.tolist() == [0.1, 0.3] and float(r.progress) == 10 and int(r.rounds) == 1
    assert r.budgets == {0: 20, 1: 10}  # 3 s fits 30 fast steps: capped at 2H
    assert r.planned_progress() == 15 and r.position_after_round() == 25
    r.commit([_row(0, 20, 1.0), _row(1, 10, 2.0)])  # now 0.05 and 0.2: averaged with the old paces
    assert r.paces.tolist() == pytest.approx([0.075, 0.25]) and float(r.progress) == 25
    assert r.budgets == {0: 20, 1: 10}


def test_a_replica_that_did_not_contribute_moves_nothing_and_the_last_round_ends_the_run():
    r = _rounds(h=10, total=30)
    r.commit([_row(0, 10, 1.0), _row(1, 10, 2.0)])
    r.commit([_row(0, 20, 2.0), _row(1, 0, 0.0, flag=0.0)])  # group 1 had just healed: no pace, no steps
    assert r.paces.tolist() == pytest.approx([0.1, 0.2]) and float(r.progress) == 30 and r.finished
    r = _rounds(h=10, total=20)
    r.commit([_row(0, 10, 1.0), _row(1, 10, 2.0)])
    assert r.budgets == {0: 14, 1: 7}  # 10 left of a 15-step round: scaled, rounded up
    r.commit([_row(0, 14, 1.4), _row(1, 7, 1.4)])
    assert float(r.progress) == 20.5 and r.finished


def test_quantile_and_clamps_shape_the_budgets():
    r = _rounds(h=10, groups=4, quantile=0.5, min_steps=3, max_steps=15)
    r.commit([_row(g, 10, s) for g, s in enumerate((0.5, 1.0, 2.0, 4.0))])
    assert r.budgets == {0: 15, 1: 10, 2: 5, 3: 3}  # D = 10 x 0.1 s (the 2nd smallest)


def test_the_inner_schedule_position_sweeps_the_round_in_the_group_s_own_steps():
    fast, slow = _rounds(group=0), _rounds(group=1)
    for r in (fast, slow):
        r.commit([_row(0, 10, 1.0), _row(1, 10, 2.0)])  # budgets 20 and 10, 15 nominal steps
        r.start_round()
    positions = []
    for r, steps in ((fast, 10), (slow, 5)):
        for _ in range(steps):
            r.step_done(0.0)
        positions.append(r.inner_position())
    assert positions == [17.5, 17.5]  # half of each group's round: 10 + 15 / 2
    for _ in range(10):
        done = fast.step_done(0.0)
    assert done and fast.inner_position() == 25.0 == fast.position_after_round()


def test_the_state_round_trips_through_tensors():
    r = _rounds()
    r.commit([_row(0, 10, 1.0), _row(1, 10, 2.0)])
    state = r.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())  # a checkpoint holds no pickled object
    other = _rounds()
    other.load_state_dict({k: v.clone() for k, v in state.items()})
    assert other.budgets == r.budgets and other.paces.tolist() == r.paces.tolist()
    assert float(other.progress) == float(r.progress) and int(other.rounds) == int(r.rounds)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: DeadlineRounds.Config(quantile=0.0), r"outer.round.quantile must be in \(0, 1\]"),
        (lambda: DeadlineRounds.Config(min_steps=8, max_steps=4), "need 1 <= min_steps <= max_steps"),
        (lambda: DeadlineRounds.Config(pace_memory=1.0), r"pace_memory must be in \[0, 1\)"),
        (
            lambda: OuterLoop.Config(
                round=DeadlineRounds.Config(), exchange=Exchange.Config(codec=Dense.Config(dtype="bfloat16"))
            ),
            r"deadline rounds weigh each group's Δ by its tokens "
            r"\(outer.exchange.weighting auto; equal turns it off\), "
            r"which scales each Δ .* lossless .* use --outer.exchange.strategy allgather",
        ),
        (
            lambda: OuterLoop.Config(round=DeadlineRounds.Config(), num_fragments=2, sync_every=10),
            "needs outer.num_fragments 1 and outer.fragment_sync_delay 0",
        ),
    ],
)
def test_bad_round_settings_are_one_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make().validate()


@pytest.mark.parametrize(
    "args,match",
    [
        (["--outer.round", "async"], "--outer.round must be one of lockstep, deadline; got 'async'"),
        (
            ["--outer.round.quantile", "0.5"],
            r"outer.round is lockstep, which has no setting 'quantile'.*"
            r"pick it with --outer.round deadline",
        ),
        (
            ["--outer.round", "lockstep", "--outer.round.max_steps", "8"],
            "outer.round is lockstep, which has no setting",
        ),
        (
            ["--outer.round.mode", "deadline"],
            r"no outer.round variant \(lockstep, deadline; now lockstep\) has a "
            r"setting 'mode'; a variant is picked with --outer.round NAME",
        ),
    ],
)
def test_a_deadline_setting_with_lockstep_rounds_or_an_unknown_mode_is_one_clear_error(args, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(["--config", "diloco/muloco_2bit", *args])


def test_the_round_mode_is_picked_by_name_and_keeps_its_settings_in_any_order():
    _, config = parse_args(
        ["--config", "diloco/muloco_2bit", "--outer.round.max_steps", "9", "--outer.round", "deadline"]
    )
    assert isinstance(config.outer.round, DeadlineRounds.Config) and config.outer.round.max_steps == 9
    assert config.outer.round.auto_weighting == "tokens" and config.outer.round.gathers_work
    _, config = parse_args(["--config", "diloco/muloco_2bit"])
    assert isinstance(config.outer.round, Lockstep.Config) and config.outer.round.auto_weighting == "equal"


def test_a_round_is_timed_from_its_first_step_to_its_last_leaving_out_the_process_s_warm_up_step():
    """Pace = the round's steps over the time from its first step's start to its last step's end
    (syncs, validation and saves fall between rounds); a process's first step (warm-up, compilation)
    is left out and the rest scaled to the round's steps."""
    r = _rounds(h=3)
    assert not r.step_done(100.0)  # the warm-up step: untimed
    assert not r.step_done(101.0)
    assert r.step_done(102.0)
    work = r.timed_work(tokens=96, ended=104.0)  # 2 timed steps in 3 s: 1.5 s per step, times 3 steps
    assert (work.steps, work.seconds, work.tokens) == (3, 4.5, 96)
    r.start_round()
    r.step_done(110.0), r.step_done(111.0), r.step_done(112.5)
    assert r.timed_work(tokens=96, ended=113.0).seconds == 3.0  # warm now: every step timed


def test_the_default_weighting_is_tokens_in_deadline_rounds_and_equal_in_lockstep_rounds():
    deadline = DeadlineRounds.Config()
    gathers = {"auto_weighting": deadline.auto_weighting, "gathers_work": deadline.gathers_work}
    assert Exchange.Config().build(**gathers).weighted
    assert not Exchange.Config().build().weighted
    assert not Exchange.Config(weighting="equal").build(**gathers).weighted
    assert Exchange.Config(weighting="tokens").build().weighted
