"""mooncake_keys' log lines in vLLM's own log stream, when the drop-in runs inside vLLM.

vLLM configures only its ``vllm`` logger (one handler with vLLM's format, stream and level,
``propagate=False``: ``vllm/logger.py``), in every process it starts. A ``mooncake_keys.*``
record reaches only the root logger, which vLLM leaves without a handler: an INFO line is
dropped and a WARNING comes out bare through ``logging.lastResort``.

:func:`join_vllm_logging` hands every ``mooncake_keys.*`` record to the ``vllm`` logger's
handlers instead (looked up at each record, so a later reconfiguration of vLLM's logging is
followed). The drop-in calls it when vLLM builds it, in each process (worker, engine core);
importing mooncake_keys never does. It changes nothing when vLLM's logging is off
(``VLLM_CONFIGURE_LOGGING=0``: the ``vllm`` logger has no handler) or when the user already gave
the ``mooncake_keys`` logger a handler: then logging stays the user's to configure.
"""

from __future__ import annotations

import logging

__all__ = ["join_vllm_logging"]

OURS = "mooncake_keys"
VLLM = "vllm"


class ToVllmHandler(logging.Handler):
    """Passes a record to the ``vllm`` logger's handlers (vLLM's format, stream and level)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(VLLM)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def join_vllm_logging() -> bool:
    """Route ``mooncake_keys.*`` records into vLLM's log stream; True when they are."""
    ours = logging.getLogger(OURS)
    if any(isinstance(h, ToVllmHandler) for h in ours.handlers):
        return True
    vllm_logger = logging.getLogger(VLLM)
    if ours.handlers or not vllm_logger.handlers:
        return False  # the user's own set-up, or vLLM's logging is off
    ours.addHandler(ToVllmHandler())
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm_logger.getEffectiveLevel())
    ours.propagate = False  # as vLLM's own logger: no second copy through the root's handlers
    return True
