# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled core: key building and rank reduction (the twin of ``_core_py.py``).

Same functions, same arguments, same errors as the pure twin (the argument checks are shared
with it: ``_core_py._check_fill_args``). Keys are written straight into ``str`` objects: head
characters, then the lowercase hex of the hash read from the blob (then the tail's characters,
where one is given), with no intermediate ``.hex()`` objects.

String reuse, and why it is here: a cold lookup of 16,384 keys spends about half its client
time allocating the new strings and freeing the previous lookup's (CPython hands emptied arenas
back to the OS, and the next lookup page-faults them in again); handing ``fill_keys`` the
previous lookup's list, whose strings it rewrites in place, measured 2.2x faster key building
on scenario a (65 -> 29 ns per key) and about 2x faster cold lookups on a and b
(docs/benchmarks.md). A string is rewritten only under the conditions CPython itself requires
before it modifies a str in place (``unicode_modifiable`` in Objects/unicodeobject.c: exact
type, one reference, hash not computed, not interned), and only when it is compact ASCII of the
right length with no cached ``wchar_t`` copy (Python < 3.12), so that no other representation
of it can go stale. Never on free-threaded builds, where a reference count of 1 proves nothing.
"""

from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from cpython.list cimport PyList_GET_ITEM, PyList_SET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.object cimport Py_SIZE
from cpython.long cimport PyLong_Check
from cpython cimport array
from libc.string cimport memcpy

from ._core_py import _check_fill_args, _check_reduce_args, _index_out_of_range


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
    Py_buffer* PyMemoryView_GET_BUFFER(object mview)
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

#: Whether ``fill_keys`` rewrites in place the strings it finds in ``out`` (not on free-threaded builds).
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


cdef inline void _new_key(list out, Py_ssize_t i, object head, const unsigned char* hexed,
                          Py_ssize_t hex_len, object tail=None) except *:
    """Put a new str into ``out[i]``: the characters of ``head``, the ASCII hex digits, then
    those of ``tail`` (None: nothing after the hex)."""
    cdef Py_ssize_t hl = PyUnicode_GET_LENGTH(head)
    cdef Py_ssize_t tl = 0 if tail is None else PyUnicode_GET_LENGTH(tail)
    cdef Py_ssize_t k
    cdef void* data
    cdef int kind
    cdef object s
    cdef Py_UCS4 maxchar
    if PyUnicode_IS_ASCII(head) and (tail is None or PyUnicode_IS_ASCII(tail)):
        s = PyUnicode_New(hl + hex_len + tl, 127)
        data = PyUnicode_DATA(s)
        memcpy(data, PyUnicode_DATA(head), hl)
        memcpy(<unsigned char*>data + hl, hexed, hex_len)
        if tl:
            memcpy(<unsigned char*>data + hl + hex_len, PyUnicode_DATA(tail), tl)
    else:  # a non-ASCII model name or cache prefix: the same characters, wider storage
        maxchar = PyUnicode_MAX_CHAR_VALUE(head)
        if tl and PyUnicode_MAX_CHAR_VALUE(tail) > maxchar:
            maxchar = PyUnicode_MAX_CHAR_VALUE(tail)
        s = PyUnicode_New(hl + hex_len + tl, maxchar)
        PyUnicode_CopyCharacters(s, 0, head, 0, hl)
        kind = PyUnicode_KIND(s)
        data = PyUnicode_DATA(s)
        for k in range(hex_len):
            PyUnicode_WRITE(kind, data, hl + k, hexed[k])
        if tl:
            PyUnicode_CopyCharacters(s, hl + hex_len, tail, 0, tl)
    cdef PyObject* prev = PyList_GET_ITEM(out, i)
    Py_INCREF(s)
    PyList_SET_ITEM(out, i, s)
    Py_DECREF(<object>prev)


cdef bint _plain_args(object out, object pos, object heads, object blob, object hash_len,
                      object index, object tails) except -1:
    """The arguments the engine passes, all valid: a list, ints, a tuple of str, a bytes or a
    byte memoryview, an ``array('q')``, in range, no tails or as many str as heads. Anything
    else goes to the twin's checks."""
    if type(out) is not list or type(pos) is not int or type(hash_len) is not int or type(heads) is not tuple:
        return False
    if type(index) is not array.array or (<array.array>index).ob_descr.typecode != b"q":
        return False
    if type(blob) is memoryview:
        if (<memoryview>blob).format != "B" or (<memoryview>blob).ndim != 1 or not (<memoryview>blob).c_contiguous:
            return False
    elif type(blob) is not bytes:
        return False
    for h in <tuple>heads:
        if type(h) is not str:
            return False
    if tails is not None:
        if type(tails) is not tuple or len(<tuple>tails) != len(<tuple>heads):
            return False
        for t in <tuple>tails:
            if type(t) is not str:
                return False
    return hash_len > 0 and pos >= 0 and pos + len(index) * len(heads) <= len(out)


def fill_keys(out, pos, heads, blob, hash_len, index, tails=None):  # long: C declarations up front
    """Write ``len(index) * len(heads)`` keys into ``out[pos:]``; return the position after them.

    See ``_core_py.fill_keys`` for the contract; this one is the same, compiled, and a slot
    that holds a str nothing else can see (``mk_rewritable``) gets the new key written into
    that str instead of a new one.
    """
    cdef const unsigned char* base
    cdef const long long* idx
    cdef Py_ssize_t nbytes, n
    cdef Py_buffer* view
    cdef object keep = None  # the views of the checked path, alive while their pointers are used
    if _plain_args(out, pos, heads, blob, hash_len, index, tails):  # the usual arguments, checked in C
        if type(blob) is bytes:
            base = <const unsigned char*>PyBytes_AS_STRING(blob)
            nbytes = PyBytes_GET_SIZE(blob)
        else:
            view = PyMemoryView_GET_BUFFER(blob)
            base = <const unsigned char*>view.buf
            nbytes = view.len
        idx = (<array.array>index).data.as_longlongs
        n = Py_SIZE(index)
    else:  # anything else: the twin's checks (the same errors), then its views
        bv, iv = _check_fill_args(out, pos, heads, blob, hash_len, index, tails)
        keep = (bv, iv)
        view = PyMemoryView_GET_BUFFER(bv)
        base = <const unsigned char*>view.buf
        nbytes = view.len
        view = PyMemoryView_GET_BUFFER(iv)
        idx = <const long long*>view.buf
        n = view.len // 8
    cdef list lst = <list>out
    cdef tuple hs = <tuple>heads
    cdef Py_ssize_t r = PyTuple_GET_SIZE(hs)
    cdef Py_ssize_t hlen = hash_len
    cdef Py_ssize_t hex_len = 2 * hlen
    cdef Py_ssize_t p = pos
    cdef Py_ssize_t c, j, hl
    cdef unsigned char[128] hexed  # 2 x the longest hash (64 bytes); longer ones use a bytearray
    cdef bytearray big = None
    cdef unsigned char* hx = hexed
    cdef unsigned char* dst
    cdef PyObject* slot
    cdef PyObject* head
    cdef long long lo, hi, v
    if n:  # the range check of the twin, at C speed
        lo = hi = idx[0]
        for c in range(1, n):
            v = idx[c]
            if v < lo:
                lo = v
            elif v > hi:
                hi = v
        err = _index_out_of_range(lo, hi, hlen, nbytes)
        if err is not None:
            raise err
    if n == 0 or r == 0:
        return p
    if hex_len > 128:
        big = bytearray(hex_len)
        hx = big
    if tails is not None:
        return _fill_with_tails(lst, p, hs, <tuple>tails, base, hlen, idx, n, hx)
    for c in range(n):
        _hexlify(base + idx[c] * hlen, hlen, hx)
        for j in range(r):
            head = PyTuple_GET_ITEM(hs, j)
            slot = PyList_GET_ITEM(lst, p)
            hl = PyUnicode_GET_LENGTH(<object>head)
            if PyUnicode_IS_ASCII(<object>head) and mk_rewritable(slot, hl + hex_len):
                dst = <unsigned char*>PyUnicode_DATA(<object>slot)
                memcpy(dst, PyUnicode_DATA(<object>head), hl)
                memcpy(dst + hl, hx, hex_len)
            else:
                _new_key(lst, p, <object>head, hx, hex_len)
            p += 1
    return p


cdef Py_ssize_t _fill_with_tails(list lst, Py_ssize_t p, tuple hs, tuple ts, const unsigned char* base,
                                 Py_ssize_t hlen, const long long* idx, Py_ssize_t n,
                                 unsigned char* hx) except -1:
    """``fill_keys``' loop for keys with a tail (``head + hex + tail``): its own loop, so the
    loop of keys without one (vLLM's) is unchanged."""
    cdef Py_ssize_t r = PyTuple_GET_SIZE(hs)
    cdef Py_ssize_t hex_len = 2 * hlen
    cdef Py_ssize_t c, j, hl, tl
    cdef PyObject* slot
    cdef PyObject* head
    cdef PyObject* tail
    cdef unsigned char* dst
    for c in range(n):
        _hexlify(base + idx[c] * hlen, hlen, hx)
        for j in range(r):
            head = PyTuple_GET_ITEM(hs, j)
            tail = PyTuple_GET_ITEM(ts, j)
            slot = PyList_GET_ITEM(lst, p)
            hl = PyUnicode_GET_LENGTH(<object>head)
            tl = PyUnicode_GET_LENGTH(<object>tail)
            if (PyUnicode_IS_ASCII(<object>head) and PyUnicode_IS_ASCII(<object>tail)
                    and mk_rewritable(slot, hl + hex_len + tl)):
                dst = <unsigned char*>PyUnicode_DATA(<object>slot)
                memcpy(dst, PyUnicode_DATA(<object>head), hl)
                memcpy(dst + hl, hx, hex_len)
                memcpy(dst + hl + hex_len, PyUnicode_DATA(<object>tail), tl)
            else:
                _new_key(lst, p, <object>head, hx, hex_len, <object>tail)
            p += 1
    return p


cdef object _ONE = 1
cdef object _ZERO = 0


cdef inline bint _present(PyObject* v) noexcept:
    """An int (bools included) equal to 1: no user code runs. CPython shares the small ints, so
    the usual answers, 1 and 0, are decided by identity."""
    cdef int overflow = 0
    if v == <PyObject*>_ONE:
        return True
    if v == <PyObject*>_ZERO or not PyLong_Check(<object>v):
        return False
    return PyLong_AsLongAndOverflow(<object>v, &overflow) == 1 and overflow == 0


def reduce_presence(results, r):
    """Flag ``i`` is 1 iff ``results[i*r : (i+1)*r]`` are all present, else 0; and how many
    items are present.

    See ``_core_py.reduce_presence`` for the contract; this one is the same, compiled.
    """
    _check_reduce_args(results, r)
    cdef list lst = <list>results
    cdef Py_ssize_t rr = r
    cdef Py_ssize_t total = PyList_GET_SIZE(lst)
    if total % rr:
        raise ValueError(f"len(results) ({total}) is not a multiple of r ({r})")
    cdef Py_ssize_t n = total // rr
    cdef Py_ssize_t i, j, k = 0, present = 0
    cdef bytearray flags = bytearray(n)
    cdef unsigned char[::1] f = flags
    cdef unsigned char ok
    # No user code runs in this loop (``_present`` calls none), so the list cannot change
    # under it: its size read once above holds throughout.
    for i in range(n):
        ok = 1
        for j in range(rr):
            if _present(PyList_GET_ITEM(lst, k)):
                present += 1
            else:
                ok = 0
            k += 1
        f[i] = ok
    return flags, present
