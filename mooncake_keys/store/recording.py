"""``RecordingStore``: the store double of the tests, the benchmarks and the examples.

It answers ``batch_is_exist`` as it is told (the keys present, a code for every key, a scripted
answer, a function, or a real store behind it), injects faults (an exception, a short answer,
an answer that is not a list, error codes), and records every call::

    store = RecordingStore(present={"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@6130"})
    engine = LookupEngine(..., store=store)
    engine.lookup(...)
    store.calls          # the keys of each batch_is_exist, in order
    RecordingStore(MemoryStore(), fault=ConnectionError("master unreachable"))
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Callable, Collection, List, Optional

__all__ = ["RecordingStore", "SHORT", "NOT_A_LIST"]

#: ``fault``: the answer lacks its last result.
SHORT = "short"
#: ``fault``: the answer is None.
NOT_A_LIST = "not a list"


class RecordingStore:
    """A store whose ``batch_is_exist`` answers as told and records every call.

    ``answer`` decides the answer to a call:

    * None (default): from ``present``; without it, every key is absent (0);
    * an int (or bool): that code for every key (``1``: everything stored);
    * a list or tuple: that answer to every call, whatever the keys (the very object, so that a
      benchmark times no store work);
    * a callable: called with the key list itself (it may read or keep it); what it returns is
      the answer;
    * a store (anything with ``batch_is_exist``, e.g. a ``MemoryStore``): its answer, and every
      other attribute is that store's too (a ``KVPool`` can save and load through it).

    ``present`` (with ``answer`` None): the keys stored, as a set (1 for its keys, 0 for others;
    the set itself is read, so keys added later count), a mapping key -> code (0 for keys not in
    it), or a function of one key returning its code.

    ``fault`` makes calls fail: all of them, or those numbered in ``fault_calls`` (from 0):

    * an exception (an instance or a class): raised;
    * :data:`SHORT` (``"short"``): the answer lacks its last result;
    * :data:`NOT_A_LIST` (``"not a list"``): the answer is None;
    * an int: that code for every key (an error code: Mooncake answers -900 when its master is
      unreachable).

    Every call is recorded, faulty ones too: ``calls`` holds a copy of each call's keys,
    ``num_calls`` and ``keys_asked`` count them, ``keys_present`` counts the answers exactly 1
    (on Mooncake, the read leases those calls took). ``record_keys=False`` only counts calls
    and keys (a benchmark would time the copies and the count of present answers). ``check_keys=True`` raises ``TypeError`` for keys that
    are not a list of str (what the engine promises to send). ``close()`` does nothing.

    ``leases=True`` makes it a Mooncake 0.3.14 store: ``lease_probes()`` is true and
    ``batch_probe_key(keys, policy, candidate_size)`` answers as ``batch_is_exist`` does (and is
    recorded in ``calls`` as well), leasing nothing with policy ``"none"`` and, with
    ``"LastHitOnly"``, the last group of ``candidate_size`` keys that all answered 1; every
    ``batch_is_exist`` leases the keys it answers 1. ``leased`` holds the keys each call leased
    (one list per call, in order), ``probe_calls`` the policy of each call (``"exist"`` for
    ``batch_is_exist``). Over a Mooncake store (``answer`` a store) they are kept too, by the
    same rules: the leases that store's master granted.
    """

    def __init__(
        self,
        answer: Any = None,
        *,
        present: Any = None,
        fault: Any = None,
        fault_calls: Optional[Collection[int]] = None,
        record_keys: bool = True,
        check_keys: bool = False,
        leases: bool = False,
    ) -> None:
        if answer is not None and present is not None:
            raise TypeError("give either answer or present, not both")
        if isinstance(fault, str) and fault not in (SHORT, NOT_A_LIST):
            raise ValueError(f"fault must be an exception, an int code, {SHORT!r} or {NOT_A_LIST!r}, got {fault!r}")
        #: The answer as given (see the class docstring).
        self.answer = answer
        self.present = present
        self.fault = fault
        self.fault_calls = fault_calls
        self.record_keys = record_keys
        self.check_keys = check_keys
        self._backing = answer if callable(getattr(answer, "batch_is_exist", None)) else None
        self._answer = self._answerer(answer, present)
        #: The keys of each call, in order (copies; empty with ``record_keys=False``).
        self.calls: List[List[str]] = []
        self.leases = leases
        #: With ``leases``: the keys each call leased, and each call's policy ("exist": batch_is_exist).
        self.leased: List[List[str]] = []
        self.probe_calls: List[str] = []
        self.num_calls = 0
        self.keys_asked = 0
        self.keys_present = 0
        self._lock = threading.Lock()
        #: Whether ``batch_is_exist`` may change or keep the list it is given (see ``LookupEngine``):
        #: only a function or a store behind this one could.
        if self._backing is not None:
            self.mutates_keys = getattr(self._backing, "mutates_keys", True)
        else:
            self.mutates_keys = callable(answer)

    def _answerer(self, answer: Any, present: Any) -> Callable[[Any], Any]:
        if self._backing is not None:
            return self._backing.batch_is_exist
        if isinstance(answer, int):
            return lambda keys: [answer] * len(keys)
        if isinstance(answer, (list, tuple)):
            return lambda keys: answer
        if callable(answer):
            return answer
        if answer is not None:
            raise TypeError("answer must be None, an int, a list, a callable or a store with batch_is_exist, "
                            f"got {type(answer).__name__}")
        if present is None:
            return lambda keys: [0] * len(keys)
        if isinstance(present, Mapping):
            return lambda keys: [present.get(k, 0) for k in keys]
        if callable(present):
            return lambda keys: [present(k) for k in keys]
        stored = present if isinstance(present, (set, frozenset)) else frozenset(present)
        return lambda keys: [1 if k in stored else 0 for k in keys]

    def batch_is_exist(self, keys: Any) -> Any:
        answer = self._existence(keys)
        if self.leases or (self._backing is not None and self.record_keys):
            leased = [k for k, a in zip(keys, answer) if a == 1] if type(answer) is list else []
            with self._lock:
                self.leased.append(leased)
                self.probe_calls.append("exist")
        return answer

    def _existence(self, keys: Any, ask: Optional[Callable[[Any], Any]] = None) -> Any:
        if self.check_keys and not (type(keys) is list and all(type(k) is str for k in keys)):
            raise TypeError(f"batch_is_exist was given {type(keys).__name__}, not a list of str")
        with self._lock:
            call = self.num_calls
            self.num_calls += 1
            self.keys_asked += len(keys)
            if self.record_keys:
                self.calls.append(list(keys))
        fault = self.fault
        if fault is None or (self.fault_calls is not None and call not in self.fault_calls):
            answer = (ask or self._answer)(keys)
            if self.record_keys and type(answer) is list:
                from ..lookup._core import reduce_presence  # answers exactly 1, no item's code run

                present = reduce_presence(answer, 1)[1] if answer else 0
                with self._lock:
                    self.keys_present += present
            return answer
        if isinstance(fault, BaseException):
            raise fault.with_traceback(None)  # raised again and again: no growing traceback
        if isinstance(fault, type) and issubclass(fault, BaseException):
            raise fault
        if fault == NOT_A_LIST:
            return None
        if fault == SHORT:
            return list(self._answer(keys))[:-1]
        return [fault] * len(keys)

    def lease_probes(self) -> bool:
        """Whether ``batch_probe_key`` answers (``leases=True``: a Mooncake 0.3.14 store; with a
        store behind this one, that store's answer)."""
        if not self.leases and self._backing is not None:
            probes = getattr(self._backing, "lease_probes", None)
            return bool(probes()) if callable(probes) else False
        return self.leases

    def batch_probe_key(self, keys: Any, policy: str = "none", candidate_size: int = 1) -> Any:
        if not self.leases:
            backing = self._backing
            if backing is None or not callable(getattr(backing, "batch_probe_key", None)):
                raise AttributeError("this RecordingStore has no batch_probe_key (leases=False: Mooncake 0.3.13)")
            answer = self._existence(keys, lambda k: backing.batch_probe_key(k, policy, candidate_size))
        else:
            if policy not in ("none", "LastHitOnly"):
                raise ValueError(f"Unknown batch_probe_key policy {policy!r}")
            answer = self._existence(keys)
        leased: List[str] = []
        if policy == "LastHitOnly" and type(answer) is list and candidate_size > 0 and len(keys) % candidate_size == 0:
            for start in range(len(keys) - candidate_size, -1, -candidate_size):
                if all(a == 1 for a in answer[start:start + candidate_size]):
                    leased = list(keys[start:start + candidate_size])
                    break
        with self._lock:
            self.leased.append(leased)
            self.probe_calls.append(policy)
        return answer

    def close(self) -> None:
        """Nothing to close (vLLM's worker calls it)."""

    def __getattr__(self, name: str) -> Any:
        backing = self.__dict__.get("_backing")
        if backing is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(backing, name)

    def __repr__(self) -> str:
        return f"<RecordingStore {self.num_calls} calls, {self.keys_asked} keys asked>"
