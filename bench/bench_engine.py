"""Throughput of the continuous-batching engine against static-batch ``model.generate``, in one run.

Every configuration serves the same N requests (random prompts of exactly ``--prompt-len`` tokens, greedy,
exactly ``--new-tokens`` new tokens each) and reports generated tokens per second of wall time:

* engine at concurrency c: all N requests are added at once to an engine with ``max_batch_size = c``
  and it is stepped until idle; c = 1 is sequential one-at-a-time serving;
* ``model.generate`` with static batches of b prompts (no padding: the prompts have equal lengths).

So that every request generates the full count on both paths, EOS is switched off in the loaded model's
``config`` and ``generation_config`` before anything runs (the engine reads its EOS ids from there) and
``generate`` also gets ``min_new_tokens``. Each configuration runs ``--repeat`` times, round-robin, and
the fastest run is reported (this machine may be shared). Both paths share one model, prepared as ``Engine.load`` does
(:func:`worker.attention.use_padded_attention`); without padding, ``generate`` never passes a mask, and
that attention function then runs transformers' own SDPA code. The torch thread count is torch's default
unless ``--threads`` is given. Usage: ``.venv/bin/python bench/bench_engine.py [--help]``.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.protocol import Job, SamplingParams  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.attention import use_padded_attention  # noqa: E402
from worker.tiny_model import make_tiny_model  # noqa: E402
from worker.transformers_engine import TransformersEngine  # noqa: E402


def make_prompts(tokenizer: PreTrainedTokenizerBase, vocab_size: int, count: int, length: int) -> list[list[int]]:
    """Random non-special token ids (seeded), so every prompt has exactly ``length`` tokens."""
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    ordinary = [token for token in range(vocab_size) if token not in special]
    return [rng.choices(ordinary, k=length) for _ in range(count)]


def run_engine(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], new_tokens: int,
    concurrency: int, prefill_batch: int,
) -> int:
    """Serve all prompts through one engine; return the number of generated tokens."""
    settings = Settings(
        model_path=Path("unused"), max_batch_size=concurrency, max_prefill_batch_size=prefill_batch
    )
    engine = TransformersEngine(model, tokenizer, settings)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(seed=i, max_new_tokens=new_tokens)
        engine.add(Job(request_id=str(i), model="bench", reply_channel="-", input_ids=prompt, params=params,
                       enqueued_at=time.time()))
    generated = 0
    while not engine.idle:
        generated += sum(1 for output in engine.step())
    return generated


@torch.inference_mode()
def run_generate(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, batch: int) -> int:
    """Static batches through ``model.generate``; return the number of generated tokens."""
    generated = 0
    for start in range(0, len(prompts), batch):
        input_ids = torch.tensor(prompts[start : start + batch], device=model.device)
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        )
        generated += output[:, input_ids.shape[1] :].numel()
    return generated


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, help="a Hugging Face model folder (default: a fresh tiny model)")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--requests", type=int, default=32, help="requests served by every configuration")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="engine max_batch_size values")
    parser.add_argument("--static-batch", type=int, nargs="+", default=[8, 32], help="model.generate batch sizes")
    parser.add_argument("--prefill-batch", type=int, default=Settings.model_fields["max_prefill_batch_size"].default,
                        help="engine max_prefill_batch_size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of every configuration; the best is reported")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        path = args.model_path or make_tiny_model(Path(scratch) / "tiny")
        model = AutoModelForCausalLM.from_pretrained(path).to(args.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    use_padded_attention(model)
    for config in (model.config, model.generation_config):
        config.eos_token_id = None
    prompts = make_prompts(tokenizer, model.config.vocab_size, args.requests, args.prompt_len)

    run_engine(model, tokenizer, prompts[:4], 8, 4, args.prefill_batch)  # warm-up of both paths
    run_generate(model, prompts[:4], 8, 4)

    runs: dict[str, Callable[[], int]] = {}
    for concurrency in args.concurrency:
        label = f"engine, concurrency {concurrency}" + (" (= sequential serving)" if concurrency == 1 else "")
        runs[label] = functools.partial(
            run_engine, model, tokenizer, prompts, args.new_tokens, concurrency, args.prefill_batch
        )
    for batch in args.static_batch:
        runs[f"static model.generate, batch {batch}"] = functools.partial(
            run_generate, model, prompts, args.new_tokens, batch
        )
    # Round-robin repeats, best time kept: a burst of load from other processes then hits one repeat of
    # every configuration alike instead of all repeats of one of them.
    best: dict[str, tuple[int, float]] = {}
    for _ in range(args.repeat):
        for label, run in runs.items():
            start = time.perf_counter()
            tokens = run()
            seconds = time.perf_counter() - start
            if label not in best or seconds < best[label][1]:
                best[label] = (tokens, seconds)

    rate = {label: tokens / seconds for label, (tokens, seconds) in best.items()}
    print(f"\n{args.requests} requests x {args.prompt_len} prompt tokens -> {args.new_tokens} new tokens, greedy, "
          f"device {args.device}, torch threads {torch.get_num_threads()}, best of {args.repeat}\n")
    print("| configuration | generated tokens | seconds | tokens/s |")
    print("|---|---:|---:|---:|")
    for label, (tokens, seconds) in best.items():
        print(f"| {label} | {tokens} | {seconds:.2f} | {rate[label]:.1f} |")
    print()
    # the engine's runs come first in ``runs``, one per concurrency; the static ones follow
    engine = {c: rate[label] for c, label in zip(args.concurrency, runs, strict=False)}
    static = {b: rate[f"static model.generate, batch {b}"] for b in args.static_batch}
    for concurrency in sorted(set(engine) & set(static)):
        print(f"engine @ {concurrency} / static generate @ {concurrency}: "
              f"{engine[concurrency] / static[concurrency]:.2f}")
    if 1 in engine:
        top = max(engine)
        print(f"engine @ {top} / sequential serving: {engine[top] / engine[1]:.1f}x")

if __name__ == "__main__":
    main()
