"""The C headers and fastzero/native/abi.py agree: dtype codes, ISA codes,
the CUDA ABI version and every CUDA entry point's signature are parsed out of
csrc/ and compared with the Python definitions, so a change on either side
alone fails here."""

import ctypes
import re

import torch

from fastzero.native import abi, build

CPU_COMMON = build.cpu_source_dir() / "common.h"
CUDA_COMMON = build.cuda_source_dir() / "common.cuh"
CUDA_API = build.cuda_source_dir() / "fastzero_cuda.h"


def _code(path) -> str:
    """The file without its comments."""
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _enum(path, name: str) -> dict[str, int]:
    """{enumerator: value} of ``enum <name>``; every value must be explicit."""
    match = re.search(rf"\benum\s+{name}\b[^{{]*\{{(.*?)\}}", _code(path), flags=re.S)
    assert match, f"no enum {name} in {path}"
    values = {}
    for item in filter(None, (s.strip() for s in match.group(1).split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        assert sep, f"{path}: enum {name}: {key} has no explicit value"
        values[key] = int(value, 0)
    return values


def _dtype_names(path) -> dict[str, str]:
    """{enumerator: name} from the ``case kX: return "name";`` lines of dtype_name()."""
    body = re.search(r"dtype_name\s*\(int code\)\s*\{(.*?)\n\}", _code(path), flags=re.S)
    assert body, f"no dtype_name() in {path}"
    return dict(re.findall(r'case\s+(\w+)\s*:\s*return\s+"(\w+)"', body.group(1)))


def _dtype_codes_from(enum: dict[str, int], names: dict[str, str]) -> tuple[dict, int]:
    """The C enum as (DTYPE_CODES, NO_DTYPE): {torch dtype: code}, and kNone."""
    codes = {getattr(torch, names[key]): value for key, value in enum.items() if key != "kNone"}
    return codes, enum["kNone"]


def test_cpu_dtype_codes_match():
    enum = _enum(CPU_COMMON, "DType")
    codes, none = _dtype_codes_from(enum, _dtype_names(CUDA_COMMON))
    assert codes == abi.DTYPE_CODES
    assert none == abi.NO_DTYPE


def test_cuda_dtype_codes_match():
    enum = _enum(CUDA_COMMON, "DType")
    names = _dtype_names(CUDA_COMMON)
    assert set(names) == set(enum), "dtype_name() must name every DType"
    assert names["kNone"] == "none"
    codes, none = _dtype_codes_from(enum, names)
    assert codes == abi.DTYPE_CODES
    assert none == abi.NO_DTYPE


def test_isa_codes_match():
    enum = _enum(CPU_COMMON, "Isa")
    # kScalar = 0, kAvx2 = 1, kAvx512 = 2  <->  ISA_NAMES[code] = "scalar", "avx2", "avx512"
    assert {key.removeprefix("k").lower(): value for key, value in enum.items()} == {
        name: code for code, name in enumerate(abi.ISA_NAMES)
    }


def test_cpu_abi_version_matches():
    match = re.search(r"#define\s+FZ_CPU_ABI_VERSION\s+(\d+)", CPU_COMMON.read_text())
    assert match, f"no FZ_CPU_ABI_VERSION in {CPU_COMMON}"
    assert int(match.group(1)) == abi.CPU_ABI_VERSION


def test_cuda_abi_version_matches():
    match = re.search(r"#define\s+FZ_CUDA_ABI_VERSION\s+(\d+)", _code(CUDA_API))
    assert match, f"no FZ_CUDA_ABI_VERSION in {CUDA_API}"
    assert int(match.group(1)) == abi.CUDA_ABI_VERSION


def _ctype(c_type: str, result: bool = False):
    """The ctypes type abi.CUDA_SIGNATURES uses for a C parameter or result type."""
    t = re.sub(r"\s+", " ", c_type.replace("*", " * ")).strip()
    t = t.replace(" *", "*")
    scalars = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32, "double": ctypes.c_double}
    if t in scalars:
        return scalars[t]
    if result and t == "const char*":
        return ctypes.c_char_p
    if t == "void* const*":  # a host array of device pointers
        return ctypes.POINTER(ctypes.c_void_p)
    if t == "const int64_t*":  # a host array of sizes or indices
        return ctypes.POINTER(ctypes.c_int64)
    if t.endswith("*"):  # a device pointer, or the stream
        return ctypes.c_void_p
    raise AssertionError(f"no ctypes rule for C type {c_type!r}")


def _prototypes(path) -> dict[str, tuple]:
    """{name: (restype, argtypes)} of every FZ_API function of the header."""
    found = {}
    for result, name, params in re.findall(r"FZ_API\s+([\w\s\*]+?)\s*(fz_cuda_\w+)\s*\((.*?)\)\s*;", _code(path), re.S):
        args = []
        if params.strip() != "void":
            for param in params.split(","):
                c_type = re.sub(r"\w+\s*$", "", param.strip())  # drop the parameter's name
                args.append(_ctype(c_type))
        found[name] = (_ctype(result, result=True), args)
    return found


def test_cuda_signatures_match_the_header():
    header = _prototypes(CUDA_API)
    assert len(header) >= 10, header.keys()
    assert set(header) == set(abi.CUDA_SIGNATURES)
    for name, (restype, argtypes) in abi.CUDA_SIGNATURES.items():
        want_res, want_args = header[name]
        assert restype == want_res, f"{name}: result {restype} but the header says {want_res}"
        assert len(argtypes) == len(want_args), f"{name}: {len(argtypes)} arguments, the header has {len(want_args)}"
        for i, (got, want) in enumerate(zip(argtypes, want_args)):
            assert got == want, f"{name}: argument {i} is {got.__name__}, the header says {want.__name__}"
