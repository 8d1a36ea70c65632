"""minigraph's ctypes declarations of cuBLAS and cuDNN against the libraries' own headers
(as test_kernel_build.py checks PTX parameters against the launchers): every declared
function's result and parameter types, parameter by parameter, as the prototype in
cublas_api.h / cudnn_*.h writes them; every C type's size as ctypes passes it (a handle
or descriptor typedef'd as a pointer, an enum as an int); every enum value used; the
layout of cuDNN's algorithm-performance structs.

The headers come from NVIDIA's wheels: MINIGRAPH_GPU_HEADERS (a folder of .h files; CI
fills one with .ci/gpu_headers.py), else the installed nvidia-cublas / -cu12 and
nvidia-cudnn-cu13 / -cu12 wheels. Without any, the test fails under CI (CI=true) and
skips elsewhere, naming the script that fetches them."""
from __future__ import annotations

import ctypes
import os
import pathlib
import re

import pytest

from minigraph.kernels.cuda import cublas, cudnn_api, libraries

INCLUDES = ("nvidia/cu13/include", "nvidia/cublas/include", "nvidia/cudnn/include")
BUILTIN = {"int": 4, "const int": 4, "double": 8, "float": 4, "size_t": 8, "int64_t": 8,
           "long long int": 8, "cudaStream_t": 8, "cudaDataType": 4, "void": None}


def header_sets():
    """{label: {file name: text}} of every header folder found (see the module doc)."""
    folders = []
    if os.environ.get("MINIGRAPH_GPU_HEADERS"):
        folders.append(pathlib.Path(os.environ["MINIGRAPH_GPU_HEADERS"]))
    for base in libraries.site_dirs():
        folders += [pathlib.Path(base) / inc for inc in INCLUDES]
    texts = {}
    for folder in folders:
        for h in sorted(folder.glob("*.h")) if folder.is_dir() else ():
            texts.setdefault(h.name, strip_comments(h.read_text(errors="replace")))
    return texts


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


HEADERS = header_sets()
ALL = "\n".join(HEADERS.values())
HAVE = "cublas_api.h" in HEADERS and "cudnn_cnn.h" in HEADERS
if not HAVE and os.environ.get("CI"):
    pytestmark = []                  # under CI the headers must be there: the tests fail
else:
    pytestmark = pytest.mark.skipif(not HAVE, reason="no cuBLAS / cuDNN headers (python "
                                    ".ci/gpu_headers.py DIR; MINIGRAPH_GPU_HEADERS=DIR)")


def normal(c_type):
    """A C type as one spelling: single spaces, '*' against the name before it."""
    return re.sub(r"\s*\*\s*", "*", " ".join(c_type.split())).strip()


def parameter_type(param):
    """The type of one C parameter declaration (its name dropped)."""
    param = normal(param.replace("[]", "*"))
    if param in ("void", ""):
        return None
    match = re.match(r"(.*?[\s*])(\w+)$", param)
    return normal(match.group(1)) if match else param


def prototype(name):
    """(result type, [parameter types]) of function `name` as the headers declare it
    (the result: the words between the previous declaration's end and the calling
    convention, upper-case macros such as CUDNN_DEPRECATED left out)."""
    found = re.search(r"\b(?:CUBLASWINAPI|CUDNNWINAPI)\s+" + name + r"\s*\(([^;{)]*)\)\s*;", ALL)
    assert found, f"{name}: no prototype in the headers"
    start = found.start()
    begin = max(ALL.rfind(c, 0, start) for c in (";", "}", "{", "\n#", ")"))
    words = [w for w in ALL[begin + 1:start].split() if not re.fullmatch(r"[A-Z0-9_]+", w)
             and not w.startswith("#")]
    params = [parameter_type(p) for p in found.group(1).split(",")]
    return normal(" ".join(words)), [p for p in params if p is not None]


def test_the_headers_are_there():
    assert HAVE, "run python .ci/gpu_headers.py DIR and set MINIGRAPH_GPU_HEADERS=DIR"


@pytest.mark.parametrize("module", [cublas, cudnn_api], ids=["cublas", "cudnn"])
def test_every_declared_function_matches_its_prototype(module):
    for name, (result, params) in module.PROTOTYPES.items():
        want_result, want_params = prototype(name)
        assert normal(result) == want_result, \
            f"{name}: result {result!r}, the header says {want_result!r}"
        assert [normal(p) for p in params] == want_params, \
            f"{name}: parameters {params}, the header says {want_params}"


def c_size(c_type):
    """The size in bytes of a C type as the headers define it (None for void)."""
    c_type = normal(c_type)
    if c_type.endswith("*"):
        return ctypes.sizeof(ctypes.c_void_p)
    if c_type in BUILTIN:
        return BUILTIN[c_type]
    bare = c_type.removeprefix("const ")
    if re.search(r"typedef\s+struct\s+\w+\s*\*\s*" + bare + r"\b[\w\s]*;", ALL):
        return ctypes.sizeof(ctypes.c_void_p)
    if re.search(r"typedef\s+enum\s*\w*\s*\{[^}]*\}\s*" + bare + r"\b", ALL):
        return 4
    raise AssertionError(f"C type {c_type!r}: not a pointer, enum or builtin in the headers")


@pytest.mark.parametrize("module", [cublas, cudnn_api], ids=["cublas", "cudnn"])
def test_every_c_type_has_its_size_in_ctypes(module):
    used = {t for result, params in module.PROTOTYPES.values() for t in [result, *params]}
    for c_type in sorted(used):
        size = c_size(c_type)
        have = module.C_TYPES[c_type]
        if c_type == "const char*":
            assert have is ctypes.c_char_p
            continue
        assert ctypes.sizeof(have) == size, f"{c_type}: ctypes {have} of {ctypes.sizeof(have)} " \
                                            f"bytes, the header's is {size}"


@pytest.mark.parametrize("module", [cublas, cudnn_api], ids=["cublas", "cudnn"])
def test_every_enum_value_matches(module):
    for name, value in module.ENUMS.items():
        found = re.search(r"\b" + name + r"(?:\s+[A-Z_]+)?\s*=\s*(-?\w+)", ALL) or \
            re.search(r"#define\s+" + name + r"\s+\(?(-?\w+)", ALL)
        assert found, f"{name}: not in the headers"
        assert int(found.group(1), 0) == value, f"{name} = {found.group(1)}, minigraph has {value}"


def test_the_algorithm_perf_structs_match():
    text = HEADERS["cudnn_cnn.h"]
    sizes = {"int": 4, "float": 4, "size_t": 8}
    for struct in cudnn_api.PERF_STRUCTS:
        body = re.search(r"typedef\s+struct\s+\w+\s*\{([^}]*)\}\s*" + struct, text)
        assert body, struct
        fields = [f.split() for f in body.group(1).split(";") if f.strip()]
        names = [f[-1].split("[")[0] for f in fields]
        assert names == [n for n, _ in cudnn_api.AlgoPerf._fields_], struct
        offset = 0
        for (c_type, name), (mine, t) in zip(fields, cudnn_api.AlgoPerf._fields_):
            size = sizes.get(c_type) or c_size(c_type)
            count = int(re.search(r"\[(\d+)\]", name).group(1)) if "[" in name else 1
            assert ctypes.sizeof(t) == size * count, f"{struct}.{name}"
            offset = -(-offset // size) * size
            assert getattr(cudnn_api.AlgoPerf, mine).offset == offset, f"{struct}.{name} offset"
            offset += size * count
