"""Atomic writes (minigraph/files.py): through symlinks to their target, never over a
device, FIFO or folder, and no temporary file left behind, even by a killed save."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from minigraph.io.files import atomic_write


def write(data):
    return lambda f: f.write(data)


def test_a_symlink_is_written_through_to_its_target(tmp_path):
    """`latest.npz -> run3/ck.npz` stays a link and run3/ck.npz gets the data."""
    (tmp_path / "run3").mkdir()
    target = tmp_path / "run3" / "ck.npz"
    target.write_bytes(b"old")
    target.chmod(0o640)
    link = tmp_path / "latest.npz"
    link.symlink_to("run3/ck.npz")
    assert atomic_write(link, write(b"new")) == link
    assert link.is_symlink() and os.readlink(link) == "run3/ck.npz"
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in (tmp_path / "run3").iterdir()) == ["ck.npz"]


def test_a_chain_of_symlinks_and_a_dangling_one(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("c")            # c does not exist yet
    atomic_write(tmp_path / "a", write(b"data"))
    assert (tmp_path / "c").read_bytes() == b"data"
    assert (tmp_path / "a").is_symlink() and (tmp_path / "b").is_symlink()


def test_a_symlink_loop_is_a_clear_error(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(OSError) as err:
        atomic_write(tmp_path / "a", write(b"data"))
    assert str(tmp_path / "a") in str(err.value)


def test_a_fifo_is_refused_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file") as err:
        atomic_write(fifo, write(b"data"))
    assert str(fifo) in str(err.value)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
    link = tmp_path / "to-pipe"
    link.symlink_to("pipe")
    with pytest.raises(OSError, match="not a regular file"):
        atomic_write(link, write(b"data"))


def test_a_folder_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError):
        atomic_write(tmp_path, write(b"data"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a device node")
def test_a_device_node_is_refused_not_replaced(tmp_path):
    """Run as root, saving to /dev/full replaced the device node with a file."""
    node = tmp_path / "full"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    with pytest.raises(OSError, match="not a regular file"):
        atomic_write(node, write(b"data"))
    assert stat.S_ISCHR(os.lstat(node).st_mode)


KILLED_SAVE = """
import os, sys, signal
from minigraph.io.files import atomic_write
def write(f):
    f.write(b"partial")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
atomic_write(sys.argv[1], write)
"""


def test_a_killed_saves_temporary_file_is_removed_by_the_next_save(tmp_path):
    target = tmp_path / "ck.npz"
    done = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(target)])
    assert done.returncode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".ck.npz.")     # what a kill leaves
    other = tmp_path / ".other.npz.tmp"
    other.write_bytes(b"not ours")
    atomic_write(target, write(b"whole"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.npz.tmp", "ck.npz"]
    assert target.read_bytes() == b"whole"


def test_a_live_saves_temporary_file_is_left_alone(tmp_path):
    """Another process saving the same path right now keeps its temporary file."""
    target = tmp_path / "ck.npz"
    seen = []

    def write_while_other_saves(f):
        seen.extend(p.name for p in tmp_path.iterdir())
        atomic_write(target, write(b"other"))   # a second save beside this one
        f.write(b"mine")

    atomic_write(target, write_while_other_saves)
    assert target.read_bytes() == b"mine"
    assert [p.name for p in tmp_path.iterdir()] == ["ck.npz"]
