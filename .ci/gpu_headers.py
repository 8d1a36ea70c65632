"""Fetch the C headers of cuBLAS and cuDNN (no libraries) for the test that checks
minigraph's ctypes declarations against them (tests/gpu/test_library_headers.py).

    python .ci/gpu_headers.py DIR

Downloads NVIDIA's wheels without installing them (pip download --no-deps, about
1 GB in all) into a temporary folder, copies only their include/*.h into DIR, and
deletes the wheels. Point MINIGRAPH_GPU_HEADERS at DIR. The wheels: WHEELS below,
the CUDA 13 line the `gpu` extra installs.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile
import time
import zipfile

WHEELS = ("nvidia-cublas>=13,<14", "nvidia-cudnn-cu13>=9,<10")


def main(out):
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                        *WHEELS], check=True)
        count = 0
        for wheel in sorted(pathlib.Path(tmp).glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if "/include/" in name and name.endswith(".h"):
                        (out / pathlib.Path(name).name).write_bytes(z.read(name))
                        count += 1
            print(f"{wheel.name}: headers taken")
    print(f"{count} headers in {out} ({time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python .ci/gpu_headers.py DIR")
    main(sys.argv[1])
