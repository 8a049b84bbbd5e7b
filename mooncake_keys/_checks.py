"""Argument checks: the one place that turns a bad argument into a TypeError or ValueError
naming it. Every public entry point checks its arguments through these helpers."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["bool_arg", "int_arg", "str_arg", "MAX_TOKENS"]

#: The largest token count or block size accepted anywhere: vLLM's lookup wire format carries
#: token counts as u32, and no model comes near it.
MAX_TOKENS = (1 << 32) - 1


def int_arg(name: str, value: Any, *, min: Optional[int] = None, max: Optional[int] = None) -> int:
    """``value`` if it is an ``int`` (not a bool) within ``[min, max]``; else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if min is not None and value < min:
        raise ValueError(f"{name} must be >= {min}, got {value}")
    if max is not None and value > max:
        raise ValueError(f"{name} must be <= {max}, got {value}")
    return int(value)


def bool_arg(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``; else TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def str_arg(name: str, value: Any) -> str:
    """``value`` if it is a ``str``; else TypeError."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value
