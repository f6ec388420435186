"""A replica group's lives across restarts (muloco/runs/lives.py): what the summary and the report
count over them. The runs behind it: tests/test_diloco.py's kill tests read the ledger a real
restart wrote."""

from __future__ import annotations

import json

import pytest

from muloco.runs.lives import LIVES_FILE, UNSAID, Lives


def _train(lives: Lives, steps: range, tokens: int = 10) -> None:
    for step in steps:
        lives.trained(step, tokens)


def test_a_killed_life_counts_up_to_its_last_sync_and_the_restart_lists_it(tmp_path):
    first = Lives.begin(tmp_path, step=0)
    _train(first, range(1, 11))
    first.synced(sync=1, step=10, committed=True, contributed=True)
    _train(first, range(11, 16))  # killed at step 15: no sync took these
    second = Lives.begin(tmp_path, step=0, restart=1)
    assert second.lives[0].ended == UNSAID and second.lives[0].steps_trained == 10  # what it wrote last
    second.healed(20)  # inside sync 2's quorum
    second.synced(sync=2, step=20, committed=True, contributed=False)
    _train(second, range(21, 31))
    second.synced(sync=3, step=30, committed=True, contributed=True)
    second.end("finished")
    totals = Lives.read(tmp_path).totals()
    assert totals == {
        "lives": 2,
        "first_started_at_step": 0,
        "restarts": [{"life": 2, "started_at_step": 0, "previous_ended": UNSAID}],
        "syncs_committed": 3,
        "syncs_contributed": 2,
        "steps_trained": 20,
        "tokens_trained": 200,
        "steps_contributed": 20,
        "tokens_contributed": 200,
        "heals": 1,
    }
    assert "over 2 lives (life 2 from step 0 after a death without a word)" in second.describe()


def test_a_sync_redone_by_a_later_life_counts_once_and_a_failed_one_loses_its_steps(tmp_path):
    first = Lives.begin(tmp_path, step=0)
    for sync in (1, 2, 3):
        _train(first, range(1, 6))
        first.synced(sync=sync, step=5 * sync, committed=True, contributed=True)
    first.end("failed at step 15: lost its quorum")
    second = Lives.begin(tmp_path, step=5)  # the whole job resumed from the checkpoint of sync 1
    _train(second, range(6, 11))
    second.synced(sync=1, step=10, committed=False, contributed=True)  # failed: its 5 steps lost
    _train(second, range(6, 11))
    second.synced(sync=2, step=10, committed=True, contributed=True)
    totals = second.totals()
    assert totals["syncs_committed"] == 3 and totals["syncs_contributed"] == 3
    assert totals["steps_trained"] == 25 and totals["steps_contributed"] == 15  # sync 2 once, sync 3 of life 1
    assert totals["restarts"][0]["previous_ended"] == "failed at step 15: lost its quorum"


def test_the_ledger_is_replaced_whole_and_a_broken_one_names_itself(tmp_path):
    lives = Lives.begin(tmp_path, step=0)
    lives.end("finished")
    assert json.loads((tmp_path / LIVES_FILE).read_text())["lives"][0]["ended"] == "finished"
    assert [p.name for p in tmp_path.iterdir()] == [LIVES_FILE]  # no temporary file left
    (tmp_path / LIVES_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{LIVES_FILE} is not a lives ledger.*delete it"):
        Lives.begin(tmp_path, step=0)
