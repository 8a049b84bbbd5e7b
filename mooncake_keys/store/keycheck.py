"""What a Mooncake client can be sent as a key: a ``str`` that encodes as strict UTF-8.

The client would fail the whole batch on a lone surrogate, and would take ``bytes`` as an alias
of the same key; both stores refuse them up front with a TypeError naming the bad key.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_batch", "check_key", "check_keys"]


def check_key(key: object, name: str = "key") -> str:
    """``key`` if it is a str the client can send; else TypeError naming ``name``."""
    if not isinstance(key, str):
        raise TypeError(f"{name} must be str, got {type(key).__name__}")
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TypeError(f"{name} is not valid UTF-8 ({exc.reason} at position {exc.start})") from None
    return key


def check_keys(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list after checking every key (TypeError naming the first bad index).

    ``keys`` must be a list or tuple of str.
    """
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"keys must be a list or tuple of str, got {type(keys).__name__}")
    try:
        # Fast path, one C-level pass: ~1.3 ms for 100k ASCII keys.
        if all(map(str.isascii, keys)):
            return keys if isinstance(keys, list) else list(keys)
    except TypeError:  # a non-str element: found below
        pass
    for i, key in enumerate(keys):
        check_key(key, f"keys[{i}]")
    return keys if isinstance(keys, list) else list(keys)


def check_batch(keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[str]:
    """:func:`check_keys`, and ``keys``, ``ptrs`` and ``sizes`` of one length (ValueError)."""
    checked = check_keys(keys)
    if not len(checked) == len(ptrs) == len(sizes):
        raise ValueError(f"keys, ptrs and sizes differ in length: {len(checked)}, {len(ptrs)}, {len(sizes)}")
    return checked
