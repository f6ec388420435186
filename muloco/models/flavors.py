"""The model map: every flavor's shape, parameter count, token budget and tuned settings.

One source of truth for the trainer (which builds models from it), the job generators and
sweeps (which read budgets, batch limits and tuned values from it) and the sizing CLI
(``muloco/sizing/cli.py``: ``muloco map`` or ``python -m muloco.model_map [--flavor F ...]
[--global-batch B] [--vocab V]``), which prints
for each flavor: parameters with and without the embedding and head for a vocabulary, the token
budget at 20 tokens per parameter, the steps that spend it at a global batch of ``--seq-len``
sequences, the largest micro-batch per GPU (MuLoCo's LBS_MAP, seq 2048), the GPUs that hold the
global batch without gradient accumulation, and the tuned values with where each comes from:
inner learning rates as MuLoCo's launchers set them, and weight decay tuned at batch 512 rescaled
the way MuLoCo's launchers rescale it (× steps(512)/steps(B), ÷ K for DiLoCo/MuLoCo with
``--replicas K``). ``--json`` prints one object per flavor. With ``--link-mbps`` it plans the link
between K replica groups instead (``muloco/sizing/link_plan.py``; that path imports torch for the
exchange's wire format). The table itself is pure Python: no torch import. Flavors are named like
MuLoCo's ``model_map``: ``llama3-w{dim}-d{depth}-h{heads}``, optionally followed by
``_qk_torch-rmsnorm`` (per-head QK RMSNorm) and ``_pa`` / ``_pf`` (post-attention /
post-FFN norms). Shapes follow MuLoCo: no GQA, SwiGLU FFN of ``int(2.75 * dim)``,
untied embeddings, no biases. Any such name is a model (trained and sized like the map's rows);
a shape that is not a row has no tuned values, and its micro-batch is the next larger row's
(marked ``~``). The vocabulary comes from the tokenizer, so counts are functions of
``vocab_size``; the table's default (``--vocab auto``) is the tokenizer each shape is trained
with by the shipped configs: the embedded standard-library BPE below width 512 (the CPU
flavors), Llama 3's from there on, padded as the model pads it (to a multiple of 64).

``hf:DIR`` sizes a Hugging Face folder (Llama 2/3.x, Qwen2/2.5, Qwen3, LLaDA) from its
``config.json`` as ``--model.flavor hf:DIR`` builds it: its grouped-query heads, head size, FFN
size, q/k/v biases, QK norms, tying and vocabulary (no tuned values; the micro-batch of the map's
next larger row).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from muloco.utils.errors import BadInput

FFN_MULTIPLIER = 2.75
TOKENS_PER_PARAM = 20  # Chinchilla budget, as in MuLoCo's MODEL_STEP_MAP
LLAMA3_VOCAB = 128256
VOCAB_MULTIPLE = 64
"""The model pads its embedding rows to this multiple (``ModelConfig.vocab_multiple_of``'s default)."""
CPU_WIDTH_BELOW = 512
"""Shapes narrower than this are the CPU flavors, trained with the embedded tokenizer."""
EMBEDDED_TOKENIZER_META = Path(__file__).parents[1] / "data" / "assets" / "stdlib_bpe.meta.json"
WD_REFERENCE_BATCH = 512
"""MuLoCo tuned weight decay at this global batch and rescales it by steps (see rescaled_weight_decay)."""

SOURCES: dict[str, str] = {
    "muon": "MuLoCo model_map.py OPTIMAL_WD_MAP['muon'] (weight decay, global batch 512)",
    "adamw": "MuLoCo model_map.py OPTIMAL_WD_MAP['adamw'] (weight decay, global batch 512)",
    "muloco_k8_topk": "MuLoCo inner_sweep_distributed_quantized_topk.py (MuLoCo inner lr, K=8, B=512, top-k)",
    "muloco_k8_quantized": "MuLoCo inner_sweep_distributed_quantized_streaming.py (MuLoCo inner lr, K=8, "
    "B=512, 2-bit; middle of its grid 0.0473/0.0224/0.0106)",
    "diloco_k8": "MuLoCo inner_sweep_distributed_quantized_topk.py (DiLoCo AdamW inner lr, K=8, B=512)",
    "ddp_muon_gbs8192": "MuLoCo ddp_baselines_h100.py (DDP Muon lr, B=8192; middle of 0.0442/0.0313/0.0221)",
    "muloco_k16": "MuLoCo diloco_muloco_no-compression_h100.py (MuLoCo inner lr, K=16, B=2048)",
    "diloco_k16": "MuLoCo diloco_muloco_no-compression_h100.py (DiLoCo AdamW inner lr, K=16, B=1024)",
}
"""Where each tuned value of the table comes from (keys of Shape.weight_decay and Shape.tuned_lr)."""


@dataclass(frozen=True)
class Shape:
    dim: int
    depth: int
    heads: int
    max_local_batch: int = 32
    """Largest micro-batch per GPU at seq 2048 (MuLoCo's LBS_MAP; tiny models: CPU)."""
    weight_decay: dict[str, float] = field(default_factory=dict)
    """Tuned decoupled weight decay at global batch 512 (MuLoCo's OPTIMAL_WD_MAP)."""
    tuned_lr: dict[str, float] = field(default_factory=dict)
    """Tuned inner learning rates from MuLoCo's launchers, keyed by method."""
    kv_heads: int | None = None
    """Grouped-query attention's key/value heads (None: ``heads``, MuLoCo's shapes)."""
    head_size: int | None = None
    """Each head's width (None: dim / heads)."""
    ffn: int | None = None
    """The SwiGLU hidden size (None: int(2.75 · dim))."""
    qkv_bias: bool = False
    tied: bool = False
    """The head shares the embedding's weights."""
    vocab: int | None = None
    """A Hugging Face folder's own vocabulary (None: the tokenizer's, ``default_vocab``)."""

    @property
    def ffn_dim(self) -> int:
        return self.ffn or int(FFN_MULTIPLIER * self.dim)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.heads

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads or self.heads


@dataclass(frozen=True)
class Flavor:
    name: str
    shape: Shape
    qk_norm: bool
    post_attention_norm: bool
    post_ffn_norm: bool


# Tiny flavors train on a 2-core CPU (tests and the embedded default job);
# the rest are MuLoCo's table (head_dim 128).
SHAPES: dict[str, Shape] = {
    "llama3-w64-d2-h2": Shape(64, 2, 2),
    "llama3-w128-d4-h2": Shape(128, 4, 2),
    "llama3-w192-d4-h3": Shape(192, 4, 3),
    "llama3-w256-d4-h4": Shape(256, 4, 4),
    "llama3-w256-d6-h4": Shape(256, 6, 4),
    "llama3-w512-d6-h4": Shape(512, 6, 4, 32, {"muon": 0.01, "adamw": 0.001}),
    "llama3-w1024-d12-h8": Shape(
        1024,
        12,
        8,
        16,
        {"muon": 0.01, "adamw": 0.01},
        {"muloco_k8_topk": 0.0625, "muloco_k8_quantized": 0.0224, "diloco_k8": 0.0039},
    ),
    "llama3-w1536-d18-h12": Shape(1536, 18, 12, 16, {"muon": 0.01, "adamw": 0.01}),
    "llama3-w2048-d24-h16": Shape(2048, 24, 16, 8, {"muon": 0.001, "adamw": 0.001}),
    "llama3-w2560-d30-h20": Shape(
        2560,
        30,
        20,
        4,
        {"muon": 0.001, "adamw": 0.001},
        {"ddp_muon_gbs8192": 0.0313, "muloco_k16": 0.015625, "diloco_k16": 0.000691},
    ),
    "llama3-w3072-d36-h24": Shape(3072, 36, 24, 2),
    "llama3-w3584-d42-h28": Shape(3584, 42, 28, 2),
    "llama3-w4096-d48-h32": Shape(4096, 48, 32, 2),
    "llama3-w4608-d54-h36": Shape(4608, 54, 36, 2, {"muon": 1e-4, "adamw": 1e-4}),
}

_SUFFIX = re.compile(
    r"^(?P<base>llama3-w(?P<dim>\d+)-d(?P<depth>\d+)-h(?P<heads>\d+))"
    r"(?P<qk>_qk_torch-rmsnorm)?(?P<pa>_pa)?(?P<pf>_pf)?$"
)


class UnknownFlavorError(BadInput, ValueError):
    pass


def known_flavors() -> list[str]:
    """Every base shape, plain and with MuLoCo's full suffix."""
    return sorted(SHAPES) + sorted(f"{b}_qk_torch-rmsnorm_pa_pf" for b in SHAPES)


def _layer_parameters(shape: Shape) -> int:
    return 4 * shape.dim * shape.dim + 3 * shape.dim * shape.ffn_dim


def _shape_outside_the_map(name: str, dim: int, depth: int, heads: int, head_dim: int | None = None) -> Shape:
    """A shape the map has no row for: no tuned values, and the micro-batch of the smallest row at
    least as large (by parameters without the embedding), or 1 beyond the largest. ``head_dim``:
    a Hugging Face folder's own (checked there)."""
    problems = [
        f"{what} must be at least 1" for what, v in (("width", dim), ("depth", depth), ("heads", heads)) if v < 1
    ]
    if head_dim is not None:
        problems = []  # hf/config.py checked the folder's shapes
    elif not problems and dim % heads:
        problems.append(f"width {dim} is not a multiple of the {heads} heads")
    elif not problems and (dim // heads) % 2:
        problems.append(
            f"the head dimension {dim}/{heads} = {dim // heads} is odd (rotary embeddings pair "
            "its entries; make width/heads even)"
        )
    if problems:
        close = difflib.get_close_matches(name, known_flavors(), n=3, cutoff=0.6)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise UnknownFlavorError(
            f"model.flavor '{name}': {'; '.join(problems)}.{hint} A flavor is "
            "llama3-w{width}-d{depth}-h{heads}, e.g. llama3-w1024-d12-h8."
        )
    shape = Shape(dim, depth, heads)
    size = depth * _layer_parameters(shape)
    larger = [row for row in SHAPES.values() if row.depth * _layer_parameters(row) >= size]
    micro = min(larger, key=lambda row: row.depth * _layer_parameters(row)).max_local_batch if larger else 1
    return dataclasses.replace(shape, max_local_batch=micro)


HF_FLAVOR = "hf:"
"""``--model.flavor hf:DIR``: the shapes of a Hugging Face folder's config.json."""


def hf_folder(flavor: str) -> str | None:
    """The folder of an ``hf:DIR`` flavor (None: a model-map flavor)."""
    return flavor[len(HF_FLAVOR) :] if flavor.startswith(HF_FLAVOR) else None


def _hf_flavor(name: str) -> Flavor:
    """A Hugging Face folder's shapes, read from its config.json as the trainer reads them."""
    from muloco.hf import config as hf_config  # JSON only, no torch

    folder = name[len(HF_FLAVOR) :]
    try:
        a = hf_config.architecture_fields(hf_config.read(folder))
    except ValueError as err:
        raise UnknownFlavorError(f"model.flavor '{name}': {err}") from None
    shape = _shape_outside_the_map(name, a["dim"], a["depth"], a["heads"], head_dim=a["head_dim"])
    shape = dataclasses.replace(
        shape,
        kv_heads=a["kv_heads"],
        head_size=a["head_dim"],
        ffn=a["ffn_dim"],
        qkv_bias=a["qkv_bias"],
        tied=a["tied"],
        vocab=a["vocab_size"],
    )
    return Flavor(
        name=name,
        shape=shape,
        qk_norm=a["qk_norm"],
        post_attention_norm=a["post_attention_norm"],
        post_ffn_norm=a["post_ffn_norm"],
    )


def parse_flavor(name: str) -> Flavor:
    """The map's row, any ``llama3-w{dim}-d{depth}-h{heads}`` shape, or ``hf:DIR`` (see the
    module's docstring)."""
    if name.startswith(HF_FLAVOR):
        return _hf_flavor(name)
    match = _SUFFIX.match(name)
    if match is None:
        close = difflib.get_close_matches(name, known_flavors(), n=3, cutoff=0.6)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise UnknownFlavorError(
            f"model.flavor '{name}' is not a flavor name.{hint} A flavor is llama3-w{{width}}-d{{depth}}-h{{heads}} "
            f"(any shape; the map's rows: {', '.join(SHAPES)}), optionally suffixed with _qk_torch-rmsnorm, "
            "_pa, _pf (in that order)."
        )
    base = match["base"]
    shape = SHAPES.get(base) or _shape_outside_the_map(
        name, int(match["dim"]), int(match["depth"]), int(match["heads"])
    )
    return Flavor(
        name=name,
        shape=shape,
        qk_norm=match["qk"] is not None,
        post_attention_norm=match["pa"] is not None,
        post_ffn_norm=match["pf"] is not None,
    )


def in_map(flavor: str | Flavor) -> bool:
    """Whether the flavor's shape is a row of the map (with its tuned values and measured micro-batch)."""
    f = parse_flavor(flavor) if isinstance(flavor, str) else flavor
    return f.name.split("_")[0] in SHAPES


def embedded_vocab() -> int:
    """The embedded standard-library BPE's vocabulary (from its meta file: no tokenizer import)."""
    return json.loads(EMBEDDED_TOKENIZER_META.read_text())["vocab_size"]


def default_vocab(flavor: str | Flavor) -> tuple[int, str]:
    """(embedding rows, which tokenizer) the shipped configs train this flavor with (a Hugging Face
    folder: its own)."""
    f = parse_flavor(flavor) if isinstance(flavor, str) else flavor
    if f.shape.vocab:
        return f.shape.vocab, "the folder's"
    if f.shape.dim < CPU_WIDTH_BELOW:
        return padded_vocab(embedded_vocab(), VOCAB_MULTIPLE), "embedded"
    return padded_vocab(LLAMA3_VOCAB, VOCAB_MULTIPLE), "llama3"


def padded_vocab(vocab_size: int, multiple_of: int) -> int:
    return -(-vocab_size // multiple_of) * multiple_of


def count_parameters(flavor: str | Flavor, vocab_size: int) -> int:
    """Closed-form parameter count; the tests check it against built models."""
    f = parse_flavor(flavor) if isinstance(flavor, str) else flavor
    return count_embedding_parameters(f, vocab_size) + f.shape.depth * block_parameters(f) + f.shape.dim  # + final norm


def block_parameters(flavor: str | Flavor) -> int:
    """One transformer block's parameters: attention (grouped-query heads, q/k/v biases), SwiGLU,
    norms (QK norms too)."""
    f = parse_flavor(flavor) if isinstance(flavor, str) else flavor
    s = f.shape
    q, kv = s.heads * s.head_dim, s.key_value_heads * s.head_dim
    attention = s.dim * (q + 2 * kv) + q * s.dim + ((q + 2 * kv) if s.qkv_bias else 0)  # wq, wk, wv (+b), wo
    norms = (2 + int(f.post_attention_norm) + int(f.post_ffn_norm)) * s.dim + (2 * s.head_dim if f.qk_norm else 0)
    return attention + 3 * s.dim * s.ffn_dim + norms  # + SwiGLU w1, w2, w3


def count_embedding_parameters(flavor: str | Flavor, vocab_size: int) -> int:
    """The embedding and the head (one matrix when they are tied)."""
    f = parse_flavor(flavor) if isinstance(flavor, str) else flavor
    return (1 if f.shape.tied else 2) * vocab_size * f.shape.dim


def token_budget(flavor: str, vocab_size: int = LLAMA3_VOCAB) -> int:
    return TOKENS_PER_PARAM * count_parameters(flavor, vocab_size)


def steps_for_batch(flavor: str, global_batch: int, seq_len: int = 2048, vocab_size: int = LLAMA3_VOCAB) -> int:
    """Steps that spend the 20-tokens-per-parameter budget at this global batch."""
    if global_batch <= 0 or seq_len <= 0:
        raise ValueError("global_batch and seq_len must be positive")
    return -(-token_budget(flavor, vocab_size) // (global_batch * seq_len))


def non_embedding_parameters(flavor: str | Flavor, vocab_size: int) -> int:
    return count_parameters(flavor, vocab_size) - count_embedding_parameters(flavor, vocab_size)


def gpus_without_accumulation(flavor: str, global_batch: int) -> int:
    """GPUs whose micro-batches (the map's ``max_local_batch`` each) hold the global batch in one step."""
    return -(-global_batch // parse_flavor(flavor).shape.max_local_batch)


def rescaled_weight_decay(
    weight_decay: float,
    flavor: str,
    global_batch: int,
    *,
    replicas: int = 1,
    seq_len: int = 2048,
    vocab_size: int = LLAMA3_VOCAB,
) -> float:
    """MuLoCo's launchers' rule: the weight decay tuned at global batch 512 scales with the
    number of steps, wd · steps(512) / steps(B), and is divided by K for DiLoCo/MuLoCo."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    ratio = steps_for_batch(flavor, WD_REFERENCE_BATCH, seq_len, vocab_size) / steps_for_batch(
        flavor, global_batch, seq_len, vocab_size
    )
    return weight_decay * ratio / replicas


@dataclass(frozen=True)
class SizingRow:
    flavor: str
    parameters: int
    non_embedding_parameters: int
    token_budget: int
    steps: int
    max_micro_batch: int
    gpus: int
    weight_decay: dict[str, float]
    """Tuned at batch 512, rescaled to this batch and K."""
    tuned_lr: dict[str, float]
    vocab: int
    """Embedding rows the counts assume."""
    vocab_source: str
    in_map: bool
    """False for a shape outside the map (no tuned values; micro-batch from the next larger row)."""


def sizing(
    flavor: str,
    *,
    global_batch: int,
    vocab_size: int = LLAMA3_VOCAB,
    seq_len: int = 2048,
    replicas: int = 1,
    vocab_source: str = "",
) -> SizingRow:
    """One row of the sizing table (``python -m muloco.model_map``)."""
    shape = parse_flavor(flavor).shape
    params = count_parameters(flavor, vocab_size)
    return SizingRow(
        flavor=flavor,
        parameters=params,
        non_embedding_parameters=non_embedding_parameters(flavor, vocab_size),
        token_budget=TOKENS_PER_PARAM * params,
        steps=steps_for_batch(flavor, global_batch, seq_len, vocab_size),
        max_micro_batch=shape.max_local_batch,
        gpus=gpus_without_accumulation(flavor, global_batch),
        weight_decay={
            k: rescaled_weight_decay(v, flavor, global_batch, replicas=replicas, seq_len=seq_len, vocab_size=vocab_size)
            for k, v in shape.weight_decay.items()
        },
        tuned_lr=dict(shape.tuned_lr),
        vocab=vocab_size,
        vocab_source=vocab_source or str(vocab_size),
        in_map=in_map(flavor),
    )
