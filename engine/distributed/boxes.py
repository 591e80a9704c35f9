"""How a process joins a job that spans several boxes (``Boxes``), and the error a box raises
when another one is gone (``BoxLost``). No torch here: the service imports these."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from engine.errors import ConfigError, EngineError

# where rank 0 listens for the others (its TCP rendezvous store), unless the job says otherwise
RENDEZVOUS_PORT = 29400


def _host_name() -> str:
    return socket.gethostname()


@dataclass(frozen=True)
class Boxes:
    """This process's place in a job that spans several boxes.

    Attributes:
        world_size: the boxes in the job (1: a plain single-box run).
        rank: this box's number, 0 to ``world_size - 1``; rank 0 writes the checkpoints.
        address: ``"host:port"`` where rank 0 listens (its rendezvous store); rank 0 binds the
            port on every interface.
        timeout_s: a box whose heartbeat has not moved for this long is lost; an exchange that
            moves no byte for this long fails.
        join_timeout_s: how long the boxes wait for each other at the start (a box may still be
            loading the model when the first arrives).
        host: this box's name, shown in the others' messages and events.
        interface: the network interface gloo uses (``GLOO_SOCKET_IFNAME``); None: the one the
            host's name resolves to.
    """

    world_size: int
    rank: int
    address: str
    timeout_s: float = 60.0
    join_timeout_s: float = 600.0
    host: str = field(default_factory=_host_name)
    interface: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError("boxes.world_size", f"boxes.world_size={self.world_size!r}: must be >= 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ConfigError(
                "boxes.rank", f"boxes.rank={self.rank!r}: must be 0 to {self.world_size - 1}", value=self.rank
            )
        self.endpoint()  # checks the address
        for name in ("timeout_s", "join_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise ConfigError(
                    f"boxes.{name}", f"boxes.{name}={value!r}: must be > 0 seconds", value=value
                )

    def endpoint(self) -> tuple[str, int]:
        """``address`` as (host, port).

        Raises:
            ConfigError: not ``host:port`` with a port 1-65535.
        """
        host, sep, port = self.address.rpartition(":")
        host = host.strip("[]")  # an IPv6 literal in brackets
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                "boxes.address",
                f"boxes.address={self.address!r}: must be host:port (rank 0's address, e.g. "
                f"10.0.0.2:{RENDEZVOUS_PORT})",
                value=self.address,
            )
        return host, int(port)


class BoxLost(EngineError):
    """Another box of the job died, left, lost its network, or never joined.

    Attributes:
        host: that box's name when known.
        rank: that box's rank when known.
    """

    def __init__(self, message: str, *, host: str | None = None, rank: int | None = None) -> None:
        super().__init__(message, stage="boxes")
        self.host = host
        self.rank = rank

    def fields(self) -> dict[str, object]:
        return {**super().fields(), "host": self.host, "rank": self.rank}
