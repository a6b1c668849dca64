"""Prometheus metrics of one worker process, in a registry the worker owns (served on WORKER_METRICS_PORT).

The API pods export the request-level TGI metrics; these are what only a worker sees: its batch, its KV
budget, its token throughput, how long its jobs waited for a batch slot and how long a step takes.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.protocol import ErrorEvent
from worker.engine import Engine, StepOutput

QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class WorkerMetrics:
    """The worker's metrics, labelled with its model; :meth:`observe_step` records one engine step."""

    def __init__(self, model: str, kv_budget_tokens: int) -> None:
        self.registry = CollectorRegistry()
        self._model = model

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model"], registry=self.registry).labels(model)

        self.batch_size = gauge("ferry_worker_batch_size", "Requests in the running batch")
        self.waiting = gauge("ferry_worker_waiting_requests", "Requests taken from the stream, not yet admitted")
        self.kv_reserved = gauge("ferry_worker_kv_reserved_tokens", "KV budget held by the running requests")
        gauge("ferry_worker_kv_budget_tokens", "KV budget of the worker (maxBatchTotalTokens)").set(kv_budget_tokens)
        self.compiled = gauge("ferry_worker_compiled", "1 once the engine runs the model's passes compiled "
                              "(set at each heartbeat)")
        self.generated = Counter(
            "ferry_worker_generated_tokens", "Tokens generated", ["model"], registry=self.registry
        ).labels(model)
        self.finished = Counter(
            "ferry_worker_requests", "Requests ended, by finish reason, or `error`", ["model", "reason"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "ferry_worker_queue_wait_seconds", "Time from queueing to the prefill, of finished requests", ["model"],
            buckets=QUEUE_BUCKETS, registry=self.registry,
        ).labels(model)
        self.step_time = Histogram(
            "ferry_worker_step_seconds", "Duration of one engine step (prefill of newcomers and one decode)",
            ["model"], buckets=STEP_BUCKETS, registry=self.registry,
        ).labels(model)

    def serve(self, port: int, host: str) -> WSGIServer:
        """Expose the registry on ``host``:``port`` (``workerMetricsHost``: loopback unless the deployment opens
        it), from a daemon thread; returns the server."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server

    def observe_step(self, engine: Engine, outputs: list[StepOutput], seconds: float) -> None:
        self.step_time.observe(seconds)
        self.batch_size.set(engine.batch_size)
        self.waiting.set(engine.waiting)
        self.kv_reserved.set(engine.reserved_tokens)
        for output in outputs:
            event = output.event
            if isinstance(event, ErrorEvent):
                self.observe_errors(1)
                continue
            self.generated.inc()
            if event.finish is not None:
                self.finished.labels(self._model, event.finish.finish_reason).inc()
                self.queue_wait.observe(event.finish.queue_time)

    def observe_errors(self, count: int) -> None:
        """Requests that ended with an error event (failed step, timeout, did not fit)."""
        if count:
            self.finished.labels(self._model, "error").inc(count)
