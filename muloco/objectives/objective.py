"""What a model is trained to do: how a batch becomes model inputs, and its loss.

The trainer, the validator and the benchmarks talk to one :class:`Objective`: it
fixes the attention direction of the model it trains (``causal``), turns a loader
batch into model inputs (:meth:`prepare`, which may corrupt them and adds the
per-document attention mask) and scores the model's output (:meth:`loss`). A loss is
a SUM over this rank's tokens divided by a global normaliser, as torchtitan's losses
are, so gradient accumulation and data parallelism add up the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.config import Configurable

from .documents import document_block_mask, document_ids, document_mask

MASK_KERNELS = ("auto", "flex", "sdpa")


@dataclass(frozen=True)
class NoiseKey:
    """Identifies one micro-batch: every random draw of an objective is seeded from it (and
    the objective's own seed)."""

    replica: int
    step: int
    micro: int
    rank: int
    world: int
    """Data-parallel ranks of this replica group (noise levels are stratified over all of them)."""


@dataclass
class Prepared:
    """A batch ready for the model: its inputs and what the loss needs to score the output."""

    inputs: torch.Tensor
    labels: torch.Tensor
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpecialTokens:
    bos: int
    eos: int
    mask: int | None


class Objective(Configurable):
    name: str = "objective"
    causal: bool = True
    """The attention direction the model is built with."""
    next_token: bool = True
    """Loader rows: labels are the next tokens (True) or the tokens themselves (False)."""
    elbo_validation: bool = False
    """Validation scores the model by the objective's bound (``elbo_terms``), not by the trainer's
    loss on the held-out rows (``components/validate.py``)."""
    mask_token: bool = False
    """Its model reads a mask token (an export needs the tokenizer to have one)."""
    title: str = "objective"
    """What it trains the model for, in words (a model card's "objective" line)."""
    pipeline_tag: str = "text-generation"
    hub_tag: str = "causal-lm"
    """The Hugging Face Hub's pipeline and tag for an exported model of it."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        document_mask: bool = False
        """Attend only within a document of a packed row."""
        mask_kernel: str = "sdpa"
        """How a document mask is applied: sdpa (SDPA's memory-efficient kernel reading a dense
        boolean L×L mask), flex (FlexAttention with a block mask, compiled kernels that skip the
        tiles no query may attend; its backward needs CUDA) or auto (flex on CUDA, sdpa
        elsewhere). sdpa is the default: in a compiled model on an H200 it trained faster than
        flex (0.79x); flex was faster only in an uncompiled model (docs/gpu.md)."""

        def describe(self) -> str:
            """The objective and its recipe, in words (the exported model card)."""
            return type(self)._owner.title

        def validate(self) -> None:
            """Raise ValueError naming the bad setting (``objective.<key> ...``)."""
            if self.mask_kernel not in MASK_KERNELS:
                raise ValueError(
                    f"objective.mask_kernel must be one of {', '.join(MASK_KERNELS)}; got {self.mask_kernel!r}"
                )

    def __init__(self, config: Config, *, tokens: SpecialTokens, rows_per_step: int = 1):
        config.validate()
        self.config = config
        self.tokens = tokens
        self.rows_per_step = rows_per_step
        """Rows of one optimizer step: all micro-batches on all data-parallel ranks of the group."""

    @property
    def skip_lm_head(self) -> bool:
        """The model returns hidden states and :meth:`loss` applies the head (``lm_head`` set)."""
        return False

    lm_head: torch.nn.Module | None = None

    def use_loss(self, loss_fn, compile_config=None) -> None:
        """The trainer's torchtitan loss (built from ``config.loss``, compiled with the model) and
        its compile setting: an objective scoring with plain cross-entropy takes the loss; others
        build their own scoring under the same setting."""

    def flops_per_token(self, model_flops: float, head_params: int) -> float:
        """Training FLOPs per loader token, from torchtitan's count for the model (6·N plus
        full seq×seq attention: exact for bidirectional attention, torchtitan's convention
        for causal) and the LM head's parameter count."""
        return model_flops

    def attention_kwargs(self, inputs: torch.Tensor) -> dict[str, Any]:
        """The model's keyword arguments for ``inputs``: the document mask, in the kernel's form."""
        if not self.config.document_mask:
            return {}
        doc = document_ids(inputs, self.tokens.bos)
        if not self._flex(inputs.device):
            return {"attention_masks": document_mask(doc, self.causal)}
        return {"attention_masks": document_block_mask(doc, self.causal)}

    def _flex(self, device: torch.device) -> bool:
        kernel = self.config.mask_kernel
        if kernel == "auto":
            return device.type == "cuda"
        if kernel == "flex" and device.type != "cuda" and torch.is_grad_enabled():
            raise ValueError(
                f"objective.mask_kernel flex trains only on CUDA (FlexAttention has no "
                f"backward on {device.type}); use --objective.mask_kernel sdpa or auto there."
            )
        return kernel == "flex"

    def truncate(self, inputs: torch.Tensor, labels: torch.Tensor, key: NoiseKey):
        """A fetched micro-batch, possibly cut shorter, before its valid tokens are counted
        (the same cut on every rank of the group). Unchanged here."""
        return inputs, labels

    def prepare(self, inputs: torch.Tensor, labels: torch.Tensor, key: NoiseKey) -> Prepared:
        raise NotImplementedError

    def loss_inputs(self, batch: Prepared) -> dict[str, torch.Tensor] | None:
        """What :meth:`loss` reads besides the inputs and labels, as tensors, so that a step can
        be recorded as a CUDA graph and replayed with each step's values (torchtitan's
        ``fwd_bwd_fn``; the draws happen in :meth:`prepare`, outside it); None: this objective's
        steps run eagerly."""
        return None

    def batch_from(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        model_kwargs: dict[str, Any],
        loss_inputs: dict[str, torch.Tensor],
    ) -> Prepared:
        """The batch :meth:`loss_inputs` was taken from, rebuilt inside the recorded step."""
        return Prepared(inputs, labels, model_kwargs)

    def loss(self, pred: torch.Tensor, batch: Prepared, global_valid_tokens: torch.Tensor | None) -> torch.Tensor:
        """This rank's summed loss over ``global_valid_tokens`` (None: the plain sum)."""
        raise NotImplementedError
