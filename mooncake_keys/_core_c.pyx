# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled core: key building and rank reduction (the twin of ``_core_py.py``).

Keys are written straight into freshly allocated ``str`` objects: head characters, then the
lowercase hex of the hash read from the blob, with no intermediate ``.hex()`` objects.
"""

from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from cpython.list cimport PyList_GET_ITEM, PyList_SET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_CheckExact
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free


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
    bint PyUnicode_CheckExact(PyObject* o)
    Py_ssize_t Py_REFCNT(PyObject* o)
    unsigned int PyUnicode_CHECK_INTERNED(PyObject* o)
    ctypedef struct PyASCIIObject:
        Py_ssize_t hash


cdef inline object _recycled_key(list spare, Py_ssize_t* left, object head, const unsigned char* hexed,
                                 Py_ssize_t hex_len):
    """A str of the previous lookup that nothing else references, rewritten to this key; or None.

    A str held only by the spare list (reference count 1) is invisible to everyone else, so
    writing new characters into it is unobservable (CPython's own in-place concatenation relies
    on the same fact). Its cached hash is reset. Saves an allocation, a free and the page faults
    that freeing whole arenas back to the OS causes.
    """
    cdef PyObject* s
    cdef Py_ssize_t hl = PyUnicode_GET_LENGTH(head)
    cdef unsigned char* dst
    cdef object taken
    while left[0] > 0:
        left[0] -= 1
        s = PyList_GET_ITEM(spare, left[0])
        if (Py_REFCNT(s) != 1 or not PyUnicode_CheckExact(s) or PyUnicode_CHECK_INTERNED(s)
                or not PyUnicode_IS_ASCII(<object>s) or PyUnicode_GET_LENGTH(<object>s) != hl + hex_len):
            continue
        taken = <object>s  # a new reference: the str now has two, ours and the list's
        Py_INCREF(None)
        PyList_SET_ITEM(spare, left[0], None)
        Py_DECREF(taken)  # the list's reference: ours is the only one left
        dst = <unsigned char*>PyUnicode_DATA(taken)
        memcpy(dst, PyUnicode_DATA(head), hl)
        memcpy(dst + hl, hexed, hex_len)
        (<PyASCIIObject*>s).hash = -1
        return taken
    return None


cdef const char* HEXDIGITS = b"0123456789abcdef"

__all__ = ["fill_keys", "reduce_presence"]


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


cdef inline object _make_key(object head, const unsigned char* hexed, Py_ssize_t hex_len):
    """A new str: the characters of ``head``, then ``hex_len`` ASCII hex digits."""
    cdef Py_ssize_t hl = PyUnicode_GET_LENGTH(head)
    cdef Py_ssize_t k
    cdef unsigned char* dst
    cdef void* data
    cdef int kind
    cdef object s
    if PyUnicode_IS_ASCII(head):
        s = PyUnicode_New(hl + hex_len, 127)
        dst = <unsigned char*>PyUnicode_DATA(s)
        memcpy(dst, PyUnicode_DATA(head), hl)
        memcpy(dst + hl, hexed, hex_len)
        return s
    # Non-ASCII model name or cache prefix: same characters, wider storage.
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


def fill_keys(list out, Py_ssize_t pos, tuple heads, const unsigned char[::1] blob,
              Py_ssize_t hash_len, const long long[::1] index, dict young=None, dict old=None,
              bint insert=True, list spare=None):
    """Write ``len(index) * len(heads)`` keys into ``out[pos:]``; return ``(pos, hits, added)``.

    See ``_core_py.fill_keys`` for the contract; this one is the same, compiled.
    """
    cdef Py_ssize_t r = len(heads)
    cdef Py_ssize_t n = index.shape[0]
    cdef Py_ssize_t nblob = blob.shape[0]
    cdef Py_ssize_t c, j, hi, hits = 0, added = 0
    cdef const unsigned char* base
    cdef const unsigned char* h
    cdef PyObject* hit
    cdef object entry, hb, key
    cdef bint probing = young is not None
    cdef Py_ssize_t left = len(spare) if spare is not None else 0
    cdef object recycled
    if n == 0 or r == 0:
        return pos, 0, 0
    if pos < 0 or pos + n * r > PyList_GET_SIZE(out):
        raise ValueError("out is too short for the keys to write")
    if hash_len <= 0:
        raise ValueError("hash_len must be > 0")
    for c in range(n):
        hi = index[c]
        if hi < 0 or (hi + 1) * hash_len > nblob:
            raise IndexError(f"hash index {hi} is outside the blob")
    base = &blob[0]
    cdef unsigned char* hexed = <unsigned char*>malloc(2 * hash_len)
    if hexed == NULL:
        raise MemoryError()
    try:
        for c in range(n):
            h = base + index[c] * hash_len
            if probing:
                hb = PyBytes_FromStringAndSize(<const char*>h, hash_len)
                hit = PyDict_GetItem(young, hb)
                if hit == NULL and old is not None:
                    hit = PyDict_GetItem(old, hb)
                    if hit != NULL:
                        PyDict_SetItem(young, hb, <object>hit)
                        added += 1
                if hit != NULL:
                    hits += 1
                    entry = <object>hit
                    for j in range(r):
                        _put(out, pos, (<tuple>entry)[j])
                        pos += 1
                    continue
                if not insert:
                    probing = False  # past the cached prefix: plain building from here on
            _hexlify(h, hash_len, hexed)
            if not probing:
                for j in range(r):
                    if left:
                        recycled = _recycled_key(spare, &left, heads[j], hexed, 2 * hash_len)
                        if recycled is not None:
                            _put(out, pos, recycled)
                            pos += 1
                            continue
                    _put(out, pos, _make_key(heads[j], hexed, 2 * hash_len))
                    pos += 1
                continue
            entry = PyTuple_New(r)
            for j in range(r):
                key = _make_key(heads[j], hexed, 2 * hash_len)
                Py_INCREF(key)
                PyTuple_SET_ITEM(entry, j, key)
                _put(out, pos, key)
                pos += 1
            PyDict_SetItem(young, hb, entry)
            added += 1
        return pos, hits, added
    finally:
        free(hexed)


cdef object ONE = 1
cdef object ZERO = 0


cdef inline bint _is_one(object v) except -1:
    cdef int overflow = 0
    if v is ONE:  # CPython shares small ints: the common answers are these two objects
        return True
    if v is ZERO:
        return False
    if PyLong_CheckExact(v):
        return PyLong_AsLongAndOverflow(v, &overflow) == 1 and overflow == 0
    return bool(v == 1)


def reduce_presence(results, Py_ssize_t r):
    """Flag ``i`` is 1 iff ``results[i*r : (i+1)*r]`` are all exactly 1, else 0."""
    cdef Py_ssize_t total = len(results)
    cdef Py_ssize_t n = total // r
    cdef Py_ssize_t i, j, k
    cdef bytearray flags = bytearray(n)
    cdef unsigned char[::1] f = flags
    cdef list lst
    cdef unsigned char ok
    if type(results) is list:
        lst = <list>results
        k = 0
        for i in range(n):
            ok = 1
            for j in range(r):
                if ok and not _is_one(<object>PyList_GET_ITEM(lst, k)):
                    ok = 0
                k += 1
            f[i] = ok
        return flags
    for i in range(n):
        ok = 1
        for j in range(r):
            if not _is_one(results[i * r + j]):
                ok = 0
                break
        f[i] = ok
    return flags
