import pytest

from toolchain.atomic import atomic_file


def test_a_finished_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "sub" / "data.bin"  # the folder is created
    with atomic_file(path) as tmp:
        assert tmp.parent == path.parent and not path.exists()  # nothing at the path while writing
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in path.parent.iterdir()] == ["data.bin"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_partial_one(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic_file(path) as tmp:
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt  # a user stopping the command mid-write
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["data.bin"]
