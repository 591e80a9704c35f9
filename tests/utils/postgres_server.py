"""A PostgreSQL server of one test's own: a throw-away cluster (``initdb``) on a free port, which
the test stops and starts again as it likes (a fault injected for real), unlike the machine's
shared server on 5432 that other tests use.

The server binaries are found at run time: ``initdb``, ``pg_ctl`` and ``postgres`` on the PATH,
else the newest of Debian's ``/usr/lib/postgresql/<version>/bin``. PostgreSQL refuses to run as
root: as root, the cluster belongs to the ``postgres`` user (else ``nobody``) and its commands run
as that user; its folder is then made outside pytest's temporary folders, which only root may
enter."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Self

from tests.utils.processes import free_port

BINARIES = ("initdb", "pg_ctl", "postgres")
# the users a root test hands the cluster to, in order of preference
SERVER_USERS = ("postgres", "nobody")


def server_binaries() -> Path | None:
    """The folder that holds ``initdb``, ``pg_ctl`` and ``postgres`` (None: no server here)."""
    found = shutil.which("pg_ctl")
    folders = [Path(found).resolve().parent] if found else []
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    folders += sorted((Path(f) for f in versions), key=lambda f: _version(f.parent.name), reverse=True)
    for folder in folders:
        if all(os.access(folder / name, os.X_OK) for name in BINARIES):
            return folder
    return None


def _version(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split(".") if part.isdigit())


def server_user() -> pwd.struct_passwd | None:
    """The user the server runs as: this process's own, or, as root, an unprivileged one (None
    when root finds none)."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    for name in SERVER_USERS:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    return None


def why_not() -> str | None:
    """Why no server of a test's own can run on this machine, or None when one can."""
    if server_binaries() is None:
        return (
            "no PostgreSQL server binaries (initdb, pg_ctl, postgres) on the PATH or in /usr/lib/postgresql"
        )
    if server_user() is None:
        return f"running as root and none of the users {', '.join(SERVER_USERS)} exists to run PostgreSQL"
    return None


class PostgresServer:
    """A throw-away cluster: ``start()`` and ``stop(mode)`` as often as wanted, always on the same
    port; ``url`` reaches its ``postgres`` database as the superuser ``postgres`` (trust
    authentication, on 127.0.0.1 only). ``remove()`` stops it and deletes its folder."""

    def __init__(self, bin_dir: Path, user: pwd.struct_passwd, folder: Path, *, port: int) -> None:
        self.bin_dir, self.user, self.folder, self.port = bin_dir, user, folder, port
        self.data = folder / "data"
        self.log = folder / "server.log"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

    @classmethod
    def create(cls) -> Self:
        """initdb a new cluster in a new folder on a free port (not started)."""
        bin_dir, user = server_binaries(), server_user()
        if bin_dir is None or user is None:
            raise RuntimeError(why_not())
        folder = Path(tempfile.mkdtemp(prefix="roundhouse-postgres-"))
        os.chown(folder, user.pw_uid, user.pw_gid)
        server = cls(bin_dir, user, folder, port=free_port())
        server._run(
            "initdb", "-D", str(server.data), "-U", "postgres", "--auth=trust", "--no-locale",
            "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        return server

    def _run(self, program: str, *args: str, timeout: float = 120) -> str:
        """Run one of the server's programs as its user; its output (raises on failure, with it)."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C", "LC_ALL": "C"}
        done = subprocess.run(
            [str(self.bin_dir / program), *args],
            cwd=self.folder,
            env=env,
            user=self.user.pw_uid if os.geteuid() == 0 else None,
            group=self.user.pw_gid if os.geteuid() == 0 else None,
            extra_groups=[] if os.geteuid() == 0 else None,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)}: exit {done.returncode}\n{done.stdout}{done.stderr}"
            )
        return done.stdout

    def start(self) -> None:
        """Start the server and wait until it accepts connections (after a crash: its recovery)."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} -c shared_buffers=16MB"
            " -c max_connections=40 -c fsync=off"  # a crash here is of processes: the kernel keeps the writes
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start"
        )

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server and wait until it is gone. ``immediate``: every server process quits at
        once, as in a crash (connections cut, no checkpoint; the next start recovers from the WAL);
        ``fast``: a clean shutdown that ends the sessions first."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def remove(self) -> None:
        if self.running():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A started throw-away server, stopped and deleted afterwards."""
    server = PostgresServer.create()
    try:
        server.start()
        yield server
    finally:
        server.remove()
