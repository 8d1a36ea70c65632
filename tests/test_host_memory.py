"""host_memory: glibc told to keep freed memory, once, unless the user tunes malloc."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from minigraph import host_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Trains the demo net on batches of 1024 and prints keep_freed_memory()'s answer and
# the minor page faults per step after warm-up. (At smaller batches glibc's own
# adaptive thresholds may keep every block of a step even untuned, depending on
# which kernels run: at 256 with the numpy kernels they do.)
SCRIPT = textwrap.dedent("""
    import resource
    from minigraph import host_memory
    from minigraph.examples.train_digits import build_net
    import numpy as np
    net, h = build_net(seed=0)
    rng = np.random.default_rng(0)
    feed = {"image": rng.standard_normal((1024, 1, 8, 8), dtype=np.float32),
            "label": rng.integers(0, 10, 1024)}
    for _ in range(10):
        net.train(feed=feed, fetch=[h["loss"]])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        net.train(feed=feed, fetch=[h["loss"]])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    from minigraph.kernels.cpu import conv_native
    print(host_memory.keep_freed_memory(), (after - before) / 50, conv_native.available())
""")


def run_script(**env):
    """(tuned, page faults per step) of SCRIPT in a fresh process with `env` and none of
    the caller's malloc or minigraph settings but its kernel cache; the native kernels
    must be on (with the numpy kernels glibc keeps every block of these steps even
    untuned)."""
    clean = {k: v for k, v in os.environ.items()
             if k == "MINIGRAPH_CACHE"
             or not (k.startswith(("MALLOC_", "MINIGRAPH_")) or k == "GLIBC_TUNABLES")}
    clean["MINIGRAPH_SPIN_US"] = "0"    # no watch, so never contended cores (pytest's
                                        # other workers): its steps would run on one thread
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    tuned, faults, native = out.split()
    assert native == "True", "the native kernels did not load in the script's process"
    return tuned == "True", float(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_steps_reuse_freed_memory():
    """After warm-up a training step touches almost no fresh pages. "Almost": where the
    step's small buffers land depends on the process's memory layout, and in some
    layouts (this test under pytest, not the same script run by hand) about four pages
    a step are fresh, in others none."""
    tuned, faults = run_script()
    assert tuned and faults < 16, faults


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_steps_fault_when_glibc_gives_memory_back():
    """The control: with glibc's initial thresholds held (128 KiB), each step maps and
    unmaps its large arrays and faults their pages in again (thousands of faults per
    step here). Untuned glibc is not a fixed control: its mmap threshold grows to the
    largest block freed, so whether it gives a step's blocks back depends on the order
    of the first frees (seen from 0 to 1,800 faults a step)."""
    tuned, faults = run_script(MALLOC_MMAP_THRESHOLD_="131072",
                               MALLOC_TRIM_THRESHOLD_="131072")
    assert not tuned and faults > 100, faults
    tuned, _ = run_script(MINIGRAPH_KEEP_FREED_MEMORY="0")
    assert not tuned


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])
def test_the_users_malloc_settings_win(env):
    tuned, _ = run_script(**env)
    assert not tuned


def test_runs_once(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_state", None)
    monkeypatch.setattr(host_memory, "_tune", lambda: calls.append(1) or True)
    assert host_memory.keep_freed_memory() and host_memory.keep_freed_memory()
    assert calls == [1]


def test_opt_out_and_non_glibc(monkeypatch):
    monkeypatch.setenv("MINIGRAPH_KEEP_FREED_MEMORY", "0")
    assert host_memory._tune() is False
    monkeypatch.delenv("MINIGRAPH_KEEP_FREED_MEMORY")
    for k in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert host_memory._tune() is False
