"""make_dirs/remove_dirs: a failed or finished run removes exactly the folders it made."""

import os

import pytest

from muloco.utils.created_dirs import make_dirs, missing_dirs, remove_dirs


def test_missing_dirs_are_listed_deepest_first(tmp_path):
    target = tmp_path / "a" / "b"
    assert missing_dirs(target) == [str(target), str(tmp_path / "a")]
    assert missing_dirs(tmp_path) == []


def test_made_dirs_are_removed_but_not_a_filled_one_nor_an_old_one(tmp_path):
    created = make_dirs(tmp_path / "a" / "b" / "c")
    assert created == [str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(tmp_path / "a" / "b" / "c")]
    (tmp_path / "a" / "keep.txt").write_text("someone else's")
    remove_dirs(created)
    assert os.listdir(tmp_path) == ["a"] and os.listdir(tmp_path / "a") == ["keep.txt"]


def test_a_failed_make_dirs_removes_what_it_made_before_failing(tmp_path):
    too_long = "x" * 300  # the parent folder is made, then this name fails (ENAMETOOLONG)
    with pytest.raises(OSError):
        make_dirs(tmp_path / "new" / too_long)
    assert os.listdir(tmp_path) == []


def test_a_file_in_the_way_is_an_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        make_dirs(tmp_path / "file")
    with pytest.raises(NotADirectoryError):
        make_dirs(tmp_path / "file" / "sub")
    assert os.listdir(tmp_path) == ["file"]


def test_a_folder_a_peer_removed_between_two_looks_is_not_taken_for_a_file(tmp_path, monkeypatch):
    """Ranks of a group probe one new dump folder at once: the folder one of them saw may be
    gone (the other's probe removed it) when it checks it is a folder. That is looked at again,
    not reported as 'is a file' (it was, once, in CI)."""
    from muloco import compat

    compat.apply()
    from muloco.config import checks

    target = tmp_path / "run"
    looks = []

    def first_look_sees_a_peers_folder(path):
        looks.append(path)
        return [] if len(looks) == 1 else missing_dirs(path)

    monkeypatch.setattr(checks, "missing_dirs", first_look_sees_a_peers_folder)
    checks.check_dump_folder(str(target))
    assert len(looks) >= 2 and not target.exists()
