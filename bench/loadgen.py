"""Closed-loop HTTP load for the serving benchmark (asyncio + httpx), and the statistics of a run.

``concurrency`` clients each send their next request as soon as the previous one is answered, until the
fixed number of requests is served. Every request is timed on the client's monotonic clock: its start,
the arrival of each token event (stream routes: TGI's, and OpenAI's streamed ``/v1/completions``, which
bench/engines_bench.py sends to every server it compares) and its end. :func:`summarize` turns the records of one
level into the report's numbers; the in-process engine run of bench/serve_bench.py produces the same
records, so both paths are measured alike.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson

STREAM_ROUTE = "/generate_stream"
COLLECT_ROUTE = "/generate"
COMPLETIONS_ROUTE = "/v1/completions"  # OpenAI's, streamed: the one client for Ferry and other servers alike


@dataclass
class RequestRecord:
    """One request as the client saw it (``time.perf_counter()`` seconds)."""

    start: float
    end: float = 0.0
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # stream routes: arrival of every token event
    relay_lags: list[float] = field(default_factory=list)  # fake token source: emission -> arrival, seconds
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(records: list[RequestRecord], wall: float) -> dict[str, Any]:
    """Throughput over the level's wall time and latency percentiles (ms) of the successful requests."""
    ok = [r for r in records if r.error is None]
    ttft = [(r.token_times[0] - r.start) * 1000 for r in ok if r.token_times]
    itl = [gap * 1000 for r in ok for gap in np.diff(r.token_times)]
    # Steady state: only gaps that start once every stream of the level has its first token (for a level
    # whose streams all open at once, this leaves out the burst of opening them).
    all_open = max((r.token_times[0] for r in ok if r.token_times), default=0.0)
    steady_itl = [(b - a) * 1000 for r in ok for a, b in itertools.pairwise(r.token_times) if a >= all_open]
    e2e = [(r.end - r.start) * 1000 for r in ok]
    lags = [lag * 1000 for r in ok for lag in r.relay_lags]
    errors = [r.error for r in records if r.error is not None]
    stats: dict[str, Any] = {
        "requests": len(records),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "tokens_per_s": sum(r.tokens for r in ok) / wall,
    }
    for name, values in (("ttft", ttft), ("itl", itl), ("steady_itl", steady_itl), ("e2e", e2e), ("relay_lag", lags)):
        stats[f"{name}_p50_ms"] = percentile(values, 50)
        stats[f"{name}_p99_ms"] = percentile(values, 99)
    return stats


def tgi_body(prompt: str, prompt_tokens: int, new_tokens: int, details: bool) -> dict[str, Any]:
    """A greedy TGI request whose prompt is cut to exactly its last ``prompt_tokens`` tokens (TGI's
    ``truncate``) and that generates ``new_tokens`` (the served model has no EOS)."""
    return {
        "inputs": prompt,
        "parameters": {"max_new_tokens": new_tokens, "truncate": prompt_tokens, "details": details},
    }


def completion_body(model: str, prompt_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """A greedy streamed OpenAI ``/v1/completions`` request of exactly ``new_tokens`` tokens. The prompt is
    token ids, so no server's tokenizer changes its length; ``ignore_eos`` (vLLM's extension, which Ferry
    honours too) keeps EOS from ending it early; the usage chunk
    gives the number of tokens generated (a token whose text is still incomplete UTF-8 has no chunk)."""
    return {
        "model": model, "prompt": prompt_ids, "max_tokens": new_tokens, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }


def _tgi_event(record: RequestRecord, data: bytes, arrived: float, stamped: bool) -> bool:
    """One TGI stream event into ``record``; True when the stream is over."""
    event = orjson.loads(data)
    if "error" in event:
        record.error = f"stream error: {event['error']}"
        return True
    record.token_times.append(arrived)
    record.tokens += 1
    if stamped:  # the fake token source's text is its emission time
        record.relay_lags.append(time.time() - float(event["token"]["text"]))
    if event.get("generated_text") is not None:
        record.end = arrived
        return True
    return False


def _completion_event(record: RequestRecord, data: bytes, arrived: float) -> bool:
    """One OpenAI completion chunk into ``record``; True when the stream is over (``[DONE]`` or an error).
    ``token_times`` holds the arrival of every chunk with text; ``tokens`` comes from the usage chunk."""
    if data.strip() == b"[DONE]":
        record.end = arrived
        if not record.tokens:
            record.error = "stream ended without a usage chunk"
        return True
    event = orjson.loads(data)
    if "error" in event:
        record.error = f"stream error: {event['error']}"
        return True
    if any(choice.get("text") for choice in event.get("choices") or ()):
        record.token_times.append(arrived)
    if event.get("usage"):
        record.tokens = event["usage"]["completion_tokens"]
    return False


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], stamped: bool,
                  openai: bool = False) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            record.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return record
        # Raw chunks split by hand: httpx's line iterator costs the client more CPU per event than the
        # API pod spends relaying it, which would make the load generator the bottleneck of the fan-out.
        rest = b""
        async for chunk in response.aiter_raw():
            arrived = time.perf_counter()
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                if (_completion_event(record, line[5:], arrived) if openai
                        else _tgi_event(record, line[5:], arrived, stamped)):
                    return record
    record.error = "stream ended without a final event"
    return record


async def _collect(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    response = await client.post(url, json=body)
    record.end = time.perf_counter()
    if response.status_code != 200:
        record.error = f"HTTP {response.status_code}: {response.text[:200]}"
    else:
        record.tokens = response.json()["details"]["generated_tokens"]
    return record


async def run_level(
    base_urls: Sequence[str],
    route: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    timeout: float,
    stamped: bool = False,
    expected_tokens: int | None = None,
) -> tuple[list[RequestRecord], float]:
    """Serve ``bodies`` (one request each, in order, spread round-robin over ``base_urls``) with
    ``concurrency`` closed-loop clients; returns the records and the wall time. A request fails when the
    server is silent for ``timeout`` seconds; the whole level is cut after ``timeout`` + 60 s."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    urls = itertools.cycle([base + route for base in base_urls])
    jobs = iter(list(zip(urls, bodies, strict=False)))  # urls cycles: one per body
    records: list[RequestRecord] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        for url, body in jobs:  # a shared iterator: each request is taken by exactly one client
            try:
                if route in (STREAM_ROUTE, COMPLETIONS_ROUTE):
                    record = await _stream(client, url, body, stamped, openai=route == COMPLETIONS_ROUTE)
                else:
                    record = await _collect(client, url, body)
            except httpx.HTTPError as exc:
                record = RequestRecord(start=time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
            if record.error is None and expected_tokens is not None and record.tokens != expected_tokens:
                record.error = f"{record.tokens} tokens generated, {expected_tokens} expected"
            records.append(record)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        started = time.perf_counter()
        tasks = [asyncio.create_task(client_loop(client)) for _ in range(min(concurrency, len(bodies)))]
        done, pending = await asyncio.wait(tasks, timeout=timeout + 60)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - started
    unfinished = len(bodies) - len(records)
    records.extend(RequestRecord(start=0.0, error="cut by the level's time limit") for _ in range(unfinished))
    return records, wall

