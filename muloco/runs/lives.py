"""A replica group's lives: what each of its processes (the first start and every restart) trained
and contributed, kept in its run folder across restarts.

A restart knows only its own life: its summary would say ``syncs committed 1/1`` for a group that
committed nine syncs before it was killed, and a heal hands it its peer's step and token counters.
So every life appends itself to ``lives.json`` in the group's folder and rewrites it (atomically)
after each sync and at its end; the summary, ``summary.json`` and ``muloco report`` count over all
of them.

- A life that ends without saying so (SIGKILL, a lost node, the launcher killed) keeps what it wrote
  at its last sync; the next life marks it ``ended without a word``. The steps it trained after that
  sync contributed nothing anyway: no sync took their Δ.
- A sync counts for the group once, by its number (torchft's step after the commit): a later life
  that commits the same sync again (a whole job resumed from an older checkpoint redoes it) replaces
  the earlier one. Syncs of an earlier life past a rewind that the new life never commits again stay
  counted (one group restarting must keep them: its peers did commit them; the ledger cannot tell a
  whole job's rewind from that).
- A ledger that begins mid-run (a checkpoint from before ledgers, or a deleted ``lives.json``) knows
  nothing of the steps before its first life (``first_started_at_step``); the report then counts
  tokens as before.
- *Contributed* means the group's Δ is in the committed average: steps and tokens trained since its
  previous sync. A sync it joined right after healing, or catching up, is committed but not
  contributed; a failed sync's steps are lost.

No torch: read by the report too.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from muloco.utils.atomic_file import write_atomically

LIVES_FILE = "lives.json"
UNSAID = "ended without a word (killed, or its node lost): counted up to its last sync"


@dataclass
class Life:
    number: int
    """1 = the first start."""
    restart: int
    """torchrun's restart count of this process (TORCHELASTIC_RESTART_COUNT; 0 outside torchrun)."""
    started_at_step: int
    started_at: float
    """Unix time."""
    step: int
    """The last trainer step it stood at (a heal moves it to the peer's)."""
    steps_trained: int = 0
    """Inner steps this process trained, also those a failed sync or a heal threw away."""
    tokens_trained: int = 0
    """Their tokens, the whole group's (every data-parallel rank's)."""
    syncs: int = 0
    """Syncs it took part in (a sync tried again is one)."""
    heals: int = 0
    committed: list[int] = field(default_factory=list)
    """Numbers of the committed syncs it took part in."""
    contributed: dict[str, list[int]] = field(default_factory=dict)
    """Sync number → [steps, tokens] of its Δ in that committed average."""
    ended: str | None = None
    """finished | stopped | failed: why | None while it runs (or when it died without a word)."""


class Lives:
    """The ledger of one replica group (written by the process that writes its metrics)."""

    def __init__(self, path: Path, lives: list[Life]):
        self.path = path
        self.lives = lives
        self._pending = [0, 0]  # steps, tokens since the last sync: what the next one may take

    @classmethod
    def read(cls, folder: str | Path) -> "Lives | None":
        """The ledger in ``folder`` (None: none there). A file that does not parse is an error
        naming it (it is only ever replaced whole)."""
        path = Path(folder) / LIVES_FILE
        if not path.is_file():
            return None
        try:
            rows = json.loads(path.read_text())["lives"]
            return cls(path, [Life(**row) for row in rows])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{path} is not a lives ledger ({err}); delete it to count from the next start on"
            ) from None

    @classmethod
    def begin(cls, folder: str | Path, *, step: int, restart: int = 0) -> "Lives":
        """A new life starting at trainer ``step``; an earlier one that never said how it ended
        is marked so."""
        lives = cls.read(folder) or cls(Path(folder) / LIVES_FILE, [])
        for life in lives.lives:
            life.ended = life.ended or UNSAID
        lives.lives.append(
            Life(number=len(lives.lives) + 1, restart=restart, started_at_step=step, started_at=time.time(), step=step)
        )
        lives.save()
        return lives

    @property
    def current(self) -> Life:
        return self.lives[-1]

    def trained(self, step: int, tokens: int) -> None:
        """One inner step of this life, now at ``step``, ``tokens`` trained in it by the group."""
        self.current.steps_trained += 1
        self.current.tokens_trained += tokens
        self.current.step = step
        self._pending[0] += 1
        self._pending[1] += tokens

    def synced(self, *, sync: int, step: int, committed: bool, contributed: bool) -> None:
        """A sync's outcome (its last try): the steps since the previous sync go with this group's Δ
        into sync number ``sync`` when it committed with it, and are lost otherwise."""
        life = self.current
        life.syncs += 1
        life.step = step
        if committed:
            life.committed.append(sync)
            if contributed:
                life.contributed[str(sync)] = list(self._pending)
        self._pending = [0, 0]
        self.save()

    def healed(self, step: int) -> None:
        """A heal from a peer, wherever it happened (before training, in a sync's quorum or a retry's,
        at the end): the peer's state replaced the steps trained since the last sync."""
        self.current.heals += 1
        self.current.step = step
        self._pending = [0, 0]
        self.save()

    def end(self, how: str) -> None:
        self.current.ended = how
        self.save()

    def save(self) -> None:
        write_atomically(self.path, json.dumps({"lives": [asdict(life) for life in self.lives]}, indent=1) + "\n")

    def totals(self) -> dict[str, Any]:
        """Over every life: a sync counted once (the latest life's say), steps and tokens of the
        Δs in committed averages, and every restart."""
        committed: set[int] = set()
        contributed: dict[str, list[int]] = {}
        for life in self.lives:
            redone = {s for s in life.committed if s in committed}  # a rewound job made these again
            committed |= set(life.committed)
            contributed = {s: v for s, v in contributed.items() if int(s) not in redone}
            contributed.update(life.contributed)
        return {
            "lives": len(self.lives),
            "first_started_at_step": self.lives[0].started_at_step if self.lives else 0,
            "restarts": [
                {
                    "life": life.number,
                    "started_at_step": life.started_at_step,
                    "previous_ended": self.lives[life.number - 2].ended,
                }
                for life in self.lives[1:]
            ],
            "syncs_committed": len(committed),
            "syncs_contributed": len(contributed),
            "steps_trained": sum(life.steps_trained for life in self.lives),
            "tokens_trained": sum(life.tokens_trained for life in self.lives),
            "steps_contributed": sum(v[0] for v in contributed.values()),
            "tokens_contributed": sum(v[1] for v in contributed.values()),
            "heals": sum(life.heals for life in self.lives),
        }

    def describe(self) -> str:
        """One line for the console summary."""
        return describe(self.totals())


def describe(t: dict[str, Any]) -> str:
    """A ledger's totals (:meth:`Lives.totals`) in one line."""
    restarts = "; ".join(
        f"life {r['life']} from step {r['started_at_step']} after {_short(r['previous_ended'])}" for r in t["restarts"]
    )
    return (
        f"over {t['lives']} li{'fe' if t['lives'] == 1 else 'ves'}"
        + (f" ({restarts})" if restarts else "")
        + f": syncs committed {t['syncs_committed']} "
        f"(its Δ in {t['syncs_contributed']}), steps trained {t['steps_trained']} (in committed syncs "
        f"{t['steps_contributed']}), tokens trained {t['tokens_trained']:,} (in committed syncs "
        f"{t['tokens_contributed']:,}), heals {t['heals']}"
    )


def _short(ended: str | None) -> str:
    if ended is None:
        return "a life still running"
    return "a death without a word" if ended == UNSAID else ended
