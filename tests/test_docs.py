"""The docs agree with the code and with each other: the demo's options and output
files, the install extras, links between pages, GPU status in one place, the quick
test subset."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from minigraph import cli

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def demo_parser():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["demo"]


def test_the_readme_lists_every_option_of_the_demo():
    """The README's demo options left out --profile and --level."""
    readme = (REPO / "README.md").read_text()
    listed = set(re.findall(r"`(--[a-z-]+)", readme[readme.index("Options (`minigraph demo"):
                                                    readme.index("Run the tests")]))
    options = {o for a in demo_parser()._actions for o in a.option_strings
               if o.startswith("--") and o != "--help"}
    assert listed == options


def test_the_help_of_out_names_every_file_the_demo_writes(tmp_path):
    """--out's help named net.svg and training.png; the demo also writes model/,
    model.onnx and profile.svg."""
    pytest.importorskip("sklearn")
    pytest.importorskip("onnx")
    from minigraph.examples import train_digits

    help_text = next(a.help for a in demo_parser()._actions if a.dest == "out")
    history = train_digits.train(epochs=1, out_dir=tmp_path, progress=False, profile=True)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["model", "model.onnx", "net.svg", "profile.svg", "training.png"], written
    assert {Path(f).name for f in history["files"]} == set(written)
    for name in written:
        assert (name + "/" if (tmp_path / name).is_dir() else name) in help_text, name


def test_every_extra_the_docs_name_exists():
    extras = set(metadata.metadata("minigraph").get_all("Provides-Extra"))
    named = set()
    for page in PAGES:
        text = page.read_text()
        named |= set(re.findall(r"minigraph\[(\w+)\]", text))
        named |= set(re.findall(r"'\.\[(\w+)\]'", text))
        named |= set(re.findall(r"`(\w+)` extra", text))
    assert named and named <= extras, named - extras
    readme = (REPO / "README.md").read_text()
    for extra in extras:                 # the README says what each extra is for
        assert f"`{extra}`" in readme, extra


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                slugs = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-")
                         for h in headings}
                assert anchor in slugs, f"{page.name}: {target}"


def test_gpu_status_is_stated_in_one_place():
    """README.md said every GPU test passed on an H200 while docs/distributed.md said
    none of the GPU side had run on a GPU."""
    status = re.compile(r"(?i)(status: checked|checked on one nvidia|none of the gpu side|"
                        r"has not (yet )?run on a (real )?gpu|(never|not yet) run on a gpu)")
    for page in PAGES:
        if page.name != "gpu.md":
            assert not status.search(page.read_text()), page.name
    gpu = (REPO / "docs" / "gpu.md").read_text()
    assert gpu.index("## Status") < gpu.index("## Set up")
    for name in ("README.md", "docs/distributed.md", "docs/gpu_kernels.md"):
        assert "gpu.md#status" in (REPO / name).read_text(), name


def test_the_quick_subset_names_test_modules():
    import conftest

    assert all((REPO / "tests" / f"{name}.py").exists() for name in conftest.QUICK)
    readme = (REPO / "README.md").read_text()
    assert "pytest -m quick" in readme and "under a minute" in readme


def test_the_pictures_import_nothing_from_the_net():
    """net.py, profile.py and the render modules imported each other in a circle; the
    Net now calls into minigraph.pictures, which never imports minigraph.net."""
    import ast

    for module in sorted((REPO / "minigraph" / "pictures").glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name != "minigraph.net" and not name.startswith(
                    ("minigraph.net.", "minigraph.passes", "minigraph.io.inference")), \
                    f"{module.name} imports {name}"


def test_layout_names_every_room_of_minigraph():
    layout = (REPO / "docs" / "layout.md").read_text()
    block = layout[layout.index("minigraph/                 the runtime"):layout.index("ops/ ")]
    for entry in sorted((REPO / "minigraph").iterdir()):
        if entry.name.startswith(("_", ".")) or entry.suffix not in (".py", ""):
            continue
        name = entry.name + ("/" if entry.is_dir() else "")
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", block, re.M), name


def _layout_tree():
    layout = (REPO / "docs" / "layout.md").read_text()
    return layout[layout.index("```\nminigraph/"):layout.index("```", layout.index("```\nminigraph/") + 3)]


@pytest.mark.parametrize("folder, start, end", [("kernels/cpu", "  cpu/ ", "  layout.py"),
                                                ("kernels/cuda", "  cuda/ ", "tests/ examples/")])
def test_layout_names_every_kernel_file(folder, start, end):
    """Each file of kernels/cpu and kernels/cuda is named in docs/layout.md's tree, or is
    covered by a rule the tree states: <family>.py beside ops/<family>.py, a launcher
    <name>.py beside its <name>.cu, any .cu (kernels/cuda/*.cu), a glob such as
    conv_im2col*.py, a native kernel's <name>.c + <name>.py named by its <name>."""
    import fnmatch

    tree = _layout_tree()
    block = tree[tree.index(start):tree.index(end)]
    names = set(re.findall(r"[\w*]+\.(?:py|c|h|cu|cuh)\b", block))
    families = {p.stem for p in (REPO / "ops").glob("*.py")}
    for entry in sorted((REPO / folder).iterdir()):
        if entry.name.startswith(("_", ".")) or entry.suffix not in (".py", ".c", ".h", ".cu",
                                                                      ".cuh"):
            continue
        if entry.suffix == ".py" and entry.stem in families:
            continue
        if folder.endswith("cuda") and (entry.suffix == ".cu" or
                                        entry.with_suffix(".cu").exists()):
            continue
        if entry.suffix in (".c", ".py") and re.search(rf"(?<![\w.]){entry.stem}(?![\w.])", block):
            continue
        assert any(fnmatch.fnmatch(entry.name, n) for n in names), \
            f"docs/layout.md does not name {folder}/{entry.name}"


def test_every_file_the_layout_names_exists():
    """A file named in docs/layout.md's tree is one of the house's files (a rename
    that leaves the tree behind fails here)."""
    import fnmatch

    files = {p.name for top in ("minigraph", "ops", "kernels") for p in (REPO / top).rglob("*")}
    for name in sorted(set(re.findall(r"[\w*]+\.(?:py|c|h|cu|cuh)\b", _layout_tree()))):
        assert fnmatch.filter(files, name), f"docs/layout.md names {name}, which does not exist"


def test_the_readmes_python_blocks_run(tmp_path, monkeypatch):
    """The README's python blocks run as written, one after the other in one namespace
    (the tour builds on itself), in a scratch folder; the distributed sketch, whose
    `...` stands for the layers, is left out."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M)
    runnable = [b for b in blocks if "mg.distributed.init()" not in b]
    assert len(runnable) == len(blocks) - 1 >= 6
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    for i, block in enumerate(runnable):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    assert {"net.svg", "checkpoint.npz", "model_dir", "model.onnx"} <= {
        p.name for p in tmp_path.iterdir()}
