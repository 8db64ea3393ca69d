"""Prometheus metrics (blocks.observe) after real traffic through a real chain, read back from ``/metrics``.

The exposition is parsed by prometheus-client's own parser, and one test
has a real Prometheus server scrape the admin listener and answer a query.
Rules: loopback only, port 0, every test bounded by ``trio.fail_after``;
each waits for the state it asserts.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import hyperframe.frame
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from support import HOST, RawFrames, closed_port, held_chain, wait_for

from blocks import (
    Chain,
    HTTPServer,
    LocalReplica,
    SchedulerConfig,
    serve_chain,
)
from blocks.mirror import MirrorConfig
from blocks.observe import Metrics
from blocks.scheduler import TenantPolicy


def h2_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(http2=True, http1=False, trust_env=False)


async def metered_chain(
    nursery: trio.Nursery,
    *,
    replicas: Sequence[str] = ("replica-0",),
    dead: Sequence[str] = (),
    **proxy: Any,
) -> tuple[Chain, HTTPServer]:
    """edge -> proxy -> worker -> demo ``replicas`` (and ``dead`` ones on closed ports), each hop with
    :class:`Metrics`, and the chain's admin listener (started last: it reads parts started before it)."""

    async def build(chain: Chain) -> None:
        local = {name: await chain.start_replica(name) for name in replicas}
        local |= {name: LocalReplica((HOST, closed_port())) for name in dead}
        await chain.start_worker(local, features=[Metrics()])
        await chain.start_proxy(features=[Metrics()], **proxy)
        await chain.start_edge(features=[Metrics()])

    chain: Chain = await nursery.start(serve_chain, build)
    admin = await chain.start_admin()
    return chain, admin


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(admin: HTTPServer) -> Samples:
    """``/metrics``, parsed: (sample name, labels) -> value."""
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.get(f"http://{HOST}:{admin.port}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def labelled(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(labels)[label] for sample, labels in samples if sample == name and label in dict(labels)}


async def test_seven_requests_are_seven_2xx_at_every_hop_with_their_phases(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain, admin = await metered_chain(nursery)
        async with h2_client() as client:
            for _ in range(7):
                assert (await client.get(chain.url + "/")).status_code == 200
        samples = await scrape(admin)
    requests = "proxyblocks_requests_total"
    assert value(samples, requests, hop="edge", app="", status_class="2xx", reason="") == 7
    assert value(samples, requests, hop="proxy", app="demo", status_class="2xx", reason="") == 7
    assert value(samples, requests, hop="worker", app="", status_class="2xx", reason="") == 7
    assert value(samples, requests, hop="edge", app="", status_class="5xx", reason="") == 0
    # Every Server-Timing phase of every hop is a histogram of 7.
    count = "proxyblocks_phase_duration_seconds_count"
    for hop, phases in {
        "edge": ("edge", "total"),
        "proxy": ("proxy", "proxy-route"),
        "worker": ("worker", "app"),
    }.items():
        assert {value(samples, count, hop=hop, phase=phase) for phase in phases} == {7}, hop
        inf = value(samples, "proxyblocks_phase_duration_seconds_bucket", hop=hop, phase=phases[0], le="+Inf")
        assert inf == 7
    assert labelled(samples, count, "phase") == {"edge", "total", "proxy", "proxy-route", "worker", "app"}
    # What is not per request is read from the parts at scrape time.
    assert value(samples, "proxyblocks_replica_in_flight", hop="proxy", replica="replica-0") == 0
    assert value(samples, "proxyblocks_replica_in_flight", hop="worker", replica="replica-0") == 0
    assert value(samples, "proxyblocks_routes_revision") == chain.cache.revision > 0
    assert value(samples, "proxyblocks_routes_staleness_seconds") == 0
    assert labelled(samples, "proxyblocks_listener_connections", "hop") == {"edge", "proxy", "worker"}
    assert value(samples, "proxyblocks_listener_accepted_connections_total", hop="edge") == 1
    assert value(samples, "proxyblocks_upstream_connections", hop="edge", protocol="h2") == 1
    assert value(samples, "proxyblocks_listener_draining", hop="edge") == 0


async def test_every_family_the_docs_list_is_exposed_and_no_other(nursery: trio.Nursery) -> None:
    """docs/observability.md's table and ``/metrics`` name the same families (with a scheduler and a mirror
    configured, so that every part runs)."""
    table = (Path(__file__).resolve().parent.parent / "docs" / "observability.md").read_text()
    documented = set(re.findall(r"^\| `(proxyblocks_\w+)` \|", table, re.MULTILINE))
    with trio.fail_after(15):
        _, admin = await metered_chain(nursery, scheduler=SchedulerConfig(budget=8), mirror=MirrorConfig())
        async with httpx.AsyncClient(trust_env=False) as client:
            text = (await client.get(f"http://{HOST}:{admin.port}/metrics")).text
    exposed = set()
    for family in text_string_to_metric_families(text):
        exposed.add(family.name + "_total" if family.type == "counter" else family.name)
    assert exposed == documented


async def test_a_502_is_counted_with_its_reason_and_the_ejection_with_its_replica(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain, admin = await metered_chain(nursery, replicas=(), dead=("dead-0",))
        async with h2_client() as client:
            response = await client.get(chain.url + "/x")
        assert response.status_code == 502
        assert response.headers["proxyblocks-error"].startswith("replica_unreachable; hop=worker; replica=dead-0 (")
        samples = await scrape(admin)
    requests = "proxyblocks_requests_total"
    for hop, app in (("edge", ""), ("proxy", "demo"), ("worker", "")):
        labels = {"hop": hop, "app": app, "status_class": "5xx"}
        assert value(samples, requests, **labels, reason="replica_unreachable") == 1, hop
        assert value(samples, requests, **labels, reason="") == 0, hop
    assert value(samples, "proxyblocks_outlier_ejections_total", hop="proxy", replica="dead-0") == 1
    assert value(samples, "proxyblocks_outlier_ejected", hop="proxy", replica="dead-0") == 1
    # The proxy's own refusal (no live replica) is counted too: a 503 with its reason.
    chain.store.transact(deletes=[key for key in chain.store.items() if "/replicas/" in key])
    await wait_for(lambda: not chain.cache.replicas("demo"), "the dead replica's route removed")
    with trio.fail_after(10):
        async with h2_client() as client:
            assert (await client.get(chain.url + "/")).status_code == 503
        samples = await scrape(admin)
    assert value(samples, requests, hop="proxy", app="demo", status_class="5xx", reason="no_replica") == 1
    assert value(samples, requests, hop="edge", app="", status_class="5xx", reason="no_replica") == 1


async def test_tenants_are_the_busiest_ten_and_other(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        chain, admin = await metered_chain(nursery, scheduler=SchedulerConfig(budget=64))
        async with h2_client() as client:
            for i in range(50):
                tenant = f"t{i:02}"
                for _ in range(3 if i < 10 else 1):
                    response = await client.get(chain.url + "/", headers={"x-tenant": tenant})
                    assert response.status_code == 200
        samples = await scrape(admin)
    admitted = "proxyblocks_scheduler_admitted_total"
    assert labelled(samples, admitted, "tenant") == {f"t{i:02}" for i in range(10)} | {"other"}
    assert value(samples, admitted, hop="proxy", tenant="t03") == 3
    assert value(samples, admitted, hop="proxy", tenant="other") == 40
    assert value(samples, "proxyblocks_scheduler_refused_total", hop="proxy", tenant="other", status="429") == 0
    assert value(samples, "proxyblocks_scheduler_queue_depth", hop="proxy", tenant="t00") == 0


async def test_a_full_queue_is_a_429_counted_for_its_tenant(nursery: trio.Nursery) -> None:
    release = trio.Event()
    policy = TenantPolicy(max_queued=0)
    with trio.fail_after(15):
        chain = await held_chain(
            nursery, release, metered=True, scheduler=SchedulerConfig(budget=1, default_policy=policy)
        )
        admin = await chain.start_admin()
        async with h2_client() as client, trio.open_nursery() as inner:
            inner.start_soon(functools.partial(client.get, chain.url + "/hold", headers={"x-tenant": "alice"}))
            await wait_for(lambda: chain.proxy.scheduler is not None and chain.proxy.scheduler.statistics().in_flight)
            response = await client.get(chain.url + "/", headers={"x-tenant": "alice"})
            assert response.status_code == 429
            release.set()
        samples = await scrape(admin)
    assert value(samples, "proxyblocks_scheduler_refused_total", hop="proxy", tenant="alice", status="429") == 1
    assert value(samples, "proxyblocks_scheduler_admitted_total", hop="proxy", tenant="alice") == 1
    requests = "proxyblocks_requests_total"
    assert value(samples, requests, hop="proxy", app="demo", status_class="4xx", reason="overloaded") == 1
    assert value(samples, requests, hop="edge", app="", status_class="4xx", reason="overloaded") == 1


async def test_a_request_that_waits_for_a_slot_is_counted_queued_and_its_depth_shown(
    nursery: trio.Nursery,
) -> None:
    release = trio.Event()
    with trio.fail_after(15):
        chain = await held_chain(nursery, release, metered=True, scheduler=SchedulerConfig(budget=1))
        admin = await chain.start_admin()
        scheduler = chain.proxy.scheduler
        async with h2_client() as client, trio.open_nursery() as inner:
            inner.start_soon(functools.partial(client.get, chain.url + "/hold", headers={"x-tenant": "alice"}))
            await wait_for(lambda: scheduler is not None and scheduler.statistics().in_flight == 1)
            inner.start_soon(functools.partial(client.get, chain.url + "/", headers={"x-tenant": "alice"}))
            await wait_for(lambda: scheduler is not None and scheduler.statistics().queued == 1, "one waits")
            waiting = await scrape(admin)
            release.set()
        samples = await scrape(admin)
    queued, depth = "proxyblocks_scheduler_queued_total", "proxyblocks_scheduler_queue_depth"
    alice = {"hop": "proxy", "tenant": "alice"}
    assert (value(waiting, queued, **alice), value(waiting, depth, **alice)) == (1, 1)
    assert (value(samples, queued, **alice), value(samples, depth, **alice)) == (1, 0)
    assert value(samples, "proxyblocks_scheduler_admitted_total", hop="proxy", tenant="alice") == 2


async def test_an_abusive_connection_is_counted_by_reason(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain, admin = await metered_chain(nursery)
        async with RawFrames.open(chain.port) as raw:
            ping = hyperframe.frame.PingFrame(0, opaque_data=b"12345678").serialize()
            for _ in range(20):
                if not await raw.send(ping * 1000):
                    break
            assert (await raw.goaway()) is not None
        await wait_for(lambda: chain.edge.statistics().abuse.get("control_flood") == 1, "the flood counted")
        samples = await scrape(admin)
    closed = "proxyblocks_abuse_closed_connections_total"
    assert value(samples, closed, hop="edge", reason="control_flood") == 1


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="Debian's prometheus is not installed (.ci/run installs it)"
)
async def test_a_real_prometheus_scrapes_the_admin_listener(nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.fail_after(60):
        chain, admin = await metered_chain(nursery)
        async with h2_client() as client:
            for _ in range(3):
                assert (await client.get(chain.url + "/")).status_code == 200
        port = closed_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: proxyblocks\n"
            f"    static_configs:\n      - targets: ['{HOST}:{admin.port}']\n"
        )
        command = [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={HOST}:{port}",
        ]
        run = functools.partial(
            trio.run_process, command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
        )
        process: trio.Process = await nursery.start(run)
        query = 'proxyblocks_requests_total{hop="proxy",status_class="2xx",reason=""}'
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                while True:
                    try:
                        response = await client.get(f"http://{HOST}:{port}/api/v1/query", params={"query": query})
                    except httpx.TransportError:
                        response = None  # not listening yet
                    if response is not None and response.status_code == 200:
                        result = json.loads(response.text)["data"]["result"]
                        if result:
                            break
                    await trio.sleep(0.2)
        finally:
            process.terminate()  # ours, by its handle
        assert result[0]["metric"]["app"] == "demo"
        assert result[0]["metric"]["job"] == "proxyblocks"
        assert float(result[0]["value"][1]) == 3
