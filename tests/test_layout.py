"""Every room has an owner, and no sign points to a room that is gone (issues 34 and 35).

- The package root holds the public modules and a few private helpers (:data:`ROOT_HELPERS`, each
  with its job); no private module anywhere in the package is named after the technology it is
  written in (:data:`TECHNOLOGIES`): rooms are named for what they serve.
- Every reference to a module or a file in the code, its docstrings and comments, the command line's
  help texts, the CUDA sources, the scripts and the documentation names one that exists: a dotted
  ``sparse_scan.…`` name (a module, or a name a module defines), a repository path (``docs/scan.md``,
  ``sparse_scan/engine/_cpu.py``, ``bench/results/…``), a Markdown link; and no source cites the
  ``ARCHITECTURE.md`` the repository does not have (the design page is docs/design.md).
- docs/design.md's layout lists every module of the package, one line each with its job, and only
  modules that exist.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import pathlib
import re

import pytest
import torch_optional
from test_namespace import PUBLIC

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "sparse_scan"

ROOT_HELPERS = {
    "_checks": "argument checks shared by the public entry points",
    "_environment": "the environment variables the package reads, one reader each",
    "_gpu_kernels": "the CUDA kernels' registry, loader and launcher",
    "_host_kernels": "the compiled host kernels' lazy loader (numba) and launcher",
    "_layerwise": "back-propagation layer by layer outside the engine (Sequential.reference_backward)",
    "_lazy": "names of a package loaded on first use",
    "_sequential": "Sequential, the chain of layers whose backward is a scan",
    "_threads": "the cores, the worker pools and the one threading rule (workers_for)",
    "_types": "type aliases",
    "_version": "the version",
}
"""The package root's private modules and their jobs: a new one is added here, on purpose."""

TECHNOLOGIES = ("numba", "numpy", "scipy", "cupy", "cuda", "nvrtc", "blas", "rawkernel")
"""Words no private module's name holds (the modules that talk to another system, ``torch/`` and
``distributed/_mpi``, are named for what they talk to)."""

SOURCES = ("sparse_scan/**/*.py", "cli/*.py", "rawkernels/*.cu", "tools/*", "bench/*.py", "bench/README.md",
           "tests/*.py", "tests/cupy_standin/*.py", "docs/*.md", "README.md", "data/README.md", "Makefile",
           "setup.cfg", "MANIFEST.in", "pyproject.toml", ".ci/run")
"""Where references are read (text files; bench/prototypes holds old patches, bench/results data)."""

CREATED = {"bench/results/gpu-run": "the folder tools/gpu_run.sh writes its run into (OUT's default)"}
"""Paths named as outputs a tool creates, not inputs that must exist."""

DOTTED = re.compile(r"\bsparse_scan(?:\.\w+)+")
PATH = re.compile(r"(?<![\w./-])(?:sparse_scan|cli|tests|tools|bench|docs|rawkernels|data)/"
                  r"[\w./{},*-]*[\w}*]")
LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)#\s]+)(?:#[^)]*)?\)")
INSTALLED = {"sparse_scan/cli": "cli", "sparse_scan/rawkernels": "rawkernels"}
"""Installed paths (setup.cfg's package_dir) -> their folder in the repository."""


def _sources() -> list[pathlib.Path]:
    """Every file :data:`SOURCES` names, but this one (its planted references are test data)."""
    files = {path for pattern in SOURCES for path in REPO.glob(pattern) if path.is_file()}
    return sorted(path for path in files if "__pycache__" not in path.parts and path.name != "test_layout.py")


def _module_path(parts: list[str]) -> pathlib.Path:
    """The repository path of the dotted module ``parts`` (``sparse_scan.cli`` is ``cli/``)."""
    for installed, folder in INSTALLED.items():
        prefix = installed.split("/")
        if parts[:2] == prefix:
            return REPO.joinpath(folder, *parts[2:])
    return REPO.joinpath(*parts)


def _defines(owner: object, name: str) -> bool:
    """Whether ``owner`` has ``name``: an attribute, or a dataclass field without a default."""
    fields = getattr(owner, "__dataclass_fields__", {}) if isinstance(owner, type) else {}
    return hasattr(owner, name) or name in fields or name in getattr(owner, "__annotations__", {})


def dotted_problem(name: str) -> str | None:
    """Why the dotted ``name`` names nothing, or None: the longest prefix that is a module, then
    attributes of it (one that needs PyTorch where it is not installed, :mod:`torch_optional`, is trusted)."""
    parts = name.split(".")
    for count in range(len(parts), 0, -1):
        path = _module_path(parts[:count])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or (
                count == 2 and path.is_dir()):
            break
    else:
        return "no such module"
    rest = parts[count:]
    if not rest:
        return None
    owner = torch_optional.import_module(".".join(parts[:count]))
    for attribute in rest:
        if owner is None or torch_optional.resolve(owner, attribute, None) is torch_optional.MISSING:
            return None  # needs PyTorch, which is not installed here: trusted
        if not _defines(owner, attribute):
            return f"{'.'.join(parts[:count])} has no {attribute!r}"
        owner = getattr(owner, attribute, None)
        if owner is None:
            return None  # a field: nothing further to check
    return None


def _expand(path: str) -> list[str]:
    """``a.{json,png}`` -> ``a.json``, ``a.png``; an f-string's ``{name}`` -> ``*``."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    if "," not in match.group(1):
        return _expand(path[:match.start()] + "*" + path[match.end():])
    return list(itertools.chain.from_iterable(
        _expand(path[:match.start()] + option + path[match.end():]) for option in match.group(1).split(",")))


def path_problem(text: str) -> str | None:
    """Why the repository path ``text`` names nothing, or None (placeholders such as ``NAME`` pass)."""
    for path in _expand(text.rstrip(".,")):
        if any(part.isupper() for part in re.split(r"[/._-]", path)) or path in CREATED:
            continue
        for installed, folder in INSTALLED.items():
            if path == installed or path.startswith(f"{installed}/"):
                path = folder + path[len(installed):]
        if not ((REPO / path).exists() if "*" not in path else any(REPO.glob(path))):
            return f"{path}: no such file or folder"
    return None


def references(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(reference, problem)`` for every reference in the file at ``path`` that names nothing."""
    text = path.read_text(encoding="utf-8", errors="replace")
    found = [(match.group(0), dotted_problem(match.group(0))) for match in DOTTED.finditer(text)]
    found += [(match.group(0), path_problem(match.group(0))) for match in PATH.finditer(text)]
    if path.suffix == ".md":
        found += [(match.group(1), None if (path.parent / match.group(1)).exists() else "no such file")
                  for match in LINK.finditer(text)]
    return sorted({(reference, problem) for reference, problem in found if problem is not None})


def test_every_reference_names_a_module_or_file_that_exists():
    broken = {path.relative_to(REPO).as_posix(): references(path) for path in _sources()}
    assert not {path: found for path, found in broken.items() if found}
    assert not [path.name for path in _sources() if "ARCHITECTURE.md" in path.read_text(errors="replace")]


def test_the_reference_check_finds_planted_dead_references(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See :mod:`sparse_scan.scan`, :func:`sparse_scan.engine.run.nope`, `docs/gone.md`, "
                    "sparse_scan/_numba_kernels.py, [here](missing.md), and the living "
                    ":class:`sparse_scan.engine.plan.ChainInfo`, its field "
                    "`sparse_scan.engine.plan.ChainInfo.weights`, `sparse_scan.cli.app`, "
                    "`bench/results/distributed-2core-cpu.{json,png}`, "
                    "`bench/results/train_resnet20-*.json`, "
                    "`bench/prototypes/NAME.patch`, [design](" + str(REPO / "docs" / "design.md") + ").")
    assert [reference for reference, _ in references(page)] == [
        "docs/gone.md", "missing.md", "sparse_scan.engine.run.nope", "sparse_scan.scan",
        "sparse_scan/_numba_kernels.py"]


def _root_modules() -> set[str]:
    return {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"} | {
        path.parent.name for path in PACKAGE.glob("*/__init__.py")}


def test_the_package_root_holds_the_public_modules_and_a_few_private_helpers():
    public = {name.split(".")[1] for name in PUBLIC if name.count(".") == 1}
    modules = _root_modules()
    assert {name for name in modules if not name.startswith("_")} == public
    assert {name for name in modules if name.startswith("_")} == set(ROOT_HELPERS)


def test_no_private_module_is_named_after_a_technology():
    private = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("_*.py")
               if path.name != "__init__.py"]
    assert private and not [name for name in private if any(word in name.lower() for word in TECHNOLOGIES)]


LAYOUT = re.compile(r"^```\n(sparse_scan/.*?)^```", re.M | re.S)


def _design_layout() -> dict[str, str]:
    """docs/design.md's layout: every ``name.py`` (or ``name/``) under its folder -> its job."""
    block = LAYOUT.search((REPO / "docs" / "design.md").read_text(encoding="utf-8")).group(1)
    listed, folders = {}, []
    for line in block.splitlines():
        match = re.match(r"^( *)([\w./]+)\s{2,}(.+)$", line)
        if match is None:
            continue
        indent, name, job = len(match.group(1)) // 2, match.group(2), match.group(3)
        folders = folders[:indent]
        if name.endswith("/"):
            folders.append(name)
            if indent == 0:
                continue
        listed["".join(folders[:indent]) + name] = job
    return listed


def test_the_design_page_lists_every_module_of_the_package_with_its_job():
    listed = {name: job for name, job in _design_layout().items() if name.startswith("sparse_scan/")}
    files = [path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts]
    packages = {path.parent for path in files if path.name == "__init__.py" and path.parent != PACKAGE}
    expected = {path.relative_to(REPO).as_posix() for path in files  # a subpackage's line is its folder's
                if path.parent not in packages or path.name != "__init__.py"}
    expected |= {package.relative_to(REPO).as_posix() + "/" for package in packages}
    assert set(listed) == expected
    assert all(len(job) > 10 for job in listed.values())


@pytest.mark.parametrize("name", ["sparse_scan.engine.plan.ChainInfo", "sparse_scan.cli.app",
                                  "sparse_scan.layers._kernels.im2col", "sparse_scan.Sequential.backward"])
def test_living_names_resolve(name):
    assert dotted_problem(name) is None


def test_a_dataclass_field_resolves():
    assert dataclasses.is_dataclass(importlib.import_module("sparse_scan.engine.plan").ChainInfo)
    assert dotted_problem("sparse_scan.engine.plan.ChainInfo.weights") is None
