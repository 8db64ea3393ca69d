"""An etcd member on loopback, for demos and tests that share routes between processes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import trio
import trio.lowlevel

from blocks.sources import EtcdSource, SourceUnavailable

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


async def serve_etcd(
    data_dir: Path | None = None,
    *,
    progress_interval: float = 1.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one etcd member on loopback until cancelled; report its client URL once it answers.

    ``etcd`` is Debian's ``etcd-server`` (``RuntimeError`` if it is not
    installed). Its data goes to ``data_dir`` (default: a new temporary
    directory), its log to ``etcd.log`` beside it; an idle watch hears from it every ``progress_interval``
    seconds. It runs in a session of its own, so that a Ctrl-C reaches only
    the caller, which stops it (SIGKILL) when cancelled; if it exits by
    itself, this raises ``RuntimeError``.
    """
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="proxyblocks-etcd-")) / "etcd"
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("no etcd binary: `apt-get install etcd-server`")
    client, peer = f"http://{HOST}:{_free_port()}", f"http://{HOST}:{_free_port()}"
    command = [
        binary,
        "--name=fleet",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=fleet={peer}",
        f"--experimental-watch-progress-notify-interval={int(progress_interval * 1000)}ms",
        "--log-level=error",
        "--logger=zap",
    ]
    with (data_dir.parent / "etcd.log").open("ab") as log:
        # Its own session, as for the proxies: Ctrl-C reaches this process only, which stops the
        # children in order (proxies first, etcd last) rather than all at once.
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    try:
        source = EtcdSource(client, request_timeout=1.0)
        with trio.fail_after(20):
            while True:
                try:
                    await source.snapshot()
                    break
                except SourceUnavailable:
                    if process.poll() is not None:
                        raise RuntimeError(f"etcd exited with {process.returncode}; see {log.name}") from None
                    await trio.sleep(0.1)
        task_status.started(client)
        await process.wait()
        raise RuntimeError(f"etcd exited with {process.returncode}; see {log.name}")
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
