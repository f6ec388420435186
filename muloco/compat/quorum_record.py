"""Keep the last quorum a torchft Manager received, which torchft 0.2.0 throws away.

``Manager._async_quorum`` reads the lighthouse's answer (a ``QuorumResult``: members,
the highest torchft step among them, how many stand at it, whether this replica heals)
into locals and keeps only the participant count. muloco needs the rest: to end a run
only once every replica group stands at the same step (no replica left out of date), to
log who was in a sync and who healed from whom, and to recognise a quorum in which no
member was ahead of a replica that expected to heal.

The Manager's RPC client is wrapped in a proxy that records each ``_quorum`` answer and
forwards everything else unchanged. Nothing else in torchft changes.
"""

from __future__ import annotations

import threading
from typing import Any


class RecordingClient:
    """Forwards to torchft's ``ManagerClient``; remembers the last ``_quorum`` result."""

    def __init__(self, client: Any):
        self._inner = client
        self._lock = threading.Lock()
        self.last_quorum: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner._quorum(*args, **kwargs)
        with self._lock:
            self.last_quorum = result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def record_quorums(manager: Any) -> RecordingClient:
    """Wrap ``manager``'s client (once); returns the recorder to read ``last_quorum`` from."""
    client = manager._client
    if not isinstance(client, RecordingClient):
        client = manager._client = RecordingClient(client)
    return client
