"""Names of a package loaded on first use (PEP 562), so importing the package imports nothing heavy.

Examples
--------
>>> namespace = {"__all__": ["sqrt"], "__name__": "demo"}
>>> getattr_, dir_ = lazy_attributes("json", namespace, {"sqrt": "decoder"})
>>> dir_()
['__all__', '__name__', 'sqrt']
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, namespace: dict[str, Any], homes: Mapping[str, str],
                    modules: tuple[str, ...] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose names load on first use.

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    namespace : dict
        Its ``globals()``: a name, once loaded, is stored there, so later lookups skip
        ``__getattr__``.
    homes : mapping
        Name -> the submodule (relative to ``package``) that defines it.
    modules : tuple of str
        Submodules given as attributes.

    Returns
    -------
    tuple of callable
        ``__getattr__(name)`` and ``__dir__()`` (``__all__`` and the dunder names).
    """

    def __getattr__(name: str) -> Any:
        if name in modules:
            return importlib.import_module(f".{name}", package)
        if name in homes:
            value = getattr(importlib.import_module(f".{homes[name]}", package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace["__all__"]) | {name for name in namespace if name.startswith("__")})

    return __getattr__, __dir__
