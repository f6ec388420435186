"""The fault-drill matrix in CI: replica groups under the local launcher, SIGKILLed at chosen
points and restarted; the test sets where each killed replica comes back and heals
(tests/drills.py says what each asserts).

CI runs :data:`drills.CI_DRILLS` with one seed each: ``final-sync`` (a restart that heals inside
its peers' final sync takes part in it, so that sync commits everywhere: ``pytest -k final_sync``)
``one-sync-behind`` (K=2: a restart one sync behind heals before it trains, no step trained
twice) and ``healing`` (K=3: a restart killed while it downloads a peer's state; its peers try that
sync again without it and commit it, nothing rolled back on them). ``scripts/fault_drills.py`` runs every drill of
:data:`drills.DRILLS` with several seeds
and prints the table.
"""

from __future__ import annotations

import pytest
from drills import CI_DRILLS, describe, run_drill

SEED = 20261122

if not CI_DRILLS:
    pytestmark = pytest.mark.skip(
        reason="the fault-drill matrix runs from scripts/fault_drills.py (out of CI for its 20-minute "
        "budget); CI's kill-and-heal drill is tests/test_slurm_jobs.py::"
        "test_array_layout_a_requeued_group_heals_while_the_other_keeps_training"
    )


@pytest.mark.timeout(1800)  # only a hang: the pacer's waits are events, each with its own hang timeout
@pytest.mark.parametrize("name", CI_DRILLS or ["last-interval"], ids=lambda name: name.replace("-", "_"))
def test_drill_ends_with_one_global_model_and_no_healthy_replica_healed(tmp_path, name):
    result = run_drill(name, SEED, tmp_path)
    print(describe(result))
    assert result.ok, (
        describe(result) + "\n" + "\n".join((tmp_path / f"{name}-{SEED}-console.txt").read_text().splitlines()[-60:])
    )
    assert result.healed, "a killed replica must have come back by healing"
