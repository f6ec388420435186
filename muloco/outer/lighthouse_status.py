"""What the torchft lighthouse knows right now: who heartbeats, the last quorum, the next one.

torchft 0.2.0 has no client call for this; its status page (``GET /status``, what its own
dashboard polls) lists the previous quorum's members with their torchft steps, every
replica that heartbeats (``<id>: seen <age>s ago``, marked ``old`` past the heartbeat
timeout) and the next quorum's state in one line. The replica groups read it to know
whether they are behind their peers before they train, to wait for their peers, to show
what a quorum is waiting for, and to tell a lighthouse that is gone (connection refused,
unknown host, no answer) from one that is merely waiting, within the connect timeout
instead of the quorum timeout. If torchft changes the page, parsing finds nothing: callers
then stop waiting rather than hang.
"""

from __future__ import annotations

import errno
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from muloco.utils.errors import REPLICA_GROUP, MulocoError

REPLICA_ID_PREFIX = "muloco_replica_"

_MEMBER = re.compile(r'<div class="member([^"]*)">\s*<b>([^<]+)</b>\s*<br/>\s*Step:\s*(-?\d+)')
_HEARTBEAT = re.compile(r'<li class="heartbeat([^"]*)">\s*([^<]+?): seen ([0-9.e-]+)s ago')
_NEXT = re.compile(r"Next quorum status:\s*([^\n<]*)")


def majority(group_size: int) -> int:
    """⌊K/2⌋+1: two quorums of this size always share a replica group (no split brain); the
    lighthouse's min_replicas and the groups' own quorum checks both use it."""
    return group_size // 2 + 1


class LighthouseUnreachable(MulocoError, ConnectionError):
    """The lighthouse did not answer; ``reason`` says how (refused, unknown host, timeout...)."""

    exit_status = REPLICA_GROUP

    def __init__(self, url: str, reason: str):
        super().__init__(f"the torchft lighthouse at {url} {reason}")
        self.url, self.reason = url, reason


def check_url(url: str) -> str:
    """``url`` if it is ``http(s)://HOST:PORT``; otherwise a ValueError that says what is wrong."""
    parsed = urllib.parse.urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise ValueError(
            f"the lighthouse address {url!r} is not a URL like http://HOST:PORT "
            "(e.g. http://127.0.0.1:29510, as ./torchft_lighthouse prints it)"
        )
    return url


def group_of(replica_id: str) -> int | None:
    """The replica group a torchft id (``muloco_replica_<i>:<uuid>``) belongs to."""
    m = re.match(rf"{REPLICA_ID_PREFIX}(\d+)(?::|$)", replica_id)
    return int(m.group(1)) if m else None


@dataclass
class LighthouseStatus:
    members: dict[str, int] = field(default_factory=dict)
    """The previous quorum: torchft replica id → the torchft step it asked with."""
    heartbeats: dict[str, bool] = field(default_factory=dict)
    """Every replica id the lighthouse has seen → whether it still counts as alive."""
    next_quorum: str = ""
    """The lighthouse's own line about the quorum it is forming."""

    @property
    def max_step(self) -> int:
        """The highest torchft step in the previous quorum (-1 before the first quorum)."""
        return max(self.members.values(), default=-1)

    def alive_members_at(self, step: int) -> set[str]:
        """Members of the previous quorum that asked with torchft step ``step`` and still heartbeat
        (the same process: a restarted one joins under a new id)."""
        return {rid for rid, s in self.members.items() if s == step and self.heartbeats.get(rid, False)}

    def alive_groups(self) -> set[int]:
        """Replica groups with at least one live heartbeat."""
        return {g for rid, alive in self.heartbeats.items() if alive and (g := group_of(rid)) is not None}

    def member_groups(self) -> set[int]:
        return {g for rid in self.members if (g := group_of(rid)) is not None}


def parse_status(html: str) -> LighthouseStatus:
    status = LighthouseStatus()
    for _cls, rid, step in _MEMBER.findall(html):
        status.members[rid.strip()] = int(step)
    for cls, rid, _age in _HEARTBEAT.findall(html):
        status.heartbeats[rid.strip()] = "old" not in cls.split()
    m = _NEXT.search(html)
    status.next_quorum = m.group(1).strip() if m else ""
    return status


def _reason(err: BaseException) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"answered HTTP {err.code} (is this a torchft lighthouse?)"
    cause = getattr(err, "reason", err)
    if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED:
        return "refused the connection (is it running? is the port right?)"
    if isinstance(cause, socket.gaierror):
        return "has a host name that does not resolve (check the address)"
    if isinstance(cause, (TimeoutError, socket.timeout)):
        return "did not answer in time"
    return f"cannot be reached ({cause})"


def fetch_status(url: str, timeout: float = 5.0) -> LighthouseStatus:
    """The lighthouse's status now; :class:`LighthouseUnreachable` if it does not answer."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/status", timeout=timeout) as page:
            return parse_status(page.read().decode("utf-8", "replace"))
    except (OSError, urllib.error.URLError) as err:
        raise LighthouseUnreachable(url, _reason(err)) from err
