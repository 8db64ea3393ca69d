"""The fleet recipe outlives the etcd it started: its proxies route from memory while etcd
is down, the recipe starts etcd again (or says in one line that it is gone), and the
proxies catch up when it is back.

Each test runs ``python -m recipes.fleet`` as a user would, finds the etcd it started
among its children (``/proc``), and kills that process only.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio
from support import Lines, curl

from blocks import EtcdSource
from blocks.testing import serve_etcd

REPO = Path(__file__).resolve().parent.parent


def children(pid: int) -> list[int]:
    """The PIDs of process ``pid``'s children (from ``/proc``: trio starts them from a worker thread)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # it has exited
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def etcd_child(pid: int) -> tuple[int, Path]:
    """The etcd that process ``pid`` runs: its PID and data dir."""
    for child in children(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if Path(argv[0]).name == "etcd":
            data_dir = next(arg.removeprefix("--data-dir=") for arg in argv if arg.startswith("--data-dir="))
            return child, Path(data_dir)
    raise AssertionError(f"process {pid} runs no etcd (children: {children(pid)})")


@attrs.define
class RunningFleet:
    process: trio.Process
    stdout: Lines
    stderr: Lines
    etcd: str
    proxies: list[str]

    async def status(self, proxy: str, host: str = "demo.example") -> int:
        # curl, as the recipe says: a proxy trusts the edge before it to have dropped
        # hop-by-hop fields, and curl sends none.
        return int(await curl("-o", "/dev/null", "-w", "%{http_code}", "-H", f"host: {host}", proxy + "/"))

    async def stop(self) -> str:
        """SIGTERM (a drain): the exit code must be 0; returns stderr."""
        self.process.send_signal(signal.SIGTERM)
        await self.stdout.until(r"^stopped$")
        assert await self.process.wait() == 0, self.stdout.text
        return await self.stderr.rest()


@asynccontextmanager
async def run_fleet() -> AsyncIterator[RunningFleet]:
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(
                trio.run_process,
                [sys.executable, "-m", "recipes.fleet"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=REPO,
                check=False,
            )
        )
        assert process.stdout is not None and process.stderr is not None
        stdout, stderr = Lines(process.stdout), Lines(process.stderr)
        await stdout.until(r"^try: curl")
        etcd = (await stdout.until(r"^etcd at (http://\S+)")).group(1)
        proxies = re.findall(r"^\[\w\] proxy \w listening on (http://\S+) pid \d+$", stdout.text, re.MULTILINE)
        assert len(proxies) == 2, stdout.text
        yield RunningFleet(process, stdout, stderr, etcd, proxies)


async def test_the_fleet_starts_etcd_again_and_its_proxies_catch_up() -> None:
    with trio.fail_after(90):
        async with run_fleet() as fleet:
            assert [await fleet.status(proxy) for proxy in fleet.proxies] == [200, 200]
            pid, _ = etcd_child(fleet.process.pid)
            os.kill(pid, signal.SIGKILL)
            for _ in range(3):  # while it is down or coming back: from memory, never an error
                assert [await fleet.status(proxy) for proxy in fleet.proxies] == [200, 200]
            await fleet.stdout.until(rf"^etcd at {fleet.etcd} exited \(killed by SIGKILL\); starting it again")
            await fleet.stdout.until(rf"^etcd at {fleet.etcd} is back \(pid \d+\)$")
            assert etcd_child(fleet.process.pid)[0] != pid
            # A route written to the new etcd (same data: revision and keys kept) reaches every proxy.
            result = await trio.run_process(
                [sys.executable, "-m", "blocks.routectl", "--etcd", fleet.etcd, "put-domain", "new.example", "demo"],
                capture_stdout=True,
                cwd=REPO,
            )
            assert result.stdout.startswith(b"put domains/new.example")
            for proxy in fleet.proxies:
                while await fleet.status(proxy, "new.example") != 200:
                    await trio.sleep(0.05)
            assert fleet.process.returncode is None
            stderr = await fleet.stop()
        assert "Traceback" not in stderr
        # Quiet: each proxy says once that etcd went, and once that it is back, whatever its retries.
        for name in "ab":
            lost = re.findall(
                rf"^proxy {name}: .* route source .* unavailable \(.*\); serving the routes", stderr, re.M
            )
            back = re.findall(rf"^proxy {name}: .* route source .* back after [\d.]+s, at revision \d+$", stderr, re.M)
            assert (len(lost), len(back)) == (1, 1), stderr


async def test_an_etcd_that_cannot_come_back_is_one_line_and_the_proxies_serve_from_memory() -> None:
    moved: Path | None = None
    try:
        with trio.fail_after(90):
            async with run_fleet() as fleet:
                pid, data_dir = etcd_child(fleet.process.pid)
                moved = data_dir.with_name("moved")
                data_dir.rename(moved)  # its keys are gone: an empty etcd in its place would be worse than none
                os.kill(pid, signal.SIGKILL)
                line = await fleet.stderr.until(rf"^proxyblocks: etcd at {fleet.etcd} is gone \((.*)\).*$")
                assert line.group(1) == f"its data dir {data_dir} is gone", line.group(0)
                for _ in range(5):  # etcd is down for good: every request is routed from memory
                    assert [await fleet.status(proxy) for proxy in fleet.proxies] == [200, 200]
                assert fleet.process.returncode is None
                assert pid not in children(fleet.process.pid)
                stderr = await fleet.stop()
            assert "Traceback" not in stderr
            assert stderr.count("proxyblocks: etcd") == 1, stderr
    finally:
        if moved is not None:
            shutil.rmtree(moved.parent, ignore_errors=True)  # the recipe's temporary directory


async def test_serve_etcd_removes_the_temporary_directory_it_made() -> None:
    def scratch() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("proxyblocks-etcd-*"))

    before = scratch()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_etcd)
            assert await EtcdSource(url).get("anything") is None  # it runs, from a directory of its own
            made = scratch() - before
            assert len(made) == 1 and (made.pop() / "etcd").is_dir()
            nursery.cancel_scope.cancel()
    assert scratch() - before == set()
