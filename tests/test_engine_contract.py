"""One contract, every engine: the same tests run against the built-in engine and the vLLM engine.

Each engine is compared with its own reference, the offline generation of the library it is built on:
``model.generate`` for the built-in engine, ``vllm.LLM.generate`` for the vLLM engine. The model folder is
the tiny model whose generation config declares a second EOS token, one that greedy decoding of
``PROMPTS[1]`` reaches, so EOS handling is exercised by every engine and every reference alike.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from common.constraints import grammar
from common.protocol import Constraint, ErrorEvent, Job, TokenEvent
from common.settings import Settings
from tests.helpers import ENGINES, VLLM_ARGS, collect, make_job, require_vllm, run, token_ids
from worker.engine import Engine, RequestRefused, RequestState, load_engine

pytestmark = pytest.mark.integration  # a real model's forward passes, checked against references

# The lengths the greedy references are made for (prompt index -> max_new_tokens)
LENGTHS = [12, 30, 7, 25, 18, 3, 40, 22]
# -- the model and the references ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def contract_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory, prompts) -> Path:
    """The tiny model with a second EOS id in its generation config: the 7th greedy token of PROMPTS[1]
    (one that greedy decoding has not produced before it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = torch.tensor([prompts[1]])
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30)
    generated = greedy[0, len(prompts[1]) :].tolist()
    stop_at = next(i for i in range(6, len(generated)) if generated[i] not in generated[:i])
    path = tmp_path_factory.mktemp("models") / "tiny-llama-eos"
    shutil.copytree(tiny_model_path, path)
    config_file = path / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], generated[stop_at]]}))
    return path


@dataclass(frozen=True)
class Reference:
    """Greedy output of one prompt (``max_new_tokens`` = LENGTHS[i]) from the engine's own library, with the
    logprob of each chosen token."""

    ids: list[int]
    logprobs: list[float]
    eos: bool  # ended on an EOS token before its length


def transformers_references(path: Path, prompts: list[list[int]]) -> list[Reference]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = set(model.generation_config.eos_token_id)
    references = []
    for prompt, length in zip(prompts, LENGTHS, strict=True):
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=length,
            output_logits=True, return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [step[0].float().log_softmax(-1)[token].item()
                    for step, token in zip(out.logits, tokens, strict=True)]
        references.append(Reference(tokens, logprobs, tokens[-1] in eos))
    return references


def vllm_references(path: Path, prompts: list[list[int]]) -> list[Reference]:
    """vLLM's offline ``LLM.generate``, in this process, shut down before the engine under test starts."""
    from vllm import LLM, TokensPrompt
    from vllm import SamplingParams as VllmSamplingParams

    llm = LLM(model=str(path), dtype="float32", seed=0, kv_cache_memory_bytes=2**30, **VLLM_ARGS)
    try:
        params = [VllmSamplingParams(temperature=0, max_tokens=length, logprobs=0) for length in LENGTHS]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params)
        references = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens, strict=True)]
            references.append(Reference(tokens, logprobs, completion.finish_reason == "stop"))
        return references
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@dataclass
class EngineUnderTest:
    kind: str
    engine: Engine
    references: list[Reference]


@pytest.fixture(scope="module", params=ENGINES)
def subject(
    request: pytest.FixtureRequest, contract_model_path: Path, prompts
) -> Iterator[EngineUnderTest]:
    kind = request.param
    settings = Settings(
        model_path=contract_model_path, engine=kind, max_batch_size=32, max_prefill_batch_size=3,
        vllm_engine_args=VLLM_ARGS,
    )
    if kind == "vllm":
        require_vllm()
        references = vllm_references(contract_model_path, prompts)
    else:
        references = transformers_references(contract_model_path, prompts)
    engine = load_engine(settings)
    try:
        yield EngineUnderTest(kind, engine, references)
    finally:
        engine.close()


# -- driving an engine --------------------------------------------------------------------------------


# -- the contract ---------------------------------------------------------------------------------------


def test_greedy_batches_equal_the_reference(subject: EngineUnderTest, prompts, tokenizer) -> None:
    """Requests joining at steps 0/2/5/9 and leaving at their own lengths: each equals its reference."""
    jobs = [make_job(ids, max_new_tokens=n) for ids, n in zip(prompts, LENGTHS, strict=True)]
    events = run(subject.engine, {0: jobs[:4], 2: jobs[4:6], 5: jobs[6:7], 9: jobs[7:]})
    for job, reference in zip(jobs, subject.references, strict=True):
        stream = events[job.request_id]
        finish = stream[-1].finish
        assert token_ids(stream) == reference.ids
        assert finish.finish_reason == ("eos_token" if reference.eos else "length")
        assert finish.prompt_tokens == len(job.input_ids) and finish.seed == job.params.seed
        assert finish.generated_text == tokenizer.decode(token_ids(stream), skip_special_tokens=True)
        assert [e.token.logprob for e in stream] == pytest.approx(reference.logprobs, abs=1e-3)
    assert subject.references[1].eos, "the second EOS id of the contract model ends PROMPTS[1]"


SAMPLED = [
    {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 11},
    {"do_sample": True, "temperature": 1.3, "seed": 2**64 - 1},
    {"do_sample": True, "top_p": 0.5, "seed": 7},
    {"do_sample": True, "top_k": 5, "repetition_penalty": 1.2, "seed": 12345},
]


def test_seeded_sampling_replays_in_a_busy_batch(subject: EngineUnderTest, prompts) -> None:
    """A seeded request gives the same tokens alone and in a busy batch, and again when it is re-delivered
    (a worker crash: the job is cancelled mid-stream and added again under the same id)."""
    engine = subject.engine
    alone = {}
    for i, params in enumerate(SAMPLED):
        job = make_job(prompts[i], max_new_tokens=24, **params)
        alone[i] = token_ids(run(engine, {0: [job]})[job.request_id])
    busy = [make_job(prompts[i], max_new_tokens=24, **params) for i, params in enumerate(SAMPLED)]
    noise = [
        make_job(prompts[4], max_new_tokens=5),
        make_job(prompts[5], max_new_tokens=30, do_sample=True, seed=99),
        make_job(prompts[6], max_new_tokens=3, do_sample=True, temperature=2.0, seed=5),
        make_job(prompts[7], max_new_tokens=12, repetition_penalty=1.5),
    ]
    arrivals = {0: [noise[0], busy[0], noise[1]], 1: [busy[1]], 3: [noise[2], busy[2]], 4: [busy[3], noise[3]]}
    events = run(engine, arrivals)
    for i, job in enumerate(busy):
        assert token_ids(events[job.request_id]) == alone[i]
    assert len(set(map(tuple, alone.values()))) == len(alone)

    crashed = make_job(prompts[0], max_new_tokens=24, **SAMPLED[0])
    partial: dict[str, list] = {}
    engine.add(crashed)
    for _ in range(4):
        collect(engine.step(), partial)
    assert engine.cancel(crashed.request_id)
    redelivered = run(engine, {1: [crashed.model_copy()]})[crashed.request_id]
    assert token_ids(redelivered) == alone[0]
    assert token_ids(partial[crashed.request_id]) == alone[0][: len(partial[crashed.request_id])]


def test_stop_strings_cut_the_text(subject: EngineUnderTest, prompts, tokenizer) -> None:
    reference = subject.references[3].ids
    full_text = tokenizer.decode(reference, skip_special_tokens=True)
    stop = full_text[20:26]
    assert stop and full_text.find(stop) == 20
    job = make_job(prompts[3], max_new_tokens=LENGTHS[3], stop=["never-generated", stop])
    other = make_job(prompts[0], max_new_tokens=LENGTHS[0], stop=["never-generated"])
    events = run(subject.engine, {0: [job, other]})
    stream = events[job.request_id]
    assert stream[-1].finish.finish_reason == "stop_sequence"
    assert stream[-1].finish.generated_text == full_text[:20]
    assert token_ids(stream) == reference[: len(stream)]
    assert tokenizer.decode(token_ids(stream)[:-1], skip_special_tokens=True).find(stop) == -1
    assert token_ids(events[other.request_id]) == subject.references[0].ids


def test_max_new_tokens_and_the_length_cap(subject: EngineUnderTest, prompts) -> None:
    engine = subject.engine
    job = make_job(prompts[6], max_new_tokens=5)
    stream = run(engine, {0: [job]})[job.request_id]
    assert token_ids(stream) == subject.references[6].ids[:5] and stream[-1].finish.finish_reason == "length"
    long = make_job(prompts[6], max_new_tokens=10**6)
    assert engine.refusal(long) is None
    assert "no room" in engine.refusal(make_job([1] * engine.max_total_tokens))
    assert "vocabulary" in engine.refusal(make_job([1, 10**6]))


def test_cancel_drops_queued_and_running_requests(subject: EngineUnderTest, prompts) -> None:
    engine = subject.engine
    jobs = [make_job(prompts[i], max_new_tokens=LENGTHS[i]) for i in (0, 1, 3)]
    late = make_job(prompts[4], max_new_tokens=LENGTHS[4])
    events: dict[str, list] = {}
    for job in jobs:
        engine.add(job)
    collect(engine.step(), events)
    collect(engine.step(), events)
    engine.add(late)
    assert engine.cancel(jobs[1].request_id)  # running
    assert engine.cancel(late.request_id)  # not yet started
    assert not engine.cancel("unknown")
    cancelled = len(events.pop(jobs[1].request_id, []))
    run(engine, {}, events)
    assert engine.idle
    assert cancelled <= 2 and jobs[1].request_id not in events and late.request_id not in events
    for job, i in zip((jobs[0], jobs[2]), (0, 3), strict=True):
        assert token_ids(events[job.request_id]) == subject.references[i].ids


def test_stop_ends_a_request_with_a_complete_answer(subject: EngineUnderTest, prompts, tokenizer) -> None:
    engine = subject.engine
    stopped, other = make_job(prompts[6], max_new_tokens=30), make_job(prompts[3], max_new_tokens=LENGTHS[3])
    events: dict[str, list] = {}
    engine.add(stopped)
    engine.add(other)
    while len(events.get(stopped.request_id, [])) < 3:
        collect(engine.step(), events)
    assert engine.stop(stopped.request_id) and not engine.stop("unknown")
    run(engine, {}, events)
    stream = events[stopped.request_id]
    assert len(stream) == 4 and stream[-1].finish.finish_reason == "stop_sequence"
    assert stream[-1].finish.generated_text == tokenizer.decode(token_ids(stream), skip_special_tokens=True)
    assert token_ids(stream) == subject.references[6].ids[:4]
    assert token_ids(events[other.request_id]) == subject.references[3].ids


def test_details_and_logprobs(subject: EngineUnderTest, prompts, tokenizer) -> None:
    job = make_job(prompts[3], max_new_tokens=3, details=True)
    sampled = make_job(prompts[5], max_new_tokens=3, do_sample=True, top_k=1, seed=3)
    events = run(subject.engine, {0: [job, sampled]})
    prefill = events[job.request_id][-1].finish.prefill
    assert events[sampled.request_id][-1].finish.prefill == []
    assert [token.id for token in prefill] == job.input_ids
    assert prefill[0].logprob is None and prefill[0].special
    assert all(token.logprob <= 0 for token in prefill[1:])
    assert [token.text for token in prefill[1:]] == [tokenizer.decode([t]) for t in job.input_ids[1:]]
    assert all(event.token.logprob == pytest.approx(0.0, abs=1e-5) for event in events[sampled.request_id])
    assert token_ids(events[sampled.request_id]) == subject.references[5].ids


def test_a_request_that_fails_alone(subject: EngineUnderTest, prompts, monkeypatch) -> None:
    bad, good = make_job(prompts[0], max_new_tokens=10), make_job(prompts[1], max_new_tokens=LENGTHS[1])
    token_event = RequestState.token_event

    def failing(state: RequestState, *args: object, **kwargs: object) -> TokenEvent:
        if state.request_id == bad.request_id:
            raise RuntimeError("broken detokenizer")
        return token_event(state, *args, **kwargs)

    monkeypatch.setattr(RequestState, "token_event", failing)
    events = run(subject.engine, {0: [bad, good]})
    assert len(events[bad.request_id]) == 1 and isinstance(events[bad.request_id][0], ErrorEvent)
    assert token_ids(events[good.request_id]) == subject.references[1].ids
    assert subject.engine.idle


def test_a_request_whose_numbers_go_bad_fails_alone(subject: EngineUnderTest, prompts) -> None:
    """A repetition_penalty that is 0 in float32 makes NaN (validation refuses it; a job from elsewhere could
    still bring it): that request, greedy or sampled, ends with an error of its own and the other's tokens are
    its reference. A temperature vLLM's SamplingParams refuses is refused when the job is added, not in a step.
    tests/test_batch_isolation.py fuzzes every parameter on the built-in engine."""
    good = make_job(prompts[1], max_new_tokens=LENGTHS[1])
    bad = [make_job(prompts[0], max_new_tokens=10, **sampling) for sampling in ({}, {"do_sample": True, "seed": 4})]
    bad = [job.model_copy(update={"params": job.params.model_copy(update={"repetition_penalty": 1e-46})})
           for job in bad]
    events = run(subject.engine, {0: [bad[0], good, bad[1]]})
    for job in bad:
        [event] = events[job.request_id]
        assert isinstance(event, ErrorEvent) and event.error_type == "generation", event
        assert "NaN or infinite" in event.message
    assert token_ids(events[good.request_id]) == subject.references[1].ids
    hot = make_job(prompts[0], max_new_tokens=4, do_sample=True, temperature=3.0, seed=1)
    if subject.kind == "vllm":
        with pytest.raises(RequestRefused, match="temperature"):
            subject.engine.add(hot)
    else:
        assert len(token_ids(run(subject.engine, {0: [hot]})[hot.request_id])) == 4
    assert subject.engine.idle


def test_typical_p_is_applied_or_accepted(subject: EngineUnderTest, prompts) -> None:
    """The built-in engine applies typical_p; vLLM has no typical sampling, so its engine takes the request
    and samples with the other parameters (SPEC.md: accepted and ignored where the engine lacks it)."""
    job = make_job(prompts[0], max_new_tokens=12, do_sample=True, typical_p=0.2, seed=1)
    plain = make_job(prompts[0], max_new_tokens=12, do_sample=True, seed=1)
    assert subject.engine.refusal(job) is None
    typical, untouched = (token_ids(run(subject.engine, {0: [one]})[one.request_id]) for one in (job, plain))
    assert len(typical) == 12
    assert (typical == untouched) == (subject.kind == "vllm")


def test_ignore_eos_and_stop_token_ids(subject: EngineUnderTest, prompts) -> None:
    """vLLM's ``ignore_eos`` and ``stop_token_ids`` (OpenAI routes): past the EOS that ends PROMPTS[1] to
    max_new_tokens; a stop id ends a request as a stop string does (``stop_sequence``), its token kept."""
    eos_ended, reference = subject.references[1], subject.references[3].ids
    assert eos_ended.eos
    ignoring = make_job(prompts[1], max_new_tokens=len(eos_ended.ids) + 5, ignore_eos=True)
    stop_at = next(i for i in range(4, len(reference)) if reference[i] not in reference[:i])
    stopped = make_job(prompts[3], max_new_tokens=LENGTHS[3], stop_token_ids=[reference[stop_at]])
    events = run(subject.engine, {0: [ignoring, stopped]})
    stream = events[ignoring.request_id]
    assert token_ids(stream)[: len(eos_ended.ids)] == eos_ended.ids
    assert len(stream) == len(eos_ended.ids) + 5 and stream[-1].finish.finish_reason == "length"
    stream = events[stopped.request_id]
    assert token_ids(stream) == reference[: stop_at + 1] and stream[-1].finish.finish_reason == "stop_sequence"


def test_the_kv_cache_holds_max_batch_total_tokens(subject: EngineUnderTest) -> None:
    """maxBatchTotalTokens sizes both engines' KV cache: vLLM's too, rather than a fraction of the host's memory
    that fails to start where other processes use memory."""
    assert subject.engine.kv_budget_tokens == Settings().max_batch_total_tokens


# -- structured outputs -------------------------------------------------------------------------------------

# Each constraint with the pattern its whole output must match
CONSTRAINED = [
    (Constraint(format="regex", value="[0-9]{3}-[a-z]{2}"), "[0-9]{3}-[a-z]{2}"),
    (Constraint(format="choice", value='["yes", "no", "maybe"]'), "yes|no|maybe"),
    (Constraint(format="grammar", value='root ::= "a" | "b"'), "a|b"),
]
# Small enough for the tiny random model to finish: a bounded integer, an enum, and no free whitespace (llguidance's
# ``x-guidance`` options, which vLLM's guidance backend reads too), else it fills its tokens with spaces.
SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 999}, "colour": {"enum": ["red", "blue"]}},
    "required": ["count", "colour"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
JSON_SCHEMA = Constraint(format="json_schema", value=json.dumps(SCHEMA))
SAMPLED_HOT = {"do_sample": True, "temperature": 1.3}


def structured_text(stream: list[TokenEvent], tokenizer) -> str:
    """The output of a request that ended on EOS, less the EOS: the contract model's second EOS is a word, whose
    text ``generated_text`` holds."""
    assert stream[-1].finish.finish_reason == "eos_token", stream[-1].finish
    return tokenizer.decode(token_ids(stream)[:-1], skip_special_tokens=True)


def test_constraints_hold(subject: EngineUnderTest, prompts, tokenizer) -> None:
    """A regex, a choice list and a GBNF grammar, greedy and sampled, in one batch: each output matches its
    constraint in full and ends on EOS, with ignore_eos too (a complete output allows nothing but EOS)."""
    jobs = [
        (make_job(prompt, max_new_tokens=32, constraint=constraint, ignore_eos=i == 0, **sampling), pattern)
        for i, prompt in enumerate(prompts[:4])
        for constraint, pattern in CONSTRAINED
        for sampling in ({}, {**SAMPLED_HOT, "seed": i})
    ]
    events = run(subject.engine, {0: [job for job, _ in jobs]})
    for job, pattern in jobs:
        text = structured_text(events[job.request_id], tokenizer)
        assert re.fullmatch(pattern, text), (pattern, text)


def test_json_schema_output_validates(subject: EngineUnderTest, prompts, tokenizer) -> None:
    """With room enough the output is JSON valid under its schema; cut short by max_new_tokens it is a prefix
    the schema's grammar allows."""
    complete = [make_job(prompt, max_new_tokens=64, constraint=JSON_SCHEMA, **sampling)
                for i, prompt in enumerate(prompts[:4]) for sampling in ({}, {**SAMPLED_HOT, "seed": i})]
    cut = make_job(prompts[5], max_new_tokens=4, constraint=JSON_SCHEMA)
    events = run(subject.engine, {0: [*complete, cut]})
    for job in complete:
        jsonschema.validate(json.loads(structured_text(events[job.request_id], tokenizer)), SCHEMA)
    stream = events[cut.request_id]
    assert stream[-1].finish.finish_reason == "length" and len(stream) == 4
    matcher = LLMatcher(from_tokenizer(tokenizer), grammar(JSON_SCHEMA))
    assert matcher.consume_tokens(token_ids(stream)) and not matcher.is_accepting()


def test_constrained_and_free_requests_share_a_batch(subject: EngineUnderTest, prompts) -> None:
    """Greedy constrained requests joining a batch of free ones at different steps: every request gets the
    tokens it gets alone (the free ones their references), so a row's mask never touches another row."""
    def constrained() -> list[Job]:
        return [make_job(prompts[i], max_new_tokens=40, constraint=constraint)
                for i, constraint in enumerate([c for c, _ in CONSTRAINED] + [JSON_SCHEMA])]

    alone = [token_ids(run(subject.engine, {0: [job]})[job.request_id]) for job in constrained()]
    jobs = constrained()
    free = [make_job(prompts[i], max_new_tokens=LENGTHS[i]) for i in (4, 6, 7)]
    events = run(subject.engine, {0: [free[0], jobs[0]], 1: [jobs[1], free[1]], 3: [jobs[2], free[2], jobs[3]]})
    for job, tokens in zip(jobs, alone, strict=True):
        assert token_ids(events[job.request_id]) == tokens
    for job, i in zip(free, (4, 6, 7), strict=True):
        assert token_ids(events[job.request_id]) == subject.references[i].ids


@pytest.mark.parametrize("constraint", [
    Constraint(format="regex", value="[0-9"),
    Constraint(format="grammar", value="root ::= missing"),
    Constraint(format="json_schema", value='{"type": "no such type"}'),
])
def test_a_constraint_that_does_not_compile_is_refused(subject: EngineUnderTest, prompts,
                                                       constraint: Constraint) -> None:
    """Refused when the job is added (the client gets a validation error), the engine untouched."""
    with pytest.raises(RequestRefused, match=f"{constraint.format} constraint"):
        subject.engine.add(make_job(prompts[0], constraint=constraint))
    assert subject.engine.idle
