"""Next-token choice for a whole batch at once, each row with its own sampling parameters.

Every parameter is a per-row tensor, so one step costs a handful of batched tensor ops whatever the mix of
requests. The only per-row Python work is drawing one uniform number from each sampling row's own
``torch.Generator``: sampling is done by inverting the row's CDF with that number, so a request's tokens
depend on its seed and its logits only, never on which other requests share the batch.

Everything is computed in float32, the parameters included (:class:`common.protocol.SamplingParams` refuses
values that float32 cannot hold). A row whose numbers go bad all the same (its logits NaN or infinite, every
token masked) gets a NaN logprob and an id inside the vocabulary, so the batch's tensors stay usable and the
engine ends that request alone.

A row with a constraint (structured outputs) carries an llguidance matcher of its grammar: before anything
else, every token that would leave the grammar gets -inf, and the chosen token is then consumed by the matcher,
so the row's next mask follows its output. The masks are computed outside any compiled pass, on the CPU, for
the constrained rows only: a free row's logits are never touched, so constrained and free requests share a
batch and each gets the tokens it would get alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.torch import fill_next_token_bitmask_par, get_bitmask_shape

from common.protocol import SamplingParams


@cache
def _executor() -> LLExecutor:
    """llguidance's threads that compute a batch's masks, started by the first constrained batch."""
    return LLExecutor()


class BatchSampler:
    """Per-row sampling state of a batch: parameters, seeded generators, the token-presence mask that
    the repetition penalty needs (prompt and generated ids of every row) and the grammar matcher of each
    constrained row (None: a free row)."""

    def __init__(
        self,
        params: Sequence[SamplingParams],
        generators: list[torch.Generator],
        presence: torch.Tensor,
        matchers: list[LLMatcher | None],
    ) -> None:
        device = presence.device
        self.params = list(params)
        self.generators = generators
        self.presence = presence
        self.matchers = matchers
        self.constrained = [(row, matcher) for row, matcher in enumerate(matchers) if matcher is not None]
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.typical_p = torch.tensor([p.typical_p for p in params], dtype=torch.float32, device=device)
        self.penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
        self.sample_rows = [i for i, p in enumerate(params) if p.do_sample]
        sampled = [params[i] for i in self.sample_rows]
        self.any_penalty = any(p.repetition_penalty != 1.0 for p in params)
        self.any_truncation = any(p.top_k > 0 or p.top_p < 1.0 for p in sampled)
        self.any_typical = any(p.typical_p < 1.0 for p in sampled)

    @classmethod
    def create(
        cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
        matchers: Sequence[LLMatcher | None] | None = None,
    ) -> BatchSampler:
        """State for freshly prefilled rows: a generator seeded with each request's seed, presence = prompt, and
        each row's matcher (``matchers``; None: every row is free). A matcher's tokenizer must have
        ``vocab_size`` tokens, the logits' width."""
        generators = [torch.Generator().manual_seed(p.seed) for p in params]
        presence = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
        for row, ids in enumerate(prompts):
            presence[row, torch.tensor(ids, dtype=torch.long, device=device)] = True
        return cls(params, generators, presence, list(matchers or [None] * len(params)))

    def select(self, rows: list[int]) -> BatchSampler:
        """The state of the kept rows, in the given order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.presence.device)
        return BatchSampler(
            [self.params[r] for r in rows], [self.generators[r] for r in rows], self.presence[index],
            [self.matchers[r] for r in rows],
        )

    @classmethod
    def concat(cls, first: BatchSampler, second: BatchSampler) -> BatchSampler:
        """The rows of ``first`` followed by the rows of ``second``."""
        return cls(
            first.params + second.params,
            first.generators + second.generators,
            torch.cat([first.presence, second.presence]),
            first.matchers + second.matchers,
        )

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose one token per row from ``logits`` [batch, vocab]; returns (ids, logprobs of the chosen ids
        under the distribution actually sampled from), and records the ids for the repetition penalty and the
        constrained rows' matchers. A row whose numbers went bad has a non-finite logprob (see the module
        docstring)."""
        logits = logits.float()
        if self.constrained:
            logits = self._constrain(logits)
        if self.any_penalty:
            logits = self._apply_penalty(logits)
        ids = logits.argmax(dim=-1)
        logprobs = logits.gather(1, ids[:, None]).squeeze(1) - logits.logsumexp(dim=-1)
        if self.sample_rows:
            if len(self.sample_rows) == len(self.params):
                ids, logprobs = self._sample(logits, slice(None))
            else:
                rows = torch.tensor(self.sample_rows, dtype=torch.long, device=logits.device)
                sampled_ids, sampled_logprobs = self._sample(logits[rows], rows)
                ids = ids.index_copy(0, rows, sampled_ids)
                logprobs = logprobs.index_copy(0, rows, sampled_logprobs)
        self.presence.scatter_(1, ids[:, None], True)
        if self.constrained:
            chosen = ids.tolist()
            for row, matcher in self.constrained:
                matcher.consume_token(chosen[row])  # a token it refuses leaves it in its error state
        return ids, logprobs

    def _constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf on every token that would leave a constrained row's grammar (beyond the tokenizer's tokens too:
        padding rows of the logits are no token); the other rows are returned as they were."""
        rows, width = self.constrained, logits.shape[-1]
        bitmask = torch.full(get_bitmask_shape(len(rows), width), -1, dtype=torch.int32)
        fill_next_token_bitmask_par(_executor(), [(matcher, i) for i, (_, matcher) in enumerate(rows)], bitmask)
        # bit b of word w allows token 32 * w + b
        bits = bitmask.to(logits.device)[:, :, None] >> torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = (bits & 1).flatten(1)[:, :width].bool()
        index = torch.tensor([row for row, _ in rows], dtype=torch.long, device=logits.device)
        return logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))

    def _apply_penalty(self, logits: torch.Tensor) -> torch.Tensor:
        """Hugging Face repetition penalty: seen tokens' positive logits are divided by it, negative ones
        multiplied (a row with penalty 1.0 is left bit-identical)."""
        penalty = self.penalty[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(self.presence, penalized, logits)

    def _sample(self, logits: torch.Tensor, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, then top-k, then top-p, then typical-p (Hugging Face's warper order) and one draw per
        row."""
        logits = logits / self.temperature[rows][:, None]
        if self.any_truncation:
            logits = self._truncate(logits, self.top_k[rows], self.top_p[rows])
        if self.any_typical:
            logits = self._typical(logits, self.typical_p[rows])
        logprobs = logits.log_softmax(dim=-1)
        cdf = logprobs.exp().cumsum(dim=-1)
        total = cdf[:, -1:]
        uniforms = torch.tensor(
            [torch.rand(1, generator=self.generators[r]).item() for r in self.sample_rows],
            dtype=torch.float32,
        ).to(logits.device)[:, None]
        # The first index whose CDF exceeds u * total has a non-zero probability; clamping the threshold
        # below the total keeps rounding from ever selecting a masked (zero-probability) tail token.
        threshold = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
        found = torch.searchsorted(cdf, threshold, right=True)
        # A NaN CDF finds no token (the vocabulary's size): such a row takes the last id, with a NaN logprob.
        ids = found.clamp(max=logits.shape[-1] - 1)
        chosen = logprobs.gather(1, ids).masked_fill(found != ids, float("nan"))
        return ids.squeeze(1), chosen.squeeze(1)

    @classmethod
    def _truncate(cls, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Mask the logits below each row's top-k / top-p cut-off. The cut-off is found on sorted logits but
        applied in vocabulary order, so a row samples the same way whether or not its batch needed a sort."""
        ranked = logits.sort(dim=-1, descending=True).values
        ranked = cls._top_p(cls._top_k(ranked, top_k), top_p)
        kept = torch.isfinite(ranked).sum(dim=-1, keepdim=True).clamp(min=1)
        cutoff = ranked.gather(1, kept - 1)
        return logits.masked_fill(logits < cutoff, float("-inf"))

    @staticmethod
    def _typical(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
        """Locally typical sampling (Meister et al.; Hugging Face's ``TypicalLogitsWarper``): keep the tokens
        whose surprisal is closest to the distribution's entropy until their mass reaches p (at least one);
        rows with p = 1.0 are untouched."""
        logprobs = logits.log_softmax(dim=-1)
        entropy = -(logprobs * logprobs.exp()).nansum(dim=-1, keepdim=True)
        distance, order = (-logprobs - entropy).abs().sort(dim=-1)
        mass = logits.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (mass < typical_p[:, None]).sum(dim=1, keepdim=True).clamp(max=logits.shape[-1] - 1)
        drop_sorted = distance > distance.gather(1, last)
        drop_sorted[:, 0] = False
        drop = drop_sorted.scatter(1, order, drop_sorted) & (typical_p < 1.0)[:, None]
        return logits.masked_fill(drop, float("-inf"))

    @staticmethod
    def _top_k(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        """Keep the k best logits of each row (ties with the k-th kept); k = 0 or k >= vocab keeps all."""
        vocab = sorted_logits.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        return sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))

    @staticmethod
    def _top_p(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Keep the smallest prefix of the sorted distribution whose mass reaches p (at least one token);
        rows with p = 1.0 are untouched, so rounding in the cumulative sum cannot cut their tail."""
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        return sorted_logits.masked_fill(drop, float("-inf"))
