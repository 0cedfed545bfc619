"""The stand-in's ``cupy.ndarray`` and ``cupy.<function>``: NumPy underneath, CuPy's rules on top.

Rules enforced (each one a way a test could pass here and fail on a GPU):

- a host ``numpy.ndarray`` is refused wherever CuPy refuses it (ufuncs, array functions, kernel
  arguments, operators with a device array), and ``numpy.asarray(device_array)`` raises like CuPy's
  ``__array__``; only the functions that upload (``asarray``, ``array``) and item assignment take
  host data, counted as uploads;
- a function, method or keyword argument the installed CuPy does not have raises (see
  :mod:`._reference`); NumPy functions called on device arrays dispatch to the CuPy function of the
  same name, or raise when CuPy has none;
- reductions and integer indexing give 0-d device arrays, as CuPy does, and turning one into a Python
  value (``bool``, ``int``, ``float``, ``item``, ``tolist``, ``get``) is a host synchronisation,
  recorded in :data:`STATS` so tests can count them;
- ``empty``/``empty_like`` memory is filled with NaN (or a byte pattern): a kernel that reads memory
  nobody wrote produces garbage here as it would on a GPU.
"""

from __future__ import annotations

import functools
import operator
import pathlib
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ._reference import Reference


@dataclass
class Stats:
    """What the code under test asked of the device: kernel launches and host synchronisations."""

    launches: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)
    uploads: int = 0

    def sync(self, reason: str) -> None:
        """Record a synchronising call, with the code line that made it."""
        frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith(_PACKAGE)]
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
        self.syncs.append(f"{reason} at {where}")

    def clear(self) -> None:
        self.launches.clear()
        self.syncs.clear()
        self.uploads = 0


_PACKAGE = str(pathlib.Path(__file__).resolve().parent)
STATS = Stats()
REFERENCE: Reference | None = None
_PINNED: dict[int, tuple[int, np.ndarray]] = {}  # start address -> (end address, buffer) of pinned memory


def reference() -> Reference:
    assert REFERENCE is not None, "cupy_standin.install() sets the reference first"
    return REFERENCE


def is_pinned(array: np.ndarray) -> bool:
    """Whether ``array``'s memory lies in a buffer from ``cupyx.empty_pinned`` and friends."""
    start = array.__array_interface__["data"][0]
    end = start + array.nbytes
    return any(s <= start and end <= e for s, (e, _) in _PINNED.items())


def pin(array: np.ndarray) -> np.ndarray:
    start = array.__array_interface__["data"][0]
    _PINNED[start] = (start + max(array.nbytes, 1), array)
    return array


def check_keywords(owner: str, name: str, parameters: dict | None, kwargs: dict) -> None:
    """Refuse keyword arguments that CuPy's ``owner.name`` does not take."""
    if not kwargs or parameters is None or parameters.get("varkw"):
        return
    unknown = sorted(set(kwargs) - set(parameters["names"]))
    if unknown:
        raise TypeError(f"{owner}.{name}() got unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(CuPy {reference().version} takes {', '.join(parameters['names']) or 'none'})")


def host_array_error(value: Any) -> TypeError:
    return TypeError(f"Unsupported type {type(value)} (a host numpy.ndarray given where CuPy needs a "
                     "cupy.ndarray: move it with cupy.asarray first)")


def unwrap(value: Any, *, host_ok: bool = False) -> Any:
    """NumPy view of stand-in arrays inside ``value``; host arrays refused unless ``host_ok``."""
    if isinstance(value, ndarray):
        return value._array
    if isinstance(value, np.ndarray):
        if not host_ok:
            raise host_array_error(value)
        STATS.uploads += 1
        if not is_pinned(value):
            STATS.sync("upload from pageable host memory")
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(unwrap(v, host_ok=host_ok) for v in value)
    return value


def wrap(value: Any) -> Any:
    """Stand-in arrays for the NumPy arrays (and NumPy scalars: CuPy returns 0-d arrays) in ``value``."""
    if isinstance(value, np.ndarray):
        return ndarray._of(value)
    if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_)):
        return ndarray._of(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(wrap(v) for v in value)
    if isinstance(value, list):
        return [wrap(v) for v in value]
    return value


def _garbage(array: np.ndarray) -> np.ndarray:
    """Fill fresh ``empty`` memory with what nobody should read: NaN, or 0x5A bytes."""
    if array.dtype.kind in "fc":
        array.fill(np.nan)
    elif array.size:
        array.view(np.uint8).fill(0x5A)
    return array


def _device_dtype(dtype: Any) -> None:
    if dtype is not None and np.dtype(dtype).kind in "OUSVMm":
        raise TypeError(f"Unsupported dtype {np.dtype(dtype)} (CuPy arrays hold numbers and booleans)")


_UPLOADING = {"asarray", "array", "asanyarray"}
_SYNCING = {"asnumpy"}


def _numpy_function(name: str) -> Callable[..., Any]:
    if name == "asnumpy":
        return lambda a, stream=None, order="C", out=None, blocking=True: np.array(a, order=order)
    function = getattr(np, name, None)
    if function is None:
        raise AttributeError(f"the CuPy stand-in has no NumPy counterpart for cupy.{name}")
    return function


def _out_argument(kwargs: dict) -> Any:
    out = kwargs.get("out")
    if out is not None and not isinstance(out, ndarray):
        raise TypeError(f"out must be a cupy.ndarray; got {type(out)}")
    return out


def _memory_functions() -> dict[str, Callable[..., Any]]:
    def empty(shape, dtype=float, order="C"):
        _device_dtype(dtype)
        return ndarray._of(_garbage(np.empty(shape, dtype=dtype, order=order)))

    def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
        if not isinstance(prototype, ndarray):
            raise host_array_error(prototype) if isinstance(prototype, np.ndarray) else TypeError(
                f"empty_like needs a cupy.ndarray; got {type(prototype)}")
        _device_dtype(dtype)
        return ndarray._of(_garbage(np.empty_like(prototype._array, dtype=dtype, order=order, shape=shape)))

    return {"empty": empty, "empty_like": empty_like}


@functools.lru_cache(maxsize=None)
def function(name: str) -> Callable[..., Any]:
    """``cupy.<name>`` of the stand-in (AttributeError when the installed CuPy has no such name)."""
    entry = reference().cupy.get(name)
    if entry is None:
        raise AttributeError(f"module 'cupy' has no attribute '{name}' (CuPy {reference().version})")
    special = _memory_functions().get(name)
    if entry["kind"] == "ufunc":
        return ufunc(name)
    implementation = special or _numpy_function(name)
    host_ok = name in _UPLOADING
    parameters = entry.get("parameters")

    @functools.wraps(implementation)
    def call(*args: Any, **kwargs: Any) -> Any:
        check_keywords("cupy", name, parameters, kwargs)
        if name in _SYNCING:
            STATS.sync(f"cupy.{name}")
            return implementation(*[unwrap(a) for a in args], **kwargs)
        if special is not None:
            return implementation(*args, **kwargs)
        _device_dtype(kwargs.get("dtype"))
        out = _out_argument(kwargs)
        if name in _UPLOADING:
            kwargs.pop("blocking", None)  # NumPy has no such keyword: CuPy's copy from host is synchronous
        result = implementation(*unwrap(args, host_ok=host_ok),
                                **{k: unwrap(v, host_ok=host_ok) for k, v in kwargs.items()})
        return out if out is not None else wrap(result)

    return call


class ufunc:
    """A CuPy ufunc: device arrays and scalars in, device arrays out; ``reduce`` and friends if CuPy
    has them."""

    def __init__(self, name: str) -> None:
        self.__name__ = name
        self._numpy = getattr(np, name)
        self._entry = reference().cupy[name]
        self.nin, self.nout = self._numpy.nin, self._numpy.nout

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        check_keywords("cupy", self.__name__, self._entry.get("parameters"), kwargs)
        _device_dtype(kwargs.get("dtype"))
        out = _out_argument(kwargs)
        result = self._numpy(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
        return out if out is not None else wrap(result)

    def __getattr__(self, method: str) -> Any:
        if method not in self._entry.get("methods", ()):
            raise AttributeError(f"cupy.{self.__name__} has no method {method!r}")
        numpy_method = getattr(self._numpy, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = _out_argument(kwargs)
            result = numpy_method(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
            return out if out is not None else wrap(result)

        return call

    def __repr__(self) -> str:
        return f"<ufunc 'cupy.{self.__name__}' (stand-in)>"


def host_ufunc(name: str, implementation: Callable[..., Any]) -> Callable[..., Any]:
    """A ufunc of ``cupyx`` (``cupyx.scipy.special.erf``): device arrays in and out, like :class:`ufunc`."""

    def call(*args: Any, **kwargs: Any) -> Any:
        check_keywords("cupyx.scipy.special", name, {"names": ["out", "dtype", "casting"], "varkw": False},
                       kwargs)
        out = _out_argument(kwargs)
        result = implementation(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
        return out if out is not None else wrap(result)

    call.__name__ = name
    return call


class MemoryPointer:
    """``ndarray.data``: the device address (here the host address) of the first element."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __int__(self) -> int:
        return self.ptr


def _binary(name: str, reflected: bool = False, inplace: bool = False) -> Callable[..., Any]:
    def method(self: "ndarray", other: Any) -> Any:
        if isinstance(other, np.ndarray):
            raise host_array_error(other)
        if not isinstance(other, (ndarray, int, float, complex, bool, np.generic)):
            return NotImplemented
        operands = (other, self) if reflected else (self, other)
        if inplace:
            function(name)(*operands, out=self)
            return self
        return function(name)(*operands)

    return method


def _unary(name: str) -> Callable[..., Any]:
    return lambda self: function(name)(self)


class ndarray:
    """A device array of the stand-in: a NumPy array that the code under test sees as ``cupy.ndarray``."""

    __array_priority__ = 100.0
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, shape: Any, dtype: Any = float, memptr: Any = None, strides: Any = None,
                 order: str = "C") -> None:
        if memptr is not None or strides is not None:
            raise NotImplementedError("the CuPy stand-in makes arrays from a shape and dtype only")
        _device_dtype(dtype)
        self._array = _garbage(np.empty(shape, dtype=dtype, order=order))

    @classmethod
    def _of(cls, array: np.ndarray) -> "ndarray":
        _device_dtype(array.dtype)
        self = cls.__new__(cls)
        self._array = array
        return self

    # --- attributes ------------------------------------------------------------------------------
    shape = property(lambda self: self._array.shape)
    dtype = property(lambda self: self._array.dtype)
    ndim = property(lambda self: self._array.ndim)
    size = property(lambda self: self._array.size)
    itemsize = property(lambda self: self._array.itemsize)
    nbytes = property(lambda self: self._array.nbytes)
    strides = property(lambda self: self._array.strides)
    flags = property(lambda self: self._array.flags)
    T = property(lambda self: ndarray._of(self._array.T))
    real = property(lambda self: ndarray._of(self._array.real))
    imag = property(lambda self: ndarray._of(self._array.imag))
    data = property(lambda self: MemoryPointer(self._array.__array_interface__["data"][0]))

    @property
    def device(self) -> Any:
        from ._cuda import Device

        return Device(0)

    @property
    def __cuda_array_interface__(self) -> dict:
        interface = dict(self._array.__array_interface__)
        interface["version"] = 3
        interface["stream"] = 1
        return interface

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """The memory shared with a consumer (PyTorch's ``from_dlpack``): the NumPy array's capsule, so
        the consumer sees this very memory, as on a GPU it sees the device buffer (in the capsule version
        the consumer asks for: mpi4py's buffers ask for a versioned one)."""
        return self._array.__dlpack__(max_version=max_version)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()

    # --- CuPy's refusals -------------------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
                        "construct a NumPy array explicitly.")

    def __array_ufunc__(self, numpy_ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        name = numpy_ufunc.__name__
        if name not in reference().cupy or reference().cupy[name]["kind"] != "ufunc":
            return NotImplemented
        target = function(name)
        if method != "__call__":
            target = getattr(target, method)
        return target(*inputs, **kwargs)

    def __array_function__(self, numpy_function: Any, types: Any, args: Any, kwargs: Any) -> Any:
        name = numpy_function.__name__
        if name not in reference().cupy:
            return NotImplemented
        return function(name)(*args, **kwargs)

    # --- host synchronisations -------------------------------------------------------------------
    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        """Copy to the host (a synchronisation unless ``blocking=False`` into pinned ``out``)."""
        if out is not None:
            if not (isinstance(out, np.ndarray) and out.shape == self.shape):
                raise ValueError("out must be a numpy.ndarray of the array's shape")
            if blocking or not is_pinned(out):
                STATS.sync("ndarray.get")
            np.copyto(out, self._array)
            return out
        STATS.sync("ndarray.get")
        return np.array(self._array, order=order)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """Copy ``arr`` from the host: asynchronous only from pinned memory."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"set needs a numpy.ndarray; got {type(arr)}")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set: shape/dtype mismatch ({arr.shape}, {arr.dtype}) for "
                             f"({self.shape}, {self.dtype})")
        if not self._array.flags.c_contiguous:
            raise RuntimeError("set: the device array must be C-contiguous")
        STATS.uploads += 1
        if not is_pinned(arr):
            STATS.sync("ndarray.set from pageable host memory")
        np.copyto(self._array, arr)

    def item(self) -> Any:
        STATS.sync("ndarray.item")
        return self._array.item()

    def tolist(self) -> Any:
        STATS.sync("ndarray.tolist")
        return self._array.tolist()

    def _scalar(self, convert: Callable[[Any], Any], what: str) -> Any:
        if self.size != 1:
            raise TypeError(f"only size-1 arrays can be converted to Python scalars ({what})")
        STATS.sync(f"{what}(device array)")
        return convert(self._array.reshape(()).item())

    def __bool__(self) -> bool:
        return self._scalar(bool, "bool")

    def __int__(self) -> int:
        return self._scalar(int, "int")

    def __float__(self) -> float:
        return self._scalar(float, "float")

    def __complex__(self) -> complex:
        return self._scalar(complex, "complex")

    def __index__(self) -> int:
        if self.dtype.kind not in "iub" or self.ndim:
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return self._scalar(operator.index, "index")

    def __format__(self, spec: str) -> str:
        if self.ndim == 0:
            return format(self._scalar(lambda v: v, "format"), spec)
        return format(str(self), spec)

    def __repr__(self) -> str:
        STATS.sync("repr")
        return repr(self._array).replace("array(", "array(", 1)

    def __str__(self) -> str:
        STATS.sync("str")
        return str(self._array)

    # --- indexing ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self) -> Any:
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, key: Any) -> "ndarray":
        return wrap(self._array[unwrap(key, host_ok=True)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._array[unwrap(key, host_ok=True)] = unwrap(value, host_ok=True)

    # --- methods: CuPy's names, NumPy's work -----------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        entry = reference().ndarray.get(name)
        if entry is None:
            raise AttributeError(f"'cupy.ndarray' object has no attribute '{name}' "
                                 f"(CuPy {reference().version})")
        numpy_method = getattr(self._array, name)
        if not callable(numpy_method):
            return wrap(numpy_method)

        def call(*args: Any, **kwargs: Any) -> Any:
            check_keywords("ndarray", name, entry.get("parameters"), kwargs)
            out = _out_argument(kwargs)
            if name == "astype":
                _device_dtype(args[0] if args else kwargs.get("dtype"))
            result = numpy_method(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
            return out if out is not None else wrap(result)

        return call

    # --- operators -----------------------------------------------------------------------------------
    __add__, __radd__, __iadd__ = _binary("add"), _binary("add", True), _binary("add", inplace=True)
    __sub__, __rsub__, __isub__ = (_binary("subtract"), _binary("subtract", True),
                                   _binary("subtract", inplace=True))
    __mul__, __rmul__, __imul__ = (_binary("multiply"), _binary("multiply", True),
                                   _binary("multiply", inplace=True))
    __truediv__, __rtruediv__, __itruediv__ = (_binary("true_divide"), _binary("true_divide", True),
                                               _binary("true_divide", inplace=True))
    __floordiv__, __rfloordiv__ = _binary("floor_divide"), _binary("floor_divide", True)
    __mod__, __rmod__ = _binary("remainder"), _binary("remainder", True)
    __pow__, __rpow__, __ipow__ = _binary("power"), _binary("power", True), _binary("power", inplace=True)
    __matmul__, __rmatmul__ = _binary("matmul"), _binary("matmul", True)
    __and__, __rand__, __iand__ = (_binary("bitwise_and"), _binary("bitwise_and", True),
                                   _binary("bitwise_and", inplace=True))
    __or__, __ror__, __ior__ = (_binary("bitwise_or"), _binary("bitwise_or", True),
                                _binary("bitwise_or", inplace=True))
    __xor__, __rxor__ = _binary("bitwise_xor"), _binary("bitwise_xor", True)
    __lshift__, __rshift__ = _binary("left_shift"), _binary("right_shift")
    __eq__, __ne__ = _binary("equal"), _binary("not_equal")  # type: ignore[assignment]
    __lt__, __le__ = _binary("less"), _binary("less_equal")
    __gt__, __ge__ = _binary("greater"), _binary("greater_equal")
    __neg__, __pos__, __abs__, __invert__ = (_unary("negative"), _unary("positive"), _unary("absolute"),
                                             _unary("invert"))


ndarray.__module__ = "cupy"  # as type(cupy.ndarray(...)).__module__ is: code tells device arrays by it
ufunc.__module__ = "cupy"


def from_dlpack(array: Any, *, device: Any = None, copy: Any = None) -> ndarray:
    """``cupy.from_dlpack``: a device array sharing the producer's memory (no copy, no upload). The
    stand-in's device is the host, so it takes what NumPy's ``from_dlpack`` takes (a CPU tensor: the
    PyTorch bridge's device path run on host tensors); a GPU takes CUDA memory only."""
    if device is not None or copy:
        raise NotImplementedError("the CuPy stand-in's from_dlpack shares memory only (no device, no copy)")
    return ndarray._of(np.from_dlpack(array))


def timer() -> float:
    return time.perf_counter()
