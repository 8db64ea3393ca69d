"""A child process that says when it is ready: what a recipe that starts processes of its own needs."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import trio
import trio.lowlevel


async def run_child_process(
    command: Sequence[str],
    ready: str,
    label: str,
    *,
    task_status: trio.TaskStatus[tuple[trio.Process, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``command`` until it exits; report ``(process, line)`` once it prints a line starting with ``ready``.

    Every line it prints is echoed as ``[label] LINE``. It runs in a session
    of its own, so that a Ctrl-C reaches only this process, which stops the
    child itself: when cancelled, SIGTERM, then SIGKILL after 5 seconds.
    Raises ``RuntimeError`` if the child exits before it is ready.
    """
    process = await trio.lowlevel.open_process(
        list(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None
    try:
        buffer = b""
        started = False
        while chunk := await process.stdout.receive_some(4096):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                if not started and text.startswith(ready):
                    task_status.started((process, text))
                    started = True
                print(f"[{label}] {text}", flush=True)
        await process.wait()
        if not started:
            raise RuntimeError(f"{label} exited with {process.returncode} before it was ready")
    finally:
        if process.returncode is None:
            process.terminate()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
