"""Argument checks: the one place that turns a bad argument into a TypeError or ValueError
naming it. Every public entry point checks its arguments through these helpers."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["bool_arg", "int_arg", "str_arg", "text_arg", "seconds_arg", "tokens_arg", "skip_tokens_arg",
           "in_token_range", "utf8_encodable", "MAX_TOKENS", "MAX_SECONDS"]

#: The largest token count or block size accepted anywhere: vLLM's lookup wire format carries
#: token counts as u32, and no model comes near it.
MAX_TOKENS = (1 << 32) - 1
#: The longest time limit accepted (a day): longer ones overflow the clocks they are handed to.
MAX_SECONDS = 86400.0


def int_arg(name: str, value: Any, *, min: Optional[int] = None, max: Optional[int] = None) -> int:
    """``value`` if it is an ``int`` (not a bool) within ``[min, max]``; else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if min is not None and value < min:
        raise ValueError(f"{name} must be >= {min}, got {value}")
    if max is not None and value > max:
        raise ValueError(f"{name} must be <= {max}, got {value}")
    return int(value)


def tokens_arg(name: str, value: Any) -> int:
    """``value`` if it is a token count (an ``int``, not a bool) in ``[0, MAX_TOKENS]``; else
    TypeError/ValueError naming ``name``."""
    int_arg(name, value)
    if not 0 <= value <= MAX_TOKENS:
        raise ValueError(f"{name} must be a token count, 0 .. {MAX_TOKENS} (2**32 - 1, what vLLM's lookup can "
                         f"carry), got {value}")
    return int(value)


def skip_tokens_arg(value: Any, num_tokens: int, name: str = "num_tokens") -> int:
    """``skip_tokens`` if it is a token count no larger than ``num_tokens`` (the tokens held
    locally are part of the prompt: more than the prompt is a caller's mistake); else
    TypeError/ValueError naming ``skip_tokens``. ``name``: the caller's name of ``num_tokens``."""
    int_arg("skip_tokens", value, min=0)
    if value > num_tokens:
        raise ValueError(f"skip_tokens ({value}) must be <= {name} ({num_tokens}): it counts tokens of the prompt")
    return int(value)


def in_token_range(value: Any) -> bool:
    """Whether ``value`` is a token count :func:`tokens_arg` accepts (for callers that answer
    rather than raise: vLLM's drop-in)."""
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_TOKENS


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


def utf8_encodable(text: str) -> bool:
    """Whether UTF-8 can encode ``text`` (a lone surrogate cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_arg(name: str, value: Any) -> str:
    """``value`` if it is a ``str`` that UTF-8 can encode (it becomes part of a store key or an
    address); else TypeError/ValueError. A lone surrogate would otherwise fail every call later."""
    str_arg(name, value)
    if not utf8_encodable(value):
        raise ValueError(f"{name} must be valid text (UTF-8 encodable), got {value!r}: surrogates not allowed")
    return value


def seconds_arg(name: str, value: Any, *, max: float = MAX_SECONDS) -> float:
    """``value`` as a float if it is a finite real number in ``(0, max]`` (a time limit, in
    seconds or the unit its name says); else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not 0 < value <= max:  # nan fails both comparisons
        raise ValueError(f"{name} must be > 0 and <= {max:g}, got {value!r}")
    return value
