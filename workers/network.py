"""Which network interface an RPC process binds to and advertises.

TensorPipe binds and advertises the interface named by ``TP_SOCKET_IFNAME``; the Gloo group that a static
RPC group builds inside ``init_rpc`` uses ``GLOO_SOCKET_IFNAME``. Without them both guess from the hostname,
which on many hosts resolves to a loopback address that peers on other hosts cannot reach. So rrefpipe is
explicit: an interface (or an address, resolved to the interface holding it) given by the user wins; a
loopback master defaults to ``lo``; otherwise an interface already set in the environment is kept, and
failing that one warning line says that TensorPipe will guess and which interface would be right.
"""
from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

__all__ = ["IFNAME_VARS", "interfaces", "resolve_interface", "route_interface", "is_loopback", "bind_interface",
           "configure_interface"]

log = logging.getLogger("rrefpipe.workers")

#: The variables that name the interface: TensorPipe's, and Gloo's (the group ``init_rpc`` builds).
IFNAME_VARS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")

_SIOCGIFADDR = 0x8915


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            ifreq = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # the interface has no IPv4 address
    return socket.inet_ntoa(ifreq[20:24])


def _ipv6_addresses() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6:
                    out.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:
        pass
    return out


def interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their addresses (the primary IPv4 address, then IPv6 ones)."""
    v6 = _ipv6_addresses()
    out: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        v4 = _ipv4_of(name)
        out[name] = ([v4] if v4 else []) + v6.get(name, [])
    return out


def _describe(table: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} ({' '.join(addrs) or 'no address'})" for name, addrs in sorted(table.items()))


def resolve_interface(name_or_address: str, table: dict[str, list[str]] | None = None) -> str:
    """The interface called ``name_or_address``, or the one holding that address.

    Raises:
        ValueError: no such interface or address here (the message lists this host's interfaces).
    """
    table = interfaces() if table is None else table
    if name_or_address in table:
        return name_or_address
    try:
        wanted = ipaddress.ip_address(name_or_address)
    except ValueError:
        raise ValueError(f"no network interface {name_or_address!r} on this host; it has: {_describe(table)}") from None
    for name, addrs in table.items():
        if any(ipaddress.ip_address(a) == wanted for a in addrs):
            return name
    raise ValueError(f"no interface of this host has the address {name_or_address}; it has: {_describe(table)}")


def route_interface(host: str, table: dict[str, list[str]] | None = None) -> str | None:
    """The interface the route to ``host`` leaves through, or None if there is none (sends nothing)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)  # a UDP connect only picks the route and source address
            source = sock.getsockname()[0]
        return resolve_interface(source, table)
    except (OSError, ValueError):
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this host's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_interface(interface: str) -> None:
    """Make TensorPipe and Gloo in this process bind to and advertise ``interface``."""
    for var in IFNAME_VARS:
        os.environ[var] = interface


def configure_interface(interface: str | None, master_addr: str, *, who: str) -> str | None:
    """Set this process's RPC interface; returns the interface used, or None if TensorPipe will guess.

    ``interface`` (a name or an address of this host) wins over the environment. Without it: ``lo``
    when ``master_addr`` is loopback; else ``TP_SOCKET_IFNAME`` if already set (Gloo's follows it);
    else a warning that names the interface the route to the master leaves through.
    """
    if interface is not None:
        chosen = resolve_interface(interface)
    elif is_loopback(master_addr):
        chosen = "lo"
    elif os.environ.get("TP_SOCKET_IFNAME"):
        chosen = os.environ["TP_SOCKET_IFNAME"]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", chosen)
        return chosen
    else:
        hint = route_interface(master_addr)
        suggestion = f"interface={hint!r} (--interface {hint})" if hint else "an interface"
        log.warning("%s: no network interface named and MASTER_ADDR %s is not loopback: TensorPipe and Gloo will "
                    "guess one from the hostname (peers on other hosts may then fail to connect or hang); the route "
                    "to the master leaves through %s, name it with %s", who, master_addr, hint or "no interface",
                    suggestion)
        return None
    bind_interface(chosen)
    log.info("%s: RPC binds to and advertises interface %s", who, chosen)
    return chosen
