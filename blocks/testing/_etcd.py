"""An etcd member on loopback, for demos and tests that share routes between processes."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import trio
import trio.lowlevel

from blocks.sources import EtcdSource, SourceUnavailable

HOST = "127.0.0.1"
RESTART_TRIES = 3
"""Starts in a row that may fail (exit, or no answer within 20 s) before a lost etcd is given up."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


async def serve_etcd(
    data_dir: Path | None = None,
    *,
    progress_interval: float = 1.0,
    restart: bool = True,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one etcd member on loopback until cancelled; report its client URL once it answers.

    ``etcd`` is Debian's ``etcd-server`` (``FileNotFoundError`` if it is not
    installed, ``RuntimeError`` if the first start fails). Its data goes to ``data_dir``
    (default: a new temporary directory), its log to ``etcd.log`` beside
    it; an idle watch hears from it every ``progress_interval`` seconds. It
    runs in a session of its own, so that a Ctrl-C reaches only the caller,
    which stops it (SIGKILL) when cancelled.

    If it exits by itself, with ``restart`` (the default) it is started
    again on the same ports and data dir, so its keys and revisions
    survive and every watch resumes where it was; it prints one line when
    it is lost and one when it answers again. If it cannot be started again
    (its data dir is gone, or :data:`RESTART_TRIES` starts in a row fail),
    it prints ``proxyblocks: etcd at URL is gone (REASON)`` on stderr and
    waits, without etcd, until cancelled: whoever routes from a cache keeps
    routing. Without ``restart``, an exit raises ``RuntimeError``. A
    temporary directory it made is removed when it ends.
    """
    if data_dir is not None:
        await _serve_etcd(data_dir, progress_interval, restart, task_status)
        return
    scratch = Path(tempfile.mkdtemp(prefix="proxyblocks-etcd-"))
    try:
        await _serve_etcd(scratch / "etcd", progress_interval, restart, task_status)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def _serve_etcd(
    data_dir: Path, progress_interval: float, restart: bool, task_status: trio.TaskStatus[str]
) -> None:
    binary = shutil.which("etcd")
    if binary is None:
        raise FileNotFoundError("no etcd binary: `apt-get install etcd-server`")
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
    log = data_dir.parent / "etcd.log"
    started = False
    failures = 0  # starts in a row that did not answer
    while True:
        if started and not await trio.Path(data_dir).is_dir():
            # A new, empty member would take every watch from a revision it never had: worse than none.
            reason = f"its data dir {data_dir} is gone"
        else:
            answered, reason = await _run_etcd(command, client, log, started=started, task_status=task_status)
            if not started and not answered:
                raise RuntimeError(f"etcd {reason}; see {log}")
            started = True
            if answered and not restart:
                raise RuntimeError(f"etcd {reason}; see {log}")
            if answered:
                failures = 0
                print(f"etcd at {client} {reason}; starting it again (same port, same data)", flush=True)
                continue
            failures += 1
            if failures < RESTART_TRIES:
                await trio.sleep(1.0)
                continue
            reason = f"{reason}, {failures} times; see {log}"
        print(f"proxyblocks: etcd at {client} is gone ({reason}); routes are served from memory", file=sys.stderr)
        sys.stderr.flush()
        await trio.sleep_forever()


async def _run_etcd(
    command: list[str], client: str, log: Path, *, started: bool, task_status: trio.TaskStatus[str]
) -> tuple[bool, str]:
    """Run etcd once, until it exits: ``(whether it answered, how it ended)``."""
    with log.open("ab") as out:
        # Its own session, as for the proxies: Ctrl-C reaches this process only, which stops the
        # children in order (proxies first, etcd last) rather than all at once.
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    try:
        source = EtcdSource(client, request_timeout=1.0)
        with trio.move_on_after(20) as waiting:
            while True:
                try:
                    await source.snapshot()
                    break
                except SourceUnavailable:
                    if (code := process.poll()) is not None:
                        return False, f"exited ({_exit_reason(code)}) before it answered"
                    await trio.sleep(0.1)
        if waiting.cancelled_caught:
            return False, "did not answer within 20 s"
        if started:
            print(f"etcd at {client} is back (pid {process.pid})", flush=True)
        else:
            task_status.started(client)
        return True, f"exited ({_exit_reason(await process.wait())})"
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
