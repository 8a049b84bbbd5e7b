# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled core: key building and rank reduction (the twin of ``_core_py.py``).

Same functions, same arguments, same errors as the pure twin (the argument checks are shared
with it: ``_core_py._check_fill_args``). Keys are written straight into ``str`` objects: head
characters, then the lowercase hex of the hash read from the blob, with no intermediate
``.hex()`` objects.

String reuse, and why it is here: a cold lookup of 16,384 keys spends about half its client
time allocating the new strings and freeing the previous lookup's (CPython hands emptied arenas
back to the OS, and the next lookup page-faults them in again); rewriting the previous lookup's
strings in place measured 1.9x (scenario a) to 2.5x (scenario b) faster cold lookups
(docs/benchmarks.md). A string is rewritten only under the conditions CPython itself requires
before it modifies a str in place (``unicode_modifiable`` in Objects/unicodeobject.c: exact
type, one reference, hash not computed, not interned), and only when it is compact ASCII of the
right length with no cached ``wchar_t`` copy (Python < 3.12), so that no other representation
of it can go stale. Never on free-threaded builds, where a reference count of 1 proves nothing.
"""

from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from cpython.list cimport PyList_GET_ITEM, PyList_SET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_Check
from libc.string cimport memcpy

from ._core_py import _check_fill_args


cdef extern from *:
    """
    #include <Python.h>
    #ifdef Py_GIL_DISABLED
    #define MK_REUSES_STRINGS 0
    #else
    #define MK_REUSES_STRINGS 1
    #endif
    static int mk_rewritable(PyObject *s, Py_ssize_t length) {
    #ifdef Py_GIL_DISABLED
        return 0;
    #else
        if (!PyUnicode_CheckExact(s) || Py_REFCNT(s) != 1) return 0;
        if (PyUnicode_CHECK_INTERNED(s)) return 0;
        if (((PyASCIIObject *)s)->hash != -1) return 0;
        if (!PyUnicode_IS_COMPACT_ASCII(s) || PyUnicode_GET_LENGTH(s) != length) return 0;
    #if PY_VERSION_HEX < 0x030C0000
        if (((PyASCIIObject *)s)->wstr != NULL) return 0;
    #endif
        return 1;
    #endif
    }
    """
    int mk_rewritable(PyObject* s, Py_ssize_t length)
    int MK_REUSES_STRINGS


cdef extern from "Python.h":
    ctypedef unsigned int Py_UCS4
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    void* PyUnicode_DATA(object o)
    int PyUnicode_KIND(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    Py_UCS4 PyUnicode_MAX_CHAR_VALUE(object o)
    int PyUnicode_IS_ASCII(object o)
    void PyUnicode_WRITE(int kind, void* data, Py_ssize_t index, Py_UCS4 value)
    Py_ssize_t PyUnicode_CopyCharacters(object to, Py_ssize_t to_start, object from_,
                                        Py_ssize_t from_start, Py_ssize_t how_many) except -1
    long PyLong_AsLongAndOverflow(object o, int* overflow) except? -1

__all__ = ["REUSES_STRINGS", "fill_keys", "reduce_presence"]

#: Whether ``fill_keys`` can rewrite spare strings in place (not on free-threaded builds).
REUSES_STRINGS = bool(MK_REUSES_STRINGS)

cdef const char* HEXDIGITS = b"0123456789abcdef"
cdef unsigned short HEXPAIRS[256]
cdef int _i
for _i in range(256):
    # Two ASCII digits per byte, in memory order (the first digit at the lower address).
    (<unsigned char*>&HEXPAIRS[_i])[0] = HEXDIGITS[_i >> 4]
    (<unsigned char*>&HEXPAIRS[_i])[1] = HEXDIGITS[_i & 15]


cdef inline void _hexlify(const unsigned char* h, Py_ssize_t hash_len, unsigned char* out) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(hash_len):
        memcpy(out + 2 * k, &HEXPAIRS[h[k]], 2)


cdef inline object _take_spare(list spare, Py_ssize_t* left, Py_ssize_t length):
    """The last rewritable str of ``spare`` (its slot set to None), or None when none is left."""
    cdef PyObject* s
    cdef object taken
    while left[0] > 0:
        left[0] -= 1
        s = PyList_GET_ITEM(spare, left[0])
        if not mk_rewritable(s, length):
            continue
        taken = <object>s  # a second reference, ours
        Py_INCREF(None)
        PyList_SET_ITEM(spare, left[0], None)
        Py_DECREF(taken)  # the list's reference: ours is the only one left
        return taken
    return None


cdef inline object _make_key(object head, bint head_ascii, const unsigned char* hexed,
                             Py_ssize_t hex_len, list spare, Py_ssize_t* left):
    """``head`` then ``hex_len`` ASCII hex digits, in a rewritten spare str or a new one."""
    cdef Py_ssize_t hl = PyUnicode_GET_LENGTH(head)
    cdef Py_ssize_t k
    cdef unsigned char* dst
    cdef void* data
    cdef int kind
    cdef object s = None
    if head_ascii:
        if left[0] > 0:
            s = _take_spare(spare, left, hl + hex_len)
        if s is None:
            s = PyUnicode_New(hl + hex_len, 127)
        dst = <unsigned char*>PyUnicode_DATA(s)
        memcpy(dst, PyUnicode_DATA(head), hl)
        memcpy(dst + hl, hexed, hex_len)
        return s
    # Non-ASCII model name or cache prefix: same characters, wider storage, never reused.
    s = PyUnicode_New(hl + hex_len, PyUnicode_MAX_CHAR_VALUE(head))
    PyUnicode_CopyCharacters(s, 0, head, 0, hl)
    kind = PyUnicode_KIND(s)
    data = PyUnicode_DATA(s)
    for k in range(hex_len):
        PyUnicode_WRITE(kind, data, hl + k, hexed[k])
    return s


cdef inline void _put(list out, Py_ssize_t i, object s):
    cdef PyObject* prev = PyList_GET_ITEM(out, i)
    Py_INCREF(s)
    PyList_SET_ITEM(out, i, s)
    Py_DECREF(<object>prev)


def fill_keys(out, pos, heads, blob, hash_len, index, spare=None):
    """Write ``len(index) * len(heads)`` keys into ``out[pos:]``; return the position after them.

    See ``_core_py.fill_keys`` for the contract; this one is the same, compiled.
    """
    bv, iv = _check_fill_args(out, pos, heads, blob, hash_len, index, spare)
    cdef const unsigned char[::1] b = bv.cast("B") if bv.format != "B" or bv.ndim != 1 else bv
    cdef const long long[::1] idx = iv
    cdef list lst = <list>out
    cdef tuple hs = <tuple>heads
    cdef Py_ssize_t r = len(hs)
    cdef Py_ssize_t n = idx.shape[0]
    cdef Py_ssize_t hlen = hash_len
    cdef Py_ssize_t p = pos
    cdef Py_ssize_t c, j
    cdef Py_ssize_t left = len(spare) if spare is not None else 0
    cdef list sp = <list>spare if spare is not None else None
    cdef unsigned char[128] hexed  # 2 x the longest hash (64 bytes); longer ones use a bytearray
    cdef bytearray big = None
    cdef unsigned char* hx = hexed
    if n == 0 or r == 0:
        return p
    if 2 * hlen > 128:
        big = bytearray(2 * hlen)
        hx = big
    cdef bytearray ascii = bytearray([PyUnicode_IS_ASCII(h) for h in hs])
    cdef const unsigned char[::1] asc = ascii
    for c in range(n):
        _hexlify(&b[0] + idx[c] * hlen, hlen, hx)
        for j in range(r):
            _put(lst, p, _make_key(hs[j], asc[j], hx, 2 * hlen, sp, &left))
            p += 1
    return p


cdef inline bint _present(object v) noexcept:
    """An int (bools included) equal to 1: no user code runs."""
    cdef int overflow = 0
    if not PyLong_Check(v):
        return False
    return PyLong_AsLongAndOverflow(v, &overflow) == 1 and overflow == 0


def reduce_presence(results, r):
    """Flag ``i`` is 1 iff ``results[i*r : (i+1)*r]`` are all present, else 0.

    See ``_core_py.reduce_presence`` for the contract; this one is the same, compiled.
    """
    if type(results) is not list:
        raise TypeError(f"results must be a list, got {type(results).__name__}")
    if type(r) is not int:
        raise TypeError(f"r must be an int, got {type(r).__name__}")
    if r <= 0:
        raise ValueError(f"r must be > 0, got {r}")
    cdef list lst = <list>results
    cdef Py_ssize_t rr = r
    cdef Py_ssize_t total = PyList_GET_SIZE(lst)
    if total % rr:
        raise ValueError(f"len(results) ({total}) is not a multiple of r ({r})")
    cdef Py_ssize_t n = total // rr
    cdef Py_ssize_t i, j, k = 0
    cdef bytearray flags = bytearray(n)
    cdef unsigned char[::1] f = flags
    cdef unsigned char ok
    # No user code runs in this loop (``_present`` calls none), so the list cannot change
    # under it: its size read once above holds throughout.
    for i in range(n):
        ok = 1
        for j in range(rr):
            if ok and not _present(<object>PyList_GET_ITEM(lst, k)):
                ok = 0
            k += 1
        f[i] = ok
    return flags
