"""A model's parameters by state_dict name, and the files of arrays: reads that refuse what is no
regular file, and what is no array or more than the memory budget, before reading it; exact casts of
numbers to floats; atomic writes.

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

Integers are cast to floats only where the float holds them exactly:

>>> import numpy as np
>>> as_float_array(np.array([2**24 + 1]), np.float32, "x")
Traceback (most recent call last):
...
ValueError: x: holds integers float32 does not hold exactly (16777217 would be 16777216 at index [0]): ...
>>> as_float_array(np.array([2**24 + 1]), np.float64, "x")
array([16777217.])
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import signal
import stat
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np

from ._environment import MEMORY_BUDGET
from ._types import Array
from .engine.figures import size_text

__all__ = ["MAX_FILE_LINKS", "as_float_array", "budget_problem", "check_writable", "every_layer",
           "load_state_dict", "named_layers", "open_regular_file", "read_npz", "scoped_name", "state_dict",
           "write_atomically", "write_npz_atomically", "write_target"]


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


_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a device"),
               (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))
"""What a path that is no regular file is, as messages say it."""

MAX_FILE_LINKS = 40
"""The symlinks a path may pass through (Linux's own limit): more is a symlink loop."""


def open_regular_file(path: str | pathlib.Path) -> IO[bytes]:
    """``path`` opened to read bytes, if it is a regular file: a named pipe, a device (``/dev/zero``) or
    a directory is refused before a byte is read (opened without blocking, so a pipe no one writes to
    does not hang), and a symlink loop is named as one.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        ``a symlink loop``, or ``not a regular file (a named pipe)`` (or a directory, a device, a socket).
    OSError
        Anything else the system refuses (no permission), with its reason.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError("a symlink loop") from None
        raise
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a file of data")
        raise ValueError(f"not a regular file ({kind})")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def budget_problem(nbytes: int, what: str, budget: int) -> str | None:
    """Why ``what``, estimated at ``nbytes``, may not be allocated: over the memory budget.

    Parameters
    ----------
    nbytes : int
        The estimate, in bytes.
    what : str
        What would be allocated, as the message names it (``"its 4 arrays"``, ``"a batch of 10
        samples"``).
    budget : int
        Bytes: the memory budget, :func:`sparse_scan._sequential.default_memory_budget`
        (``SPARSE_SCAN_MEMORY_BUDGET``, else half the memory available: the one budget, which the
        planner's products are held to too).

    Returns
    -------
    str or None
        The message (the size, the budget, how to raise it), or None where it fits.

    Examples
    --------
    >>> budget_problem(2**20, "a batch of 10 samples", 2**30) is None
    True
    >>> print(budget_problem(3 * 2**30, "a batch of 10 samples", 2**30))  # doctest: +NORMALIZE_WHITESPACE
    a batch of 10 samples would take ~3.0 GiB (estimated before allocating it), over the memory budget of
    1.0 GiB (raise it with SPARSE_SCAN_MEMORY_BUDGET)
    """
    if nbytes <= budget:
        return None
    return (f"{what} would take ~{size_text(nbytes)} (estimated before allocating it), over the memory "
            f"budget of {size_text(budget)} (raise it with {MEMORY_BUDGET.name})")


def as_float_array(array: Any, dtype: Any, what: str) -> np.ndarray:
    """``array`` (numbers: floats, integers or bools) cast to the float ``dtype``, checked: nothing
    rounded that was an integer, nothing too large for the dtype, no NaN or Inf.

    Parameters
    ----------
    array : array-like
    dtype : numpy dtype
        float32 or float64.
    what : str
        How the message names the array (``"--input x.npy"``).

    Raises
    ------
    ValueError
        ``<what>: ...``: not numbers; NaN or Inf (or values too large for ``dtype``); integers the
        dtype does not hold exactly (float32 holds every integer up to 2^24, float64 up to 2^53), with
        the first one and where it is.
    """
    array = np.asarray(array)
    dtype = np.dtype(dtype)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{what}: dtype {array.dtype}, expected numbers")
    with np.errstate(over="ignore", invalid="ignore"):
        cast = array.astype(dtype)
    if not np.all(np.isfinite(cast)) or (array.dtype.kind == "f" and not np.all(np.isfinite(array))):
        raise ValueError(f"{what}: holds NaN or Inf (or values too large for {dtype.name})")
    if array.dtype.kind in "iu":
        exact = 2 ** (np.finfo(dtype).nmant + 1)  # every integer up to it is a float of the dtype
        info = np.iinfo(array.dtype)
        if info.max > exact or info.min < -exact:
            # back to the integer type where the float lies in its range (powers of two: exact bounds)
            inside = (cast >= float(info.min)) & (cast < float(info.max) + 1.0)
            rounded = ~inside | (np.where(inside, cast, 0).astype(array.dtype) != array)
            if rounded.any():
                where = tuple(int(i) for i in np.argwhere(rounded)[0])
                raise ValueError(f"{what}: holds integers {dtype.name} does not hold exactly ({array[where]} "
                                 f"would be {int(cast[where])} at index {list(where)}): give floats, or use "
                                 "float64 (exact up to 2^53)")
    return cast


_NPZ_MEMBER = re.compile(r".+\.npy")


def read_npz(path: str | pathlib.Path, budget: int | None = None) -> dict[str, np.ndarray]:
    """The arrays of a ``.npz`` file (no pickles), read only if the file is a regular one
    (:func:`open_regular_file`), every member is an array (``.npy``) and, given a memory ``budget``
    (bytes), they fit it together (:func:`budget_problem`, from their headers).

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        Anything else that makes it no readable ``.npz`` (a symlink loop, a named pipe, a ``.npy``, an
        empty or truncated file, a member that is no array, a pickle, more than the memory budget), with
        the reason.
    """
    with open_regular_file(path) as handle:  # closed whatever np.load makes of it
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
                members = stored.zip.namelist()
                other = next((name for name in members if not _NPZ_MEMBER.fullmatch(name)), None)
                if other is not None:
                    raise ValueError(f"member {other!r} is not an array (.npy): write the file with "
                                     "numpy.savez")
                if budget is not None:
                    total = sum(_member_bytes(stored.zip, name) for name in members)
                    problem = budget_problem(total, f"its {len(members)} arrays", budget)
                    if problem is not None:
                        raise ValueError(problem)
                return {key: stored[key] for key in stored.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise ValueError(str(error) or type(error).__name__) from None


def _member_bytes(archive: zipfile.ZipFile, name: str) -> int:
    """The bytes the array ``name`` of an ``.npz`` takes once read, from its ``.npy`` header alone."""
    with archive.open(name) as member:
        version = np.lib.format.read_magic(member)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:  # a later format: its size is known once read (np.load checks it)
            return 0
        shape, _, dtype = read_header(member)
    return int(np.prod(shape, dtype=object)) * dtype.itemsize


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_target(path: str | pathlib.Path) -> pathlib.Path:
    """The file a write to ``path`` replaces: where its symlinks lead (an output named by a symlink is
    written through it, the link kept), else ``path`` itself.

    Raises
    ------
    ValueError
        ``a symlink loop``: the links never reach a file (or more than :data:`MAX_FILE_LINKS` of them).
    """
    path = pathlib.Path(path)
    for _ in range(MAX_FILE_LINKS):
        if not path.is_symlink():
            return path
        path = path.parent / os.readlink(path)
    raise ValueError("a symlink loop")


def _remove_stale_temporaries(target: pathlib.Path) -> None:
    """Remove the temporaries of writes to ``target`` (:func:`write_atomically`) that a process killed
    while writing left (their names hold the writer's process id: one that no longer runs)."""
    pattern = re.compile(re.escape(f".{target.name}.") + r"(\d+)\.\w+\.(?:npz|tmp)")
    try:
        entries = os.listdir(target.parent)
    except OSError:
        return
    for name in entries:
        match = pattern.fullmatch(name)
        if match is None or _running(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target.parent / name)


def _running(pid: int) -> bool:
    """Whether the process ``pid`` runs (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # not ours to signal: it runs
        pass
    return True


def _new_temporary(path: str | pathlib.Path, suffix: str = ".npz") -> tuple[pathlib.Path, int, str]:
    """The file a write to ``path`` replaces (:func:`write_target`), and a new temporary file beside it
    named ``.<name>.<pid>.<random><suffix>`` (its descriptor and path; ``suffix`` ``.npz`` or
    ``.tmp``), once the temporaries of killed writers are removed."""
    target = write_target(path)
    _remove_stale_temporaries(target)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=suffix,
                                         dir=target.parent)
    return target, handle, temporary


def check_writable(path: str | pathlib.Path) -> None:
    """Create and remove the temporary file :func:`write_npz_atomically` would write for ``path``
    (after removing those that killed writers left), to know before any work that it can be written.

    Raises
    ------
    OSError
        It cannot be created there: a read-only or full file system, a name too long, no permission.
    ValueError
        ``a symlink loop`` (:func:`write_target`).
    """
    _, handle, temporary = _new_temporary(path)
    os.close(handle)
    os.unlink(temporary)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) while the block runs and raise it as ``KeyboardInterrupt`` once it is done,
    so that a write is never cut in the middle (where Python handles SIGINT: its main thread, its own
    handler; elsewhere nothing changes)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


def write_atomically(path: str | pathlib.Path, write: Callable[[IO[bytes]], Any],
                     suffix: str = ".tmp") -> None:
    """Write a file to ``path`` by ``write(stream)`` (a binary stream) through a temporary file in the
    same folder and a rename, so that an interruption leaves either the old file or the new one, never a
    partial one.

    The file gets a plain file's permissions (``0o666`` less the umask). A symlink is written through
    (:func:`write_target`: the file it leads to is replaced, the link kept). Ctrl-C during the write
    takes effect once the file is complete. The temporary's name holds the writer's process id
    (``.<name>.<pid>.<random><suffix>``, ``suffix`` ``.tmp`` or ``.npz``): a process killed while
    writing (SIGKILL) leaves it behind, and the next write to ``path`` removes it.
    """
    with _interrupts_held():
        target, handle, temporary = _new_temporary(path, suffix)
        try:
            os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes it private; a plain file would not be
            with os.fdopen(handle, "wb") as stream:
                write(stream)
            os.replace(temporary, target)
        except BaseException:
            os.unlink(temporary)
            raise


def write_npz_atomically(path: str | pathlib.Path, arrays: dict[str, Array]) -> None:
    """Write ``arrays`` to ``path`` as ``np.savez`` does, atomically (:func:`write_atomically`)."""
    write_atomically(path, lambda stream: np.savez(stream, **{key: np.asarray(value)
                                                             for key, value in arrays.items()}), ".npz")
