"""A real PostgreSQL server for the team-tracking tests: `initdb` + `pg_ctl` into a temporary directory, on a free
loopback port, stopped afterwards. PostgreSQL refuses to run as root, so as root the server runs as the
`postgres` system user (Debian's postgresql packages create it)."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest


def _pg_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_uri():
    """`postgresql://a2@127.0.0.1:PORT/mlflow` of a fresh server (trust authentication on loopback only)."""
    initdb, pg_ctl = _pg_tool("initdb"), _pg_tool("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("needs PostgreSQL's initdb and pg_ctl (Debian package postgresql)")
    import psycopg  # the test extras' driver, also SQLAlchemy 2's default for postgresql://

    run_as: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="a2-pg-"))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, and there is no `postgres` user to run PostgreSQL as")
        os.chmod(root, 0o755)
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    data, log = root / "data", root / "server.log"
    port = _free_port()
    subprocess.run([*run_as, initdb, "-D", str(data), "-A", "trust", "-U", "a2", "--no-sync", "-E", "UTF8"],
                   check=True, stdout=subprocess.DEVNULL)
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    subprocess.run([*run_as, pg_ctl, "-D", str(data), "-o", options, "-l", str(log), "-w", "start"], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        with psycopg.connect(host="127.0.0.1", port=port, user="a2", dbname="postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE mlflow")
        yield f"postgresql://a2@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run([*run_as, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], stdout=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)
