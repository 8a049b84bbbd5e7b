"""A TCP probe of the master's RPC port, so that a dead master is refused in microseconds.

The Mooncake client's own ping notices a dead master after 1-5 s, and every call stalls ~4.3 s
until it does; a refused connection on the master's port tells within one probe interval.
"""

from __future__ import annotations

import logging
import socket
import threading

__all__ = ["DEFAULT_PROBE_INTERVAL_S", "MasterProbe"]

logger = logging.getLogger("mooncake_keys.store")

#: Seconds between TCP probes of the master's RPC port (0 or None: no probe).
DEFAULT_PROBE_INTERVAL_S = 0.05


class MasterProbe(threading.Thread):
    """Connects to the master's RPC port every ``interval`` s; ``down`` while that fails."""

    def __init__(self, host: str, port: int, interval: float) -> None:
        super().__init__(name=f"mooncake-probe-{host}:{port}", daemon=True)
        self.address = (host, port)
        self.interval = interval
        self.down = False
        self.reason = ""
        self._stop_event = threading.Event()
        self._wake = threading.Event()

    @classmethod
    def start_for(cls, master_address: str, interval: float | None) -> "MasterProbe | None":
        if not interval or interval <= 0:
            return None
        host, sep, port = master_address.rpartition(":")
        if not sep or not port.isdigit() or "://" in master_address or ";" in master_address:
            return None  # HA / etcd addresses: leave it to the client's own ping
        probe = cls(host.strip("[]"), int(port), interval)
        probe.start()
        return probe

    def suspect(self, reason: str) -> None:
        """Mark the master down now and re-probe at once (a live master clears it within µs)."""
        if not self.down:
            logger.warning("Mooncake master %s:%d suspected down: %s", *self.address, reason)
        self.reason = reason
        self.down = True
        self._wake.set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self._wake.clear()
            try:
                with socket.create_connection(self.address, timeout=max(self.interval, 0.5)):
                    pass
                if self.down:
                    logger.info("Mooncake master %s:%d answers again", *self.address)
                self.down, self.reason = False, ""
            except OSError as exc:
                if not self.down:
                    logger.warning("Mooncake master %s:%d unreachable: %s", *self.address, exc)
                self.reason = f"TCP probe of the master: {exc.strerror or exc}"
                self.down = True
            self._wake.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self._wake.set()


