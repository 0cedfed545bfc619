"""Every RawKernel instantiation the glue can request compiles as CuPy compiles it, from one registry.

``sparse_scan._gpu_kernels.INSTANTIATIONS`` lists, per ``rawkernels/`` file, every kernel and its template
domains; the glue compiles each file with all of them as ``name_expressions``, and
``tools/check_kernels.py`` compiles the same list with CuPy's NVRTC path for sm_80 and sm_90 without a
GPU. Here: the tool passes on the real sources and lists every expression (run in a child process, so
this process never imports the real CuPy; skipped where CuPy or NVRTC is missing, unless
``SPARSE_SCAN_REQUIRE_NVRTC=1``, which CI sets); a broken template body that ``nvcc --ptx`` of the bare
file lets through makes it fail; the registry covers every ``__global__`` kernel and every request of
the glue; and ``_gpu_kernels.function`` refuses what the registry does not list, before importing CuPy.

(No nvcc test is left: NVRTC with the name expressions instantiates every kernel the glue can ask for,
which is what the nvcc wrapper of this file used to do.)
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from sparse_scan import _gpu_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAWKERNELS = ROOT / "rawkernels"
TOOL = ROOT / "tools" / "check_kernels.py"
ARCHS = ("80", "90")
KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
# The helper call that a template body gets wrong in the broken copy (one argument short).
GOOD_CALL = "scan_spmv_item<I, T>(d, sample, index)"
BROKEN_CALL = "scan_spmv_item<I, T>(d, sample)"


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """Run tools/check_kernels.py in a child process; skip (or fail, under SPARSE_SCAN_REQUIRE_NVRTC=1)
    when it cannot load CuPy or NVRTC there."""
    result = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    if result.returncode == 2 and "install them" in result.stderr:
        reason = f"tools/check_kernels.py cannot run here: {result.stderr.strip()}"
        if os.environ.get("SPARSE_SCAN_REQUIRE_NVRTC") == "1":
            pytest.fail(f"SPARSE_SCAN_REQUIRE_NVRTC=1 but {reason}")
        pytest.skip(reason)
    return result


def all_expressions() -> list[tuple[str, str]]:
    """``(file, expression)`` of every registered instantiation."""
    return [(filename, name) for filename in _gpu_kernels.INSTANTIATIONS
            for name in _gpu_kernels.name_expressions(filename)]


def test_the_tool_compiles_every_registered_instantiation_for_sm80_and_sm90():
    result = run_tool()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    expected = all_expressions()
    for arch in ARCHS:
        for filename, name in expected:
            pattern = rf"ok   sm_{arch}  {re.escape(filename)}  {re.escape(name)} +-> _Z\w+"
            assert any(re.fullmatch(pattern, line) for line in lines), f"no ok line for {name} on sm_{arch}"
    assert sum(line.startswith("ok ") for line in lines) == len(expected) * len(ARCHS)
    assert not any(line.startswith("FAIL") for line in lines)
    total = len(expected) * len(ARCHS)
    assert f"{total} instantiations ({len(expected)} per arch; sm_80, sm_90)" in lines[-1]
    assert lines[-1].endswith("all ok")


def test_a_broken_template_body_fails_the_tool_but_not_nvcc_on_the_bare_file(tmp_path):
    sources = tmp_path / "rawkernels"
    shutil.copytree(RAWKERNELS, sources)
    scan = sources / "scan.cu"
    text = scan.read_text()
    assert text.count(GOOD_CALL) == 1
    scan.write_text(text.replace(GOOD_CALL, BROKEN_CALL))
    if shutil.which("nvcc") is not None:  # the gap CI's former step had: the template is never instantiated
        bare = subprocess.run(["nvcc", "--ptx", "-std=c++17", "-arch=sm_90", "-o", str(tmp_path / "scan.ptx"),
                               str(scan)], capture_output=True, text=True, timeout=300)
        assert bare.returncode == 0, bare.stderr
    result = run_tool("--rawkernels", str(sources), "--arch", "90")
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"^FAIL sm_90  scan\.cu  scan_level<int, float> ", result.stdout, re.M)
    assert f"{scan}(" in result.stdout, "NVRTC's log should name the file and line"
    assert "scan_spmv_item" in result.stdout
    assert re.search(r"^ok   sm_90  pooling\.cu ", result.stdout, re.M), "the other files still compile"
    assert result.stdout.splitlines()[-1].endswith("4 FAILED")


def test_the_tool_exits_2_with_what_to_install_when_cupy_is_missing():
    code = ("import runpy, sys; sys.modules['cupy'] = None; sys.argv = [sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code, str(TOOL)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "CuPy cannot be imported" in result.stderr and "pip install" in result.stderr
    assert result.stdout == ""


def test_the_registry_covers_every_kernel_of_every_source():
    sources = {path.name: path for path in RAWKERNELS.glob("*.cu")}
    assert set(_gpu_kernels.INSTANTIATIONS) == set(sources)
    for filename, path in sources.items():
        declared = set(KERNEL.findall(path.read_text()))
        assert declared, f"no __global__ kernel found in {filename}"
        assert declared == set(_gpu_kernels.INSTANTIATIONS[filename]), filename
        assert "Name expressions:" not in path.read_text(), f"{filename}: the registry is the only list"


def _requests() -> list[tuple[pathlib.Path, str, ast.expr]]:
    """``(module, file, kernel-name node)`` of every ``_gpu_kernels.function(FILE, KERNEL, ...)`` call."""
    found = []
    for path in sorted((ROOT / "sparse_scan").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Constant) for target in node.targets
                     if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "function" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "_gpu_kernels"):
                first = node.args[0]
                filename = first.value if isinstance(first, ast.Constant) else constants.get(first.id)
                found.append((path, filename, node.args[1]))
    return found


def test_every_request_of_the_glue_names_a_registered_kernel():
    requests = _requests()
    assert {filename for _, filename, _ in requests} == set(_gpu_kernels.INSTANTIATIONS)
    for path, filename, name in requests:
        where = f"{path.relative_to(ROOT)}:{name.lineno}"
        kernels = _gpu_kernels.INSTANTIATIONS[filename]
        if isinstance(name, ast.Constant):
            assert name.value in kernels, f"{where}: {name.value!r} is not registered for {filename}"
        else:  # an f-string: its literal parts with any name in between must match registered kernels
            assert isinstance(name, ast.JoinedStr), f"{where}: name the kernel with a literal string"
            pattern = "".join(re.escape(part.value) if isinstance(part, ast.Constant) else r"\w+"
                              for part in name.values)
            assert any(re.fullmatch(pattern, kernel) for kernel in kernels), f"{where}: {pattern}"


def test_name_expressions_spell_every_combination():
    assert _gpu_kernels.name_expressions("pooling.cu") == [
        "pool_row_counts<int>", "pool_row_counts<long long>", "pool_fill<int>", "pool_fill<long long>",
        "maxpool_values<int, float>", "maxpool_values<int, double>", "maxpool_values<long long, float>",
        "maxpool_values<long long, double>"]
    assert len(all_expressions()) == 28
    with pytest.raises(ValueError, match="no kernel source"):
        _gpu_kernels.name_expressions("nope.cu")


@pytest.mark.parametrize("request_", [
    ("nope.cu", "scan_level", np.int32, np.float32),
    ("scan.cu", "scan_levels", np.int32, np.float32),
    ("scan.cu", "scan_level", np.int32, np.float16),
    ("scan.cu", "scan_level", np.float32, np.int32),
    ("scan.cu", "scan_level", np.int32),
    ("pooling.cu", "pool_fill", np.int32, np.float32),
    ("conv.cu", "conv_jt_fill_pattern", np.uint32),
], ids=["file", "kernel", "dtype", "order", "too-few", "too-many", "unsigned"])
def test_function_refuses_an_unregistered_request_before_importing_cupy(request_, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # importing CuPy now raises ImportError
    with pytest.raises(ValueError, match="registered"):
        _gpu_kernels.function(*request_)


class _FakeModule:
    """Records how ``_gpu_kernels.function`` builds modules (``cupy.RawModule``'s signature)."""

    built: list[dict] = []

    def __init__(self, *, code: str, options: tuple, name_expressions: list[str]) -> None:
        self.name_expressions = tuple(name_expressions)
        _FakeModule.built.append({"code": code, "options": options, "names": self.name_expressions})

    def get_function(self, name: str) -> tuple[str, str]:
        assert name in self.name_expressions
        return ("kernel", name)


def test_function_builds_one_module_per_device_and_file_with_every_expression(monkeypatch):
    fake = types.SimpleNamespace(RawModule=_FakeModule,
                                 cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_gpu_kernels, "_MODULES", {})
    monkeypatch.setattr(_FakeModule, "built", [])
    assert _gpu_kernels.function("scan.cu", "scan_level", np.int32, np.float32) == (
        "kernel", "scan_level<int, float>")
    assert _gpu_kernels.function("scan.cu", "scan_level", np.dtype(np.int64), "float64") == (
        "kernel", "scan_level<long long, double>")
    assert len(_FakeModule.built) == 1
    built = _FakeModule.built[0]
    assert built["names"] == tuple(_gpu_kernels.name_expressions("scan.cu"))
    assert built["options"] == _gpu_kernels.COMPILE_OPTIONS
    assert built["code"] == _gpu_kernels.source("scan.cu")
    _gpu_kernels.function("pooling.cu", "pool_fill", np.int64)
    assert [b["names"][0] for b in _FakeModule.built] == ["scan_level<int, float>", "pool_row_counts<int>"]
