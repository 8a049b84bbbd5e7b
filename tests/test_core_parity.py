"""The two cores, called directly: the same arguments accepted, the same results, the same errors.

Nothing here goes through the dispatcher: each case calls ``_core_c`` and ``_core_py`` side by
side and compares the outcome (value, or exception type and message)."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.cores import CORE_C, CORE_PY

pytestmark = pytest.mark.c_extension
if CORE_C is None:
    pytest.skip("the compiled core is not built", allow_module_level=True)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome under test
        return ("raised", type(exc), str(exc))


def both(name, make_args):
    """Run core function ``name`` on fresh arguments from ``make_args()`` in each core."""
    got = []
    for core in (CORE_C, CORE_PY):
        args = make_args()
        got.append((outcome(getattr(core, name), *args), args))
    return got


def test_the_same_public_names():
    assert CORE_C.__all__ == CORE_PY.__all__
    assert CORE_PY.REUSES_STRINGS is False and isinstance(CORE_C.REUSES_STRINGS, bool)


GOOD = dict(pos=0, heads=("a@", "b@"), blob=bytes(range(8)), hash_len=2, index=array("q", [0, 3]))

BAD_FILL = {
    "out not a list": dict(out=(None,) * 4),
    "pos not an int": dict(pos=0.0),
    "pos bool is an int subclass": dict(pos=True),
    "negative pos": dict(pos=-1),
    "heads a list": dict(heads=["a@", "b@"]),
    "heads with bytes": dict(heads=("a@", b"b@")),
    "heads with a str subclass": dict(heads=("a@", type("S", (str,), {})("b@"))),
    "blob not bytes-like": dict(blob="abcd"),
    "blob not contiguous": dict(blob=memoryview(bytes(range(16)))[::2]),
    "hash_len zero": dict(hash_len=0),
    "hash_len negative": dict(hash_len=-2),
    "hash_len float": dict(hash_len=2.0),
    "index a list": dict(index=[0, 3]),
    "index of int32": dict(index=array("i", [0, 3])),
    "index negative": dict(index=array("q", [-1])),
    "index past the blob": dict(index=array("q", [4])),
    "out too short": dict(index=array("q", [0, 1, 2])),
    "blob a non-byte memoryview": dict(blob=memoryview(bytes(range(8))).cast("H")),
    "index a numpy-like format": dict(index=memoryview(array("l", [0, 3]))),
    "tails a list": dict(tails=["_k", "_v"]),
    "tails with bytes": dict(tails=("_k", b"_v")),
    "tails with a str subclass": dict(tails=("_k", type("S", (str,), {})("_v"))),
    "fewer tails than heads": dict(tails=("_k",)),
    "more tails than heads": dict(tails=("_k", "_v", "_w")),
    "tails with an out too short": dict(tails=("_k", "_v"), index=array("q", [0, 1, 2])),
}


@pytest.mark.parametrize("case", sorted(BAD_FILL))
def test_fill_keys_rejects_the_same_arguments_the_same_way(case):
    def make():
        args = dict(out=[None] * 4, **GOOD)
        args.update(BAD_FILL[case])
        tails = (args["tails"],) if "tails" in args else ()
        return (args["out"], args["pos"], args["heads"], args["blob"], args["hash_len"], args["index"]) + tails

    (c, c_args), (p, p_args) = both("fill_keys", make)
    assert c == p
    if case not in ("pos bool is an int subclass", "blob a non-byte memoryview", "index a numpy-like format"):
        assert c[0] == "raised", c
    if type(c_args[0]) is list:
        assert c_args[0] == p_args[0]  # nothing half-written by one core only


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 6), r=st.integers(0, 4), hash_len=st.integers(1, 70), pos=st.integers(0, 3),
    seed=st.integers(0, 2**32), head_chars=st.sampled_from(["ascii", "latin1", "bmp", "astral"]),
)
def test_fill_keys_gives_the_same_keys(n, r, hash_len, pos, seed, head_chars):
    rnd = random.Random(seed)
    alphabet = {"ascii": "m@:x", "latin1": "é@ñ", "bmp": "модель日本", "astral": "🚀a"}[head_chars]
    heads = tuple("".join(rnd.choice(alphabet) for _ in range(rnd.randrange(1, 9))) for _ in range(r))
    blob = rnd.randbytes(6 * hash_len)
    index = array("q", [rnd.randrange(6) for _ in range(n)])
    size = pos + n * r + rnd.randrange(3)
    (c, c_args), (p, p_args) = both("fill_keys", lambda: ([None] * size, pos, heads, blob, hash_len, index))
    assert c == p == ("ok", pos + n * r)
    assert c_args[0] == p_args[0]
    assert c_args[0][pos:pos + n * r] == [h + blob[i * hash_len:(i + 1) * hash_len].hex() for i in index for h in heads]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 6), r=st.integers(0, 4), hash_len=st.integers(1, 70), pos=st.integers(0, 3),
    seed=st.integers(0, 2**32), chars=st.sampled_from(["ascii", "latin1", "bmp", "astral"]),
    tail_chars=st.sampled_from(["ascii", "latin1", "bmp", "astral", "empty"]),
    reuse=st.booleans(),
)
def test_fill_keys_with_tails_gives_the_same_keys(n, r, hash_len, pos, seed, chars, tail_chars, reuse):
    """Keys of the form head + hex + tail (SGLang's ``<prefix>_<hash>_<rank>_k``): the same in both
    cores, whatever the characters of heads and tails, and whether or not ``out`` holds strings
    the compiled core may rewrite in place."""
    rnd = random.Random(seed)
    alphabet = {"ascii": "m_:x", "latin1": "é_ñ", "bmp": "модель日本", "astral": "🚀a", "empty": ""}

    def text(kind, lo):
        return "".join(rnd.choice(alphabet[kind]) for _ in range(rnd.randrange(lo, 9) if alphabet[kind] else 0))

    heads = tuple(text(chars, 0) for _ in range(r))
    tails = tuple(text(tail_chars, 0) for _ in range(r))
    blob = rnd.randbytes(6 * hash_len)
    index = array("q", [rnd.randrange(6) for _ in range(n)])
    size = pos + n * r + rnd.randrange(3)
    want = [h + blob[i * hash_len:(i + 1) * hash_len].hex() + t for i in index for h, t in zip(heads, tails)]

    def make():
        # Fresh strings of each key's final length: ones the compiled core may write into.
        out = ["".join(rnd.choice("xyz") for _ in range(len(w))) for w in [""] * pos + want] if reuse else []
        return (out + [None] * (size - len(out)), pos, heads, blob, hash_len, index, tails)

    (c, c_args), (p, p_args) = both("fill_keys", make)
    assert c == p == ("ok", pos + n * r)
    assert c_args[0][pos:pos + n * r] == p_args[0][pos:pos + n * r] == want


def test_fill_keys_without_tails_is_as_before():
    """``tails=None`` (what vLLM's keys pass) builds exactly the keys of the six-argument call."""
    blob, index = bytes(range(12)), array("q", [2, 0, 1])
    for core in (CORE_C, CORE_PY):
        a, b = [None] * 6, [None] * 6
        assert core.fill_keys(a, 0, ("a@", "b@"), blob, 4, index) == core.fill_keys(b, 0, ("a@", "b@"), blob, 4, index, None)
        assert a == b == [h + blob[i * 4:i * 4 + 4].hex() for i in index for h in ("a@", "b@")]


class Weird:
    def __eq__(self, other):  # never to be called by a reduction
        raise AssertionError("__eq__ called")

    __hash__ = object.__hash__


class IntSub(int):
    def __eq__(self, other):
        raise AssertionError("__eq__ called")

    __hash__ = int.__hash__


ITEMS = [1, 0, -1, 2, -900, True, False, 1 << 70, -(1 << 70), 1.0, "1", None, b"\x01", Weird(), IntSub(1),
         IntSub(0)]


@settings(max_examples=300, deadline=None)
@given(items=st.lists(st.sampled_from(range(len(ITEMS))), max_size=40), r=st.integers(1, 5))
def test_reduce_presence_gives_the_same_flags(items, r):
    results = [ITEMS[i] for i in items]
    results = results[: len(results) // r * r]
    (c, _), (p, _) = both("reduce_presence", lambda: (list(results), r))
    assert c == p
    flags, present = c[1]
    one = [type(x) in (int, bool, IntSub) and int(x) == 1 for x in results]
    assert list(flags) == [int(all(one[i * r:(i + 1) * r])) for i in range(len(results) // r)]
    assert present == sum(one)  # the keys a store answered present: the read leases taken


@pytest.mark.parametrize("results,r", [
    ((1, 1), 1), ({1: 1}, 1), (None, 1), (b"\x01", 1), (type("L", (list,), {})([1]), 1),
    ([1, 1, 1], 2), ([1], 0), ([1], -1), ([1], 1.0), ([1], True),
])
def test_reduce_presence_rejects_the_same_arguments_the_same_way(results, r):
    (c, _), (p, _) = both("reduce_presence", lambda: (results, r))
    assert c == p
    if r is not True:
        assert c[0] == "raised"


def test_reduce_presence_survives_an_item_that_empties_the_list():
    """An item whose ``__eq__`` empties the list crashed the compiled core.
    No item's ``__eq__`` runs now, so the list cannot change under the reduction."""

    class Emptier:
        def __init__(self, lst):
            self.lst = lst

        def __eq__(self, other):
            self.lst.clear()
            return True

        __hash__ = object.__hash__

    for core in (CORE_C, CORE_PY):
        results = [1] * 64
        results[1] = Emptier(results)
        flags, present = core.reduce_presence(results, 8)
        assert list(flags) == [0] + [1] * 7 and present == 63 and len(results) == 64

