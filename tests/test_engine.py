"""The built-in engine's own guarantees (attention paths, penalties, limits); what every engine promises is in
tests/test_engine_contract.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from common.protocol import TokenEvent
from common.settings import Settings
from tests.helpers import collect, greedy_reference, make_engine, make_job, token_ids
from tests.helpers import run_complete as run  # the built-in engine fails no request here
from worker.attention import PADDED_SDPA
from worker.transformers_engine import TransformersEngine

pytestmark = pytest.mark.integration  # a real model's forward passes, checked against references


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> PreTrainedModel:
    """The stock model: the reference every engine output is compared with."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


# -- batching leaves greedy and seeded outputs unchanged ---------------------------------------------


@pytest.mark.parametrize("attention", [PADDED_SDPA, "sdpa", "eager"])
def test_greedy_batch_matches_generate_alone(model, served, tokenizer, prompts, tiny_model_path, attention) -> None:
    if attention != PADDED_SDPA:  # the 4D-mask path with transformers' SDPA, and the 2D-mask path
        served = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attention).eval()
    engine = make_engine(served, tokenizer, max_prefill_batch_size=3)
    lengths = [12, 30, 7, 25, 18, 3, 40, 22]
    jobs = [make_job(ids, max_new_tokens=n) for ids, n in zip(prompts, lengths, strict=True)]
    arrivals = {0: jobs[:4], 2: jobs[4:6], 5: jobs[6:7], 9: jobs[7:]}
    events = run(engine, arrivals)
    for job in jobs:
        stream = events[job.request_id]
        assert token_ids(stream) == greedy_reference(model, job.input_ids, job.params.max_new_tokens)
        assert stream[-1].finish.finish_reason == "length"
        assert stream[-1].finish.prompt_tokens == len(job.input_ids)
        assert stream[-1].finish.seed == job.params.seed
        assert stream[-1].finish.generated_text == tokenizer.decode(token_ids(stream), skip_special_tokens=True)


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


def test_special_eos_token_is_emitted_with_empty_text(model, served, tokenizer, prompts) -> None:
    reference = greedy_reference(model, prompts[0], 20)
    eos_model = copy.deepcopy(served)
    with torch.no_grad():  # make the EOS logit a multiple of the logit of a token greedy decoding picks
        eos_model.lm_head.weight[tokenizer.eos_token_id] = 3 * eos_model.lm_head.weight[reference[4]]
    eos_model.lm_head.pack()  # the packed copy follows the changed weight
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


def test_total_length_is_capped_by_max_seq_len(served, tokenizer, prompts) -> None:
    prompt = prompts[1]
    engine = make_engine(served, tokenizer, max_seq_len=len(prompt) + 5)
    job = make_job(prompt, max_new_tokens=50)
    assert engine.refusal(job) is None
    stream = run(engine, {0: [job]})[job.request_id]
    assert len(stream) == 5 and stream[-1].finish.finish_reason == "length"
    assert "no room" in engine.refusal(make_job(prompt + prompt[:5]))


def test_fits_rejects_what_can_never_run(served, tokenizer, prompts) -> None:
    engine = make_engine(served, tokenizer, max_prefill_tokens=10, max_batch_total_tokens=40)
    assert engine.refusal(make_job(prompts[0], max_new_tokens=1000)) is None
    assert "maxPrefillTokens" in engine.refusal(make_job([1] * 11))
    assert "vocabulary" in engine.refusal(make_job([1, len(tokenizer) + 5]))
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
    assert engine.room() > 0
    engine.add(jobs[2])
    assert engine.room() == 0
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
    assert engine.room() == 1
    engine.add(jobs[1])
    assert engine.room() == 0
    engine.add(jobs[2])  # the loop would not, but a queued job must simply wait
    events: dict[str, list[TokenEvent]] = {}
    collect(engine.step(), events)
    assert engine.batch_size == 2
    run(engine, {}, events)
    assert len(events[jobs[2].request_id]) == 6


def test_room_is_what_the_next_prefill_takes(served, tokenizer, prompts) -> None:
    """The worker takes no more jobs than the next prefill pass admits: the rest stay in the job streams,
    where any worker of the pool can take them."""
    engine = make_engine(served, tokenizer, max_batch_size=6, max_prefill_batch_size=4)
    assert engine.room() == 4
    for i in range(3):
        engine.add(make_job(prompts[i], max_new_tokens=4))
    assert engine.room() == 1
    engine.step()  # the three start
    assert engine.batch_size == 3 and engine.room() == 3  # batch slots are the limit now


def test_held_jobs_start_most_urgent_first(served, tokenizer, prompts) -> None:
    """Jobs added past a full batch wait in the engine in the order workers take them from the job streams: a
    lower priority number first, first come first served within one."""
    engine = make_engine(served, tokenizer, max_batch_size=1)
    jobs = [make_job(prompts[0], max_new_tokens=2).model_copy(update={"priority": p}) for p in (5, 5, 1, 3, 1)]
    events = run(engine, {0: jobs})  # all added before the first step: the batch takes one, four wait
    assert list(events) == [jobs[i].request_id for i in (2, 4, 3, 0, 1)]


def test_a_failing_forward_pass_drops_its_batch(model, served, tokenizer, prompts, monkeypatch) -> None:
    engine = make_engine(served, tokenizer)
    engine.add(make_job(prompts[0], max_new_tokens=10))
    engine.step()
    # the LM head: every decode pass ends there, the model's forward as the Llama decode step
    monkeypatch.setattr(served.lm_head, "forward", lambda *args: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert engine.idle
    monkeypatch.undo()
    job = make_job(prompts[1], max_new_tokens=5)
    assert token_ids(run(engine, {0: [job]})[job.request_id]) == greedy_reference(model, job.input_ids, 5)


def test_load_from_settings(tiny_model_path: Path, prompts) -> None:
    engine = TransformersEngine.load(Settings(model_path=tiny_model_path, device="cpu", dtype="float32"))
    job = make_job(prompts[0], max_new_tokens=4)
    assert len(run(engine, {0: [job]})[job.request_id]) == 4


def test_a_model_without_position_ids_serves_mixed_batches(tiny_model_path: Path, tokenizer, prompts, tmp_path) -> None:
    """Bloom (ALiBi) declares no ``position_ids``: the engine passes only the arguments a forward declares,
    and left-padded, joining batches still equal ``generate`` alone."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(
        vocab_size=len(tokenizer), hidden_size=64, n_layer=2, n_head=4, initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    BloomForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = TransformersEngine.load(Settings(model_path=tmp_path))
    assert not engine._forward.position_ids
    reference_model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    jobs = [make_job(prompts[i], max_new_tokens=12) for i in range(4)]
    events = run(engine, {0: jobs[:2], 3: jobs[2:]})
    for job in jobs:
        assert token_ids(events[job.request_id]) == greedy_reference(reference_model, job.input_ids, 12)


REMOTE_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class FerryRemoteConfig(LlamaConfig):
    model_type = "ferry_remote"


class FerryRemoteForCausalLM(LlamaForCausalLM):
    config_class = FerryRemoteConfig
'''


@pytest.fixture(scope="module")
def remote_code_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a model type transformers does not know, served by code in the folder (auto_map)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("models") / "tiny-remote"
    shutil.copytree(tiny_model_path, path)
    (path / "modeling_ferry_remote.py").write_text(REMOTE_CODE)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="ferry_remote", architectures=["FerryRemoteForCausalLM"], auto_map={
        "AutoConfig": "modeling_ferry_remote.FerryRemoteConfig",
        "AutoModelForCausalLM": "modeling_ferry_remote.FerryRemoteForCausalLM",
    })
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_trust_remote_code_loads_a_model_with_its_own_code(remote_code_model: Path, model, prompts) -> None:
    engine = TransformersEngine.load(Settings(model_path=remote_code_model, trust_remote_code=True))
    assert type(engine.model).__name__ == "FerryRemoteForCausalLM"
    job = make_job(prompts[0], max_new_tokens=6)
    assert token_ids(run(engine, {0: [job]})[job.request_id]) == greedy_reference(model, job.input_ids, 6)


def test_a_model_that_cannot_load_stops_the_worker_with_one_line(
    remote_code_model: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Custom code without trustRemoteCode, and a folder without weights: ferry-worker exits 1 at once with
    one line naming the folder, instead of a healthy-looking worker that fails every request."""
    import shutil
    import subprocess
    import sys

    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_path, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    for path, expected in ((remote_code_model, "trust_remote_code"), (no_weights, "no-weights")):
        result = subprocess.run(
            [sys.executable, "-m", "worker.main", "--model-path", str(path), "--redis-url", "redis://127.0.0.1:1/0"],
            capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 1, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("ferry-worker: cannot load the model at") and str(path) in last and expected in last
        assert "Traceback" not in result.stderr
