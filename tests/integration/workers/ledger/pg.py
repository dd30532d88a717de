"""A real PostgreSQL server from Debian's package, on 127.0.0.1 and a free port, owned by the test that starts it."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid


def postgres_bin() -> str | None:
    """The directory of Debian's PostgreSQL server binaries (not on PATH), newest version first; None if absent."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]), reverse=True)
    return os.path.dirname(found[0]) if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    """``initdb`` (trust auth, user postgres) in a fresh directory, ``pg_ctl start``/``stop``; as root, every server
    command runs as the ``postgres`` user (PostgreSQL refuses to run as root)."""

    def __init__(self, bindir: str):
        self.bindir = bindir
        self.port = free_port()
        self.root = tempfile.mkdtemp(prefix="ledger-pg-")  # under /tmp: the postgres user must reach it
        self.data = os.path.join(self.root, "data")
        self.sockets = os.path.join(self.root, "sock")
        os.makedirs(self.sockets)
        self._as_root = os.geteuid() == 0
        if self._as_root:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(self.sockets, "postgres", "postgres")
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [os.path.join(self.bindir, tool), *args]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            output = result.stdout[-2000:] + result.stderr[-2000:]
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {output}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        log = os.path.join(self.root, "server.log")
        self._run("pg_ctl", "-D", self.data, "-o", options, "-l", log, "-w", "-t", "60", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-m", "fast", "-w", "-t", "60", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh database; its connection string."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def destroy(self) -> None:
        try:
            self.stop()
        except RuntimeError:
            pass  # already stopped
        shutil.rmtree(self.root, ignore_errors=True)
