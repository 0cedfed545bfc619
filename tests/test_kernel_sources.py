"""Every RawKernel instantiation the engine can request compiles with nvcc (skipped without nvcc).

``nvcc --ptx`` of a bare ``.cu`` file (CI's compile check) only parses templates; the bodies of
``kernel<float>`` and friends compile when CuPy asks for them by name on a GPU. So each source's
``Name expressions:`` comment is expanded here (``a<T>, b<I, T> with I in {int, long long} and T in
{float, double}``), every expression is taken by address in a wrapper, and the wrapper is compiled
for the device, which instantiates them all. Sources without the comment must instantiate their
kernels explicitly.
"""

from __future__ import annotations

import itertools
import pathlib
import re
import shutil
import subprocess

import pytest

RAWKERNELS = pathlib.Path(__file__).resolve().parents[1] / "rawkernels"
SOURCES = sorted(RAWKERNELS.glob("*.cu"))


def name_expressions(text: str) -> list[str]:
    """The expanded ``Name expressions:`` of a source ([] when it has none)."""
    match = re.search(r"// Name expressions:(.*?\.)\s*$", text, re.S | re.M)
    if match is None:
        return []
    sentence = " ".join(line.strip().removeprefix("//").strip() for line in match.group(1).splitlines())
    names, _, domains = sentence.rstrip(".").partition(" with ")
    values = {var: [v.strip() for v in options.split(",")]
              for var, options in re.findall(r"(\w+) in \{([^}]*)\}", domains)}
    expressions = []
    for kernel, params in re.findall(r"(\w+)<([^>]*)>", names):
        variables = [p.strip() for p in params.split(",")]
        for combo in itertools.product(*(values[v] for v in variables)):
            expressions.append(f"{kernel}<{', '.join(combo)}>")
    return expressions


def test_name_expressions_are_parsed():
    text = ("// Name expressions: a<T>, b<I, T> and c<T> with I in {int, long long} and T in\n"
            "// {float, double}.\n")
    assert name_expressions(text) == [
        "a<float>", "a<double>", "b<int, float>", "b<int, double>", "b<long long, float>",
        "b<long long, double>", "c<float>", "c<double>"]


@pytest.mark.parametrize("source", SOURCES, ids=[path.name for path in SOURCES])
def test_every_instantiation_compiles_with_nvcc(source, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    text = source.read_text()
    expressions = name_expressions(text)
    assert expressions or "template __global__" in text, f"{source.name} declares no instantiation"
    wrapper = tmp_path / f"instantiate_{source.stem}.cu"
    wrapper.write_text(f'#include "{source}"\n' + "".join(
        f"void* const keep_{k} = (void*)&{expression};\n" for k, expression in enumerate(expressions)))
    result = subprocess.run(["nvcc", "--ptx", "-std=c++17", "-arch=sm_90", "-diag-suppress", "177",
                             "-o", str(tmp_path / "out.ptx"), str(wrapper)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    entries = (tmp_path / "out.ptx").read_text().count(".entry ")
    assert entries == len(expressions) if expressions else entries > 0, "not every kernel was compiled"
