"""Who may make admin calls by their address alone: the rule, written once.

With no admin credential configured at all (no ``--admin-token``, no admin tenant's key,
no JWT issuer), the control plane (the admin API, the engine commands, the dashboard)
takes callers from loopback, from this host's own addresses and from the
``--admin-from`` networks (``Identity.admin``). A router on its node's address is
called by the engines of that node from that address: they are as local as loopback
(``core/host.py`` says why that address cannot be borrowed from outside). The start-up
line and each refusal name the same three.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from dprouter.config import admin_networks
from dprouter.core.host import Address, HostAddresses


class Trust:
    """The callers taken by address: loopback, ``host``'s addresses, ``admin_from``."""

    def __init__(self, admin_from: Sequence[str], host: HostAddresses | None = None) -> None:
        self.admin_from = tuple(admin_from)
        self.networks = admin_networks(self.admin_from)
        self.host = host or HostAddresses()

    def trusts(self, remote: str | None) -> bool:
        """``remote`` (a peer's address as the socket gives it) is loopback, one of this
        host's addresses, or in an ``--admin-from`` network."""
        address = caller_address(remote)
        if address is None:
            return False  # no address: not a caller it can place
        if address.is_loopback or any(address in network for network in self.networks):
            return True
        return self.host.holds(address)

    def whom(self) -> str:
        """The trusted callers, named: this host's addresses as they are now."""
        own = sorted(
            (a for a in self.host.now() if not a.is_loopback), key=lambda a: (a.version, a)
        )
        named = ", ".join(map(str, own)) if own else "none besides loopback now"
        whom = f"loopback, this host's own addresses ({named})"
        if self.admin_from:
            whom += f", --admin-from {', '.join(self.admin_from)}"
        return whom

    def exposure(self) -> str:
        """What a router without an admin credential opens, and to whom (said at start-up)."""
        return (
            "no admin credential: the admin API (adding and removing workers, pausing engines, "
            f"weight updates, aborts) answers anyone on {self.whom()} without one; give "
            "--admin-token, or an admin tenant's key in --tenants, or --jwt-issuer, to require one"
        )

    def refusal(self, remote: str | None) -> str:
        return (
            "without an admin token, admin calls are taken from loopback, this host's own "
            f"addresses and --admin-from networks only, not from {remote}: start the router "
            "with --admin-token, or name the caller's network in --admin-from"
        )


def caller_address(remote: str | None) -> Address | None:
    """A peer's address: its IPv6 zone dropped, an IPv4 caller of a dual-stack socket
    (``::ffff:a.b.c.d``) as IPv4; None when it names none."""
    try:
        address = ipaddress.ip_address((remote or "").split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
