"""Hosts on one machine: Linux network namespaces on a bridge, each with an address of its own.

>>> with Network(["store", "holder", "lookup"]) as net:     # doctest: +SKIP
...     net.address("store")                                  # "10.77.N.1"
...     net.cut("lookup")                                     # its cable pulled at the switch
...     net.heal("lookup")

The switch is a bridge in a namespace of its own; every host is a namespace with a veth pair
whose far end is a port of that bridge; this process (the test) has one more port, so it can
reach every host (readiness checks). :meth:`Network.cut` sets a host's switch port down: the
host sees no carrier and its packets go nowhere, no RST and no ICMP from anyone (a pulled
cable, not a refused connection). Names carry this process's PID (``mk<PID>-<host>``), so runs
side by side do not meet; the /24 is one no interface of ours already routes. :meth:`close`
deletes every namespace and our port, and a new :class:`Network` first deletes those left by a
process that is gone (one SIGKILLed before its teardown).

Processes started in a host (``ip netns exec``) are the caller's to stop before :meth:`close`:
a namespace lives on while a process is in it, even after its name is deleted.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Sequence

__all__ = ["Network", "NetworkError", "unavailable"]

#: Seconds any one ``ip`` command may take (it takes milliseconds; a hung one is an error).
IP_TIMEOUT_S = 30.0

_NAME = re.compile(r"^mk(\d+)-")
_ROOT_PORT = re.compile(r"^mk(\d+)c$")


class NetworkError(RuntimeError):
    """An ``ip`` command failed."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS...``; a failure raises :class:`NetworkError` naming the command and its stderr."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and out.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def unavailable() -> str:
    """Why network namespaces cannot be made here ("" when they can): not Linux, not root, no
    ``ip`` (Debian: iproute2), or ``ip netns add`` refused (a container without CAP_SYS_ADMIN)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if shutil.which("ip") is None:
        return "no 'ip' command (install iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"mk{os.getpid()}-probe"
    try:
        out = ip("netns", "add", name, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"'ip netns add' could not run: {exc}"
    if out.returncode != 0:
        return f"'ip netns add' failed: {out.stderr.strip()}"
    ip("netns", "delete", name, check=False)
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> List[str]:
    """Delete the namespaces and root ports of earlier runs whose process is gone; their names."""
    gone = []
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            ip("netns", "delete", name, check=False)
            gone.append(name)
    for line in ip("-o", "link", "show").stdout.splitlines():
        fields = line.split(":")
        link = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        m = _ROOT_PORT.match(link)
        if m and not _alive(int(m.group(1))):
            ip("link", "delete", link, check=False)
            gone.append(link)
    return gone


def _free_subnet() -> int:
    """The third byte N of a 10.77.N.0/24 that no route of this namespace covers yet."""
    routes = ip("-4", "route", "show").stdout
    taken = {int(n) for n in re.findall(r"\b10\.77\.(\d+)\.", routes)}
    start = os.getpid() % 200 + 20
    for n in [*range(start, 250), *range(1, start)]:
        if n not in taken:
            return n
    raise NetworkError("no free 10.77.N.0/24 subnet")


class Network:
    """Hosts (network namespaces) on one bridge, with 10.77.N.i addresses (see the module doc).

    ``hosts`` are short names (letters, digits); host i (from 1) gets ``10.77.N.i``, this process
    ``10.77.N.254``. Used as a context manager it is closed on exit, whatever happened."""

    def __init__(self, hosts: Sequence[str]) -> None:
        if len(set(hosts)) != len(hosts) or not all(re.fullmatch(r"[a-z0-9]{1,8}", h) for h in hosts):
            raise ValueError(f"hosts must be distinct short names [a-z0-9]{{1,8}}, got {list(hosts)}")
        self.hosts = list(hosts)
        self.prefix = f"mk{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.root_port = f"{self.prefix}c"  # at most 15 characters: mk + a 7-digit PID + c
        self.subnet = 0
        self._made: List[str] = []
        self._index: Dict[str, int] = {h: i + 1 for i, h in enumerate(self.hosts)}

    def netns(self, host: str) -> str:
        """The namespace name of ``host`` (``ip netns exec NAME ...``)."""
        self._index[host]  # KeyError for a host we do not have
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of ``host``."""
        return f"10.77.{self.subnet}.{self._index[host]}"

    @property
    def our_address(self) -> str:
        """This process's address on the switch."""
        return f"10.77.{self.subnet}.254"

    def _port(self, host: str) -> str:
        return f"p{self._index[host]}"

    def open(self) -> "Network":
        """Make the switch, the hosts and our port. On any failure what was made is deleted."""
        sweep_stale()
        try:
            self.subnet = _free_subnet()
            self._add_netns(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                ns, port, dev = self.netns(host), self._port(host), f"{self.prefix}e{self._index[host]}"
                self._add_netns(ns)
                ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                ip("-n", ns, "link", "set", dev, "name", "eth0")
                ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", self.switch, "link", "set", port, "master", "br0")
                ip("-n", self.switch, "link", "set", port, "up")
            ip("link", "add", self.root_port, "type", "veth", "peer", "name", "pc", "netns", self.switch)
            self._made.append(self.root_port)
            ip("addr", "add", f"{self.our_address}/24", "dev", self.root_port)
            ip("link", "set", self.root_port, "up")
            ip("-n", self.switch, "link", "set", "pc", "master", "br0")
            ip("-n", self.switch, "link", "set", "pc", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def cut(self, host: str) -> None:
        """Pull ``host``'s cable at the switch: its port down (no carrier; packets vanish)."""
        ip("-n", self.switch, "link", "set", self._port(host), "down")

    def heal(self, host: str) -> None:
        """Plug ``host``'s cable back in (its port up)."""
        ip("-n", self.switch, "link", "set", self._port(host), "up")

    def names(self) -> List[str]:
        """The namespaces of this network that exist now."""
        listed = {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.split()}
        return sorted(n for n in [self.switch, *(self.netns(h) for h in self.hosts)] if n in listed)

    def close(self) -> None:
        """Delete our port and every namespace made (their veth pairs go with them). Idempotent."""
        for name in reversed(self._made):
            if name == self.root_port:
                ip("link", "delete", name, check=False)
            else:
                ip("netns", "delete", name, check=False)
        self._made = []

    def __enter__(self) -> "Network":
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
