"""A fresh interpreter that loads relu_native from a given cache and runs it
(test_native.py, test_native_cache.py): a bad library can kill the process that
loads it, and a process loads a path only once. It prints "LOADED" or "NOT LOADED",
native.reason("relu_native"), then "KERNEL OK" once the kernel matched numpy."""
from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import numpy as np
from minigraph.kernels.cpu import native, relu_native
lib = native.library("relu_native")
print("LOADED" if lib is not None else "NOT LOADED", "|", native.reason("relu_native"))
if lib is not None:
    rng = np.random.default_rng(0)
    out = np.maximum(rng.standard_normal(1000).astype(np.float32), 0)
    dout = rng.standard_normal(1000).astype(np.float32)
    dx = np.full_like(dout, np.nan)
    assert relu_native.relu_grad(out, dout, dx)
    np.testing.assert_array_equal(dx, np.where(out > 0, dout, 0))
    print("KERNEL OK")
"""


def environment(cache, **env):
    """This process's environment with MINIGRAPH_CACHE=cache and `env`, native on."""
    full = {**os.environ, "MINIGRAPH_CACHE": str(cache), **env}
    full.pop("MINIGRAPH_NATIVE", None)
    return full


def run(cache, timeout=60, **env):
    """Run the probe to its end: (returncode, output)."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=environment(cache, **env), timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def start(cache, **env):
    """Start the probe (stdout and stderr in one pipe); the Popen."""
    return subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=environment(cache, **env))
