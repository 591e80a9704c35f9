"""Separate test hosts on one machine, for the multi-host tests.

Where the machine allows it (root, ``ip`` and ``unshare``), each host is a network namespace on a
private bridge, with its own host name (a UTS namespace) and its own mounts: the folders of the
other hosts are hidden under empty tmpfs mounts, so a worker can only have what it pulled
through the network. The main host's services (PostgreSQL, Redis, the object store), which listen
on 127.0.0.1, are reached through TCP relays on the bridge address. Elsewhere the hosts are plain
processes on 127.0.0.1 with their own folders, and ``isolated`` says so.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
# a host's own name and mounts, inside its network namespace (``ip netns exec NS ...``)
UNSHARE = ("unshare", "--uts", "--mount", "--propagation", "private")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why separate network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "not root (a network namespace with a veth pair needs CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH"
    probe = f"rhprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
        _ip("link", "add", f"{probe}b", "type", "bridge")
        _ip("link", "del", f"{probe}b")
        subprocess.run(
            ["ip", "netns", "exec", probe, *UNSHARE, "true"], check=True, capture_output=True, timeout=30
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        stderr = (getattr(error, "stderr", b"") or b"").decode(errors="replace").strip()
        return f"`{' '.join(map(str, error.cmd))}` failed: {stderr}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Relay:
    """Accepts TCP connections on ``(host, port)`` (port 0: a free one) and relays each, both
    ways, to ``target``; ``close`` ends the listener and every relayed connection."""

    def __init__(self, host: str, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server((host, 0))
        self.port = int(self.server.getsockname()[1])
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"relay-{self.port}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()
        with self.lock:
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


@dataclass
class Host:
    """One test host: its name, and the network namespace it runs in (None: this machine's)."""

    name: str
    netns: str | None = None
    hidden: list[Path] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host: in its namespaces, as ``name``, with ``hidden`` folders empty."""
        if self.netns is None:
            return list(argv)
        steps = [f"hostname {shlex.quote(self.name)}"]
        steps += [
            f"mount -t tmpfs -o ro,size=1m roundhouse-hidden {shlex.quote(str(p))}" for p in self.hidden
        ]
        script = " && ".join([*steps, 'exec "$@"'])
        return ["ip", "netns", "exec", self.netns, *UNSHARE, "/bin/sh", "-c", script, "sh", *argv]


class Lan:
    """The main host (this machine) and test hosts that reach it by ``address``.

    ``expose(port)`` gives the port by which the hosts reach a service listening on
    127.0.0.1:``port``; ``host(name)`` adds a host. With ``isolated`` False, hosts are plain
    processes and ``address`` is 127.0.0.1."""

    def __init__(self, *, isolated: bool) -> None:
        self.isolated = isolated
        self.token = f"{random.randrange(16**5):05x}"
        self.bridge = f"rh{self.token}br"
        self.relays: list[Relay] = []
        self.hosts: list[Host] = []
        if isolated:
            subnet = self._free_subnet()
            self.address, self._prefix = f"{subnet}.1", subnet
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        else:
            self.address = LOOPBACK

    @staticmethod
    def _free_subnet() -> str:
        """A 10.x.y.0/24 no route of this machine uses."""
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
        while True:
            subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
            if f"{subnet}." not in routes:
                return subnet

    def expose(self, port: int) -> int:
        if not self.isolated:
            return port
        relay = Relay(self.address, (LOOPBACK, port))
        self.relays.append(relay)
        return relay.port

    def url(self, url: str) -> str:
        """``url`` of a service on 127.0.0.1 (``scheme://[user@]127.0.0.1:port/...``) as hosts reach it."""
        parts = urlsplit(url)
        if parts.hostname != LOOPBACK or parts.port is None:
            raise ValueError(f"{url}: not a service on {LOOPBACK}:PORT")
        user = parts.netloc.rpartition("@")[0]
        netloc = f"{user}@" if user else ""
        return parts._replace(netloc=f"{netloc}{self.address}:{self.expose(parts.port)}").geturl()

    def host(self, name: str, *, hidden: Sequence[Path] = ()) -> Host:
        """A new host ``name``; ``hidden``: folders of this machine it must not see."""
        if not self.isolated:
            host = Host(name)
        else:
            n = len(self.hosts) + 1
            netns, outside, inside = f"rh{self.token}-{n}", f"rh{self.token}{n}o", f"rh{self.token}{n}i"
            _ip("netns", "add", netns)
            host = Host(name, netns=netns, hidden=list(hidden))
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("link", "set", inside, "netns", netns)
            _ip("-n", netns, "addr", "add", f"{self._prefix}.{n + 1}/24", "dev", inside)
            _ip("-n", netns, "link", "set", inside, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
        self.hosts.append(host)
        return host

    def close(self) -> None:
        for relay in self.relays:
            relay.close()
        if self.isolated:
            for host in self.hosts:  # deleting a namespace deletes its end of the veth pair
                subprocess.run(["ip", "netns", "del", str(host.netns)], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


@contextlib.contextmanager
def lan(*, isolated: bool) -> Iterator[Lan]:
    network = Lan(isolated=isolated)
    try:
        yield network
    finally:
        network.close()
