"""Tests for muloco.data.tokenizer, muloco.data.split and the embedded-BPE build script."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import re
import sys
from pathlib import Path, PurePosixPath

import pytest
import torch
from conftest import run_watched
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from muloco.data.split import is_validation, stdlib_root, stdlib_sources
from muloco.data.tokenizer import (
    EMBEDDED_TOKENIZER,
    NUM_TIKTOKEN_SPECIAL_TOKENS,
    TIKTOKEN_MAX_RUN_CHARS,
    MulocoTokenizer,
    TokenizerError,
    _split_long_runs,
)

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "scripts" / "build_embedded_tokenizer.py"

SAMPLE = (
    "def f(x):\n\treturn x ** 2  # héllo wörld 🙂\r\n\n"
    "    indented   spaces\u00a0nbsp 12345678 'quoted' it's\n"
    "<|begin_of_text|> <|end_of_text|> <|mask|> <s> </s> [MASK]"
)


def build(path: str | os.PathLike = "", kind: str = "auto", **kw) -> MulocoTokenizer:
    return MulocoTokenizer.Config(path=str(path), kind=kind).build(**kw)


def write_tiktoken(path: Path, tokens: list[bytes]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    return path


def check_tokenizer(tok: MulocoTokenizer, text: str = SAMPLE) -> list[int]:
    """Invariants every tokenizer must satisfy; returns the ids of ``text``."""
    specials = {tok.bos_id, tok.eos_id, tok.mask_id}
    assert len(specials) == 3
    assert all(isinstance(i, int) and 0 <= i < tok.get_vocab_size() for i in specials)
    assert tok.vocab_size == tok.get_vocab_size()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not specials & set(ids), "special-token text must not encode to special ids"
    wrapped = tok.encode(text, add_bos=True, add_eos=True)
    assert wrapped == [tok.bos_id, *ids, tok.eos_id]
    assert tok.encode_batch([text, "", "x"], add_bos=True) == [tok.encode(t, add_bos=True) for t in (text, "", "x")]
    assert tok.decode(torch.tensor(ids)) == text
    assert max(ids) < tok.get_vocab_size()
    return ids


@pytest.fixture(scope="module")
def small_tiktoken(tmp_path_factory) -> tuple[Path, int]:
    merges = [b"th", b"he", b"the", b"  ", b"in", b"re", b"return"]
    tokens = [bytes([b]) for b in range(256)] + merges
    return write_tiktoken(tmp_path_factory.mktemp("tt") / "tokenizer.model", tokens), len(tokens)


@pytest.fixture(scope="module")
def embedded_as_tiktoken(tmp_path_factory) -> Path:
    """The embedded BPE's merges rewritten as a tiktoken file: a realistic vocabulary."""
    vocab = json.loads(EMBEDDED_TOKENIZER.read_text())["model"]["vocab"]
    decoder = {chr(c): b for b, c in _bytes_to_unicode().items()}
    ordered = sorted((i, tok) for tok, i in vocab.items() if not tok.startswith("<|"))
    tokens = [bytes(decoder[ch] for ch in tok) for _, tok in ordered]
    return write_tiktoken(tmp_path_factory.mktemp("tt") / "stdlib.tiktoken", tokens)


def _bytes_to_unicode() -> dict[int, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, cs))


def train_hf(tmp_path: Path, special_tokens: list[str], name: str = "tokenizer.json") -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog"] * 20, trainer)
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp_path / name))
    return tmp_path / name


# --------------------------------------------------------------------------- tiktoken


def test_tiktoken_llama3_special_layout(small_tiktoken):
    path, n_ranks = small_tiktoken
    tok = build(path)
    assert tok.kind == "tiktoken"
    assert (tok.bos_id, tok.eos_id, tok.mask_id) == (n_ranks, n_ranks + 1, n_ranks + 2)
    assert tok.get_vocab_size() == n_ranks + NUM_TIKTOKEN_SPECIAL_TOKENS
    assert tok.decode([tok.bos_id, tok.eos_id, tok.mask_id]) == "<|begin_of_text|><|end_of_text|><|mask|>"
    check_tokenizer(tok)
    assert n_ranks - 1 in tok.encode("return x")  # merges are used


def test_tiktoken_mask_text_is_plain_text(small_tiktoken):
    tok = build(small_tiktoken[0])
    for text in ("<|mask|>", "<|end_of_text|>", "<|begin_of_text|>", "<|reserved_special_token_7|>"):
        ids = tok.encode(text)
        assert tok.mask_id not in ids and all(i < small_tiktoken[1] for i in ids)
        assert tok.decode(ids) == text


def test_tiktoken_from_real_vocabulary(embedded_as_tiktoken):
    tok = build(embedded_as_tiktoken, kind="tiktoken")
    source = (stdlib_root() / "json" / "__init__.py").read_text(encoding="utf-8")
    ids = check_tokenizer(tok, source)
    # Same merges, slightly different pre-tokenization regex: similar length.
    assert abs(len(ids) - len(build().encode(source))) < 0.1 * len(ids)
    assert len(ids) < len(source.encode()) / 2
    assert tok.get_vocab_size() == 2045 + NUM_TIKTOKEN_SPECIAL_TOKENS


def test_tiktoken_long_runs_are_chunked(small_tiktoken):
    tok = build(small_tiktoken[0])
    text = "a b" + " " * (2 * TIKTOKEN_MAX_RUN_CHARS + 7) + "x" * (TIKTOKEN_MAX_RUN_CHARS + 3) + "\nend"
    pieces = list(_split_long_runs(text))
    assert "".join(pieces) == text and len(pieces) == 4
    long_run = re.compile(r"\s{%d}|\S{%d}" % ((TIKTOKEN_MAX_RUN_CHARS + 1,) * 2))
    assert not any(long_run.search(p) for p in pieces)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode_batch(["short", text]) == [tok.encode("short"), ids]


# --------------------------------------------------------------------------- huggingface


def test_embedded_tokenizer():
    tok = build()
    assert Path(tok.path) == EMBEDDED_TOKENIZER.resolve() and tok.kind == "huggingface"
    assert (tok.bos_id, tok.eos_id, tok.mask_id) == (0, 1, 2)
    meta = json.loads(EMBEDDED_TOKENIZER.with_name("stdlib_bpe.meta.json").read_text())
    assert tok.get_vocab_size() == meta["vocab_size"] == 2048
    assert hashlib.sha256(EMBEDDED_TOKENIZER.read_bytes()).hexdigest() == meta["sha256"]
    check_tokenizer(tok)
    check_tokenizer(tok, (stdlib_root() / "textwrap.py").read_text(encoding="utf-8"))


def test_embedded_special_text_is_plain_text():
    tok = build()
    for text in ("<|mask|>", "<|end_of_text|>", "a<|begin_of_text|>b"):
        ids = tok.encode(text)
        assert not {tok.bos_id, tok.eos_id, tok.mask_id} & set(ids)
        assert tok.decode(ids) == text


def test_hf_known_names_and_added_mask(tmp_path):
    path = train_hf(tmp_path, ["<s>", "</s>"])
    tok = build(path)
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.mask_id == Tokenizer.from_file(str(path)).get_vocab_size()  # appended
    assert tok.get_vocab_size() == tok.mask_id + 1
    assert tok.decode([tok.mask_id]) == "<|mask|>"
    check_tokenizer(tok, "the lazy fox <s></s> <|mask|> ünïcode")


def test_hf_tokenizer_config_and_directory(tmp_path):
    train_hf(tmp_path, ["<unk>", "<bos>", "<eos>", "<mask>"])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<bos>"}, "eos_token": "<eos>"})
    )
    tok = build(tmp_path)  # a directory holding tokenizer.json
    assert tok.kind == "huggingface"
    assert (tok.bos_id, tok.eos_id, tok.mask_id) == (1, 2, 3)
    check_tokenizer(tok, "the dog <bos> <eos> <mask>")


def test_hf_shared_endoftext_gets_dedicated_bos(tmp_path):
    tok = build(train_hf(tmp_path, ["<|endoftext|>"]))
    assert tok.eos_id == 0 and tok.bos_id != tok.eos_id
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"
    check_tokenizer(tok, "fox <|endoftext|>")


def test_hf_without_bos_eos_is_an_error(tmp_path):
    path = train_hf(tmp_path, [])
    with pytest.raises(TokenizerError, match="no eos_token found") as e:
        build(path)
    assert str(path) in str(e.value)


def test_tiktoken_directory(small_tiktoken):
    tok = build(small_tiktoken[0].parent)
    assert tok.kind == "tiktoken" and tok.path == str(small_tiktoken[0].resolve())


# --------------------------------------------------------------------------- errors


def assert_error(path: Path | str, kind: str = "auto", match: str = "") -> str:
    with pytest.raises(TokenizerError, match=match) as e:
        build(path, kind)
    assert str(path) in str(e.value), str(e.value)
    return str(e.value)


def test_missing_file(tmp_path):
    msg = assert_error(tmp_path / "nope" / "tok.model", match="does not exist")
    assert "--tokenizer.path" in msg and "embedded" in msg


def test_directory_without_tokenizer(tmp_path):
    (tmp_path / "README").write_text("hi")
    msg = assert_error(tmp_path, match="directory without")
    assert "README" in msg


def test_corrupt_tiktoken(tmp_path, small_tiktoken):
    bad_line = tmp_path / "bad.model"
    bad_line.write_bytes(small_tiktoken[0].read_bytes() + b"!!notbase64!! 263\n")
    assert_error(bad_line, match="line 264")
    rand = tmp_path / "random.model"
    rand.write_bytes(os.urandom(4096))
    assert_error(rand, match="not a valid tiktoken BPE file")
    gap = write_tiktoken(tmp_path / "gap.model", [bytes([b]) for b in range(200)])
    assert_error(gap, match="single bytes")
    assert_error(write_tiktoken(tmp_path / "empty.model", []), match="no ranks")


def test_corrupt_json(tmp_path):
    good = EMBEDDED_TOKENIZER.read_bytes()
    truncated = tmp_path / "truncated.json"
    truncated.write_bytes(good[: len(good) // 2])
    assert_error(truncated, match="not a valid Hugging Face tokenizer.json")
    rand = tmp_path / "random.json"
    rand.write_bytes(os.urandom(4096))
    assert_error(rand, match="not a valid Hugging Face tokenizer.json")
    assert_error(EMBEDDED_TOKENIZER, kind="tiktoken", match="not a valid tiktoken")


def test_corrupt_tokenizer_config(tmp_path):
    train_hf(tmp_path, ["<s>", "</s>"])
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json") as e:
        build(tmp_path)
    assert str(cfg) in str(e.value)


# --------------------------------------------------------------------------- caching, pickling


def test_cache_and_reload_on_change(tmp_path, small_tiktoken):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(small_tiktoken[0].read_bytes())
    a, b = build(path), build(path, tokenizer_path="/ignored/by/design")
    assert a._backend is b._backend
    write_tiktoken(path, [bytes([x]) for x in range(256)] + [b"ab"])
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    c = build(path)
    assert c._backend is not a._backend and c.bos_id == 257


def test_pickle_round_trip(small_tiktoken):
    for tok in (build(), build(small_tiktoken[0])):
        clone = pickle.loads(pickle.dumps(tok))
        assert clone.encode(SAMPLE) == tok.encode(SAMPLE)
        assert (clone.bos_id, clone.eos_id, clone.mask_id) == (tok.bos_id, tok.eos_id, tok.mask_id)


# --------------------------------------------------------------------------- split and build script


def test_is_validation_split():
    files = stdlib_sources()
    assert len(files) > 500 and files == sorted(files)
    assert not any("site-packages" in f or "__pycache__" in f for f in files)
    flags = [is_validation(f) for f in files]
    assert flags == [is_validation(f) for f in files]
    assert 0.02 <= sum(flags) / len(flags) <= 0.10
    assert is_validation(PurePosixPath(files[0])) == flags[0]
    assert not any(is_validation(f, val_percent=0.0) for f in files)
    assert all(is_validation(f, val_percent=100.0) for f in files)


def test_build_script_is_reproducible(tmp_path):
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run / "A.json"
        run_watched(
            [sys.executable, str(BUILD_SCRIPT), "--max-files", "20", "--vocab-size", "400", "--output", str(out)],
            check=True,
        )
        outputs.append((out.read_bytes(), out.with_name("A.meta.json").read_bytes()))
    assert outputs[0] == outputs[1]
    meta = json.loads(outputs[0][1])
    assert meta["n_files"] == 20 and meta["vocab_size"] == 400
    assert meta["sha256"] == hashlib.sha256(outputs[0][0]).hexdigest()
    check_tokenizer(build(tmp_path / "a" / "A.json"))


TEXTS = ["def f(x):\n    return x  # é ü 中文 🙂\n", "import os\n\nprint(os.getcwd())", " the quick brown fox"]


@pytest.mark.parametrize("which", ["embedded", "tiktoken", "huggingface"])
def test_token_bytes_add_up_to_the_bytes_of_the_text_and_specials_weigh_nothing(which, embedded_as_tiktoken, tmp_path):
    """What bits per byte divide by: Σ token_bytes over a document's ids (BOS and EOS included)
    is the UTF-8 size of its text, multi-byte characters split across tokens included."""
    tok = {
        "embedded": lambda: build(),
        "tiktoken": lambda: build(embedded_as_tiktoken, kind="tiktoken"),
        "huggingface": lambda: build(train_hf(tmp_path, ["<|begin_of_text|>", "<|end_of_text|>"])),
    }[which]()
    sizes = tok.token_bytes()
    assert len(sizes) == tok.get_vocab_size()
    assert sizes[tok.bos_id] == sizes[tok.eos_id] == sizes[tok.mask_id] == 0
    for text in TEXTS:
        ids = tok.encode(text, add_bos=True, add_eos=True)
        assert sum(sizes[i] for i in ids) == len(text.encode("utf-8")), (which, text)
