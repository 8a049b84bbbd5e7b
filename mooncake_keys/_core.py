"""Picks the compiled core when it is there and allowed, the pure-Python twin otherwise.

``MOONCAKE_KEYS_NO_EXTENSIONS`` (any non-empty value) forces the pure-Python core, as do
interpreters other than CPython.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

NO_EXTENSIONS = bool(os.environ.get("MOONCAKE_KEYS_NO_EXTENSIONS")) or (
    platform.python_implementation() != "CPython"
)

#: True when the compiled core is the one in use.
ACCELERATED = False

if TYPE_CHECKING:
    from ._core_py import fill_keys, reduce_presence
else:
    if not NO_EXTENSIONS:
        try:
            from ._core_c import fill_keys, reduce_presence

            ACCELERATED = True
        except ImportError:  # not built: no compiler, or a failed build
            from ._core_py import fill_keys, reduce_presence
    else:
        from ._core_py import fill_keys, reduce_presence

__all__ = ["ACCELERATED", "NO_EXTENSIONS", "fill_keys", "reduce_presence"]
