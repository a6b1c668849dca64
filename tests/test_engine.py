"""The continuous-batching engine against the tiny model: batching must never change a request's output."""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from common.protocol import ErrorEvent, Job, SamplingParams, TokenEvent
from common.settings import Settings
from worker.attention import PADDED_SDPA, use_padded_attention
from worker.engine import Engine, StepOutput

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog because",
    "你好，世界",
    "import torch\nimport numpy as np\n\nclass Model:",
    "a",
    "Once upon a time there was a little server that answered every request",
    "数据结构与算法",
    "for i in range(10):\n    print(i)",
]
_request_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> PreTrainedModel:
    """The stock model: the reference every engine output is compared with."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="module")
def served(tiny_model_path: Path) -> PreTrainedModel:
    """The model as ``Engine.load`` prepares it (padded-batch SDPA attention)."""
    served = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    use_padded_attention(served)
    assert served.config._attn_implementation == PADDED_SDPA
    return served


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [tokenizer(text).input_ids for text in PROMPTS]


def make_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **limits: int) -> Engine:
    defaults = {"max_batch_size": 32, "max_prefill_batch_size": 8, "max_prefill_tokens": 8192}
    settings = Settings(model_path=Path("unused"), **{**defaults, **limits})
    return Engine(model, tokenizer, settings)


def make_job(input_ids: list[int], *, seed: int = 0, max_new_tokens: int = 16, **params: object) -> Job:
    return Job(
        request_id=f"req-{next(_request_ids)}",
        model="tiny",
        reply_channel="unused",
        input_ids=input_ids,
        params=SamplingParams(seed=seed, max_new_tokens=max_new_tokens, **params),
        enqueued_at=time.time(),
    )


def collect(outputs: list[StepOutput], events: dict[str, list[TokenEvent]]) -> None:
    """Append one step's outputs to ``events``, checking the per-step rules of the event stream."""
    seen: set[str] = set()
    for output in outputs:
        assert isinstance(output.event, TokenEvent), output.event
        request_id = output.job.request_id
        assert request_id not in seen, "two tokens for one request in one step"
        seen.add(request_id)
        stream = events.setdefault(request_id, [])
        assert not stream or stream[-1].finish is None, "event after finish"
        stream.append(output.event)
        assert output.event.index == len(stream) - 1
        assert output.finished == (output.event.finish is not None)


def run(
    engine: Engine, arrivals: Mapping[int, Iterable[Job]], events: dict[str, list[TokenEvent]] | None = None
) -> dict[str, list[TokenEvent]]:
    """Add ``arrivals[n]`` before step n, step until idle (extending ``events`` of earlier steps); check
    the event stream of every request."""
    events = {} if events is None else events
    step = 0
    while not engine.idle or any(n >= step for n in arrivals):
        for job in arrivals.get(step, ()):
            engine.add(job)
        collect(engine.step(), events)
        step += 1
    for stream in events.values():
        assert stream[-1].finish is not None
        assert stream[-1].finish.generated_tokens == len(stream)
        assert "".join(event.token.text for event in stream) == stream[-1].finish.generated_text
    return events


def token_ids(stream: list[TokenEvent]) -> list[int]:
    return [event.token.id for event in stream]


def greedy_reference(model: PreTrainedModel, input_ids: list[int], max_new_tokens: int, **kwargs: object) -> list[int]:
    """``model.generate`` on the prompt alone."""
    ids = torch.tensor([input_ids])
    output = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, **kwargs
    )
    return output[0, len(input_ids) :].tolist()


# -- batching leaves greedy and seeded outputs unchanged ---------------------------------------------


@pytest.mark.parametrize("attention", [PADDED_SDPA, "sdpa", "eager"])
def test_greedy_batch_matches_generate_alone(model, served, tokenizer, prompts, tiny_model_path, attention) -> None:
    if attention != PADDED_SDPA:  # the 4D-mask path with transformers' SDPA, and the 2D-mask path
        served = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attention).eval()
    engine = make_engine(served, tokenizer, max_prefill_batch_size=3)
    lengths = [12, 30, 7, 25, 18, 3, 40, 22]
    jobs = [make_job(ids, max_new_tokens=n) for ids, n in zip(prompts, lengths)]
    arrivals = {0: jobs[:4], 2: jobs[4:6], 5: jobs[6:7], 9: jobs[7:]}
    events = run(engine, arrivals)
    for job in jobs:
        stream = events[job.request_id]
        assert token_ids(stream) == greedy_reference(model, job.input_ids, job.params.max_new_tokens)
        assert stream[-1].finish.finish_reason == "length"
        assert stream[-1].finish.prompt_tokens == len(job.input_ids)
        assert stream[-1].finish.seed == job.params.seed
        assert stream[-1].finish.generated_text == tokenizer.decode(token_ids(stream), skip_special_tokens=True)


def test_greedy_logprobs_are_the_model_distribution(model, served, tokenizer, prompts) -> None:
    job = make_job(prompts[1], max_new_tokens=6)
    other = make_job(prompts[3], max_new_tokens=9)
    events = run(make_engine(served, tokenizer), {0: [job, other]})
    ids = torch.tensor([job.input_ids])
    output = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
        output_logits=True, return_dict_in_generate=True,
    )
    for event, logits in zip(events[job.request_id], output.logits):
        expected = logits[0].float().log_softmax(-1)[event.token.id].item()
        assert event.token.logprob == pytest.approx(expected, abs=1e-4)


SAMPLED = [
    {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 11},
    {"do_sample": True, "temperature": 1.3, "seed": 2**64 - 1},
    {"do_sample": True, "top_p": 0.5, "seed": 7},
    {"do_sample": True, "top_k": 5, "repetition_penalty": 1.2, "seed": 12345},
]


def test_seeded_sampling_is_independent_of_the_batch(served, tokenizer, prompts) -> None:
    alone = {}
    for i, params in enumerate(SAMPLED):
        job = make_job(prompts[i], max_new_tokens=24, **params)
        alone[i] = run(make_engine(served, tokenizer), {0: [job]})[job.request_id]
    busy = [make_job(prompts[i], max_new_tokens=24, **params) for i, params in enumerate(SAMPLED)]
    noise = [
        make_job(prompts[4], max_new_tokens=5),
        make_job(prompts[5], max_new_tokens=30, do_sample=True, seed=99),
        make_job(prompts[6], max_new_tokens=3, do_sample=True, temperature=2.0, seed=5),
        make_job(prompts[7], max_new_tokens=12, repetition_penalty=1.5),
    ]
    arrivals = {0: [noise[0], busy[0], noise[1]], 1: [busy[1]], 3: [noise[2], busy[2]], 4: [busy[3], noise[3]]}
    events = run(make_engine(served, tokenizer, max_prefill_batch_size=2), arrivals)
    for i, job in enumerate(busy):
        stream = events[job.request_id]
        assert token_ids(stream) == token_ids(alone[i])
        assert [e.token.logprob for e in stream] == pytest.approx([e.token.logprob for e in alone[i]], abs=1e-4)
    other_seed = make_job(prompts[0], max_new_tokens=24, **{**SAMPLED[0], "seed": 12})
    assert token_ids(run(make_engine(served, tokenizer), {0: [other_seed]})[other_seed.request_id]) != token_ids(alone[0])


def test_top_k_1_sampling_is_greedy_with_certain_tokens(model, served, tokenizer, prompts) -> None:
    job = make_job(prompts[2], max_new_tokens=10, do_sample=True, top_k=1, temperature=0.5, seed=3)
    stream = run(make_engine(served, tokenizer), {0: [job]})[job.request_id]
    assert token_ids(stream) == greedy_reference(model, job.input_ids, 10)
    assert all(event.token.logprob == 0.0 for event in stream)


def test_repetition_penalty_matches_generate(model, served, tokenizer, prompts) -> None:
    penalised = [make_job(prompts[i], max_new_tokens=30, repetition_penalty=p) for i, p in ((6, 1.3), (0, 0.3))]
    plain = make_job(prompts[3], max_new_tokens=20)
    events = run(make_engine(served, tokenizer), {0: [penalised[0], plain], 2: [penalised[1]]})
    for job in penalised:
        expected = greedy_reference(model, job.input_ids, 30, repetition_penalty=job.params.repetition_penalty)
        assert token_ids(events[job.request_id]) == expected
        assert expected != greedy_reference(model, job.input_ids, 30)
    assert token_ids(events[plain.request_id]) == greedy_reference(model, plain.input_ids, 20)


def test_decoder_input_details_are_prompt_logprobs(model, served, tokenizer, prompts) -> None:
    job = make_job(prompts[3], max_new_tokens=3).model_copy(update={"decoder_input_details": True})
    longer = make_job(prompts[5], max_new_tokens=3)
    events = run(make_engine(served, tokenizer), {0: [job, longer]})
    prefill = events[job.request_id][-1].finish.prefill
    assert events[longer.request_id][-1].finish.prefill == []
    assert [token.id for token in prefill] == job.input_ids
    assert prefill[0].logprob is None and prefill[0].special
    with torch.no_grad():
        logprobs = model(torch.tensor([job.input_ids])).logits[0, :-1].log_softmax(-1)
    expected = logprobs.gather(1, torch.tensor(job.input_ids[1:])[:, None]).squeeze(1).tolist()
    assert [token.logprob for token in prefill[1:]] == pytest.approx(expected, abs=1e-4)
    assert [token.text for token in prefill[1:]] == [tokenizer.decode([t]) for t in job.input_ids[1:]]


# -- finish reasons ---------------------------------------------------------------------------------


def test_eos_from_a_generation_config_list(model, served, tokenizer, prompts) -> None:
    reference = greedy_reference(model, prompts[1], 20)
    stop_at = 6
    eos_model = copy.deepcopy(served)
    eos_model.generation_config.eos_token_id = [tokenizer.eos_token_id, reference[stop_at]]
    job = make_job(prompts[1], max_new_tokens=20)
    stream = run(make_engine(eos_model, tokenizer), {0: [job]})[job.request_id]
    first = reference.index(reference[stop_at])
    assert token_ids(stream) == reference[: first + 1]
    assert stream[-1].finish.finish_reason == "eos_token"
    assert stream[-1].finish.generated_tokens == first + 1


def test_special_eos_token_is_emitted_with_empty_text(model, served, tokenizer, prompts) -> None:
    reference = greedy_reference(model, prompts[0], 20)
    eos_model = copy.deepcopy(served)
    with torch.no_grad():  # make the EOS logit a multiple of the logit of a token greedy decoding picks
        eos_model.lm_head.weight[tokenizer.eos_token_id] = 3 * eos_model.lm_head.weight[reference[4]]
    job = make_job(prompts[0], max_new_tokens=20)
    other = make_job(prompts[3], max_new_tokens=20)
    events = run(make_engine(eos_model, tokenizer), {0: [job, other]})
    for request in (job, other):
        stream = events[request.request_id]
        last = stream[-1]
        if last.finish.finish_reason == "length":
            continue
        assert last.finish.finish_reason == "eos_token"
        assert last.token.id == tokenizer.eos_token_id and last.token.special
        assert last.finish.generated_text == tokenizer.decode(token_ids(stream), skip_special_tokens=True)
        assert token_ids(stream)[:-1] == greedy_reference(eos_model, request.input_ids, len(stream) - 1)
    assert events[job.request_id][-1].finish.finish_reason == "eos_token"


def test_stop_sequence_cuts_the_text(model, served, tokenizer, prompts) -> None:
    reference = greedy_reference(model, prompts[3], 40)
    full_text = tokenizer.decode(reference, skip_special_tokens=True)
    stop = full_text[25:31]
    assert stop and full_text.find(stop) == 25
    job = make_job(prompts[3], max_new_tokens=40, stop=["never-generated", stop])
    other = make_job(prompts[0], max_new_tokens=40, stop=["never-generated"])
    events = run(make_engine(served, tokenizer), {0: [job, other]})
    stream = events[job.request_id]
    finish = stream[-1].finish
    assert finish.finish_reason == "stop_sequence"
    assert finish.generated_text == full_text[:25]
    assert token_ids(stream) == reference[: len(stream)]
    assert tokenizer.decode(token_ids(stream), skip_special_tokens=True).startswith(full_text[:31])
    assert tokenizer.decode(token_ids(stream)[:-1], skip_special_tokens=True).find(stop) == -1
    assert events[other.request_id][-1].finish.finish_reason == "length"


def test_total_length_is_capped_by_max_seq_len(served, tokenizer, prompts) -> None:
    prompt = prompts[1]
    engine = make_engine(served, tokenizer, max_seq_len=len(prompt) + 5)
    job = make_job(prompt, max_new_tokens=50)
    assert engine.fits(job)
    stream = run(engine, {0: [job]})[job.request_id]
    assert len(stream) == 5 and stream[-1].finish.finish_reason == "length"
    assert not engine.fits(make_job(prompt + prompt[:5]))


def test_fits_rejects_what_can_never_run(served, tokenizer, prompts) -> None:
    engine = make_engine(served, tokenizer, max_prefill_tokens=10, max_batch_total_tokens=40)
    assert engine.fits(make_job(prompts[0], max_new_tokens=1000))
    assert not engine.fits(make_job([1] * 11))
    assert not engine.fits(make_job([1, len(tokenizer) + 5]))
    with pytest.raises(ValueError):
        engine.add(make_job([1] * 11))


# -- streaming text ---------------------------------------------------------------------------------


def test_streamed_text_is_exact_for_multibyte_output(served, tokenizer) -> None:
    prompt = tokenizer("中文测试：人工智能模型，数据结构与算法").input_ids
    jobs = [make_job(prompt, max_new_tokens=120, do_sample=True, temperature=1.5, seed=seed) for seed in range(6)]
    events = run(make_engine(served, tokenizer), {0: jobs})
    non_ascii = 0
    for job in jobs:
        stream = events[job.request_id]
        text = stream[-1].finish.generated_text
        assert text == tokenizer.decode(token_ids(stream), skip_special_tokens=True)
        non_ascii += sum(ord(char) > 127 for char in text)
        if "\ufffd" not in text:
            assert all("\ufffd" not in event.token.text for event in stream)
    assert non_ascii > 50  # the test did exercise multi-byte characters


# -- scheduling limits ------------------------------------------------------------------------------


def test_kv_budget_makes_jobs_wait(model, served, tokenizer, prompts) -> None:
    budget = 80
    engine = make_engine(served, tokenizer, max_batch_total_tokens=budget)
    jobs = [make_job(prompts[i], max_new_tokens=n) for i, n in ((0, 20), (4, 8), (7, 30))]
    reserved = [len(job.input_ids) + job.params.max_new_tokens for job in jobs]
    assert sum(reserved[:2]) < budget < sum(reserved)
    engine.add(jobs[0])
    engine.add(jobs[1])
    assert engine.has_room()
    engine.add(jobs[2])
    assert not engine.has_room()
    events: dict[str, list[TokenEvent]] = {}
    first_token_step: dict[str, int] = {}
    finish_step: dict[str, int] = {}
    step = 0
    while not engine.idle:
        collect(engine.step(), events)
        for request_id, stream in events.items():
            first_token_step.setdefault(request_id, step)
            if stream[-1].finish is not None:
                finish_step.setdefault(request_id, step)
        running = [i for i, job in enumerate(jobs) if job.request_id in events and job.request_id not in finish_step]
        assert sum(reserved[i] for i in running) <= budget
        assert engine.batch_size == len(running)
        step += 1
    short, waiter = jobs[1].request_id, jobs[2].request_id
    assert first_token_step[waiter] == finish_step[short] + 1  # joined right after room was made
    for job in jobs:
        assert token_ids(events[job.request_id]) == greedy_reference(model, job.input_ids, job.params.max_new_tokens)


def test_batch_size_limit(served, tokenizer, prompts) -> None:
    engine = make_engine(served, tokenizer, max_batch_size=2)
    jobs = [make_job(prompts[i], max_new_tokens=4 + i) for i in range(3)]
    engine.add(jobs[0])
    assert engine.has_room()
    engine.add(jobs[1])
    assert not engine.has_room()
    engine.add(jobs[2])  # the loop would not, but a queued job must simply wait
    events: dict[str, list[TokenEvent]] = {}
    collect(engine.step(), events)
    assert engine.batch_size == 2
    run(engine, {}, events)
    assert len(events[jobs[2].request_id]) == 6


def test_cancel_drops_queued_and_running_requests(model, served, tokenizer, prompts) -> None:
    engine = make_engine(served, tokenizer, max_prefill_batch_size=3)
    jobs = [make_job(prompts[i], max_new_tokens=20) for i in range(4)]
    for job in jobs[:3]:
        engine.add(job)
    events: dict[str, list[TokenEvent]] = {}
    collect(engine.step(), events)
    collect(engine.step(), events)
    engine.add(jobs[3])
    assert engine.batch_size == 3
    assert engine.cancel(jobs[1].request_id)  # running
    assert engine.cancel(jobs[3].request_id)  # still queued
    assert not engine.cancel("unknown")
    cancelled = events.pop(jobs[1].request_id)
    collect(engine.step(), events)
    assert engine.batch_size == 2
    run(engine, {}, events)
    assert engine.idle
    assert len(cancelled) == 2 and jobs[1].request_id not in events and jobs[3].request_id not in events
    for job in (jobs[0], jobs[2]):
        assert token_ids(events[job.request_id]) == greedy_reference(model, job.input_ids, 20)


def test_stop_ends_a_request_with_a_complete_answer(model, served, tokenizer, prompts) -> None:
    engine = make_engine(served, tokenizer)
    stopped, other = make_job(prompts[2], max_new_tokens=20), make_job(prompts[5], max_new_tokens=20)
    events: dict[str, list[TokenEvent]] = {}
    engine.add(stopped)
    engine.add(other)
    for _ in range(3):
        collect(engine.step(), events)
    assert engine.stop(stopped.request_id) and not engine.stop("unknown")
    run(engine, {}, events)
    stream = events[stopped.request_id]
    assert len(stream) == 4 and stream[-1].finish.finish_reason == "stop_sequence"
    assert stream[-1].finish.generated_text == tokenizer.decode(token_ids(stream), skip_special_tokens=True)
    assert token_ids(events[other.request_id]) == greedy_reference(model, other.input_ids, 20)


def test_a_failing_request_does_not_stop_the_others(model, served, tokenizer, prompts, monkeypatch) -> None:
    engine = make_engine(served, tokenizer)
    bad, good = make_job(prompts[0], max_new_tokens=10), make_job(prompts[1], max_new_tokens=10)
    engine.add(bad)
    engine.add(good)
    stream = engine._waiting[0].stream  # the queued state of ``bad``

    def broken(token_id: int) -> tuple[str, bool]:
        raise RuntimeError("broken detokenizer")

    monkeypatch.setattr(stream, "push", broken)
    outputs = engine.step()
    failed = [out for out in outputs if out.job is bad]
    assert len(failed) == 1 and isinstance(failed[0].event, ErrorEvent) and failed[0].finished
    assert engine.batch_size == 1
    events: dict[str, list[TokenEvent]] = {}
    collect([out for out in outputs if out.job is good], events)
    run(engine, {}, events)
    assert token_ids(events[good.request_id]) == greedy_reference(model, good.input_ids, 10)


def test_a_failing_forward_pass_drops_its_batch(model, served, tokenizer, prompts, monkeypatch) -> None:
    engine = make_engine(served, tokenizer)
    engine.add(make_job(prompts[0], max_new_tokens=10))
    engine.step()
    monkeypatch.setattr(served, "forward", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert engine.idle
    monkeypatch.undo()
    job = make_job(prompts[1], max_new_tokens=5)
    assert token_ids(run(engine, {0: [job]})[job.request_id]) == greedy_reference(model, job.input_ids, 5)


def test_load_from_settings(tiny_model_path: Path, prompts) -> None:
    engine = Engine.load(Settings(model_path=tiny_model_path, device="cpu", dtype="float32"))
    job = make_job(prompts[0], max_new_tokens=4)
    assert len(run(engine, {0: [job]})[job.request_id]) == 4
