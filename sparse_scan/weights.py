"""A model's parameters by state_dict name, ``.npz`` reads and atomic ``.npz`` writes.

Examples
--------
>>> from sparse_scan import Sequential
>>> from sparse_scan.layers import Linear
>>> sorted(state_dict(Sequential(Linear(2, 3, rng=0))))
['0.bias', '0.weight']

A residual block's layers are named under the block, as PyTorch names a module's children:

>>> from sparse_scan.layers import ReLU, Residual
>>> model = Sequential(Residual(Linear(3, 3, rng=0), ReLU(), shortcut=Linear(3, 3, rng=1)))
>>> list(named_layers(model))
['0', '0.0', '0.1', '0.shortcut']
>>> list(state_dict(model))
['0.0.weight', '0.0.bias', '0.shortcut.weight', '0.shortcut.bias']
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import zipfile
from typing import Any, Iterator

import numpy as np

from ._types import Array

__all__ = ["every_layer", "load_state_dict", "named_layers", "read_npz", "scoped_name", "state_dict",
           "write_npz_atomically"]


def scoped_name(name: str, layer: Any, key: str) -> str:
    """How ``key`` (a parameter's name, or a path inside ``layer``) of the layer ``name`` is named in the
    scope that holds the layer: ``"<name>.<key>"``, or ``key`` alone where the layer names what it holds
    in that scope (``layer.scoped`` False: an inline residual block). :func:`named_layers` names the
    layers by the same rule.

    >>> from sparse_scan.layers import Linear
    >>> scoped_name("fc", Linear(2, 2, rng=0), "weight")
    'fc.weight'
    """
    return f"{name}.{key}" if getattr(layer, "scoped", True) else key


def _walk(model: Any) -> Iterator[tuple[str, Any]]:
    """``(path, layer)`` for every layer of ``model``, a block before the layers it holds: under the
    block's path, or in the block's own scope for a block that is not ``scoped`` (an inline residual
    sum, whose layers keep their paths)."""
    def visit(path: str, layer: Any, scope: str) -> Iterator[tuple[str, Any]]:
        yield path, layer
        inner = path if getattr(layer, "scoped", True) else scope
        for name, child in getattr(layer, "named_children", list)():
            yield from visit(f"{inner}.{name}" if inner else name, child, inner)

    for layer in model.layers:
        yield from visit(str(layer.name), layer, "")


def named_layers(model: Any) -> dict[str, Any]:
    """Every layer of ``model`` by its path, in order: a layer's ``name``, and the layers a block holds
    (a :class:`~sparse_scan.layers.Residual`'s ``named_children``) as ``"<block path>.<child name>"``
    (or ``"<child name>"`` in the block's scope where the block is not ``scoped``), nested blocks
    included. A parameter's state_dict name is ``"<path>.<parameter>"``."""
    return dict(_walk(model))


def every_layer(model: Any) -> list[Any]:
    """Every layer of ``model``, nested ones included, in :func:`named_layers`' order; layers without
    parameters may share a name, and none is left out for it."""
    return [layer for _, layer in _walk(model)]


def state_dict(model: Any) -> dict[str, np.ndarray]:
    """``"<layer path>.<name>"`` -> the parameter array (not a copy), for every layer of
    :func:`named_layers` and every name in its ``parameter_names`` (default ``weight`` and ``bias``; a
    recurrent layer has four, a block none of its own)."""
    out = {}
    for path, layer in named_layers(model).items():
        for name in getattr(layer, "parameter_names", ("weight", "bias")):
            value = getattr(layer, name, None)
            if value is not None:
                out[f"{path}.{name}"] = value
    return out


def load_state_dict(model: Any, values: dict[str, Array], strict: bool = True) -> None:
    """Set parameters by state_dict name, like PyTorch's ``load_state_dict``: values are copied in the
    parameter's dtype (float arrays only, finite after the cast), the layers validate shapes.

    Parameters
    ----------
    model : Sequential
    values : dict
        ``"<layer path>.<parameter>"`` -> array-like (:func:`state_dict`'s names).
    strict : bool
        Every parameter of the model must be given (unknown keys are refused either way).

    Raises
    ------
    ValueError
        Naming the key: unknown, missing (``strict``), not floats, NaN/Inf or too large for the
        parameter's dtype, or the wrong shape. Nothing is changed then.
    """
    current = state_dict(model)
    unknown = sorted(set(values) - set(current))
    if unknown:
        raise ValueError(f"{unknown[0]!r} matches no parameter of the model (it has "
                         f"{', '.join(sorted(current)) or 'none'})")
    missing = sorted(set(current) - set(values))
    if strict and missing:
        raise ValueError(f"no {missing[0]!r} (strict: every parameter must be given)")
    cast = {}
    for key, value in values.items():
        array = np.asarray(value)
        if array.dtype.kind != "f":
            raise ValueError(f"{key!r} has dtype {array.dtype}, expected floats")
        if array.shape != current[key].shape:
            raise ValueError(f"{key!r} has shape {list(array.shape)}, the model's is "
                             f"{list(current[key].shape)}")
        with np.errstate(over="ignore"):
            cast[key] = array.astype(current[key].dtype)
        if not np.all(np.isfinite(cast[key])):
            raise ValueError(f"{key!r} holds NaN or Inf (or values too large for {current[key].dtype})")
    layers = named_layers(model)
    for key, value in cast.items():
        path, _, name = key.rpartition(".")
        setattr(layers[path], name, value)


def read_npz(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """The arrays of a ``.npz`` file (no pickles).

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        Anything else that makes it no readable ``.npz`` (a ``.npy``, an empty or truncated file, a
        pickle), with the reason.
    """
    with open(path, "rb") as handle:  # closed whatever np.load makes of it
        magic = handle.read(6)
        handle.seek(0)
        if magic.startswith(b"\x93NUMPY"):
            raise ValueError("a single array (.npy), not an archive of named arrays")
        if not magic.startswith(b"PK"):
            raise ValueError("not a zip archive of arrays (.npz)" if magic else "an empty file")
        try:
            stored = np.load(handle, allow_pickle=False)
            if not isinstance(stored, np.lib.npyio.NpzFile):
                raise ValueError("a single array (.npy), not an archive of named arrays")
            with stored:
                return {key: stored[key] for key in stored.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise ValueError(str(error) or type(error).__name__) from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_npz_atomically(path: str | pathlib.Path, arrays: dict[str, Array]) -> None:
    """Write ``arrays`` to ``path`` through a temporary file in the same folder and a rename, so that
    an interruption leaves either the old file or the new one, never a partial one."""
    path = pathlib.Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npz", dir=path.parent)
    try:
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes it private; a plain file would not be
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, **{key: np.asarray(value) for key, value in arrays.items()})
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
