"""Load DCP checkpoints without unpickling arbitrary objects.

torch 2.13's distributed checkpoint reads the ``.metadata`` file with a bare
``pickle.load`` (``filesystem.py:930``) and every non-tensor value with
``torch.load(weights_only=False)`` (``default_planner.py:387``). A checkpoint
folder copied from elsewhere could therefore run code on load. We read the
metadata with an unpickler that admits only DCP's own metadata classes and torch's
dtype/layout/Size, and non-tensor values with ``weights_only=True`` (plain
containers, numbers, strings and tensors). All of muloco's own state (trainer
step, data position, scheduler, optimizer) is built from those types.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.default_planner as default_planner
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata

from muloco.utils.errors import BadCheckpoint


class UnsafeCheckpointError(BadCheckpoint, pickle.UnpicklingError):
    """A checkpoint refers to a Python object that a checkpoint has no reason to hold."""


def _dcp_classes(module) -> set[str]:
    return {
        name
        for name, obj in vars(module).items()
        if isinstance(obj, type)
        and obj.__module__ == module.__name__
        and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    }


def _torch_values() -> set[str]:
    return {
        name for name, obj in vars(torch).items() if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    } | {"Size"}


ALLOWED_GLOBALS: dict[str, set[str]] = {
    dcp_metadata.__name__: _dcp_classes(dcp_metadata),
    dcp_filesystem.__name__: {"_StorageInfo"},
    "torch": _torch_values(),
    "torch.serialization": {"_get_layout"},  # how torch.layout pickles (name -> layout)
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # checkpoint ids
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "slice"},
}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to '{module}.{name}', which is not a DCP "
            "metadata type; refusing to load it. Only load checkpoints written by "
            "muloco/torchtitan; delete or re-create this checkpoint folder."
        )


def safe_read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
    rank = kwargs.get("rank")
    path = self._get_metadata_path(rank)
    with self.fs.create_stream(path, "rb") as metadata_file:
        metadata = MetadataUnpickler(metadata_file).load()
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _unpickler_reason(err: BaseException) -> str:
    """What torch's weights-only unpickler objected to, without torch's advice to retry
    with ``weights_only=False`` (which is exactly the arbitrary-code path refused here)."""
    text = str(err)
    _, found, reason = text.partition("WeightsUnpickler error:")
    reason = reason.split("Check the documentation of torch.load")[0] if found else ""
    reason = " ".join(reason.split())
    return reason or "not a plain-data pickle"


def _load_plain(value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"a checkpoint value is garbled or holds a Python object that is not plain data "
            f"({_unpickler_reason(err)}); refusing to unpickle it. Re-create the checkpoint "
            "with muloco, or resume from another one."
        ) from None


def safe_load_bytes(self, read_item, value: io.BytesIO) -> None:
    obj = _load_plain(value)
    if self.flatten_state_dict:
        default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def apply() -> None:
    dcp_filesystem.FileSystemReader.read_metadata = safe_read_metadata
    default_planner.DefaultLoadPlanner.load_bytes = safe_load_bytes
