"""BatchSampler on hand-made logits: each warper keeps exactly the tokens it should, with the right logprobs,
and a grammar keeps a constrained row to the tokens llguidance allows."""

from __future__ import annotations

import math
import re

import pytest
import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.hf import from_tokenizer

from common.constraints import grammar
from common.protocol import Constraint, SamplingParams
from worker.sampling import BatchSampler

# probabilities 0.4, 0.3, 0.2, 0.1 over a vocabulary of 4
LOGITS = torch.tensor([[math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]])


def sampler(n: int = 1, **params: object) -> BatchSampler:
    rows = [SamplingParams(seed=seed, max_new_tokens=1, **params) for seed in range(n)]
    return BatchSampler.create(rows, [[0]] * n, LOGITS.shape[1], torch.device("cpu"))


def draws(**params: object) -> tuple[set[int], dict[int, float]]:
    """Sample 200 rows (seeds 0..199) once; return the ids seen and the logprob reported for each."""
    ids, logprobs = sampler(200, **params)(LOGITS.expand(200, -1))
    return set(ids.tolist()), dict(zip(ids.tolist(), logprobs.tolist(), strict=True))


def test_greedy_takes_argmax_with_its_logprob() -> None:
    ids, logprobs = sampler()(LOGITS)
    assert ids.tolist() == [0] and logprobs.item() == pytest.approx(math.log(0.4))


def test_top_k_keeps_the_k_best_and_renormalises() -> None:
    seen, logprobs = draws(do_sample=True, top_k=2)
    assert seen == {0, 1}
    assert logprobs[0] == pytest.approx(math.log(0.4 / 0.7)) and logprobs[1] == pytest.approx(math.log(0.3 / 0.7))


def test_top_k_beyond_the_vocabulary_keeps_everything() -> None:
    assert draws(do_sample=True, top_k=100)[0] == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    seen, logprobs = draws(do_sample=True, top_p=0.5)  # 0.4 < 0.5, 0.4 + 0.3 >= 0.5
    assert seen == {0, 1}
    assert logprobs[0] == pytest.approx(math.log(0.4 / 0.7))


def test_temperature_sharpens_the_sampled_distribution() -> None:
    seen, logprobs = draws(do_sample=True, temperature=0.5)
    expected = torch.log_softmax(LOGITS[0] / 0.5, dim=-1)
    assert seen == {0, 1, 2, 3}
    assert all(logprobs[i] == pytest.approx(expected[i].item(), abs=1e-5) for i in seen)


def test_repetition_penalty_applies_to_seen_tokens_only() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.0]])
    rows = [SamplingParams(seed=0, max_new_tokens=1, repetition_penalty=2.0)]
    choose = BatchSampler.create(rows, [[0, 2]], 4, torch.device("cpu"))
    ids, logprobs = choose(logits)  # token 0: 2.0 -> 1.0, token 2: -1.0 -> -2.0
    assert ids.tolist() == [1]
    assert logprobs.item() == pytest.approx(torch.log_softmax(torch.tensor([1.0, 1.9, -2.0, -1.0]), -1)[1].item())
    ids, _ = choose(logits)  # token 1 is now penalised as well
    assert ids.tolist() == [0]


def test_same_seed_same_draws() -> None:
    a, b = sampler(1, do_sample=True), sampler(1, do_sample=True)
    assert [a(LOGITS)[0].item() for _ in range(20)] == [b(LOGITS)[0].item() for _ in range(20)]


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_keeps_what_transformers_typical_warper_keeps(mass: float) -> None:
    """On random logits, typical-p masks exactly the tokens transformers' TypicalLogitsWarper masks; a row
    with typical_p 1.0 in the same batch is left alone."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(int(mass * 100))) * 3
    rows = [SamplingParams(seed=0, max_new_tokens=1, do_sample=True, typical_p=p) for p in (mass, mass, 1.0, mass)]
    warped = BatchSampler._typical(logits, torch.tensor([row.typical_p for row in rows]))
    expected = TypicalLogitsWarper(mass)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    for row in (0, 1, 3):
        assert torch.equal(torch.isinf(warped[row]), torch.isinf(expected[row]))
    assert torch.equal(warped[2], logits[2])


def test_typical_p_draws_only_typical_tokens() -> None:
    # entropy of (0.4, 0.3, 0.2, 0.1) is 1.28 nats; surprisals 0.92, 1.20, 1.61, 2.30: token 1 is the most typical
    assert draws(do_sample=True, typical_p=0.25)[0] == {1}


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer) -> LLTokenizer:
    """The tiny model's tokenizer as llguidance reads it, with 4 padding rows past its tokens, as the logits of
    a model whose embedding is padded have."""
    return from_tokenizer(tokenizer, n_vocab=len(tokenizer) + 4)


def test_a_constrained_row_samples_from_its_grammar_only(tokenizer, grammar_tokenizer) -> None:
    """At every step a constrained row chooses among the tokens llguidance's own per-token mask allows (never a
    padding row, which these logits favour), with the logprob of the masked distribution, and the grammar
    follows its tokens to EOS; the free rows beside it get bit for bit what they get without it."""
    text = grammar(Constraint(format="regex", value="[0-9]{2}-[a-z]"))
    oracle = LLMatcher(grammar_tokenizer, text)
    width = grammar_tokenizer.vocab_size
    rows = [SamplingParams(seed=seed, max_new_tokens=8, do_sample=seed > 0) for seed in range(3)]
    constrained = BatchSampler.create(rows, [[0]] * 3, width, torch.device("cpu"),
                                      [None, LLMatcher(grammar_tokenizer, text), None])
    free = BatchSampler.create(rows, [[0]] * 3, width, torch.device("cpu"))
    draw = torch.Generator().manual_seed(0)
    tokens: list[int] = []
    while tokenizer.eos_token_id not in tokens:
        assert len(tokens) < 8
        logits = torch.randn(3, width, generator=draw)
        logits[:, -4:] += 50.0
        allowed = torch.frombuffer(bytearray(oracle.compute_logit_bias()), dtype=torch.uint8)[:width] > 0
        ids, logprobs = constrained(logits)
        free_ids, free_logprobs = free(logits)
        assert torch.equal(ids[[0, 2]], free_ids[[0, 2]]) and torch.equal(logprobs[[0, 2]], free_logprobs[[0, 2]])
        token = int(ids[1])
        assert allowed[token]
        assert logprobs[1].item() == pytest.approx((logits[1, token] - logits[1, allowed].logsumexp(0)).item())
        assert oracle.consume_token(token)
        tokens.append(token)
    assert re.fullmatch("[0-9]{2}-[a-z]", tokenizer.decode(tokens, skip_special_tokens=True))
