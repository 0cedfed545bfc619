"""What the real CuPy offers: names and parameters, read from the installed package in a child process.

The stand-in is strict by refusing what CuPy does not have: a function, an ``ndarray`` method or a
keyword argument that the installed CuPy lacks fails the test the way it would fail on a GPU. The
names and parameter lists come from the real package (which imports without a GPU driver), read in a
child process so that the test process never imports it, and cached per CuPy version.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_PROBE = r'''
import inspect, json, re, sys
import cupy, cupyx, cupyx.scipy.sparse

def doc_parameters(obj):
    """Parameter names from the signature line of a Cython docstring: 'name(self, a, b=1, *c, **d)'."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    match = re.match(r"[\w.]+\((.*?)\)(\s*->.*)?$", doc.splitlines()[0] if doc else "")
    if match is None:
        return None
    text = match.group(1).replace("\\*", "*")
    try:
        namespace = {}
        exec(f"def f({text}): pass", namespace)
        return describe(inspect.signature(namespace["f"]))
    except Exception:
        return None

def describe(signature):
    names, varkw, varargs = [], False, False
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            varkw = True
        elif p.kind is p.VAR_POSITIONAL:
            varargs = True
        elif p.name != "self":
            names.append(p.name)
    return {"names": names, "varkw": varkw, "varargs": varargs}

def parameters(obj):
    try:
        return describe(inspect.signature(obj))
    except Exception:
        return doc_parameters(obj)

def namespace(module):
    out = {}
    for name in dir(module):
        if name.startswith("__"):
            continue
        obj = getattr(module, name)
        kind = type(obj).__name__
        entry = {"kind": kind}
        if kind == "ufunc":
            entry["parameters"] = doc_parameters(obj)
            entry["methods"] = [m for m in ("reduce", "accumulate", "reduceat", "outer", "at")
                                if hasattr(obj, m)]
        elif callable(obj) and not isinstance(obj, type):
            entry["parameters"] = parameters(obj)
        out[name] = entry
    return out

methods = {}
for name in dir(cupy.ndarray):
    if name.startswith("__") and name not in ("__getitem__", "__setitem__"):
        continue
    methods[name] = {"kind": type(getattr(cupy.ndarray, name)).__name__,
                     "parameters": doc_parameters(getattr(cupy.ndarray, name))}
json.dump({"version": cupy.__version__, "cupy": namespace(cupy), "ndarray": methods,
           "cuda": sorted(n for n in dir(cupy.cuda) if not n.startswith("_")),
           "cupyx": sorted(n for n in dir(cupyx) if not n.startswith("_")),
           "sparse": sorted(n for n in dir(cupyx.scipy.sparse) if not n.startswith("_"))}, sys.stdout)
'''


class ReferenceUnavailable(RuntimeError):
    """The real CuPy package is not installed (or does not import): the stand-in cannot be strict."""


@dataclass(frozen=True)
class Reference:
    """The installed CuPy's API: names of ``cupy``, ``cupy.ndarray``, ``cupy.cuda``, ``cupyx``."""

    version: str
    cupy: dict
    ndarray: dict
    cuda: list
    cupyx: list
    sparse: list


def _installed_version() -> str | None:
    from importlib import metadata

    for distribution in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"):
        try:
            return f"{distribution}-{metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def load() -> Reference:
    """The reference of the installed CuPy (cached on disk per version).

    Raises
    ------
    ReferenceUnavailable
        CuPy is not installed, or fails to import in a child process.
    """
    version = _installed_version()
    if version is None:
        raise ReferenceUnavailable("the real CuPy package is not installed (pip install '.[test]' "
                                   "installs cupy-cuda13x, whose API the stand-in follows)")
    cache = pathlib.Path(tempfile.gettempdir()) / "sparse-scan-cupy-standin" / f"reference-{version}.json"
    if not cache.exists():
        result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
        if result.returncode:
            raise ReferenceUnavailable(f"the real CuPy does not import: {result.stderr.strip()[-400:]}")
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(".tmp")
        partial.write_text(result.stdout)
        partial.replace(cache)
    data = json.loads(cache.read_text())
    return Reference(data["version"], data["cupy"], data["ndarray"], data["cuda"], data["cupyx"],
                     data["sparse"])
