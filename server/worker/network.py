"""Where the other boxes of a job on several hosts reach this worker: its advertised address, the
NIC that carries it and that NIC's nominal speed. Read when the worker registers, never at import.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import psutil

from server.services.gpus import Endpoint
from server.settings import Settings

SYS_NET = Path("/sys/class/net")


def _usable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def nic_addresses() -> dict[str, list[str]]:
    """The IPv4 addresses of each NIC that is up (loopback left out), by NIC name."""
    stats = psutil.net_if_stats()
    out: dict[str, list[str]] = {}
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        if name in stats and not stats[name].isup:
            continue
        found = [a.address for a in addresses if a.family == socket.AF_INET and _usable(a.address)]
        if found:
            out[name] = found
    return out


def resolved_address(host: str) -> str | None:
    """``host``'s IPv4 address by the resolver, when it has one other boxes could use."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    return next((str(info[4][0]) for info in infos if _usable(str(info[4][0]))), None)


def advertised_address(settings: Settings) -> str:
    """``advertise_address``, else this machine's name resolved, else the first address of a NIC
    that is up, else 127.0.0.1 (one box only)."""
    if settings.advertise_address:
        return settings.advertise_address
    mine = resolved_address(socket.gethostname())
    if mine is not None and any(mine in found for found in nic_addresses().values()):
        return mine
    return next((found[0] for found in nic_addresses().values()), "127.0.0.1")


def interface_of(address: str) -> str | None:
    """The NIC that holds ``address`` (None: none here holds it, e.g. an address behind a NAT)."""
    return next((name for name, found in nic_addresses().items() if address in found), None)


def nominal_gbps(interface: str | None) -> float | None:
    """The NIC's link speed from ``/sys/class/net/<nic>/speed`` (Mb/s) in Gb/s; None when it is
    not readable or unknown (a virtual NIC without a speed says -1)."""
    if not interface:
        return None
    try:
        megabits = int((SYS_NET / interface / "speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return megabits / 1000.0 if megabits > 0 else None


def endpoint(settings: Settings) -> Endpoint:
    """This worker's rendezvous registration."""
    address = advertised_address(settings)
    interface = settings.box_interface or interface_of(address)
    return Endpoint(address, settings.rendezvous_port, interface, nominal_gbps(interface))
