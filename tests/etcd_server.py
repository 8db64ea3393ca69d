"""A real etcd for tests: one member on free loopback ports, a temporary data dir, killed by PID.

``etcd`` comes from Debian's ``etcd-server`` package, which ``bash .ci/run``
installs. Without it the tests that need it FAIL, saying so: a skip would
let a machine without etcd pass the suite without testing the etcd source.

:class:`EtcdServer` can be killed with SIGKILL mid-test (no clean shutdown,
as when a machine dies) and restarted on the same ports and data dir, so
that its revisions and keys survive, as a real member's would.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

HOST = "127.0.0.1"
PROGRESS_INTERVAL = 0.5
"""The ``--experimental-watch-progress-notify-interval`` the test etcd runs with, in seconds."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def etcd_binary() -> str:
    """The path of ``etcd``, or a test failure that says how to get it."""
    path = shutil.which("etcd")
    if path is None:
        pytest.fail(
            "the etcd binary is not installed: `apt-get install etcd-server` (bash .ci/run does it); "
            "the etcd source's tests need a real etcd and are never skipped"
        )
    return path


class EtcdServer:
    """One etcd member on loopback. Use :func:`etcd_server` (an async context manager)."""

    def __init__(self, data_dir: Path, *, progress_interval: float = PROGRESS_INTERVAL) -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.progress_interval = progress_interval
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.log = data_dir.parent / f"{data_dir.name}.log"
        self.process: trio.Process | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def _command(self) -> list[str]:
        peer = f"http://{HOST}:{self.peer_port}"
        return [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--initial-cluster-state=new",
            f"--experimental-watch-progress-notify-interval={int(self.progress_interval * 1000)}ms",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
            "--logger=zap",
        ]

    async def start(self, timeout: float = 20.0) -> None:
        """Start (or restart, on the same ports and data) and wait until it serves reads and writes."""
        assert self.process is None, "already running"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.data_dir.parent)}
        with self.log.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                self._command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
        with trio.move_on_after(timeout):
            async with httpx.AsyncClient(trust_env=False, timeout=1.0) as client:
                while True:
                    if self.process.poll() is not None:
                        self.process = None
                        raise RuntimeError(f"etcd exited at start; its log:\n{self.log.read_text()[-3000:]}")
                    try:
                        # A linearizable read answers only once the member leads its cluster of one.
                        response = await client.post(self.url + "/v3/kv/range", json={"key": "aGVhbHRo"})
                        if response.status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.05)
        await self.stop()
        raise RuntimeError(f"etcd was not ready within {timeout}s; its log:\n{self.log.read_text()[-3000:]}")

    async def kill(self) -> None:
        """SIGKILL by PID, and reap it: the member dies without a word to its clients."""
        process, self.process = self.process, None
        if process is not None:
            os.kill(process.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await process.wait()

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def stop(self) -> None:
        await self.kill()


@asynccontextmanager
async def open_etcd(tmp_path: Path, **kwargs: float) -> AsyncIterator[EtcdServer]:
    """Start an etcd in ``tmp_path``; yield it; kill it by PID however the test ends."""
    server = EtcdServer(tmp_path / "etcd-data", **kwargs)
    for attempt in range(3):
        try:
            await server.start()
            break
        except RuntimeError:
            # Another process may have taken a free port between our probe and etcd's bind.
            if attempt == 2:
                raise
            server = EtcdServer(tmp_path / f"etcd-data-{attempt}", **kwargs)
    try:
        yield server
    finally:
        await server.stop()
