"""The native kernels' cache takes builds in turn (kernels/cpu/native_cache.py's
build_turn): processes started together on an empty cache build a library once and
the others load it; a turn held past the build limit is waited for no longer; the
turn leaves no file behind. (The cache's other checks: test_native.py.)"""
from __future__ import annotations

import re
import shutil
import time

import native_probe
import pytest

from minigraph.kernels.cpu import native_cache

CC = shutil.which("gcc") or shutil.which("cc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler here")


def output_of(probe, timeout):
    """The probe's output once it has ended; killed (and the test failed) after
    `timeout` seconds."""
    try:
        return probe.communicate(timeout=timeout)[0]
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()


def logging_compiler(tmp_path):
    """A $CC that writes each command line it is given to a log, then runs the real
    compiler; (its path, the log's path)."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{CC}" "$@"\n')
    cc.chmod(0o755)
    return cc, log


def compiled_libraries(log):
    """The libraries the logged compiler built, one name per build, in order (loading
    relu_native also builds blas_pool, the BLAS thread callback)."""
    return [re.search(r"/\.([a-z_]+)-[0-9a-f]+\.so\.", line).group(1)
            for line in log.read_text().splitlines() if "--version" not in line]


def test_processes_started_together_build_a_library_once(tmp_path):
    cc, log = logging_compiler(tmp_path)
    cache = tmp_path / "cache"
    probes = [native_probe.start(cache, CC=str(cc)) for _ in range(3)]
    try:
        outputs = [output_of(p, 120) for p in probes]
    finally:
        for p in probes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(probes, outputs):
        assert p.returncode == 0 and "KERNEL OK" in out, out
    built = compiled_libraries(log)
    assert "relu_native" in built and len(built) == len(set(built)), built
    assert len(list(cache.glob("relu_native-*.so"))) == 1


def test_a_turn_held_past_the_build_limit_is_not_waited_for_longer(tmp_path):
    """A holder that never lets go (a stuck process) costs a waiting process the build
    limit, then it builds on its own."""
    cc, log = logging_compiler(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    with native_cache.build_turn(cache, 1) as waited:
        assert waited < 1
        start = time.monotonic()
        probe = native_probe.start(cache, CC=str(cc), MINIGRAPH_NATIVE_BUILD_TIMEOUT="3")
        out = output_of(probe, 60)
        took = time.monotonic() - start
    assert probe.returncode == 0 and "KERNEL OK" in out, out
    built = compiled_libraries(log)
    assert "relu_native" in built and len(built) == len(set(built)), built
    assert 3 * len(built) <= took < 60, took       # each library waited 3 s, no more


def test_the_turn_is_one_holders_at_a_time_and_leaves_no_file(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    with native_cache.build_turn(directory, 1) as first:
        with native_cache.build_turn(directory, 0.2) as second:
            assert first < 0.2 <= second < 2    # a second descriptor waits, then gives up
    with native_cache.build_turn(directory, 1) as third:
        assert third < 0.2                      # released when the first block ended
    assert list(directory.iterdir()) == []


def test_a_file_system_without_locks_builds_without_turns(tmp_path, monkeypatch):
    import errno
    import fcntl

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    with native_cache.build_turn(directory, 5) as waited:
        assert waited < 1
    with native_cache.build_turn(tmp_path / "missing", 5) as waited:
        assert waited == 0.0
