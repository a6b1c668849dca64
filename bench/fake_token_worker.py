"""A BENCHMARK TOOL, never a way to serve: a worker that emits tokens without a model.

It runs the real :class:`worker.main.WorkerLoop` (XREADGROUP, PUBLISH, XACK, heartbeats, controls) with
:class:`FakeTokenEngine` in place of a model engine, so the API pods and Redis see exactly
the traffic of a real worker while the token source costs almost nothing. bench/serve_bench.py uses it
to measure how many concurrent SSE streams one API pod can relay.

Every request gets its first token at the first step after it is added, then one token every
``--interval-ms``, up to its ``max_new_tokens``. Requests keep the phase of their arrival, so the
tokens of many streams are spread over the interval as they would be from many real workers. The text of
each token is the worker's wall-clock time of emission (``time.time()``), so a client on the same machine
can measure how long the relay took.

Usage (same env as ``ferry-worker``: REDIS_URL, MODEL_PATH/MODEL_NAME, MAX_BATCH_SIZE bounds the streams)::

    .venv/bin/python bench/fake_token_worker.py --interval-ms 25
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.protocol import Finish, Job, TokenEvent, TokenInfo  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.engine import Engine, PreparedJob, StepOutput  # noqa: E402
from worker.main import WorkerLoop  # noqa: E402

FAKE_TOKEN_ID = 42

DEFAULT_INTERVAL_MS = 25.0


@dataclass
class _Stream:
    job: Job
    added_at: float  # unix time
    next_due: float  # time.monotonic() of the next token
    emitted: int = 0
    text: str = ""
    stopping: bool = False


class FakeTokenEngine(Engine):
    """The :class:`worker.engine.Engine` contract without a model: one token per request per interval.

    Capacity is ``settings.max_batch_size`` requests; there is no KV budget, so ``reserved_tokens`` is 0.
    """

    max_total_tokens = 2**31

    def __init__(self, settings: Settings, interval: float) -> None:
        self.settings = settings
        self.interval = interval
        self._streams: dict[str, _Stream] = {}

    def refusal(self, job: Job) -> str | None:
        if job.adapter is not None or job.media:
            return "the fake token source has no model: no LoRA adapters, no media"
        return None

    def room(self) -> int:
        return max(0, self.settings.max_batch_size - len(self._streams))

    def add(self, job: Job | PreparedJob) -> None:
        assert isinstance(job, Job)  # refusal takes no job with media, so none is prepared
        if job.request_id in self._streams:
            raise ValueError(f"request {job.request_id} is already running")
        self._streams[job.request_id] = _Stream(job, time.time(), time.monotonic())

    def unload_adapter(self, name: str) -> None:
        """Nothing to free: :meth:`refusal` takes no job with an adapter."""

    def cancel(self, request_id: str) -> bool:
        return self._streams.pop(request_id, None) is not None

    def stop(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.stopping = True
        return stream is not None

    @property
    def idle(self) -> bool:
        return not self._streams

    @property
    def batch_size(self) -> int:
        return len(self._streams)

    @property
    def waiting(self) -> int:
        return 0

    @property
    def reserved_tokens(self) -> int:
        return 0

    @property
    def kv_budget_tokens(self) -> int:
        return self.settings.max_batch_total_tokens

    @classmethod
    def load(cls, settings: Settings) -> FakeTokenEngine:
        return cls(settings, DEFAULT_INTERVAL_MS / 1000)

    def step(self) -> list[StepOutput]:
        """Sleep until the next token is due (at most one interval, so the loop still reads new jobs and
        controls), then emit every token that is due."""
        if self._streams:
            wait = min(stream.next_due for stream in self._streams.values()) - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, self.interval))
        now = time.monotonic()
        outputs = []
        for stream in [s for s in self._streams.values() if s.next_due <= now]:
            outputs.append(StepOutput(stream.job, self._token(stream)))
            stream.next_due += self.interval
        return outputs

    def _token(self, stream: _Stream) -> TokenEvent:
        text = f"{time.time():.6f}"
        stream.emitted += 1
        stream.text += text
        job = stream.job
        finish = None
        if stream.stopping or stream.emitted >= job.params.max_new_tokens:
            del self._streams[job.request_id]
            finish = Finish(
                finish_reason="stop_sequence" if stream.stopping else "length",
                generated_tokens=stream.emitted,
                prompt_tokens=len(job.input_ids),
                seed=job.params.seed,
                generated_text=stream.text,
                queue_time=max(0.0, stream.added_at - job.enqueued_at),
                inference_time=time.time() - stream.added_at,
            )
        token = TokenInfo(id=FAKE_TOKEN_ID, text=text, logprob=0.0, special=False)
        return TokenEvent(index=stream.emitted - 1, token=token, finish=finish)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-ms", type=float, default=DEFAULT_INTERVAL_MS,
                        help="time between two tokens of one request")
    args = parser.parse_args(argv)
    settings = Settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop = WorkerLoop(settings, Redis.from_url(settings.redis_url), FakeTokenEngine(settings, args.interval_ms / 1000))
    signal.signal(signal.SIGTERM, lambda *_: loop.stop())
    loop.run()


if __name__ == "__main__":
    main()
