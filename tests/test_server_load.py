"""A bounded load test of `exl2cpp serve` on 127.0.0.1 (SmolLM2, CPU): 64 concurrent streaming clients run a fixed
number of chat requests with random small max_tokens, some hanging up mid-stream. Every request must complete or
be cancelled cleanly (no 5xx, well-formed SSE ending in [DONE]), no cache pages may stay in use, and the server's
RSS must stay roughly flat. Prints requests/s and time-to-first-token p50/p99."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from test_server import ADMIN, KEY, ServerProc

CLIENTS = 64
REQUESTS = 200
WARMUP = 32
DISCONNECT_RATE = 0.15
TOPICS = [
    "cats",
    "rain",
    "the sea",
    "Paris",
    "numbers",
    "music",
    "trees",
    "coffee",
    "stars",
    "bread",
]


async def one_request(http: httpx.AsyncClient, url: str, rng: random.Random, results: list) -> None:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}],
        "max_tokens": rng.randint(1, 8),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    hang_up = rng.random() < DISCONNECT_RATE
    t0 = time.perf_counter()
    ttft = None
    rec = {"status": None, "done": False, "cancelled": False, "ttft": None, "tokens": 0}
    async with http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        rec["status"] = r.status_code
        if r.status_code != 200:
            rec["body"] = (await r.aread()).decode()
            results.append(rec)
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                rec["done"] = True
                break
            obj = json.loads(data)
            assert "error" not in obj, obj
            if obj["choices"] and obj["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - t0
                if hang_up:
                    rec["cancelled"] = True
                    break  # leaving the context manager closes the connection mid-stream
            if obj.get("usage"):
                rec["tokens"] = obj["usage"]["completion_tokens"]
    rec["ttft"] = ttft
    results.append(rec)


async def run_load(url: str, n_requests: int, seed: int) -> tuple[list, float]:
    rng = random.Random(seed)
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(n_requests):
        queue.put_nowait(None)
    results: list = []
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:

        async def worker():
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await one_request(http, url, rng, results)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
        return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@pytest.mark.slow
def test_load_64_streaming_clients(smollm2_dir):
    srv = ServerProc(
        smollm2_dir,
        "--api-key",
        KEY,
        "--admin-key",
        ADMIN,
        "--cache-tokens",
        "16384",
        "--page-size",
        "16",
        "--model-name",
        "smollm2",
        "--log-level",
        "warning",
    )
    try:
        proc = psutil.Process(srv.proc.pid)
        url = srv.url + "/v1/chat/completions"
        warm, _ = asyncio.run(run_load(url, WARMUP, seed=1))
        assert all(r["status"] == 200 for r in warm)
        time.sleep(0.5)
        rss_warm = proc.memory_info().rss
        results, elapsed = asyncio.run(run_load(url, REQUESTS, seed=2))
        time.sleep(0.5)
        rss_end = proc.memory_info().rss

        statuses = [r["status"] for r in results]
        assert len(results) == REQUESTS
        assert all(s == 200 for s in statuses), [r for r in results if r["status"] != 200][:3]
        cancelled = [r for r in results if r["cancelled"]]
        completed = [r for r in results if r["done"]]
        assert (
            len(cancelled) + len(completed) == REQUESTS
        )  # each one either finished with [DONE] or hung up
        assert len(cancelled) >= 5
        assert all(1 <= r["tokens"] <= 8 for r in completed)

        ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
        stats = None
        deadline = time.time() + 20
        while time.time() < deadline:
            stats = httpx.get(
                srv.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}
            ).json()
            s = stats["engine"]
            if s["jobs_active"] == 0 and s["jobs_queued"] == 0:
                break
            time.sleep(0.2)
        s = stats["engine"]
        assert s["jobs_active"] == 0 and s["jobs_queued"] == 0
        assert s["pages_used"] - s["pages_evictable"] == 0 and s["pages_reserved"] == 0
        assert (
            s["tokens_reused"] > 0
        )  # the chat template's system prompt is shared through the prefix cache
        metrics = httpx.get(srv.url + "/metrics").text
        assert "exl2cpp_cache_pages_in_use 0.0" in metrics
        assert 'completions",status="5' not in metrics
        growth = (rss_end - rss_warm) / 2**20
        print(
            f"\nload: {REQUESTS} requests, {CLIENTS} concurrent streaming clients, {len(cancelled)} hung up "
            f"mid-stream: {REQUESTS / elapsed:.2f} requests/s, {elapsed:.1f} s, "
            f"TTFT p50 {pct(ttfts, 0.5) * 1000:.0f} ms p99 {pct(ttfts, 0.99) * 1000:.0f} ms, "
            f"tokens out {sum(r['tokens'] for r in completed)}, RSS {rss_warm / 2**20:.0f} -> "
            f"{rss_end / 2**20:.0f} MiB ({growth:+.1f}), prompt tokens reused from shared pages "
            f"{s['tokens_reused']}/{s['tokens_in']}"
        )
        assert growth < 64, f"server RSS grew by {growth:.0f} MiB over {REQUESTS} requests"
    finally:
        srv.stop()
    assert "Traceback" not in srv.logs()
