"""Tokenizers for muloco: one class over tiktoken BPE files and Hugging Face tokenizer.json.

Why not torchtitan's ``HuggingFaceTokenizer``: it needs a downloaded asset
directory, cannot read Llama 3's original tiktoken ``tokenizer.model``, and
lets text that spells a special token (``"<|end_of_text|>"`` inside a scraped
document) become that special id. Here the default is a small BPE embedded in
the repository, both file formats load through one ``--tokenizer.path``, and
special tokens only ever come from ``add_bos``/``add_eos`` or ``mask_id``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tiktoken
from tokenizers import AddedToken, Tokenizer
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.tools.logging import logger
from muloco.utils.errors import BadInput

EMBEDDED_TOKENIZER = Path(__file__).parent / "assets" / "stdlib_bpe.json"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
MASK_TOKEN = "<|mask|>"

# Llama 3's pre-tokenization regex, so a Llama 3 tokenizer.model encodes exactly
# as Meta's reference implementation does.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_TIKTOKEN_SPECIAL_TOKENS = 256
# tiktoken's regex backtracking is quadratic (and recursion-deep) on huge
# whitespace or non-whitespace runs; Llama 3's reference tokenizer bounds both.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
TIKTOKEN_MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % ((TIKTOKEN_MAX_RUN_CHARS + 1,) * 2))

HF_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "[CLS]")
HF_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "[SEP]")
HF_MASK_NAMES = ("<|mask|>", "<|mdm_mask|>", "<mask>", "[MASK]")
"""``<|mdm_mask|>``: LLaDA's mask token."""

Kind = Literal["auto", "tiktoken", "huggingface"]
_PATH_FIX = (
    "pass --tokenizer.path <a tiktoken BPE file, a tokenizer.json, or a directory "
    "holding one>, or leave it empty for the embedded standard-library BPE"
)


class TokenizerError(BadInput, ValueError):
    """A tokenizer file is missing, unreadable or corrupt; the message says how to fix it."""


# --------------------------------------------------------------------------- path resolution


def _resolve(path: str, kind: str) -> tuple[Path, str]:
    """Map the user's ``path``/``kind`` to one concrete file and backend."""
    if kind not in ("auto", "tiktoken", "huggingface"):
        raise TokenizerError(
            f"tokenizer.kind '{kind}' is not one of 'auto', 'tiktoken', 'huggingface'"
        )
    if not path:
        return _resolve_embedded(kind)
    p = Path(path).expanduser()
    if not p.exists():
        raise TokenizerError(f"tokenizer.path '{path}' does not exist; {_PATH_FIX}")
    if p.is_dir():
        return _resolve_dir(p, kind)
    if kind == "auto":
        kind = "huggingface" if p.suffix.lower() == ".json" else "tiktoken"
    return p.resolve(), kind


def _resolve_embedded(kind: str) -> tuple[Path, str]:
    if kind == "tiktoken":
        raise TokenizerError(
            f"tokenizer.kind 'tiktoken' cannot load the embedded BPE "
            f"'{EMBEDDED_TOKENIZER}' (a tokenizer.json); leave tokenizer.kind 'auto' "
            "or set tokenizer.path to a tiktoken BPE file"
        )
    if not EMBEDDED_TOKENIZER.is_file():
        raise TokenizerError(
            f"the embedded tokenizer '{EMBEDDED_TOKENIZER}' is missing; rebuild it with "
            "`python scripts/build_embedded_tokenizer.py` or set --tokenizer.path"
        )
    return EMBEDDED_TOKENIZER.resolve(), "huggingface"


def _resolve_dir(d: Path, kind: str) -> tuple[Path, str]:
    """Prefer tokenizer.json; fall back to Llama 3's tiktoken file, which Hugging
    Face checkouts of Llama 3 keep under ``original/``."""
    candidates = []
    if kind in ("auto", "huggingface"):
        candidates.append((d / "tokenizer.json", "huggingface"))
    if kind in ("auto", "tiktoken"):
        candidates += [(d / "tokenizer.model", "tiktoken"), (d / "original" / "tokenizer.model", "tiktoken")]
    for file, file_kind in candidates:
        if file.is_file():
            return file.resolve(), file_kind
    wanted = " or ".join(str(f.relative_to(d)) for f, _ in candidates)
    present = sorted(x.name for x in d.iterdir())[:20]
    raise TokenizerError(
        f"tokenizer.path '{d}' is a directory without {wanted} (it holds {present}); {_PATH_FIX}"
    )


def _stamp(file: Path) -> tuple[int, int]:
    st = file.stat()
    return st.st_mtime_ns, st.st_size


# --------------------------------------------------------------------------- backends


def tiktoken_special_tokens() -> list[str]:
    """The special tokens after a tiktoken file's ranks, in id order (Llama 3's layout, with
    muloco's BOS, EOS and mask first)."""
    return [BOS_TOKEN, EOS_TOKEN, MASK_TOKEN] + [
        f"<|reserved_special_token_{i}|>" for i in range(NUM_TIKTOKEN_SPECIAL_TOKENS - 3)
    ]


def read_tiktoken_ranks(file: str | Path) -> dict[bytes, int]:
    """A tiktoken file's ``token bytes → rank`` (read without tiktoken's path-keyed cache)."""
    return _read_tiktoken_ranks(Path(file))


class _TiktokenBackend:
    """A tiktoken BPE file with Llama 3's layout of 256 special tokens after the ranks."""

    def __init__(self, file: Path):
        ranks = _read_tiktoken_ranks(file)
        n = len(ranks)
        names = tiktoken_special_tokens()
        self.encoding = tiktoken.Encoding(
            name=f"muloco:{file}",
            pat_str=LLAMA3_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens={name: n + i for i, name in enumerate(names)},
        )
        self.bos_id, self.eos_id, self.mask_id = n, n + 1, n + 2
        self.vocab_size = n + NUM_TIKTOKEN_SPECIAL_TOKENS

    def encode(self, text: str) -> list[int]:
        pieces = list(_tiktoken_pieces(text))
        if len(pieces) == 1:
            return self.encoding.encode_ordinary(pieces[0])
        return [t for ids in self.encoding.encode_ordinary_batch(pieces) for t in ids]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_ordinary* never emits special ids: special-token text stays text.
        pieces = [list(_tiktoken_pieces(t)) for t in texts]
        flat = self.encoding.encode_ordinary_batch([p for ps in pieces for p in ps])
        if len(flat) == len(texts):
            return flat
        out, i = [], 0
        for ps in pieces:
            out.append([t for ids in flat[i : i + len(ps)] for t in ids])
            i += len(ps)
        return out

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    @functools.cached_property
    def token_bytes(self) -> list[int]:
        """UTF-8 bytes each id stands for (exact: tiktoken ranks are byte strings); specials 0."""
        ranks = self.vocab_size - NUM_TIKTOKEN_SPECIAL_TOKENS
        return [len(self.encoding.decode_single_token_bytes(i)) for i in range(ranks)] + \
            [0] * NUM_TIKTOKEN_SPECIAL_TOKENS


def _read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """Parse ``base64(token) rank`` lines, as ``tiktoken.load.load_tiktoken_bpe`` does.

    Not calling that function: it caches file contents under /tmp keyed by the
    path alone, so a file edited in place would silently load stale ranks, and
    its errors do not say which line is broken.
    """
    data = _read_bytes(file, "tiktoken BPE file")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise _corrupt(file, "tiktoken BPE file", f"line {lineno} {line[:80]!r} is not '<base64 token> <rank>' ({e})") from None
    _check_ranks(file, ranks)
    return ranks


def _check_ranks(file: Path, ranks: dict[bytes, int]) -> None:
    """Catch files that parse but would make tiktoken panic or mis-place specials."""
    if not ranks:
        raise _corrupt(file, "tiktoken BPE file", "it holds no ranks")
    if set(ranks.values()) != set(range(len(ranks))):
        raise _corrupt(file, "tiktoken BPE file", f"its {len(ranks)} ranks are not exactly 0..{len(ranks) - 1} (duplicate tokens or ranks)")
    missing = sum(bytes([b]) not in ranks for b in range(256))
    if missing:
        raise _corrupt(file, "tiktoken BPE file", f"{missing} of the 256 single bytes have no rank, so some text could not be encoded")


def _tiktoken_pieces(text: str) -> Iterator[str]:
    """Split text the way Llama 3's reference tokenizer does before encoding."""
    if len(text) <= TIKTOKEN_MAX_RUN_CHARS:
        yield text
        return
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS])


def _split_long_runs(text: str) -> Iterator[str]:
    """Cut runs of whitespace or non-whitespace longer than TIKTOKEN_MAX_RUN_CHARS
    every TIKTOKEN_MAX_RUN_CHARS characters (same cuts as Llama 3's reference)."""
    start = 0
    for m in _LONG_RUN.finditer(text):
        for cut in range(m.start() + TIKTOKEN_MAX_RUN_CHARS, m.end(), TIKTOKEN_MAX_RUN_CHARS):
            yield text[start:cut]
            start = cut
    yield text[start:]


class _HuggingFaceBackend:
    """A ``tokenizers`` tokenizer.json, with bos/eos/mask found or added."""

    def __init__(self, file: Path, mask_token: str = ""):
        text = _read_bytes(file, "tokenizer.json")
        try:
            tok = Tokenizer.from_str(text.decode("utf-8"))
        except Exception as e:  # the Rust side raises a bare Exception
            raise _corrupt(file, "Hugging Face tokenizer.json", str(e)) from None
        hf_config = _read_tokenizer_config(file.parent / "tokenizer_config.json")
        self.eos_id = _find_token(tok, file, hf_config, "eos_token", HF_EOS_NAMES, required=True)
        self.bos_id = _find_token(tok, file, hf_config, "bos_token", HF_BOS_NAMES, required=True)
        if self.bos_id == self.eos_id:
            # GPT-2/Qwen style files share one <|endoftext|>; document starts
            # must stay distinguishable from document ends.
            logger.info(f"{file}: bos == eos; adding a dedicated {BOS_TOKEN}")
            self.bos_id = _add_special(tok, BOS_TOKEN)
        self.mask_id = _chosen_mask(tok, file, mask_token) if mask_token else \
            _find_token(tok, file, hf_config, "mask_token", HF_MASK_NAMES, required=False)
        if self.mask_id is None:
            self.mask_id = _add_special(tok, MASK_TOKEN)
        if len({self.bos_id, self.eos_id, self.mask_id}) != 3:
            raise _corrupt(file, "Hugging Face tokenizer.json", f"bos/eos/mask ids {self.bos_id}/{self.eos_id}/{self.mask_id} are not distinct")
        # Split special-token text like ordinary text, so a document that
        # spells "<|end_of_text|>" cannot inject EOS (tokenizers >= 0.15).
        tok.encode_special_tokens = True
        self.tokenizer = tok
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @functools.cached_property
    def token_bytes(self) -> list[int]:
        """UTF-8 bytes each id stands for; special tokens 0. Exact for byte-level BPE (each
        character of a token string is one byte); for SentencePiece-style files ``▁`` counts as
        a space and ``<0xNN>`` as one byte (a decoder's whitespace rules aside)."""
        out = [0] * self.vocab_size
        # read from the file's decoder only here: bits per byte is the one user, and parsing a
        # large tokenizer.json again at every construction cost start-up time
        byte_level = "ByteLevel" in json.dumps(json.loads(self.tokenizer.to_str()).get("decoder"))
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if token in special:
                continue
            if byte_level:
                out[i] = len(token)
            elif _BYTE_FALLBACK.fullmatch(token):
                out[i] = 1
            else:
                out[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        return out


_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _read_tokenizer_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        cfg = json.loads(_read_bytes(file, "tokenizer_config.json"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _corrupt(file, "tokenizer_config.json", str(e)) from None
    if not isinstance(cfg, dict):
        raise _corrupt(file, "tokenizer_config.json", "the top level is not a JSON object")
    return cfg


def _find_token(
    tok: Tokenizer, file: Path, cfg: dict, key: str, names: Sequence[str], *, required: bool
) -> int | None:
    """Id of the token tokenizer_config.json names for ``key``, else of the first known name."""
    value = cfg.get(key)
    content = value.get("content") if isinstance(value, dict) else value
    if isinstance(content, str) and content:
        token_id = tok.token_to_id(content)
        if token_id is None:
            raise _corrupt(file, "Hugging Face tokenizer", f"tokenizer_config.json names {key} {content!r}, which is not in the vocabulary")
        return token_id
    for name in names:
        if (token_id := tok.token_to_id(name)) is not None:
            return token_id
    if required:
        raise _corrupt(file, "Hugging Face tokenizer", f"no {key} found: tokenizer_config.json does not name one and none of {list(names)} is in the vocabulary")
    return None


def _chosen_mask(tok: Tokenizer, file: Path, name: str) -> int:
    """The id of ``--tokenizer.mask_token`` (an unused special token of a full vocabulary, such as
    Llama 3's reserved ones), which must be in the vocabulary."""
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    token_id = special.get(name)
    if token_id is None:  # an ordinary word would be masked wherever the text has it
        reserved = sorted(t.content for t in tok.get_added_tokens_decoder().values() if "reserved" in t.content)[:2]
        hint = f" (its reserved tokens include {', '.join(reserved)})" if reserved else ""
        raise TokenizerError(f"--tokenizer.mask_token {name!r} is not a special (added) token of {file}{hint}; name "
                             "one of them, or leave it empty to use the tokenizer's mask token or add <|mask|>")
    return token_id


def _add_special(tok: Tokenizer, content: str) -> int:
    tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
    return tok.token_to_id(content)


def _read_bytes(file: Path, what: str) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read {what} '{file}': {e.strerror or e}; check its permissions or {_PATH_FIX}") from None


def _corrupt(file: Path, what: str, problem: str) -> TokenizerError:
    return TokenizerError(
        f"'{file}' is not a valid {what}: {problem}; re-download or rebuild it, set "
        "--tokenizer.kind if the format was guessed wrong, or leave --tokenizer.path "
        "empty for the embedded standard-library BPE"
    )


@functools.lru_cache(maxsize=8)
def _load_backend(file: str, kind: str, stamp: tuple, mask_token: str = "") -> _TiktokenBackend | _HuggingFaceBackend:
    """Loaded backends, shared: trainer, dataloader and eval each build a tokenizer,
    and re-parsing a 128k-rank file (~0.2 s) for each is wasted work.

    ``stamp`` (mtime, size of the file and of any tokenizer_config.json) is in
    the key so an edited file is reloaded; backends are never mutated after
    construction, so sharing them between tokenizer instances is safe.
    """
    if kind == "tiktoken":
        if mask_token:
            raise TokenizerError(f"--tokenizer.mask_token names a token of a tokenizer.json; {file} is a tiktoken "
                                 "BPE, whose mask muloco adds after its ranks: leave it empty")
        return _TiktokenBackend(Path(file))
    return _HuggingFaceBackend(Path(file), mask_token)


# --------------------------------------------------------------------------- public class


class MulocoTokenizer(BaseTokenizer):
    """Tokenizer with distinct ``bos_id``/``eos_id``/``mask_id`` for any supported file.

    ``tokenizer_path`` is accepted only because torchtitan's Trainer passes
    ``config.hf_assets_path`` to every tokenizer build; it is ignored so that
    ``config.path`` is the single source of truth for which tokenizer runs.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        path: str = ""
        """Empty: the embedded BPE built from the Python standard library
        (muloco/data/assets/stdlib_bpe.json). Otherwise a tiktoken-format BPE
        file such as Llama 3's ``tokenizer.model``, a Hugging Face
        ``tokenizer.json``, or a directory holding one of them."""

        kind: Literal["auto", "tiktoken", "huggingface"] = "auto"
        """auto: a ``.json`` file or a directory with tokenizer.json is
        huggingface, anything else tiktoken."""

        mask_token: str = ""
        """The masked-diffusion mask token of a tokenizer.json: empty takes the one its
        tokenizer_config.json names (or a known name such as <|mask|>), else adds <|mask|> after
        the vocabulary; a name (e.g. Llama 3's <|reserved_special_token_0|>) uses that token, for a
        model whose embedding has no row left for an added one."""

        def validate(self) -> None:
            if self.path and not os.path.exists(self.path):
                raise ValueError(f"tokenizer.path '{self.path}' does not exist; give a tiktoken BPE file, a "
                                 "tokenizer.json or a directory holding one, or leave it empty for the "
                                 "embedded standard-library BPE.")

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None):
        super().__init__()
        self.config = config if config is not None else self.Config()
        file, kind = _resolve(self.config.path, self.config.kind)
        stamp = (_stamp(file), _config_stamp(file) if kind == "huggingface" else None)
        self._backend = _load_backend(str(file), kind, stamp, self.config.mask_token)
        self.path, self.kind = str(file), kind
        self.bos_id: int = self._backend.bos_id
        self.eos_id: int = self._backend.eos_id
        self.mask_id: int = self._backend.mask_id

    def __reduce__(self):
        # Rebuild from config in the receiving process (e.g. spawned dataloader
        # workers) instead of pickling the native encoder.
        return (_rebuild, (self.config,))

    def __repr__(self) -> str:
        return f"MulocoTokenizer(path={self.path!r}, kind={self.kind!r}, vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def get_vocab_size(self) -> int:
        """Max id + 1 over every token, special ones included: the embedding size needed."""
        return self._backend.vocab_size

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self._wrap(self._backend.encode(text), add_bos, add_eos)

    def encode_batch(self, texts: list[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """Many documents in one native call, which the backends parallelise."""
        if not texts:
            return []
        return [self._wrap(ids, add_bos, add_eos) for ids in self._backend.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int] | Any) -> str:
        """Special ids decode to their text, so masked/bos/eos positions stay visible."""
        if hasattr(ids, "tolist"):  # tensors and numpy arrays
            ids = ids.tolist()
        return self._backend.decode(list(ids))

    def token_bytes(self) -> list[int]:
        """UTF-8 bytes of text each id stands for (0 for BOS, EOS, mask and other special
        tokens): Σ over the targets is the bytes of the text they spell, what bits per byte
        divide by."""
        return self._backend.token_bytes

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids


def _config_stamp(file: Path) -> tuple[int, int] | None:
    cfg = file.parent / "tokenizer_config.json"
    return _stamp(cfg) if cfg.is_file() else None


def _rebuild(config: MulocoTokenizer.Config) -> MulocoTokenizer:
    return MulocoTokenizer(config)
