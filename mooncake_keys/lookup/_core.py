"""Picks the compiled core when it is there and allowed, the pure-Python twin otherwise.

``MOONCAKE_KEYS_NO_EXTENSIONS`` (any non-empty value) forces the pure-Python core, as do
interpreters other than CPython. :func:`get_core` names a core explicitly: a lookup engine can
pin one (``core="c"`` / ``"py"``), which is how the benchmarks put both side by side in one run.

A :class:`~mooncake_keys.Deployment` (which the engine and the KV pool are built on) resolves its
core once, when it is made, through :func:`get_core`: it is the only caller, and nothing else
reaches the core functions. :func:`default_core` changes what ``core=None`` means inside a
``with`` block (the tests run every behaviour on both cores that way).
"""

from __future__ import annotations

import os
import platform
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Iterator, Optional

from . import _core_py

NO_EXTENSIONS = bool(os.environ.get("MOONCAKE_KEYS_NO_EXTENSIONS")) or (
    platform.python_implementation() != "CPython"
)

#: True when the compiled core is the one in use.
ACCELERATED = False

_core_c: Optional[ModuleType] = None
if not NO_EXTENSIONS:
    try:
        from . import _core_c
    except ImportError:  # not built: no compiler, or a failed build
        _core_c = None

if TYPE_CHECKING:
    from ._core_py import fill_keys, reduce_presence
elif _core_c is not None:
    from ._core_c import fill_keys, reduce_presence

    ACCELERATED = True
else:
    from ._core_py import fill_keys, reduce_presence

CORE_NAMES = ("c", "py")
_default: Optional[str] = None  # set by default_core()


def get_core(name: Optional[str] = None) -> ModuleType:
    """The core module named ``"c"`` (compiled) or ``"py"`` (pure Python); None: the default
    (the active one, unless :func:`default_core` says otherwise)."""
    if name is None:
        name = _default
    if name is None:
        return _core_c if ACCELERATED else _core_py  # type: ignore[return-value]
    if name == "py":
        return _core_py
    if name == "c":
        if _core_c is None:
            raise ValueError("core='c': the compiled core is not built here, or MOONCAKE_KEYS_NO_EXTENSIONS is set")
        return _core_c
    raise ValueError(f"core must be one of {CORE_NAMES} or None, got {name!r}")


@contextmanager
def default_core(name: str) -> Iterator[ModuleType]:
    """Within the block, ``core=None`` means ``name``; yields that core module."""
    global _default
    module = get_core(name)
    saved, _default = _default, name
    try:
        yield module
    finally:
        _default = saved


__all__ = ["ACCELERATED", "CORE_NAMES", "NO_EXTENSIONS", "default_core", "fill_keys", "get_core", "reduce_presence"]
