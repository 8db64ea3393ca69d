"""What a token check costs: TokenVerifier.verify for HMAC-SHA256, Ed25519 and a cache hit.

Everything runs in this process, on the caller's thread, the way a proxy
calls the verifier: one synchronous call per request, ``now`` passed in.
Each figure is the distribution of single calls, timed one by one with
``perf_counter_ns``; the cost of reading the clock twice (measured first,
and printed) is subtracted from every sample. The figures are sampled in
interleaved rounds (a slice of each per round), so that a burst of load from
elsewhere on the machine lands on all of them alike rather than on one.

1. ``hmac-sha256``: a proxy-auth token verified in full (size, shape, key,
   signature, payload, claims). The verifier's cache holds Ed25519 tokens
   only, so this is what every HMAC verify costs. Target: p50 <= 5 µs.
2. ``ed25519, uncached``: the same checks with an Ed25519 key and the cache
   off. No target (cryptography's Ed25519 verify dominates): printed so the
   cache's worth is visible.
3. ``cache hit``: an Ed25519 token the verifier has seen: the cache lookup
   and the claim checks. Target: p50 <= 1 µs.

For information, no target: a rejected token (a forged signature, HMAC),
which raises; ``ProxyAuth.authorize`` as the proxy runs it (header lookup,
verify, the token header stripped from 12 fields); and, for scale, one
``hashlib.sha256`` of 128 bytes, sampled in the same rounds: on a shared
machine the speed of the CPU itself drifts (by 2x here, from minute to
minute), and this row moves with it, so a figure over its target together
with a slow reference is the machine, not the code.

The last line is ``verdict: PASS|FAIL ...`` over the two targets' p50s.
Only this machine's figures compare with each other; absolute figures drift
with the machine and its load (printed first).

Run it from the repository root:

    python bench/tokens.py           # 200,000 samples per figure (5,000 for uncached Ed25519)
    python bench/tokens.py --quick   # 20,000 samples per figure (500 for uncached Ed25519)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from _harness import ROOT, load_average, percentile

HMAC_TARGET_US = 5.0
CACHE_HIT_TARGET_US = 1.0
NOW = 1_700_000_000.0


def _import_project() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def clock_overhead_ns(samples: int = 200_000) -> float:
    """The median cost of two back-to-back ``perf_counter_ns`` calls: subtracted from every sample."""
    values = []
    for _ in range(samples):
        start = perf_counter_ns()
        values.append(perf_counter_ns() - start)
    values.sort()
    return percentile(values, 0.5)


ROUNDS = 20


def sample(calls: dict[str, tuple[Callable[[], Any], int]], overhead: float) -> dict[str, list[float]]:
    """Per name, ``samples`` timings of its call in µs, sorted, clock overhead removed.

    ``calls`` maps a name to ``(call, samples)``. Every call is warmed up
    first; then each round takes a slice of every figure's samples.
    """
    for call, samples in calls.values():
        for _ in range(min(1000, samples)):
            call()
    raw: dict[str, list[int]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, (call, samples) in calls.items():
            values = raw[name]
            append = values.append
            for _ in range(max(1, samples // ROUNDS)):
                start = perf_counter_ns()
                call()
                append(perf_counter_ns() - start)
    return {name: sorted(max(0.0, (ns - overhead) / 1000) for ns in values) for name, values in raw.items()}


def rejecting(call: Callable[[], Any]) -> Callable[[], Any]:
    from blocks.errors import InvalidToken

    def run() -> None:
        try:
            call()
        except InvalidToken:
            pass
        else:
            raise AssertionError("the forged token verified")

    return run


def measure(samples: int, slow_samples: int, overhead: float) -> dict[str, list[float]]:
    _import_project()
    from blocks import Keyring, ProxyAuth, TokenIssuer, TokenKey, TokenVerifier
    from blocks.tokens import TokenVerifierConfig

    hmac_key = TokenKey.generate("k2024", "hmac-sha256")
    ed_key = TokenKey.generate("e2024", "ed25519")
    hmac_token = TokenIssuer(hmac_key).mint(app="chat", tenant="acme", now=NOW, ttl=3600).encode()
    ed_token = TokenIssuer(ed_key).mint(app="chat", tenant="acme", now=NOW, ttl=3600).encode()
    hmac_verifier = TokenVerifier(Keyring([hmac_key]))
    ed_uncached = TokenVerifier(Keyring([ed_key.verifying()]), TokenVerifierConfig(cache_size=0))
    ed_cached = TokenVerifier(Keyring([ed_key.verifying()]))
    block = bytes(128)
    forged = hmac_token[:-2] + (b"AA" if not hmac_token.endswith(b"AA") else b"AQ")

    auth = ProxyAuth(hmac_verifier, apps={"chat"})
    headers = [(b"accept", b"*/*"), (b"user-agent", b"bench/1.0")]
    headers += [(b"x-extra-%d" % i, b"value") for i in range(9)]
    headers.append((b"authorization", b"Bearer " + hmac_token))

    hmac_verify = hmac_verifier.verify
    ed_verify = ed_uncached.verify
    cached_verify = ed_cached.verify
    cached_verify(ed_token, now=NOW, app="chat")  # the first sight fills the cache
    figures = sample(
        {
            "hmac-sha256": (lambda: hmac_verify(hmac_token, now=NOW, app="chat"), samples),
            "ed25519, uncached": (lambda: ed_verify(ed_token, now=NOW, app="chat"), slow_samples),
            "cache hit (ed25519)": (lambda: cached_verify(ed_token, now=NOW, app="chat"), samples),
            "rejected (bad signature, hmac)": (rejecting(lambda: hmac_verify(forged, now=NOW, app="chat")), samples),
            "ProxyAuth.authorize (hmac)": (lambda: auth.authorize("chat", headers, NOW), samples),
            "for scale: sha256 of 128 bytes": (lambda: hashlib.sha256(block).digest(), samples),
        },
        overhead,
    )
    stats = ed_cached.statistics()
    assert stats.cache_entries == 1 and stats.cache_hits >= samples // ROUNDS * ROUNDS, stats
    assert hmac_verifier.statistics().rejected["bad_signature"] >= samples // ROUNDS * ROUNDS
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 samples per figure")
    parser.add_argument("--samples", type=int, default=200_000, help="samples per figure (default 200000)")
    args = parser.parse_args()
    samples = 20_000 if args.quick else max(100, args.samples)
    slow_samples = max(100, samples // 40)

    print(f"python {sys.version.split()[0]}, load average {load_average()}")
    overhead = clock_overhead_ns()
    print(f"clock overhead (two perf_counter_ns calls), subtracted from each sample: {overhead:.0f} ns")
    gc.collect()
    figures = measure(samples, slow_samples, overhead)

    print(f"\nµs per call ({samples} samples a row, {slow_samples} for uncached Ed25519; {ROUNDS} interleaved rounds)")
    print(f"{'':<34}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>10}   target (p50)")
    targets = {"hmac-sha256": HMAC_TARGET_US, "cache hit (ed25519)": CACHE_HIT_TARGET_US}
    for name, values in figures.items():
        target = targets.get(name)
        mark = f"<= {target:g}" if target is not None else "none"
        print(
            f"{name:<34}{percentile(values, 0.5):>9.2f}{percentile(values, 0.9):>9.2f}"
            f"{percentile(values, 0.99):>9.2f}{values[-1]:>10.1f}   {mark}"
        )

    def p50(name: str) -> float:
        return percentile(figures[name], 0.5)

    def p99(name: str) -> float:
        return percentile(figures[name], 0.99)

    hmac_ok = p50("hmac-sha256") <= HMAC_TARGET_US
    hit_ok = p50("cache hit (ed25519)") <= CACHE_HIT_TARGET_US
    verdict = "PASS" if hmac_ok and hit_ok else "FAIL"
    print(
        f"verdict: {verdict} HMAC p50 {p50('hmac-sha256'):.2f} µs (p99 {p99('hmac-sha256'):.2f}; target <= "
        f"{HMAC_TARGET_US:g}), cache hit p50 {p50('cache hit (ed25519)'):.2f} µs (p99 "
        f"{p99('cache hit (ed25519)'):.2f}; target <= {CACHE_HIT_TARGET_US:g}), Ed25519 uncached p50 "
        f"{p50('ed25519, uncached'):.1f} µs (p99 {p99('ed25519, uncached'):.1f}; no target); for scale, "
        f"sha256 of 128 bytes p50 {p50('for scale: sha256 of 128 bytes'):.2f} µs"
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
