"""A model's parameters by state_dict name, ``.npz`` reads and atomic ``.npz`` writes.

Examples
--------
>>> from sparse_scan import Sequential
>>> from sparse_scan.layers import Linear
>>> sorted(state_dict(Sequential(Linear(2, 3, rng=0))))
['0.bias', '0.weight']
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import zipfile
from typing import Any

import numpy as np

__all__ = ["load_state_dict", "read_npz", "state_dict", "write_npz_atomically"]


def state_dict(model: Any) -> dict[str, np.ndarray]:
    """``"<layer>.<name>"`` -> the parameter array (not a copy), for every name in the layer's
    ``parameter_names`` (default ``weight`` and ``bias``; a recurrent layer has four)."""
    out = {}
    for layer in model.layers:
        for name in getattr(layer, "parameter_names", ("weight", "bias")):
            value = getattr(layer, name, None)
            if value is not None:
                out[f"{layer.name}.{name}"] = value
    return out


def load_state_dict(model: Any, values: dict[str, Any]) -> None:
    """Set parameters by state_dict name (the layers validate shape and dtype)."""
    layers = {layer.name: layer for layer in model.layers}
    for key, value in values.items():
        layer_name, _, name = key.rpartition(".")
        setattr(layers[layer_name], name, value)


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


def write_npz_atomically(path: str | pathlib.Path, arrays: dict[str, Any]) -> None:
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
