"""Packaging: ops/, kernels/ and examples/ live inside the `minigraph` namespace,
a built wheel holds them there (and nothing top-level), and the README's code runs."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("minigraph.ops", "minigraph.kernels", "minigraph.examples")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def test_subpackages_import_from_the_installed_package():
    import minigraph
    from minigraph.schema import registered_ops

    for name in SUBPACKAGES:
        module = importlib.import_module(name)
        assert module.__name__ == name
    importlib.import_module("minigraph.ops.batch_norm")
    assert {"batch_norm", "conv2d", "momentum", "sgd"} <= set(registered_ops())
    assert Path(minigraph.__file__).parent.name == "minigraph"


def test_no_top_level_ops_kernels_or_examples_outside_the_repo(tmp_path):
    code = ("import importlib.util as u, minigraph.ops, minigraph.kernels\n"
            "print([n for n in ('ops', 'kernels', 'examples') if u.find_spec(n)])")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def copy_sources(dst):
    """The files a build needs, without caches, build output or version control."""
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                    ".venv", "venv", ".pytest_cache", ".ruff_cache",
                                    "demo_out", "tests", "benchmarks", "*.so", "*.ptx")
    shutil.copytree(REPO, dst, ignore=ignore)
    return dst


def can_build_offline():
    """Whether this environment's setuptools can build the wheel by itself: at least
    the version pyproject.toml's build-system asks for (77 and later have bdist_wheel
    built in and read the license as an SPDX string)."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    wanted = re.search(r'"setuptools>=(\d+)"', (REPO / "pyproject.toml").read_text())
    return int(re.findall(r"\d+", version)[0]) >= int(wanted.group(1))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built from a copy of the sources (pip wheel --no-deps)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = copy_sources(tmp / "src")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"),
           str(src)]
    if can_build_offline():
        cmd.insert(4, "--no-build-isolation")     # no index needed
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = (tmp / "dist").glob("minigraph-*.whl")
    return whl


def test_the_wheel_maps_ops_kernels_and_examples_into_minigraph(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"minigraph", next(n for n in tops if n.endswith(".dist-info"))}
    for module in sorted((REPO / "ops").glob("*.py")):
        assert f"minigraph/ops/{module.name}" in names
    for module in sorted((REPO / "minigraph").rglob("*.py")):   # every subpackage listed
        assert module.relative_to(REPO).as_posix() in names, module
    sources = (sorted((REPO / "kernels").rglob("*.cu*")) + sorted((REPO / "kernels").rglob("*.c"))
               + sorted((REPO / "kernels").rglob("*.h")))
    assert any(source.suffix == ".c" for source in sources)
    for source in sources + sorted((REPO / "kernels").rglob("*.py")):
        assert f"minigraph/{source.relative_to(REPO).as_posix()}" in names, source
    assert "minigraph/kernels/__init__.py" in names
    assert "minigraph/examples/train_digits.py" in names
    assert "minigraph/cli.py" in names and "minigraph/pictures/render.py" in names
    assert "minigraph/io/checkpoint.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "minigraph = minigraph.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_a_regular_install_of_the_wheel_works_outside_the_repo(wheel, tmp_path):
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-index", "--target", str(site), str(wheel)],
                         capture_output=True, text=True, timeout=300, env=clean_env())
    assert res.returncode == 0, res.stdout + res.stderr
    code = ("import minigraph as mg, minigraph.ops, minigraph.kernels, importlib.util as u\n"
            "from minigraph.examples.train_digits import build_net\n"
            "net, h = build_net(mg.CPUPlace(), seed=0)\n"
            "import numpy as np\n"
            "(p,) = net.infer(feed={'image': np.zeros((2, 1, 8, 8), 'float32')},"
            " fetch=[h['logits']])\n"
            "from minigraph.kernels.cpu import conv_native\n"
            "print(mg.__file__, mg.ops.__file__, mg.kernels.__file__, p.shape,"
            " [n for n in ('ops', 'kernels') if u.find_spec(n)], conv_native.available())\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env=clean_env(PYTHONPATH=str(site),
                                                               MINIGRAPH_CACHE=str(tmp_path / "c")))
    assert res.returncode == 0, res.stderr
    mg_file, ops_file, kernels_file, *rest = res.stdout.split()
    assert Path(mg_file).parent == site / "minigraph"
    assert Path(ops_file).parent == site / "minigraph" / "ops"
    assert Path(kernels_file).parent == site / "minigraph" / "kernels"
    from minigraph.kernels.cpu import conv_native  # the installed source builds as the repo's
    assert " ".join(rest) == f"(2, 10) [] {conv_native.available()}"


def readme_python_blocks():
    """The python blocks of the README's tour (the GPU and Distributed sections
    after it hold sketches that need GPUs or several processes)."""
    text = (REPO / "README.md").read_text().split("\n## GPU")[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_code_runs(tmp_path, monkeypatch):
    blocks = readme_python_blocks()
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert (tmp_path / "net.svg").exists() and (tmp_path / "full.svg").exists()
    assert (tmp_path / "checkpoint.npz").exists()
