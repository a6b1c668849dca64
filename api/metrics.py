"""Prometheus metrics of an API pod, with TGI's names where they apply, in a registry of the app's own.

Request metrics are recorded by :mod:`api.pipeline` (the path every protocol's requests take), so TGI,
KServe and OpenAI requests all count. Durations run from queueing the job (validation and tokenizing are
before it): ``duration`` = queue + inference as this pod saw them; queue and inference times come from the
worker (:class:`common.protocol.Finish`). Cluster gauges (queue depth, batch sizes, live workers) are read
from Redis at scrape time, so every pod reports the same values for them.

prometheus-client exposes counters with the ``_total`` suffix of OpenMetrics: ``tgi_request_count_total``;
histograms as ``_bucket``, ``_sum`` and ``_count`` series. TGI has no time-to-first-token or inter-token
metric, so those two carry vLLM's names under Ferry's prefix.

MindIE's names (vLLM's, unprefixed, labelled ``model_name``) are exported beside TGI's and updated by the
same methods, so the two families always agree: ``request_received_total`` = ``tgi_request_count_total``,
``request_success_total`` = ``tgi_request_success_total``, ``request_failed_total`` = the sum of
``tgi_request_failure_total`` over ``err``, ``prompt_tokens_total`` = ``tgi_request_input_length_sum``,
``generation_tokens_total`` = ``tgi_request_generated_tokens_sum``, ``time_to_first_token_seconds`` and
``time_per_output_token_seconds`` observe what ``ferry_time_to_first_token_seconds`` and
``ferry_inter_token_latency_seconds`` do, and the gauges ``num_requests_running`` (=
``tgi_batch_current_size``) and ``num_requests_waiting`` (queued, not running) come from the same read of Redis.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from common.cluster import ModelState
from common.protocol import Finish

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TOKEN_BUCKETS = tuple(float(2**n) for n in range(0, 21))  # 1 .. 1 Mi tokens


class ApiMetrics:
    """The pod's metrics, every series labelled with its model."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model"], registry=registry)

        self.count = Counter("tgi_request_count", "Requests queued or refused at queueing", ["model"],
                             registry=registry)
        self.success = Counter("tgi_request_success", "Requests that finished", ["model"], registry=registry)
        self.failure = Counter("tgi_request_failure", "Requests that failed, by error type", ["model", "err"],
                               registry=registry)
        self.duration = histogram("tgi_request_duration", "Seconds from queueing to the last token",
                                  DURATION_BUCKETS)
        self.queue_duration = histogram("tgi_request_queue_duration", "Seconds queued before the prefill",
                                        DURATION_BUCKETS)
        self.inference_duration = histogram("tgi_request_inference_duration", "Seconds from prefill to last token",
                                            DURATION_BUCKETS)
        self.time_per_token = histogram("tgi_request_mean_time_per_token_duration",
                                        "Inference seconds per generated token", PER_TOKEN_BUCKETS)
        self.input_length = histogram("tgi_request_input_length", "Prompt tokens", TOKEN_BUCKETS)
        self.max_new_tokens = histogram("tgi_request_max_new_tokens", "Effective max_new_tokens", TOKEN_BUCKETS)
        self.generated_tokens = histogram("tgi_request_generated_tokens", "Generated tokens", TOKEN_BUCKETS)
        self.queue_size = gauge("tgi_queue_size", "Jobs queued or running (the job streams' lengths)")
        self.batch_size = gauge("tgi_batch_current_size", "Requests running, summed over live workers")
        self.batch_tokens = gauge("tgi_batch_current_max_tokens", "KV budget held, summed over live workers")
        self.live_workers = gauge("ferry_live_workers", "Workers with a live heartbeat")
        self.time_to_first_token = histogram(
            "ferry_time_to_first_token_seconds", "Seconds from queueing to the first token, as the pod receives it",
            DURATION_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "ferry_inter_token_latency_seconds", "Seconds between two tokens of a request, as the pod receives them",
            PER_TOKEN_BUCKETS,
        )
        self.failure_duration = histogram(
            "ferry_request_failure_duration_seconds", "Seconds from queueing to the failure (0: refused at queueing)",
            DURATION_BUCKETS,
        )
        self.last_request_end = gauge("ferry_last_request_timestamp_seconds", "Unix time the last request ended")
        self.adapter_count = Counter("ferry_lora_request_count", "Requests queued with a LoRA adapter",
                                     ["model", "adapter"], registry=registry)
        self.mindie = MindIEMetrics(registry)

    def _received(self, model: str) -> None:
        self.count.labels(model).inc()
        self.mindie.received.labels(model).inc()

    def request_queued(self, model: str, input_length: int, max_new_tokens: int, adapter: str | None = None) -> None:
        self._received(model)
        if adapter is not None:
            self.adapter_count.labels(model, adapter).inc()
        self.input_length.labels(model).observe(input_length)
        self.mindie.prompt_tokens.labels(model).inc(input_length)
        self.max_new_tokens.labels(model).observe(max_new_tokens)

    def token_received(self, model: str, seconds: float, first: bool) -> None:
        """A token reached the pod ``seconds`` after the previous one (after queueing, for the first)."""
        (self.time_to_first_token if first else self.inter_token_latency).labels(model).observe(seconds)
        (self.mindie.time_to_first_token if first else self.mindie.time_per_output_token).labels(model).observe(
            seconds)

    def request_refused(self, model: str, error_type: str) -> None:
        """Refused at queueing (overloaded, duplicate id, Redis unreachable): counted, and failed."""
        self._received(model)
        self.request_failed(model, error_type, 0.0)

    def request_failed(self, model: str, error_type: str, duration: float) -> None:
        self.failure.labels(model, error_type).inc()
        self.mindie.failed.labels(model).inc()
        self.failure_duration.labels(model).observe(duration)
        self.last_request_end.labels(model).set_to_current_time()

    def request_finished(self, model: str, finish: Finish, duration: float) -> None:
        self.success.labels(model).inc()
        self.mindie.success.labels(model).inc()
        self.mindie.generation_tokens.labels(model).inc(finish.generated_tokens)
        self.duration.labels(model).observe(duration)
        self.queue_duration.labels(model).observe(finish.queue_time)
        self.inference_duration.labels(model).observe(finish.inference_time)
        self.time_per_token.labels(model).observe(finish.inference_time / max(finish.generated_tokens, 1))
        self.generated_tokens.labels(model).observe(finish.generated_tokens)
        self.last_request_end.labels(model).set_to_current_time()

    def observe_cluster(self, states: list[ModelState]) -> None:
        """Set the cluster gauges from a fresh read of Redis."""
        for state in states:
            self.queue_size.labels(state.model).set(state.queue_depth)
            self.batch_size.labels(state.model).set(state.batch_size)
            self.batch_tokens.labels(state.model).set(state.kv_reserved_tokens)
            self.live_workers.labels(state.model).set(len(state.workers))
            self.mindie.running.labels(state.model).set(state.batch_size)
            self.mindie.waiting.labels(state.model).set(state.waiting)

    def mean(self, histogram: Histogram, model: str) -> float | None:
        """The mean of one model's observations of a histogram (``_sum`` / ``_count``, read through
        ``collect()``); None before the first."""
        samples = series(histogram, model)
        count = samples.get("_count", 0.0)
        return samples.get("_sum", 0.0) / count if count else None

    def render(self) -> bytes:
        return generate_latest(self.registry)


def series(metric: MetricWrapperBase, model: str) -> dict[str, float]:
    """One model's samples of a metric, by suffix: ``_count`` and ``_sum`` of a histogram, ``""`` of a gauge
    (summed over the other labels)."""
    [family] = metric.collect()
    found: dict[str, float] = {}
    for sample in family.samples:
        if sample.labels.get("model") == model:
            suffix = sample.name.removeprefix(family.name)
            found[suffix] = found.get(suffix, 0.0) + sample.value
    return found


class MindIEMetrics:
    """MindIE's Prometheus names, labelled ``model_name``; only :class:`ApiMetrics`' methods update them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry)

        self.received = counter("request_received", "Requests queued or refused at queueing (MindIE)")
        self.success = counter("request_success", "Requests that finished (MindIE)")
        self.failed = counter("request_failed", "Requests that failed or were refused (MindIE)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests queued (MindIE)")
        self.generation_tokens = counter("generation_tokens", "Tokens generated by the requests that finished "
                                                              "(MindIE)")
        self.running = gauge("num_requests_running", "Requests running, summed over live workers (MindIE)")
        self.waiting = gauge("num_requests_waiting", "Requests queued, not running yet (MindIE)")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Seconds from queueing to the first token (MindIE)", DURATION_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Seconds between two tokens of a request (MindIE)", PER_TOKEN_BUCKETS)
