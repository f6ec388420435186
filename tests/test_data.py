"""Data pipeline: splits, shards, packing, exact resume, and error messages.

A byte-level tokenizer stub keeps these tests independent of the BPE assets
and makes every expected token computable by hand.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from muloco.data import corpus
from muloco.data import loader as loader_module
from muloco.data.corpus import DataError, JsonlSource, StdlibSource
from muloco.data.loader import PackedTextDataLoader
from muloco.data.sources import EmbeddedStdlib, HuggingFaceDataset, JsonlFiles, SftRows

BOS, EOS = 256, 257


class ByteTokenizer:
    """UTF-8 bytes as ids, with bos=256 and eos=257: the MulocoTokenizer interface."""

    bos_id, eos_id, mask_id = BOS, EOS, 258

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return [BOS] * add_bos + list(text.encode("utf-8")) + [EOS] * add_eos

    def encode_batch(self, texts, add_bos: bool = False, add_eos: bool = False):
        return [self.encode(t, add_bos, add_eos) for t in texts]

    def get_vocab_size(self) -> int:
        return 259


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture
def jsonl_dir(tmp_path: Path) -> Path:
    """Two files of distinct short documents."""
    data = tmp_path / "jsonl"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [f"alpha document {i}" for i in range(60)])
    write_jsonl(data / "b.jsonl", [f"beta doc {i}" for i in range(45)])
    return data


def all_jsonl_texts(directory: Path) -> set[str]:
    return {json.loads(line)["text"] for f in directory.glob("*.jsonl") for line in f.read_text().splitlines()}


SOURCES = {"stdlib": EmbeddedStdlib, "jsonl": JsonlFiles, "huggingface": HuggingFaceDataset, "sft": SftRows}
LOADER_FIELDS = {"split", "infinite", "seed", "next_token", "shuffle_documents"}


def loader_config(source: str = "stdlib", **kw) -> PackedTextDataLoader.Config:
    """A loader config: ``source`` names the source, the settings it reads go to it, the rest to the loader."""
    own = {k: kw.pop(k) for k in list(kw) if k not in LOADER_FIELDS}
    return PackedTextDataLoader.Config(source=SOURCES[source](**own), **kw)


def make_loader(*, world: int = 1, rank: int = 0, seq_len: int = 16, batch: int = 2, **cfg):
    config = loader_config(**cfg)
    return config.build(
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=ByteTokenizer(),
        seq_len=seq_len,
        local_batch_size=batch,
    )


def take(it, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x["input"].clone(), y.clone()) for x, y in (next(it) for _ in range(n))]


def shard_texts(source: corpus.DocumentSource, epoch: int = 0) -> list[str]:
    reader = source.open_shard(epoch, None)
    return list(reader.documents())


def jsonl_source(path: Path, *, split="train", rank=0, world=1, **kw) -> JsonlSource:
    args = dict(
        dataset_path=str(path),
        validation_path=None,
        split=split,
        text_field="text",
        val_percent=20.0,
        seed=0,
        shuffle=True,
        rank=rank,
        world=world,
    )
    args.update(kw)
    return JsonlSource(**args)


def stdlib_source(split="train", rank=0, world=1) -> StdlibSource:
    return StdlibSource(split=split, val_percent=5.0, seed=0, shuffle=True, rank=rank, world=world)


# ------------------------------------------------------------------- splits


def test_stdlib_split_is_deterministic_disjoint_and_complete():
    train, val = stdlib_source("train"), stdlib_source("validation")
    assert train.rel_paths == stdlib_source("train").rel_paths
    assert train.rel_paths and val.rel_paths
    assert not set(train.rel_paths) & set(val.rel_paths)
    everything = corpus.stdlib_split.stdlib_sources()
    assert sorted(train.rel_paths + val.rel_paths) == everything
    assert not any("site-packages" in p or "__pycache__" in p for p in everything)


def test_stdlib_file_list_skips_site_packages_and_caches_without_entering_them(tmp_path):
    """The corpus's file list is what a glob of every ``.py`` file gives, less those under
    site-packages and __pycache__, whose folders the walk never enters (an interpreter's own
    site-packages can be most of the tree); the real stdlib root lists the same both ways."""

    from muloco.data.split import EXCLUDED_DIRS, stdlib_root, stdlib_sources

    def by_glob(base: Path) -> list[str]:  # the definition, as the file list was first written
        rels = (p.relative_to(base) for p in base.rglob("*.py") if p.is_file())
        return sorted(r.as_posix() for r in rels if EXCLUDED_DIRS.isdisjoint(r.parts))

    for rel in (
        "a.py",
        "pkg/__init__.py",
        "pkg/sub/b.py",
        "pkg/notes.txt",
        "site-packages/c.py",
        "pkg/site-packages/d.py",
        "pkg/__pycache__/b.cpython-311.py",
        ".hidden/e.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    (tmp_path / "folder.py").mkdir()  # a folder, not a file
    (tmp_path / "linked").symlink_to(tmp_path / "pkg", target_is_directory=True)  # not followed
    (tmp_path / "link.py").symlink_to(tmp_path / "a.py")  # a file through a link: listed
    expected = [".hidden/e.py", "a.py", "link.py", "pkg/__init__.py", "pkg/sub/b.py"]
    assert stdlib_sources(tmp_path) == by_glob(tmp_path) == expected
    assert stdlib_sources() == by_glob(stdlib_root())


def test_jsonl_hash_split_is_deterministic_disjoint_and_complete(jsonl_dir):
    train = shard_texts(jsonl_source(jsonl_dir))
    val = shard_texts(jsonl_source(jsonl_dir, split="validation"))
    assert train == shard_texts(jsonl_source(jsonl_dir))
    assert train and val and not set(train) & set(val)
    assert set(train) | set(val) == all_jsonl_texts(jsonl_dir)


def test_jsonl_validation_path_reads_files_whole(tmp_path, jsonl_dir):
    held_out = write_jsonl(tmp_path / "held_out.jsonl", ["v1", "v2"])
    val = jsonl_source(jsonl_dir, split="validation", validation_path=str(held_out))
    train = jsonl_source(jsonl_dir, validation_path=str(held_out))
    assert sorted(shard_texts(val)) == ["v1", "v2"]
    assert set(shard_texts(train)) == all_jsonl_texts(jsonl_dir)


# ------------------------------------------------------------------- shards


@pytest.mark.parametrize("world", [2, 3])
def test_stdlib_shards_are_disjoint_and_cover_the_split(world):
    for epoch in (0, 1):
        shards = [stdlib_source(rank=r, world=world).shard_paths(epoch) for r in range(world)]
        flat = [p for s in shards for p in s]
        assert len(flat) == len(set(flat))
        assert sorted(flat) == stdlib_source().rel_paths
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize("world", [2, 3])
def test_jsonl_shards_are_disjoint_and_cover_the_split(jsonl_dir, world):
    shards = [shard_texts(jsonl_source(jsonl_dir, rank=r, world=world)) for r in range(world)]
    flat = [t for s in shards for t in s]
    assert len(flat) == len(set(flat))
    assert sorted(flat) == sorted(shard_texts(jsonl_source(jsonl_dir)))


def test_epochs_reorder_documents_but_keep_the_set():
    source = stdlib_source()
    first, second = source.shard_paths(0), source.shard_paths(1)
    assert first != second and sorted(first) == sorted(second)
    assert first == stdlib_source().shard_paths(0)


# ------------------------------------------------------------------ packing


def expected_stream(texts: list[str]) -> tuple[list[int], list[int]]:
    inputs, labels = [], []
    for t in texts:
        doc = ByteTokenizer().encode(t, add_bos=True, add_eos=True)
        inputs += doc[:-1]
        labels += doc[1:]
    return inputs, labels


def tiny_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    texts = ["ab", "cde", "", "fghij", "k", "lmnopqrstu", "vw", "xyz!"]
    return write_jsonl(tmp_path / "tiny.jsonl", texts), texts


def test_packing_shifts_labels_within_documents(tmp_path):
    path, texts = tiny_corpus(tmp_path)
    dl = make_loader(
        source="jsonl",
        dataset_path=str(path),
        val_percent=0.0,
        infinite=False,
        shuffle_documents=False,
        seq_len=5,
        batch=2,
    )
    batches = list(dl)
    assert all(set(x) == {"input"} for x, _ in batches)
    assert all(x["input"].shape[1] == 5 and x["input"].dtype == torch.long for x, _ in batches)
    assert [x["input"].shape[0] for x, _ in batches][:-1] == [2] * (len(batches) - 1)
    got_in = torch.cat([x["input"].flatten() for x, _ in batches]).tolist()
    got_lab = torch.cat([y.flatten() for _, y in batches]).tolist()
    want_in, want_lab = expected_stream(texts)
    usable = len(want_in) // 5 * 5
    assert got_in == want_in[:usable] and got_lab == want_lab[:usable]
    # A document's last label is eos and the next input is the next bos.
    for i in range(usable - 1):
        if got_lab[i] == EOS:
            assert got_in[i + 1] == BOS
        else:
            assert got_lab[i] == got_in[i + 1]
    assert BOS not in got_lab and EOS not in got_in


def test_infinite_reloops_the_same_documents(tmp_path):
    path, texts = tiny_corpus(tmp_path)
    dl = make_loader(
        source="jsonl",
        dataset_path=str(path),
        val_percent=0.0,
        shuffle_documents=False,
        seq_len=7,
        batch=3,
    )
    one_pass, _ = expected_stream(texts)
    n_batches = 3 * len(one_pass) // 21 + 1
    got = torch.cat([x.flatten() for x, _ in take(iter(dl), n_batches)]).tolist()
    assert got == (one_pass * 4)[: len(got)]
    assert dl.state_dict()["dp_rank_0"]["epoch"] >= 2


def test_finite_pass_ends(tmp_path):
    path, _ = tiny_corpus(tmp_path)
    dl = make_loader(source="jsonl", dataset_path=str(path), val_percent=0.0, infinite=False)
    assert len(list(dl)) > 0
    assert list(dl) == []


# ------------------------------------------------------------------- resume


def assert_resumes_exactly(build, n: int, m: int) -> dict:
    """N batches, save, M more; a rebuilt loader given the state yields the same M."""
    first = build()
    it = iter(first)
    take(it, n)
    state = first.state_dict()
    expected = take(it, m)
    second = build()
    second.load_state_dict(roundtrip(state))
    resumed = take(iter(second), m)
    for (x1, y1), (x2, y2) in zip(expected, resumed, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    return state


def roundtrip(state: dict) -> dict:
    """What a checkpoint gives back: the state through torch.save / weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_stdlib_resume_is_exact(monkeypatch):
    monkeypatch.setattr(loader_module, "DOCS_PER_TOKENIZE_CALL", 2)
    state = assert_resumes_exactly(lambda: make_loader(world=3, rank=1, seq_len=512, batch=4), n=7, m=9)
    assert set(state) == {"dp_rank_1", "world_size"}


def test_jsonl_resume_is_exact_across_files_and_epochs(jsonl_dir, monkeypatch):
    monkeypatch.setattr(loader_module, "DOCS_PER_TOKENIZE_CALL", 3)
    build = lambda: make_loader(  # noqa: E731
        world=2, rank=1, source="jsonl", dataset_path=str(jsonl_dir), seq_len=16, batch=2
    )
    for n in (1, 11, 23, 40):  # inside the first file, across files, into epoch 1
        assert_resumes_exactly(build, n=n, m=15)


def sorted_corpus(tmp_path: Path, books: int = 8, chapters: int = 40) -> Path:
    """One JSONL file sorted as a book export is: book 0's chapters, then book 1's, and so on."""
    return write_jsonl(
        tmp_path / "sorted.jsonl", [f"book{b} chapter{c:02d}" for b in range(books) for c in range(chapters)]
    )


def first_documents(source, epoch: int, n: int) -> list[str]:
    reader = source.open_shard(epoch, None)
    try:
        return [doc for doc, _ in zip(reader.documents(), range(n))]
    finally:
        reader.close()


def books_of(docs: list[str]) -> set[str]:
    return {d.split()[0] for d in docs}


def test_a_sorted_jsonl_file_is_read_in_a_new_order_each_epoch_and_resumes_mid_epoch(tmp_path):
    """A sorted file (8 books × 40 chapters, book by book): in stored order the first 16
    documents are all book 0; shuffled, they span most books, each epoch another order of the
    same documents, and a loader resumed mid-epoch yields the batches the uninterrupted one did."""
    path = sorted_corpus(tmp_path)
    source = lambda shuffle, rank=0, world=1: JsonlSource(  # noqa: E731
        dataset_path=str(path),
        validation_path=None,
        split="train",
        text_field="text",
        val_percent=5.0,
        seed=0,
        shuffle=shuffle,
        rank=rank,
        world=world,
    )
    assert books_of(first_documents(source(False), 0, 16)) == {"book0"}
    shuffled = first_documents(source(True), 0, 16)
    assert len(books_of(shuffled)) >= 5, shuffled
    every = first_documents(source(True), 0, 10_000)
    again = first_documents(source(True), 1, 10_000)
    assert every != again and sorted(every) == sorted(again) == sorted(first_documents(source(False), 0, 10_000))
    assert every == first_documents(source(True), 0, 10_000)  # the order is the seed's and the epoch's
    shards = [first_documents(source(True, rank, 3), 0, 10_000) for rank in range(3)]
    assert sorted(sum(shards, [])) == sorted(every) and shards[1] == every[1::3]  # round robin over the order
    build = lambda: make_loader(world=2, rank=1, source="jsonl", dataset_path=str(path), seq_len=16, batch=2)  # noqa: E731
    for n in (3, 40):  # mid-epoch, and into the next epoch
        assert_resumes_exactly(build, n=n, m=12)


def test_the_held_out_split_is_the_same_lines_in_either_order(tmp_path):
    path = sorted_corpus(tmp_path)
    held = {
        shuffle: sorted(
            first_documents(
                JsonlSource(
                    dataset_path=str(path),
                    validation_path=None,
                    split="validation",
                    text_field="text",
                    val_percent=10.0,
                    seed=3,
                    shuffle=shuffle,
                    rank=0,
                    world=1,
                ),
                0,
                10_000,
            )
        )
        for shuffle in (False, True)
    }
    assert held[True] == held[False] and 0 < len(held[True]) < 320


def test_the_line_index_is_built_once_rebuilt_when_the_file_changes_and_optional(tmp_path, monkeypatch):
    """One scan per file version: the cached index is read back (no second scan), a changed file
    gets a new one and the stale one goes, and an unwritable cache folder only costs the caching."""
    from muloco.data import line_index

    monkeypatch.setenv("MULOCO_CACHE_DIR", str(tmp_path / "cache"))
    line_index._offsets.cache_clear()
    corpus._held_out_lines.cache_clear()
    scans = []
    real_scan = line_index._scan
    monkeypatch.setattr(line_index, "_scan", lambda path: scans.append(path) or real_scan(path))
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n  \n{"text": "three"}\n')
    offsets = line_index.line_offsets(path)
    assert [line_index.start_of(o) for o in offsets] == [0, 16, 32, 35]
    assert [bool(o & line_index.BLANK) for o in offsets] == [False, False, True, False]
    line_index._offsets.cache_clear()  # a new process: the index comes from the cache folder
    assert np.array_equal(line_index.line_offsets(path), offsets) and len(scans) == 1
    cached = list((tmp_path / "cache" / "line-index").iterdir())
    assert len(cached) == 1 and oct(cached[0].stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    with open(path, "a") as f:
        f.write(json.dumps({"text": "four"}) + "\n")
    assert len(line_index.line_offsets(path)) == 5 and len(scans) == 2
    assert [p.name for p in (tmp_path / "cache" / "line-index").iterdir()] != [cached[0].name]
    assert len(list((tmp_path / "cache" / "line-index").iterdir())) == 1
    held = sorted(shard_texts(jsonl_source(path, split="validation", val_percent=50.0)))
    assert len(list((tmp_path / "cache" / "line-index").glob("*-held-*.npy"))) == 1  # the held-out lines, cached too
    line_index._offsets.cache_clear()
    corpus._held_out_lines.cache_clear()  # a new process: no line is hashed again
    with monkeypatch.context() as m:
        m.setattr(corpus, "jsonl_line_is_validation", lambda *a: pytest.fail("hashed a line again"))
        assert sorted(shard_texts(jsonl_source(path, split="validation", val_percent=50.0))) == held
    (tmp_path / "ro").write_text("a file where the cache folder would be")
    monkeypatch.setenv("MULOCO_CACHE_DIR", str(tmp_path / "ro"))
    line_index._offsets.cache_clear()
    assert len(line_index.line_offsets(path)) == 5 and len(scans) == 3


def _umask() -> int:
    from muloco.utils.atomic_file import umask

    return umask()


def test_many_files_few_open_handles_symlinks_split_by_their_own_name_and_old_positions_resume(tmp_path):
    """40 files read shuffled with at most ``OPEN_FILES`` open at once; a symlinked file holds out
    the lines its own name says in either order; a position written before the order was recorded
    resumes in the order it was read in (the files permuted per epoch); another seed is refused."""
    data = tmp_path / "many"
    data.mkdir()
    for i in range(40):
        write_jsonl(data / f"f{i:02d}.jsonl", [f"file{i} line{j}" for j in range(5)])
    src = jsonl_source(data, val_percent=0.0)
    reader = src.open_shard(0, None)
    most = max(len(reader._handles) for _ in reader.documents())
    assert most == corpus.OPEN_FILES and reader.position["doc_index"] == 200
    (tmp_path / "target.jsonl").write_text((data / "f00.jsonl").read_text())
    link = tmp_path / "linked"
    link.mkdir()
    (link / "alias.jsonl").symlink_to(tmp_path / "target.jsonl")
    held = [
        sorted(shard_texts(jsonl_source(link, split="validation", val_percent=40.0, shuffle=shuffle)))
        for shuffle in (False, True)
    ]
    assert held[0] == held[1] and held[0]
    old = corpus._JsonlReader(src, src.legacy_file_order(0), None, order=None)  # the reader before the change
    docs = old.documents()
    [next(docs) for _ in range(7)]
    saved = json.loads(json.dumps(old.position))
    assert "order" not in saved
    assert list(src.open_shard(0, saved).documents()) == list(docs)
    moved = dict(json.loads(json.dumps(reader.position)), doc_index=3)
    with pytest.raises(DataError, match="dataloader.seed 0, and this run has 200 with seed 5"):
        jsonl_source(data, val_percent=0.0, seed=5).open_shard(0, moved)


def test_a_position_read_in_the_other_order_is_refused_at_the_load(tmp_path):
    path = sorted_corpus(tmp_path)
    stored = make_loader(source="jsonl", dataset_path=str(path), shuffle_documents=False)
    take(iter(stored), 3)
    shuffled = make_loader(source="jsonl", dataset_path=str(path))
    with pytest.raises(DataError, match="stored order.*resume with --dataloader.no-shuffle-documents"):
        shuffled.load_state_dict(roundtrip(stored.state_dict()))


def test_resume_refuses_another_world_size(jsonl_dir):
    state = make_loader(world=2, source="jsonl", dataset_path=str(jsonl_dir)).state_dict()
    dl = make_loader(world=3, source="jsonl", dataset_path=str(jsonl_dir))
    with pytest.raises(DataError, match="2 data shards.*has 3"):
        dl.load_state_dict(state)


def test_state_dict_loads_with_weights_only(jsonl_dir):
    dl = make_loader(source="jsonl", dataset_path=str(jsonl_dir))
    take(iter(dl), 3)
    state = dl.state_dict()
    assert roundtrip(state) == state
    assert json.loads(state["dp_rank_0"]["position"])["doc_index"] > 0


def test_the_packing_buffer_travels_as_bytes_and_a_list_saved_before_still_resumes(monkeypatch):
    """The rest of the current document travels as int64 bytes (DCP walks a list token by token
    at every save); a state saved as lists of ints, as checkpoints before 2026-11-27 hold it,
    resumes to the same batches."""
    monkeypatch.setattr(loader_module, "DOCS_PER_TOKENIZE_CALL", 2)
    first = make_loader(seq_len=64, batch=4)
    it = iter(first)
    take(it, 3)
    state = first.state_dict()
    expected = take(it, 5)
    saved = state["dp_rank_0"]
    assert isinstance(saved["inputs"], bytes) and isinstance(saved["labels"], bytes) and saved["inputs"]
    tokens = {key: np.frombuffer(saved[key], "<i8", offset=1) for key in ("inputs", "labels")}  # after the mark
    as_lists = {**state, "dp_rank_0": {**saved, **{key: t.tolist() for key, t in tokens.items()}}}
    unmarked = {**state, "dp_rank_0": {**saved, **{key: t.tobytes() for key, t in tokens.items()}}}  # 2026-11-27/28
    for resumed_from in (state, as_lists, unmarked):
        second = make_loader(seq_len=64, batch=4)
        second.load_state_dict(roundtrip(resumed_from))
        for (x1, y1), (x2, y2) in zip(expected, take(iter(second), 5), strict=True):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_a_state_saved_with_an_empty_packing_buffer_loads_weights_only(tmp_path, monkeypatch):
    """A document that ends on a row's last token leaves the buffer empty; the saved state must
    still pass the weights-only load every checkpoint goes through (an empty ``bytes`` would not)."""
    monkeypatch.setattr(loader_module, "DOCS_PER_TOKENIZE_CALL", 1)
    write_jsonl(tmp_path / "d.jsonl", ["abcdefghijklmn"] * 6)  # 16 tokens a document with BOS and EOS: rows of 15
    dl = make_loader(source="jsonl", dataset_path=str(tmp_path), val_percent=0.0, seq_len=15, batch=1)
    it = iter(dl)
    take(it, 1)
    state = dl.state_dict()
    assert len(state["dp_rank_0"]["labels"]) == 1  # the mark alone: nothing left of the document
    expected = take(it, 3)
    again = make_loader(source="jsonl", dataset_path=str(tmp_path), val_percent=0.0, seq_len=15, batch=1)
    again.load_state_dict(roundtrip(state))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, take(iter(again), 3), strict=True))


def test_resume_through_distributed_checkpoint(hf_dir, tmp_path, monkeypatch):
    """DCP fills only the keys a fresh loader's state_dict already has."""
    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(loader_module, "DOCS_PER_TOKENIZE_CALL", 2)
    first = hf_loader(hf_dir, seq_len=8, batch=2)
    it = iter(first)
    take(it, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process, no process group
        dcp.save({"dataloader": first}, checkpoint_id=str(tmp_path / "ckpt"))
        second = hf_loader(hf_dir, seq_len=8, batch=2)
        dcp.load({"dataloader": second}, checkpoint_id=str(tmp_path / "ckpt"))
    for (x1, y1), (x2, y2) in zip(take(it, 30), take(iter(second), 30), strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


# ----------------------------------------------------------------- errors


def test_jsonl_bad_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken\n')
    dl = make_loader(source="jsonl", dataset_path=str(path), val_percent=0.0)
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a JSON object"):
        list(iter(dl))


def test_jsonl_missing_field_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"body": "oops"}\n')
    dl = make_loader(source="jsonl", dataset_path=str(path), val_percent=0.0)
    with pytest.raises(DataError, match=r"bad\.jsonl:3: no string field 'text'.*text_field"):
        list(iter(dl))


@pytest.mark.parametrize("path", [None, "/nonexistent/data-*.jsonl"])
def test_missing_jsonl_path_names_the_config_key(path):
    with pytest.raises(DataError, match=r"dataloader\.source\.dataset_path"):
        make_loader(source="jsonl", dataset_path=path)


def test_unknown_source_and_split_are_rejected(jsonl_dir):
    from muloco.config.cli import parse_args
    from muloco.config.loader import ConfigError

    with pytest.raises(
        ConfigError, match=r"--dataloader\.source must be one of stdlib, jsonl, huggingface, sft; got 'parquet'"
    ):
        parse_args(["--config", "ddp/adamw", "--dataloader.source", "parquet"])
    with pytest.raises(DataError, match=r"dataloader\.split='test'.*train"):
        make_loader(split="test")


def test_empty_jsonl_corpus_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match="no documents"):
        next(iter(make_loader(source="jsonl", dataset_path=str(path))))


# ------------------------------------------------------------ huggingface


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    data = tmp_path / "hf"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [f"train example number {i}" for i in range(40)])
    write_jsonl(data / "validation.jsonl", [f"held out {i}" for i in range(6)])
    return data


def hf_loader(path: Path, **kw):
    return make_loader(source="huggingface", dataset_path=str(path), **kw)


def hf_texts(path: Path, split: str, rank: int = 0, world: int = 1, **kw) -> list[str]:
    source = hf_loader(path, split=split, world=world, rank=rank, **kw).source
    return shard_texts(source)


def test_huggingface_reads_local_splits_and_shards(hf_dir):
    assert hf_texts(hf_dir, "validation", shuffle_documents=False) == [f"held out {i}" for i in range(6)]
    assert sorted(hf_texts(hf_dir, "validation")) == [f"held out {i}" for i in range(6)]
    for world in (2, 3):
        flat = [t for r in range(world) for t in hf_texts(hf_dir, "train", r, world)]
        assert sorted(flat) == sorted(f"train example number {i}" for i in range(40))


def test_a_sorted_huggingface_dataset_is_drawn_through_a_seeded_buffer_each_epoch_anew(tmp_path):
    """A window shuffle: with a buffer of 8 the first documents are no longer the first 8 in order,
    each epoch draws anew, the same seed draws the same, and the buffer size 0 (or no shuffling)
    keeps the dataset's order; the held-out documents are the same in any order."""
    data = tmp_path / "sorted_hf"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [f"doc{i:03d}" for i in range(100)])
    source = lambda **kw: make_loader(source="huggingface", dataset_path=str(data), split="train", **kw).source  # noqa: E731
    stored = shard_texts(source(shuffle_buffer=0))  # the train side of the hash split, in the dataset's order
    assert stored == sorted(stored) and len(stored) > 80
    first = shard_texts(source(shuffle_buffer=8))
    assert sorted(first) == stored and first[:8] != stored[:8] and first == shard_texts(source(shuffle_buffer=8))
    assert shard_texts(source(shuffle_buffer=8), epoch=1) != first
    assert max(int(t[3:]) for t in first[:10]) < 20  # a window: the first ten come from near the start
    assert shard_texts(source(shuffle_buffer=0)) == stored == shard_texts(source(shuffle_documents=False))
    assert "shuffled through a buffer of 8 (seed 0)" in source(shuffle_buffer=8).describe()
    stored_state = make_loader(source="huggingface", dataset_path=str(data), shuffle_buffer=0)
    take(iter(stored_state), 2)
    with pytest.raises(DataError, match="read in the dataset's order.*shuffle_buffer 1000"):
        make_loader(source="huggingface", dataset_path=str(data)).load_state_dict(roundtrip(stored_state.state_dict()))


def test_huggingface_without_validation_split_hashes_text(tmp_path):
    data = tmp_path / "hf_train_only"
    data.mkdir()
    texts = [f"only train {i}" for i in range(60)]
    write_jsonl(data / "train.jsonl", texts)
    train = hf_texts(data, "train", val_percent=20.0)
    val = hf_loader(data, split="validation", val_percent=20.0)
    held_out = shard_texts(val.source)
    assert held_out and not set(held_out) & set(train)
    assert sorted(held_out + train) == sorted(texts)
    assert "hash" in val.describe()


@pytest.mark.parametrize("world,rank", [(1, 0), (3, 2)])
def test_huggingface_resume_is_exact(hf_dir, monkeypatch, world, rank):
    monkeypatch.setattr(loader_module, "DOCS_PER_TOKENIZE_CALL", 2)
    for buffer in (4, 1000):  # drawing from a full buffer as the stream goes; the whole shard buffered, drained
        build = lambda: hf_loader(hf_dir, world=world, rank=rank, seq_len=8, batch=2, shuffle_buffer=buffer)  # noqa: E731
        for n in (5, 60):  # the first epoch, a later one
            state = assert_resumes_exactly(build, n=n, m=40)
            assert isinstance(json.loads(state[f"dp_rank_{rank}"]["position"])["hf_state"], dict)
        assert state[f"dp_rank_{rank}"]["epoch"] > 0


def test_huggingface_missing_path_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"dataloader\.source\.dataset_path"):
        hf_loader(tmp_path / "absent")
    with pytest.raises(DataError, match=r"dataloader\.source\.dataset_path"):
        make_loader(source="huggingface")


# --------------------------------------------------------------- preflight


def test_preflight_reads_only_up_to_the_first_document(tmp_path):
    """A bad line after the first document of both splits is found by the loader, not
    by preflight, which must not read whole large files."""
    path = write_jsonl(tmp_path / "data.jsonl", [f"doc {i}" for i in range(30)])
    with path.open("a") as f:
        f.write("{broken\n")
    for split in ("train", "validation"):
        loader_module.check_readable(loader_config("jsonl", dataset_path=str(path), split=split, val_percent=20.0))


def test_preflight_parses_every_line_before_the_first_document(tmp_path):
    """The validation split's first document comes after a bad train-side line: reported."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{broken\n' + "".join('{"text": "x"}\n' for _ in range(30)))
    config = loader_config("jsonl", dataset_path=str(path), split="validation")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a JSON object"):
        loader_module.check_readable(config)


def test_preflight_names_the_empty_split_and_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "few.jsonl", [f"doc {i}" for i in range(5)])  # none held out at 5%
    loader_module.check_readable(loader_config("jsonl", dataset_path=str(path)))
    config = loader_config("jsonl", dataset_path=str(path), split="validation")
    with pytest.raises(DataError, match=r"no document in its validation split.*val_percent.*validator\.no-enable"):
        loader_module.check_readable(config)


def test_preflight_reads_a_local_huggingface_dataset(hf_dir):
    for split in ("train", "validation"):
        loader_module.check_readable(loader_config("huggingface", dataset_path=str(hf_dir), split=split))


# ------------------------------------------------------------ integration


def test_builds_with_the_trainer_and_validator_kwargs():
    config = PackedTextDataLoader.Config(split="validation")
    dl = replace(config, infinite=False).build(
        dp_world_size=2,
        dp_rank=0,
        tokenizer=ByteTokenizer(),
        seq_len=32,
        local_batch_size=2,
        snapshot_every_n_steps=None,
    )
    line = dl.describe()
    assert "\n" not in line and "shard 0/2" in line and "split=validation" in line
    x, y = next(iter(dl))
    assert x["input"].shape == y.shape == (2, 32)


def test_real_tokenizer_packs_stdlib():
    tokenizer_module = pytest.importorskip("muloco.data.tokenizer")
    tok = tokenizer_module.MulocoTokenizer(tokenizer_module.MulocoTokenizer.Config())
    dl = PackedTextDataLoader.Config().build(dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=128, local_batch_size=2)
    x, y = next(iter(dl))
    assert x["input"].shape == y.shape == (2, 128)
    assert x["input"][0, 0].item() == tok.bos_id
    assert int(x["input"].max()) < tok.get_vocab_size()
    inputs, labels = x["input"], y
    ends = labels[:, :-1] == tok.eos_id
    assert torch.equal(inputs[:, 1:][~ends], labels[:, :-1][~ends])
    assert (inputs[:, 1:][ends] == tok.bos_id).all()
