"""``--processes N``: N processes share a hop's port under a supervising parent.

Every case runs ``python -m recipes.chain`` as the docs say, with real
processes and real sockets on 127.0.0.1 (port 0), and waits for states (a
printed line, an answer, a count in ``/metrics``), each bounded by
``trio.fail_after``. Connections are spread by the kernel (``SO_REUSEPORT``
hashes each new connection), so a case that needs both processes opens new
connections until both have counted one.
"""

from __future__ import annotations

import ctypes
import functools
import io
import json
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from support import Lines, curl, http_server, start_python, start_recipe
from test_startup_errors import assert_one_line_error, run_recipe

from blocks import Chain, Request, Response, WorkerSessionConfig, serve_chain, serve_http
from blocks.command import SUPERVISED_VARIABLE, _Supervised, _supervised, _whole_lines
from blocks.http import BytesBody
from blocks.observe import ProcessAdmin, merge_metrics, serve_merged_admin
from blocks.scheduler import SchedulerConfig, TenantPolicy

PROCESSES = r"^processes: (\d+) (\d+) \(sharing (\S+)\)$"


async def get(url: str, **headers: str) -> httpx.Response:
    """One request on a connection of its own (so the kernel picks a process for it)."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        return await client.get(url, headers=headers)


async def answered(admin: str, hop: str = "edge") -> dict[str, float]:
    """``hop``'s 2xx answers by process, from the parent's merged ``/metrics``."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        text = (await client.get(f"{admin}/metrics")).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "proxyblocks_requests_total" and (labels["hop"], labels["status_class"]) == (hop, "2xx"):
                counts[labels["process"]] = counts.get(labels["process"], 0) + sample.value
    return counts


async def until_both_count(
    url: str, admin: str, since: dict[str, float] | None = None, path: str = "/", **headers: str
) -> list[str]:
    """Requests on new connections until both processes counted one more than ``since``; their bodies."""
    since = since or {}
    bodies = []
    while True:
        response = await get(f"{url}{path}", **headers)
        assert response.status_code == 200, response.text
        bodies.append(response.text)
        counts = await answered(admin)
        if all(counts.get(p, 0) > since.get(p, 0) for p in ("0", "1")):
            return bodies


async def stop(process: trio.Process, lines: Lines) -> str:
    process.send_signal(signal.SIGTERM)
    output = await lines.rest()
    assert output.endswith("draining...\nstopped\n"), output
    assert await process.wait() == 0
    return output


async def test_two_processes_serve_one_port_and_the_parent_merges_their_metrics() -> None:
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--processes", "2", "--admin-port", "0")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            pids = (await lines.until(PROCESSES)).groups()[:2]
            admin = (await lines.until(r"^admin listening on (\S+)$")).group(1)
            assert len(set(pids)) == 2 and str(process.pid) not in pids
            await until_both_count(url, admin)  # requests landed on both, each counted with its label
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                assert (await client.get(f"{admin}/readyz")).status_code == 200
                assert (await client.get(f"{admin}/healthz")).status_code == 200
                status = (await client.get(f"{admin}/status.json")).json()
            assert [(row["process"], str(row["pid"])) for row in status["processes"]] == [(0, pids[0]), (1, pids[1])]
            assert all(row["status"]["listeners"][0]["url"] == url for row in status["processes"])
            await stop(process, lines)


async def test_a_killed_process_is_started_again_and_the_port_stays_served() -> None:
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--processes", "2")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            first, second, _ = (await lines.next(PROCESSES)).groups()
            os.kill(int(first), signal.SIGKILL)
            while _alive(int(first)):  # (a connection queued on its listener as it dies is reset)
                await trio.sleep(0.01)
            for _ in range(10):  # the other process takes every connection meanwhile
                assert (await get(f"{url}/")).status_code == 200
            again = (await lines.next(PROCESSES)).groups()
            assert again[0] not in (first, second) and again[1] == second
            assert (await get(f"{url}/")).status_code == 200
            assert process.stderr is not None
            said = (await Lines(process.stderr).until(r"^proxyblocks: process 0 .*$")).group(0)
            assert f"(pid {first}) was killed by SIGKILL; starting it again in 0.1s" in said
            await stop(process, lines)
    assert not any(_alive(int(pid)) for pid in (*again[:2], first))  # none outlives the parent


async def test_sighup_reaches_every_process(tmp_path: Path) -> None:
    config, routes = tmp_path / "chain.toml", tmp_path / "routes.toml"
    with trio.fail_after(120):
        async with (
            http_server(tmp_path / "a", b"A\n") as a,
            http_server(tmp_path / "b", b"B\n") as b,
            trio.open_nursery() as nursery,
        ):
            config.write_text(f'replica = ["http://{a[0]}:{a[1]}"]\nroutes = "routes.toml"\n')
            routes.write_text("[domains]\n")
            process, lines = await start_recipe(
                nursery, "--processes", "2", "--admin-port", "0", "--config", str(config)
            )
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            worker = (await lines.until(r"^worker listening on h2c://(\S+)$")).group(1)
            admin = (await lines.until(r"^admin listening on (\S+)$")).group(1)
            assert set(await until_both_count(url, admin, path="/hello.txt")) == {"A\n"}
            # The config file's replicas, reloaded by SIGHUP in both processes:
            before = await answered(admin)
            config.write_text(f'replica = ["http://{b[0]}:{b[1]}"]\nroutes = "routes.toml"\n')
            process.send_signal(signal.SIGHUP)
            await lines.next(r"^reloaded$")
            assert set(await until_both_count(url, admin, before, path="/hello.txt")) == {"B\n"}
            # A route file edit, loaded by SIGHUP in both at once (before their watches would see it):
            before = await answered(admin)
            staged = tmp_path / "routes.new"
            staged.write_text(
                '[domains]\n"other.example" = "other"\n'
                f'[apps.other.replicas.a]\nworker = "{worker}"\naddress = "{a[0]}:{a[1]}"\nprotocol = "h1"\n'
            )
            staged.replace(routes)
            process.send_signal(signal.SIGHUP)
            await lines.next(r"^reloaded$")
            answers = await until_both_count(url, admin, before, path="/hello.txt", host="other.example")
            assert set(answers) == {"A\n"}
            await stop(process, lines)


async def test_sessions_hold_whichever_process_a_request_lands_on(tmp_path: Path) -> None:
    """The proxy runs as two processes in front of one worker (here, in the test's process, with two
    demo replicas whose sessions it keeps): a session token names its replica, and either proxy
    process verifies it and sends the session's requests there."""
    config = tmp_path / "sessions.toml"
    secret = "cd" * 32
    config.write_text(
        f"[sessions]\napps = ['demo']\nrequire_auth = false\n[[sessions.keys]]\nkid = 's1'\nsecret = '{secret}'\n"
    )
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:

            async def build(chain: Chain) -> None:
                local = {name: await chain.start_replica(name) for name in ("replica-0", "replica-1")}
                await chain.start_worker(local, app=None, sessions=WorkerSessionConfig())

            chain: Chain = await nursery.start(serve_chain, build)
            replicas = [
                arg for server in chain.replicas.values() for arg in ("--replica", f"h2c://127.0.0.1:{server.port}")
            ]
            at = f"h2c://127.0.0.1:{chain.worker_server.port}"
            args = ("--role", "proxy", "--next-hop", at, *replicas, "--config", str(config), "--admin-port", "0")
            proxy, lines = await start_recipe(nursery, *args, "--processes", "2")
            port = (await lines.until(PROCESSES)).group(3).rpartition(":")[2]
            admin = (await lines.until(r"^admin listening on (\S+)$")).group(1)
            proxy_url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(trust_env=False, timeout=10, http1=False, http2=True) as client:
                started = await client.post(f"{proxy_url}/.proxyblocks/sessions")
            assert started.status_code == 201, started.text
            token, replica = started.json()["token"], started.json()["replica"]
            before = await answered(admin, "proxy")  # (the start counted at one of them)
            seen: set[str] = set()
            while seen != {"0", "1"}:  # new connections until both proxy processes served the session
                async with httpx.AsyncClient(trust_env=False, timeout=10, http1=False, http2=True) as client:
                    answer = await client.get(f"{proxy_url}/", headers={"proxyblocks-session": token})
                assert (answer.status_code, answer.headers["x-replica"]) == (200, replica), answer.text
                seen = {p for p, n in (await answered(admin, "proxy")).items() if n > before.get(p, 0)}
            await stop(proxy, lines)
            chain.cancel()


async def test_a_bad_flag_with_processes_is_one_line() -> None:
    code, stdout, stderr = await run_recipe("chain", "--processes", "2", "--port", "70000")
    assert_one_line_error(code, stdout, stderr, "--port")
    code, stdout, stderr = await run_recipe("chain", "--processes", "0")
    assert_one_line_error(code, stdout, stderr, "--processes")
    code, stdout, stderr = await run_recipe("chain", "--processes", "2", "--tls")  # (a certificate each)
    assert_one_line_error(code, stdout, stderr, "--tls", "--cert")
    code, stdout, stderr = await run_recipe("chain", "--processes", "2", "--start-timeout", "0")
    assert_one_line_error(code, stdout, stderr, "--start-timeout")


async def test_a_process_that_cannot_start_ends_the_parent_with_its_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    code, stdout, stderr = await run_recipe("chain", "--processes", "2", "--routes", str(missing))
    assert_one_line_error(code, stdout, stderr, str(missing))


async def test_a_port_in_use_is_one_line() -> None:
    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, stdout, stderr = await run_recipe("chain", "--processes", "2", "--port", str(port))
        assert_one_line_error(code, stdout, stderr, f"127.0.0.1:{port}")
        code, stdout, stderr = await run_recipe("chain", "--processes", "2", "--admin-port", str(port))
        assert_one_line_error(code, stdout, stderr, f"127.0.0.1:{port}")


def test_the_budgets_are_split_so_n_processes_admit_what_one_did() -> None:
    config = SchedulerConfig(
        budget=512,
        default_policy=TenantPolicy(max_in_flight=256, max_queued=512),
        tenants={"tiny": TenantPolicy(max_in_flight=1, max_queued=0, weight=3)},
    )
    assert config.split(1, 0) is config
    half = config.split(2, 1)
    assert (half.budget, half.default_policy.max_in_flight, half.default_policy.max_queued) == (256, 128, 256)
    assert (half.tenants["tiny"].max_in_flight, half.tenants["tiny"].max_queued, half.tenants["tiny"].weight) == (
        1,
        0,
        3,
    )  # at least 1 slot; never waiting stays never waiting
    assert [SchedulerConfig(budget=5).split(2, i).budget for i in (0, 1)] == [3, 2]  # not 2 and 2
    assert config.split(1000, 999).budget == 1
    assert SchedulerConfig(budget=8).split(2, 0).default_policy.max_in_flight is None
    with pytest.raises(ValueError, match="at least 1"):
        config.split(0, 0)
    with pytest.raises(ValueError, match="from 0 to 1"):
        config.split(2, 2)


@given(
    budget=st.integers(1, 10_000),
    in_flight=st.none() | st.integers(1, 10_000),
    queued=st.integers(0, 10_000),
    processes=st.integers(1, 256),
)
def test_the_shares_of_n_processes_add_up_to_what_one_process_had(
    budget: int, in_flight: int | None, queued: int, processes: int
) -> None:
    """Invariant: the shares of every index add up to the original, or to ``processes`` where the
    original is below it (each share is at least 1; never waiting stays never waiting)."""
    config = SchedulerConfig(budget=budget, tenants={"t": TenantPolicy(max_in_flight=in_flight, max_queued=queued)})
    shares = [config.split(processes, index) for index in range(processes)]
    policies = [share.policy("t") for share in shares]
    assert sum(share.budget for share in shares) == max(budget, processes)
    assert all(share.budget >= 1 for share in shares)
    if in_flight is None:
        assert all(policy.max_in_flight is None for policy in policies)
    else:
        assert sum(policy.max_in_flight or 0 for policy in policies) == max(in_flight, processes)
    assert sum(policy.max_queued for policy in policies) == (queued and max(queued, processes))
    assert max(share.budget for share in shares) - min(share.budget for share in shares) <= 1  # even


def test_merged_metrics_label_every_sample_with_its_process() -> None:
    text = (
        "# HELP proxyblocks_requests_total Requests.\n# TYPE proxyblocks_requests_total counter\n"
        'proxyblocks_requests_total{hop="edge"} 3.0\n'
    )
    merged = merge_metrics([(0, text), (1, text), (2, None), (3, text + "not metrics {{{\n")])
    families = {family.name: family for family in merged}
    samples = [(s.labels, s.value) for s in families["proxyblocks_requests"].samples]
    assert samples == [({"hop": "edge", "process": "0"}, 3.0), ({"hop": "edge", "process": "1"}, 3.0)]
    up = [(s.labels["process"], s.value) for s in families["proxyblocks_process_up"].samples]
    assert up == [("0", 1.0), ("1", 1.0), ("2", 0.0), ("3", 0.0)]  # (3: its text does not parse)


METRICS = (
    b"# HELP proxyblocks_requests_total Requests.\n# TYPE proxyblocks_requests_total counter\n"
    b'proxyblocks_requests_total{hop="edge"} 3.0\n'
)


@pytest.mark.parametrize(
    ("metrics", "status"),
    [
        (b"not metrics at all {{{\n", b"not json"),
        (b"\xff\xfe proxyblocks_requests_total 1\n", b"\xff\xfe{}"),
        (b"# TYPE x bogus\nx 1\n", b'{"draining": NaN}'),
        (b"x{a=b} 1\n", b"[" * 100_000),
    ],
)
async def test_a_process_answering_garbage_is_one_that_did_not_answer(metrics: bytes, status: bytes) -> None:
    """Three stand-ins for a parent's children, real HTTP servers on loopback: process 0 answers
    ``metrics`` and ``status`` (that do not parse), process 1 answers well, process 2 never answers.
    The parent's merged endpoints leave 0 and 2 out alike, and keep 1's data."""
    good_status = {"draining": False, "listeners": []}

    async def garbage(request: Request) -> Response:
        return Response(200, [], BytesBody(metrics if request.path == b"/metrics" else status))

    async def good(request: Request) -> Response:
        body = METRICS if request.path == b"/metrics" else json.dumps(good_status).encode()
        return Response(200, [], BytesBody(body))

    async def silent(request: Request) -> Response:
        await trio.sleep_forever()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            ports = [
                (await nursery.start(functools.partial(serve_http, handler))).port
                for handler in (garbage, good, silent)
            ]
            known = [ProcessAdmin(i, os.getpid(), port, True) for i, port in enumerate(ports)]
            merged = await nursery.start(functools.partial(serve_merged_admin, lambda: known, timeout=0.5))
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                scraped = await client.get(f"http://127.0.0.1:{merged.port}/metrics")
                document = await client.get(f"http://127.0.0.1:{merged.port}/status.json")
            nursery.cancel_scope.cancel()
    assert scraped.status_code == 200, scraped.text
    families = {family.name: family for family in text_string_to_metric_families(scraped.text)}
    up = {s.labels["process"]: s.value for s in families["proxyblocks_process_up"].samples}
    assert up == {"0": 0.0, "1": 1.0, "2": 0.0}
    samples = [(s.name, s.labels, s.value) for s in families["proxyblocks_requests"].samples]
    assert samples == [("proxyblocks_requests_total", {"hop": "edge", "process": "1"}, 3.0)]
    assert document.status_code == 200, document.text
    assert [row["status"] for row in document.json()["processes"]] == [None, good_status, None]


async def test_the_processes_do_not_outlive_a_killed_parent() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--processes", "2")
            pids = [int(pid) for pid in (await lines.until(PROCESSES)).groups()[:2]]
            process.kill()  # no drain of its own: each process reads end-of-file on its link and drains
            await process.wait()
            while any(_alive(pid) for pid in pids):
                await trio.sleep(0.05)


async def test_a_parent_killed_while_its_processes_drain_lets_them_finish() -> None:
    """SIGTERM to the parent drains every process; SIGKILL to it then (end-of-file on each one's link)
    is no second signal: the request in flight completes, and each process exits 0."""
    with trio.fail_after(90), adopting_orphans() as pids:
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--processes", "2", "--admin-port", "0", "--grace", "60")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            pids += [int(pid) for pid in (await lines.until(PROCESSES)).groups()[:2]]
            admin = (await lines.until(r"^admin listening on (\S+)$")).group(1)
            async with (
                httpx.AsyncClient(trust_env=False, timeout=30) as client,
                client.stream("GET", f"{url}/stream?n=6&ms=400") as response,
            ):
                chunks = response.aiter_raw()
                body = await anext(chunks)  # in flight
                process.send_signal(signal.SIGTERM)
                await lines.until(r"^draining\.\.\.$")
                while not all(map(drained_or_draining, rows := await statuses(admin))):
                    await trio.sleep(0.05)
                draining = [os.pidfd_open(row["pid"]) for row in rows if row["serving"]]  # (one has our request)
                process.kill()
                async for chunk in chunks:
                    body += chunk
            assert (response.status_code, body) == (200, b"".join(b"token %d\n" % i for i in range(6)))
            exits = [await exit_status(pidfd) for pidfd in draining]  # (None: it ended before its parent)
            assert 0 in exits and set(exits) <= {0, None}, exits


def drained_or_draining(row: dict[str, Any]) -> bool:
    """Whether a process of the merged ``/status.json`` drains (an idle one may be done already)."""
    return not row["serving"] or bool(row["status"] and row["status"]["draining"])


async def statuses(admin: str) -> list[dict[str, Any]]:
    """Each process's row of the parent's merged ``/status.json``."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        rows: list[dict[str, Any]] = (await client.get(f"{admin}/status.json")).json()["processes"]
    return rows


@contextmanager
def adopting_orphans() -> Iterator[list[int]]:
    """This process adopts the orphans of its descendants (``PR_SET_CHILD_SUBREAPER``), so that a test
    can read the exit status of a process whose parent it killed (:func:`exit_status`). Yields a
    list for the test to put their pids in: any of them still running on the way out is killed, and
    all are reaped."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        pytest.skip("this system cannot make a process a subreaper")
    pids: list[int] = []
    try:
        yield pids
    finally:
        prctl(36, 0, 0, 0, 0)
        for pid in pids:
            try:
                if os.waitpid(pid, os.WNOHANG) == (0, 0):  # adopted, and running
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # not adopted, or reaped already


async def exit_status(pidfd: int) -> int | None:
    """The exit status of the process of ``pidfd`` (closed here) once it exits, if this process
    adopted it (:func:`adopting_orphans`); None if its parent was there to reap it."""
    try:
        await trio.lowlevel.wait_readable(pidfd)
        ended = os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    except ChildProcessError:
        return None
    finally:
        os.close(pidfd)
    assert ended is not None
    return ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status


STAND_IN = """
import json, os, signal, sys

mode, grace, start_timeout = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
if "PROXYBLOCKS_PROCESS" not in os.environ:  # the parent, as run_until_signal makes it
    from blocks._supervisor import supervise
    from blocks.command import Operations

    operations = Operations(processes=2, start_timeout=start_timeout)
    sys.exit(supervise(operations, ("127.0.0.1", 0), grace=grace, stop_margin=0.5))
index, _, link, *_ = map(int, os.environ["PROXYBLOCKS_PROCESS"].split())
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.write(1, f"child {index} pid {os.getpid()}\\n".encode())  # (one write: the two children share stdout)
if mode == "deaf" or index == 0:  # "deaf": serves, and ignores SIGTERM; "silent": process 1 never serves
    os.write(link, json.dumps({"started": os.getpid(), "admin": None}).encode() + b"\\n")
while True:
    signal.pause()
"""
"""A command whose children misbehave (``python STAND_IN MODE GRACE START_TIMEOUT``): the parent is
the real supervisor (stopping children 0.5 s past the grace), and each child a few lines that speak
the link's protocol, then ignore SIGTERM."""


async def test_a_process_that_ignores_sigterm_is_killed_past_the_grace(tmp_path: Path) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process, lines = await start_python(nursery, str(script), "deaf", "0.5", "60")
            pids = [int(pid) for pid in (await lines.until(PROCESSES)).groups()[:2]]
            process.send_signal(signal.SIGTERM)
            output = await lines.rest()
            assert await process.wait() == 0
            assert process.stderr is not None
            said = (await Lines(process.stderr).rest()).splitlines()
    assert output.endswith("draining...\nstopped\n"), output
    assert sorted(said) == [
        f"proxyblocks: process {i} (pid {pid}) did not stop within 1s of SIGTERM; killing it"
        for i, pid in enumerate(pids)
    ]
    assert not any(_alive(pid) for pid in pids)


async def test_a_process_that_never_serves_ends_the_parent_with_one_line(tmp_path: Path) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, str(script), "silent", "0.5", "3"], capture_stdout=True, capture_stderr=True, check=False
        )
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    assert_one_line_error(result.returncode, stdout, stderr, "process 1 did not serve within 3s")
    pids = [int(pid) for pid in re.findall(r"^child \d pid (\d+)$", stdout, re.MULTILINE)]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids), stdout


def test_the_link_to_the_parent_is_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that a supervised one starts cannot hold its link to the parent open."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.set_inheritable(True)  # (as pass_fds leaves it in the child)
        monkeypatch.setenv(SUPERVISED_VARIABLE, f"1 2 {theirs.fileno()}")
        _supervised.cache_clear()
        try:
            assert _supervised() == _Supervised(1, 2, theirs.fileno())
            assert not theirs.get_inheritable()
        finally:
            _supervised.cache_clear()


class _Writes(io.RawIOBase):
    """A raw stream that keeps each ``write`` it is given, as a pipe's reader would see them arrive."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.writes.append(bytes(data))
        return len(data)


@given(st.lists(st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=1000)))
def test_a_printed_line_is_one_write_under_pythonunbuffered(lines: list[str]) -> None:
    """The parent and its processes share stdout: a line printed by one must not be split by another's.
    ``-u`` (``PYTHONUNBUFFERED``, as containers set it) writes a print's text and its newline apart."""
    raw = _Writes()
    stream = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)  # (what -u makes of stdout)
    _whole_lines(stream)
    for line in lines:
        print(line, file=stream)
        assert raw.writes[-1:] == [f"{line}\n".encode()]
    assert len(raw.writes) == len(lines)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_each_fleet_proxy_is_n_processes() -> None:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--processes", "2", recipe="fleet")
            shared = [
                (await lines.until(rf"^\[{name}\] processes: (\d+) (\d+) \(sharing (\S+)\)$")).groups() for name in "ab"
            ]
            for *pids, where in shared:
                assert all(_alive(int(pid)) for pid in pids)
                for _ in range(4):
                    # curl, as the recipe says (a proxy trusts an edge to have dropped hop-by-hop fields)
                    assert (
                        await curl(
                            "-o", "/dev/null", "-w", "%{http_code}", "-H", "host: demo.example", f"http://{where}/"
                        )
                        == "200"
                    )
            process.send_signal(signal.SIGTERM)
            await lines.until(r"^stopped$")
            assert await process.wait() == 0
    assert not any(_alive(int(pid)) for *pids, _ in shared for pid in pids)
