"""The dense codec: the tensor's own bytes, in float32, bfloat16 or float16.

The baseline every compressor is measured against, and the way to send a tensor
uncompressed through the same exchange path (bfloat16 halves the bytes at ~0.3% error).
Its payloads can also be summed element by element, which is what the all-reduce
strategy does with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import Codec
from .packing import from_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, setting: str = "dtype") -> torch.dtype:
    """A float dtype from its name (``"bfloat16"``) or itself; ValueError otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{setting} must be one of {tuple(DTYPES)}, got {dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Dense(Codec):
    name = "dense"

    @dataclass(kw_only=True, slots=True)
    class Config(Codec.Config):
        dtype: str = "float32"
        """float32 | bfloat16 | float16: the dtype on the wire."""

        def validate(self) -> None:
            resolve_dtype(self.dtype)

        def wire_bits(self) -> float:
            return 32 if self.dtype == "float32" else 16

        def keeps_everything(self) -> bool:
            return self.dtype == "float32"

        def method_tag(self) -> str:
            """The wire dtype when it is not float32 (``diloco-bfloat16``)."""
            return "" if self.dtype == "float32" else self.dtype

    def __init__(self, config: Config, *, compiled: bool = False):
        super().__init__(config, compiled=compiled)
        self.dtype = resolve_dtype(config.dtype)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.lossless = config.keeps_everything()  # the rule stated once, on the config

    def payload_bytes(self, numel: int) -> int:
        return self.itemsize * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        # Always a copy: the payload must not alias x (error feedback subtracts the
        # decoded payload from the very tensor it encoded).
        return x.detach().reshape(-1).to(self.dtype, copy=True).view(torch.uint8)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        self.check_payload(payload, numel)
        # A fresh tensor (never a view of the payload, whose buffer may be reused).
        return from_bytes(payload, self.dtype).to(torch.float32, copy=True)

    def describe(self) -> str:
        return f"dense({dtype_name(self.dtype)})"
