"""One request's numbers never fail its batch (issue 34).

A ``repetition_penalty`` of 5e-324 was in range as a Python float, 0 in the sampler's float32: ``logits / 0``
made NaN, ``searchsorted`` answered the vocabulary's size, and the step failed every request of the batch.
Two guards, tested here: :class:`common.protocol.SamplingParams` refuses what float32 cannot compute with, which
every protocol answers as its own validation error; and the built-in engine ends a row whose numbers go bad all
the same with an error event of its own, the other rows going on exactly as they would without it. The vLLM
engine's side is in tests/test_engine_contract.py.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from api.app import create_app
from common.protocol import FLOAT32_MAX, FLOAT32_TINY, MIN_DIVISOR, ErrorEvent, Job, SamplingParams
from common.settings import Settings
from tests.fakes import one_token_submit, patch_submit
from tests.helpers import (
    assert_kserve_error,
    assert_mindie_error,
    assert_openai_error,
    assert_tgi_error,
    examples,
    infer_body,
    make_engine,
    make_job,
    run,
    token_ids,
)

FLOAT_FIELDS = [name for name, field in SamplingParams.model_fields.items() if field.annotation is float]
# Where float32 breaks (0 and subnormals, its smallest normal, its largest, overflow), each range's ends, and
# values no range allows.
EDGES = [
    0.0, -0.0, 5e-324, 1e-46, 1e-45, 1e-40, FLOAT32_TINY, 1e-30, 1e-17, MIN_DIVISOR, 1e-9, 1e-5, 0.3, 1.0,
    1.0000001, 2.0, 1e5, 1e30, 1e38, FLOAT32_MAX, 3.5e38, 1e300, math.inf, -math.inf, math.nan, -1.0, -1e-300,
]
poisons = st.fixed_dictionaries(
    {"do_sample": st.booleans()},
    optional={**{name: st.one_of(st.sampled_from(EDGES), st.floats()) for name in FLOAT_FIELDS},
              "top_k": st.integers(0, 5000)},
)
# Beside the poisoning request: one greedy request and one sampled one, each compared with its run alone.
VICTIMS = [({}, 0), ({"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 11}, 1)]
VICTIM_TOKENS = 12


def victims(prompt_ids: list[list[int]]) -> list[Job]:
    return [make_job(prompt_ids[prompt], max_new_tokens=VICTIM_TOKENS, **params) for params, prompt in VICTIMS]


@pytest.fixture(scope="module")
def alone(served, tokenizer, prompts) -> list[list[int]]:  # noqa: F811
    """Each victim's tokens when it runs alone."""
    return [token_ids(run(make_engine(served, tokenizer), {0: [job]})[job.request_id]) for job in victims(prompts)]


@pytest.fixture(scope="module")
def outcomes() -> Iterator[Counter[str]]:
    """How the fuzz's poisoning requests ended; the tally is printed (``-s``) for the record."""
    tally: Counter[str] = Counter()
    yield tally
    print(f"\nbatch isolation fuzz: {sum(tally.values())} cases: {dict(tally)}")


@pytest.mark.integration  # a real engine's forward passes, for every poison
@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(poison=poisons, joins=st.sampled_from([0, 2]), prompt=st.integers(0, 2))
def test_a_request_whose_numbers_go_bad_fails_alone(
    served, tokenizer, prompts, alone, outcomes, poison: dict[str, Any], joins: int, prompt: int  # noqa: F811
) -> None:
    """Whatever its parameters, a request beside two others (at the first prefill, or joining their decode) is
    refused by validation, fails with an error event of its own, or completes; the others' tokens are those they
    get alone. Refused parameters run too, unvalidated, as a job from elsewhere could bring them."""
    try:
        SamplingParams(seed=5, max_new_tokens=6, **poison)
        valid = True
    except ValidationError:
        valid = False
    job = make_job(prompts[prompt], seed=5, max_new_tokens=6)
    job = job.model_copy(update={"params": job.params.model_copy(update=poison)})
    others = victims(prompts)
    arrivals = {0: list(others)}
    arrivals.setdefault(joins, []).append(job)
    events = run(make_engine(served, tokenizer), arrivals)
    assert [token_ids(events[other.request_id]) for other in others] == alone, poison
    last = events[job.request_id][-1]
    failed = isinstance(last, ErrorEvent)
    if failed:
        assert not valid, (poison, last)  # parameters that pass validation always compute
        assert last.error_type == "generation" and "NaN or infinite" in last.message, last
    else:
        assert last.finish is not None
    outcomes[f"{'valid' if valid else 'refused by validation'}, {'failed alone' if failed else 'completed'}"] += 1


# -- every protocol refuses them as its own validation error -------------------------------------------------


UNDERFLOW = [5e-324, 1e-46, 1e-40]  # float32: 0, 0, a subnormal
POISONS = {
    "repetition_penalty": [*UNDERFLOW, 1e-17, 1e300],
    "top_p": UNDERFLOW,
    "typical_p": UNDERFLOW,
    "temperature": [1e-40, 1e39, 1e300],  # sampling
}
# The vLLM-dialect routes decode greedily below a temperature of 1e-5 (vLLM's rule): only overflow poisons them.
GREEDY_BELOW = {"openai", "mindie-vllm"}
# KServe's parameters have no typical_p (an unknown parameter is ignored there).
CARRIES_NO_TYPICAL_P = {"kserve-generate", "kserve-infer"}


def route_cases() -> Iterator[tuple[str, str, float]]:
    routes = ["tgi", "mindie-infer", "mindie-vllm", "openai", "kserve-generate", "kserve-infer"]
    for route in routes:
        for field, values in POISONS.items():
            for value in values:
                if (field == "temperature" and value < 1 and route in GREEDY_BELOW) or (
                        field == "typical_p" and route in CARRIES_NO_TYPICAL_P):
                    continue
                yield route, field, value


@pytest.fixture(scope="module")
def client(tiny_model_path: Path) -> Iterator[TestClient]:
    """The app over fakeredis; a request that passes validation is answered by a stand-in worker (a 200 the test
    rejects), and a server error is answered as a 500 rather than raised."""
    app = create_app(Settings(model_path=tiny_model_path, max_iter_times=64), redis=fakeredis.FakeAsyncRedis())
    with pytest.MonkeyPatch.context() as patcher:
        patch_submit(patcher, one_token_submit)
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c


@pytest.mark.parametrize(("route", "field", "value"), list(route_cases()))
def test_every_protocol_refuses_the_poisoning_parameters(client: TestClient, route: str, field: str,
                                                         value: float) -> None:
    model = client.app.state.ctx.model.model_id
    sampled = {"do_sample": True, field: value}

    def post(path: str, body: dict[str, Any]):
        return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})

    if route == "tgi":
        assert_tgi_error(post("/generate", {"inputs": "def main(", "parameters": sampled}), field)
    elif route == "mindie-infer":
        assert_mindie_error(post("/infer", {"inputs": "def main(", "parameters": sampled}), f"`{field}`")
    elif route == "mindie-vllm":
        assert_mindie_error(post("/generate", {"prompt": "def main(", field: value}), f"`{field}`")
    elif route == "openai":
        assert_openai_error(post("/v1/completions", {"model": model, "prompt": "def main(", field: value}), 400,
                            f"`{field}`", field)
    elif route == "kserve-generate":
        assert_kserve_error(post(f"/v2/models/{model}/generate", {"text_input": "def main(", "parameters": sampled}),
                            400, f"`{field}`")
    else:
        assert_kserve_error(post(f"/v2/models/{model}/infer", infer_body(**sampled)), 400, f"`{field}`")
