"""make_dirs/remove_dirs: a failed or finished run removes exactly the folders it made."""

import os

import pytest

from muloco.created_dirs import make_dirs, missing_dirs, remove_dirs


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
