"""torchft's live-recovery transport, made safe to load and consistent to serve.

torchft 0.2.0's ``HTTPTransport`` has two problems for muloco:

- the receiver unpickles whatever a peer sends (``_streaming_load(weights_only=False)``,
  ``torchft/checkpointing/http_transport.py``). muloco never loads arbitrary objects:
  the healing state holds only tensors and plain containers, so it loads with
  ``weights_only=True``;
- on CPU ``send_checkpoint`` serves the live tensors (``_to_cpu`` copies only
  accelerator tensors). The sender keeps training while a healing peer downloads
  (streaming DiLoCo overlaps τ inner steps), so the peer could receive a state that
  is half old, half new. The sender snapshots the state when it is staged.

This is a subclass passed to ``torchft.Manager(checkpoint_transport=...)``, not a
patch: nothing else in torchft changes.
"""

from __future__ import annotations

import urllib.request
from datetime import timedelta

import torch
from torch.utils._pytree import tree_map_only
from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport
from torchtitan.tools.logging import logger


class SafeHTTPTransport(HTTPTransport):
    """HTTPTransport that snapshots on send, loads with ``weights_only=True``, and gives peers the
    group's advertised address (torchft's gives the hostname; its server listens on every
    interface)."""

    def __init__(self, *args, advertise: str | None = None, **kwargs) -> None:
        self._advertise = advertise  # before torchft's constructor, which logs address()
        super().__init__(*args, **kwargs)

    def address(self) -> str:
        if not self._advertise:
            return super().address()
        return f"http://{self._advertise}:{self._server.socket.getsockname()[1]}/checkpoint/"

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
        snapshot = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state_dict)
        super().send_checkpoint(dst_ranks, step, snapshot, timeout)
        logger.info(f"serving this group's state at sync {step} to healing replica rank(s) {list(dst_ranks)}")

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        # a heal over a slow link takes a while: say it started (and from whom) before it blocks
        logger.info(f"healing: downloading a peer's state from {address}")
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)


def build(timeout: timedelta, advertise: str | None = None) -> SafeHTTPTransport:
    return SafeHTTPTransport(timeout=timeout, num_chunks=0, advertise=advertise)
