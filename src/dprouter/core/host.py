"""This host's own addresses: those of its network interfaces, as the kernel lists them.

A router started on its node's address (RL frameworks start theirs on the node IP, and
the engines on that node call it from that address) takes admin calls from its own host
as it does from loopback (``server/trust.py``): a caller on the router's host can reach
loopback anyway. The kernel drops a packet from outside that carries one of the host's
own addresses as its source (``accept_local`` is off by default), and the answer to a
forged handshake would never leave the host, so such an address cannot be borrowed.

Interfaces change (a container's network set up after start, DHCP, a VPN), so an
address not found is looked up again, at most once per ``reread`` seconds: a stranger's
calls cost a set lookup, not a read of the interfaces each (about 56 µs, through
psutil's ``getifaddrs``).
"""

from __future__ import annotations

import ipaddress
import socket
import time

import psutil

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

REREAD = 5.0  # seconds between two reads of the interfaces, at most one per


def interface_addresses() -> frozenset[Address]:
    """Every IPv4 and IPv6 address of every interface now, loopback and link-local
    included (a link-local one without its ``%zone``)."""
    found: set[Address] = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                found.add(ipaddress.ip_address(str(entry.address).split("%")[0]))
            except ValueError:
                continue
    return frozenset(found)


class HostAddresses:
    """The host's addresses, read when first asked and again when an address is not
    found, at most once per ``reread`` seconds."""

    def __init__(self, reread: float = REREAD) -> None:
        self.reread = reread
        self._addresses: frozenset[Address] = frozenset()
        self._read_at: float | None = None

    def holds(self, address: Address) -> bool:
        """``address`` is one of this host's (a new one found within ``reread`` seconds)."""
        if address in self._addresses:
            return True
        now = time.monotonic()
        if self._read_at is not None and now - self._read_at < self.reread:
            return False
        self._read(now)
        return address in self._addresses

    def now(self) -> frozenset[Address]:
        """The addresses as the interfaces list them at this moment (read afresh)."""
        self._read(time.monotonic())
        return self._addresses

    def _read(self, now: float) -> None:
        self._addresses = interface_addresses()
        self._read_at = now
