"""Structured outputs on the built-in engine: what JSON-schema constraints cost (issue 37).

``.venv/bin/python bench/structured_bench.py [--help]`` (the ``bench`` extra installed, as ``make bench-engines``
does) measures, on the built-in engine (:class:`worker.transformers_engine.TransformersEngine`) called in this
process:

1. throughput: generated tokens per second at concurrency ``--concurrency`` (32) of two sides, ``free`` (no
   constraint) and ``json`` (every request constrained by a JSON schema), in the closed loop of
   bench/serve_bench.py's ``in_process`` (a request is added as soon as a client's previous one finished), each
   round on the same prompts and seeds for both sides, fresh ones every round, the side order alternated (round 1
   free then json, round 2 json then free, ...; ``--rounds``, 2). Reported per side and round: tokens/s,
   TTFT and ITL p50/p99 (bench/loadgen.py's ``summarize``), and the json / free tokens/s ratio of each round and
   its median (the issue's target: at least 0.9);
2. the time to compile a new schema: for three schemas of growing size (a flat object of 3 fields; a nested one
   with arrays and enums, ~20 properties; a generated one of 200 properties), the time a worker pays for a schema
   it has not seen: :func:`common.constraints.grammar` (the grammar text, validated, as the API and the engine
   make it), the first ``LLMatcher`` on the engine's own llguidance tokenizer and that matcher's first mask of
   one row; each cold (a schema text never compiled before: a unique ``title``), median of ``--compile-repeats``
   (5).

The workload looks like traffic: ``--requests`` (64) requests per side and round, prompts of random non-special
token ids whose lengths are a seeded triangular draw (``--prompt-tokens MIN MODE MAX``: 16, 120, 600, as issue
38's mixed workload), at most ``--new-tokens`` (128) new tokens each, sampled at temperature 1 with a seed of the
request's own. A ``json`` request carries one of :data:`SCHEMAS` (request i the i-th modulo 4: a few schemas, as
real clients send), made into a constraint as the API makes it (:func:`api.rules.constraint_of`: compact JSON);
their grammars are compiled in the warm-up, so the measured rounds find them in the engine's cache, as a worker
does once clients have sent them before (the cold cost is section 2's).

The model: bench/engines_bench.py's ~28M-parameter Llama (``--model-dir``, made there once), float32, its passes
compiled as a worker compiles them (``compileModel``; the bench waits for the compile before it measures;
``--eager`` leaves them eager). It declares no EOS token, so a free request always runs to ``--new-tokens``. The
engine ends a request on the model's EOS ids only: a constrained request whose output is complete has a grammar
that allows nothing but the tokenizer's EOS, which this model would then repeat up to ``--new-tokens``; so each
json request names that token as a stop token (``stop_token_ids``) and ends with it, as it would on a model that
declares its EOS. Outputs therefore differ in length between the sides: tokens/s counts the tokens generated (the
closing token included), not requests, and the table gives the mean tokens per request of each side.

Threads: the engine's torch threads are bound as a worker binds them (``--bind auto``: CPU_THREADS_BIND auto's
cores, every usable core but the last, one torch thread each; ``none``: torch's default, unbound), and llguidance's
mask threads, started by the first constrained batch, inherit that placement.

Writes ``structured.md`` and ``structured.json`` to ``--out`` (default bench/out/) and prints the markdown.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

from api.rules import constraint_of  # noqa: E402
from bench_engine import make_prompts  # noqa: E402
from common.constraints import grammar  # noqa: E402
from common.protocol import Constraint, Job, SamplingParams  # noqa: E402
from common.settings import Settings  # noqa: E402
from engines_bench import MODEL_SHAPE, affinity, ensure_bench_model, parameter_count  # noqa: E402
from serve_bench import Workload, _ms, _table, in_process, machine_facts  # noqa: E402
from worker.cpu_threads import auto_cores  # noqa: E402
from worker.engine import PreparedJob  # noqa: E402
from worker.transformers_engine import TransformersEngine  # noqa: E402

SIDES = ("free", "json")
RATIO_TARGET = 0.9  # issue 37: json tokens/s at least 0.9 of free's
TIME_LIMIT = 1800.0  # seconds after which a side's run is cut (in_process's time limit)

# The json side's schemas: objects whose strings and arrays let a model of random weights write for long.
SCHEMAS: tuple[dict[str, Any], ...] = (
    {"type": "object", "properties": {"summary": {"type": "string"}, "score": {"type": "integer"}},
     "required": ["summary", "score"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"},
                                      "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["title", "body", "tags"]},
    {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"},
                                      "sources": {"type": "array", "items": {"type": "string"}}},
     "required": ["answer", "confidence", "sources"]},
    {"type": "object", "properties": {"name": {"type": "string"},
                                      "sentiment": {"enum": ["positive", "neutral", "negative"]},
                                      "reasons": {"type": "array", "items": {"type": "string"}}},
     "required": ["name", "sentiment", "reasons"]},
)


def as_constraint(schema: dict[str, Any]) -> Constraint:
    """The schema as the API's routes make it into a constraint (compact JSON)."""
    return constraint_of("response_format", "json", schema)


# -- the engine ------------------------------------------------------------------------------------


class ShapedEngine(TransformersEngine):
    """The built-in engine, unchanged but for the jobs bench/serve_bench.py's ``in_process`` queues (greedy, free,
    numbered by their prompt's index): each takes the sampling parameters and constraint that :attr:`shapes` gives
    its request id, the side's."""

    shapes: dict[str, tuple[SamplingParams, Constraint | None]]

    def add(self, job: Job | PreparedJob) -> None:
        if isinstance(job, Job) and job.request_id in self.shapes:
            params, constraint = self.shapes[job.request_id]
            job = job.model_copy(update={"params": params, "constraint": constraint})
        super().add(job)


def load_engine(model: Path, max_batch: int, eager: bool) -> ShapedEngine:
    """The engine as a worker loads it (float32, its passes compiled unless ``eager``), once its compile ended."""
    engine = ShapedEngine.load(Settings(model_path=model, dtype="float32", max_batch_size=max_batch,
                                        compile_model=not eager))
    assert isinstance(engine, ShapedEngine)  # load() makes its own class
    engine.shapes = {}
    if engine._forward.step is not None:
        begun = time.monotonic()
        engine._forward.step.wait_compiled()
        print(f"model passes {'compiled' if engine.compiled else 'eager'} "
              f"({time.monotonic() - begun:.0f} s waited)", flush=True)
    return engine


# -- section 1: tokens/s ---------------------------------------------------------------------------


def prompt_lengths(count: int, low: int, mode: int, high: int, seed: int) -> list[int]:
    """Seeded triangular prompt lengths (tokens)."""
    rng = random.Random(seed)
    return [round(rng.triangular(low, high, mode)) for _ in range(count)]


def side_shapes(side: str, count: int, new_tokens: int, first_seed: int,
                stop_ids: list[int]) -> dict[str, tuple[SamplingParams, Constraint | None]]:
    """Each request's sampling parameters and constraint on a side: temperature 1, seed ``first_seed + i``;
    json: schema i modulo 4, ended by ``stop_ids`` (see the module docstring)."""
    shapes: dict[str, tuple[SamplingParams, Constraint | None]] = {}
    for index in range(count):
        constrained = side == "json"
        params = SamplingParams(do_sample=True, temperature=1.0, seed=first_seed + index, max_new_tokens=new_tokens,
                                stop_token_ids=stop_ids if constrained else [])
        shapes[str(index)] = (params, as_constraint(SCHEMAS[index % len(SCHEMAS)]) if constrained else None)
    return shapes


def run_side(engine: ShapedEngine, side: str, workload: Workload, first_seed: int, concurrency: int,
             stop_ids: list[int]) -> dict[str, Any]:
    """One side over the workload: in_process's closed loop, its summarize() stats and the tokens per request."""
    engine.shapes = side_shapes(side, len(workload.prompt_ids), workload.new_tokens, first_seed, stop_ids)
    stats = in_process(engine, workload, concurrency, TIME_LIMIT)
    ok = stats["requests"] - stats["errors"]
    tokens = round(stats["tokens_per_s"] * stats["wall_s"])
    return {**stats, "tokens": tokens, "tokens_per_request": tokens / ok if ok else None}


def measure(args: argparse.Namespace, engine: ShapedEngine, prompts: list[list[int]],
            stop_ids: list[int]) -> list[dict[str, Any]]:
    """Every round both sides back to back on the round's prompts and seeds: free first in rounds 1, 3, ..., json
    first in rounds 2, 4, ...."""
    runs = []
    for number in range(args.rounds):
        prompt_ids = prompts[number * args.requests:(number + 1) * args.requests]
        workload = Workload([], prompt_ids, max(map(len, prompt_ids)), args.new_tokens)
        first_seed = 1_000_000 * (number + 1)
        for side in SIDES if number % 2 == 0 else SIDES[::-1]:
            load = os.getloadavg()[0]
            stats = run_side(engine, side, workload, first_seed, args.concurrency, stop_ids)
            runs.append({"round": number + 1, "side": side, **stats, "load_average_before": round(load, 2)})
            print(f"round {number + 1} {side:<4} {stats['tokens_per_s']:7.1f} tokens/s  "
                  f"{stats['tokens_per_request'] or 0:.1f} tokens/request  TTFT p50 {_ms(stats['ttft_p50_ms'])} ms  "
                  f"ITL p50 {_ms(stats['itl_p50_ms'])} ms  errors {stats['errors']}", flush=True)
    return runs


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """json / free tokens/s within each round."""
    by_round: dict[int, dict[str, float]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["side"]] = run["tokens_per_s"]
    return [{"round": number, "json_over_free": sides["json"] / sides["free"]}
            for number, sides in sorted(by_round.items()) if sides.get("free") and "json" in sides]


# -- section 2: compile time of a new schema -------------------------------------------------------


def flat_schema() -> dict[str, Any]:
    """A flat object of 3 fields."""
    return {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                             "active": {"type": "boolean"}},
            "required": ["name", "age", "active"]}


def nested_schema() -> dict[str, Any]:
    """An order: nested objects, arrays and enums, 20 properties in all."""
    address = {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"}, "postcode": {"type": "string"},
        "country": {"enum": ["DE", "FR", "GB", "IT", "NL", "US"]}}, "required": ["street", "city", "country"]}
    item = {"type": "object", "properties": {
        "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}, "price": {"type": "number"},
        "category": {"enum": ["book", "food", "tool", "toy", "other"]}}, "required": ["sku", "quantity", "price"]}
    return {"type": "object", "properties": {
        "id": {"type": "string"},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                                      "address": address}, "required": ["name", "address"]},
        "items": {"type": "array", "items": item, "minItems": 1},
        "status": {"enum": ["new", "paid", "shipped", "delivered", "cancelled"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "total": {"type": "number"}, "gift": {"type": "boolean"}, "notes": {"type": "string"}},
        "required": ["id", "customer", "items", "status", "total"]}


def large_schema(properties: int = 200) -> dict[str, Any]:
    """A generated object of ``properties`` fields of every kind, one in four required."""
    kinds: list[dict[str, Any]] = [
        {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
        {"enum": ["alpha", "beta", "gamma", "delta"]}, {"type": "array", "items": {"type": "string"}},
        {"type": "object", "properties": {"value": {"type": "number"}, "unit": {"type": "string"}},
         "required": ["value"]},
    ]
    fields = {f"field_{i:03d}": kinds[i % len(kinds)] for i in range(properties)}
    return {"type": "object", "properties": fields, "required": [name for i, name in enumerate(fields) if i % 4 == 0]}


COMPILE_SCHEMAS: tuple[tuple[str, Callable[[], dict[str, Any]]], ...] = (
    ("flat, 3 fields", flat_schema),
    ("nested, arrays and enums", nested_schema),
    ("generated, 200 fields (some nested)", large_schema),
)


def property_count(schema: Any) -> int:
    """Properties declared anywhere in the schema."""
    if isinstance(schema, dict):
        own = len(schema["properties"]) if isinstance(schema.get("properties"), dict) else 0
        return own + sum(property_count(value) for value in schema.values())
    if isinstance(schema, list):
        return sum(property_count(value) for value in schema)
    return 0


def compile_once(tokenizer: LLTokenizer, schema: dict[str, Any]) -> dict[str, float]:
    """A never-seen copy of the schema (a unique title) through what a worker pays for it: its grammar text,
    a matcher of it and the matcher's first mask; ms of each."""
    constraint = as_constraint({"title": f"bench-{uuid.uuid4().hex}", **schema})
    started = time.perf_counter()
    text = grammar(constraint)
    compiled = time.perf_counter()
    matcher = LLMatcher(tokenizer, text)
    made = time.perf_counter()
    bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
    fill_next_token_bitmask(matcher, bitmask, 0)
    masked = time.perf_counter()
    if matcher.is_error():
        raise RuntimeError(f"the schema's matcher failed: {matcher.get_error()}")
    return {"grammar_ms": 1000 * (compiled - started), "matcher_ms": 1000 * (made - compiled),
            "first_mask_ms": 1000 * (masked - made), "total_ms": 1000 * (masked - started)}


def compile_times(tokenizer: LLTokenizer, repeats: int) -> list[dict[str, Any]]:
    """Section 2: each schema ``repeats`` times cold; medians, and the total's min and max."""
    compile_once(tokenizer, flat_schema())  # llguidance's first-call costs, off the clock
    rows = []
    for name, make in COMPILE_SCHEMAS:
        schema = make()
        times = [compile_once(tokenizer, schema) for _ in range(repeats)]
        medians = {key: statistics.median(t[key] for t in times) for key in times[0]}
        totals = [t["total_ms"] for t in times]
        rows.append({"schema": name, "properties": property_count(schema),
                     "schema_bytes": len(as_constraint(schema).value), **medians,
                     "total_min_ms": min(totals), "total_max_ms": max(totals), "runs": times})
        print(f"compile {name}: {medians['total_ms']:.1f} ms (median of {repeats})", flush=True)
    return rows


# -- the report ------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    config, facts, work = report["config"], report["machine"], report["workload"]
    ratio_values = [row["json_over_free"] for row in report["ratios"]]
    median = statistics.median(ratio_values) if ratio_values else None
    target = ("- no round ran both sides" if median is None else
              f"- json / free tokens/s at concurrency {config['concurrency']} >= {RATIO_TARGET}: **{median:.2f}** "
              f"(median; rounds: {', '.join(f'{v:.2f}' for v in ratio_values)}), "
              f"{'met' if median >= RATIO_TARGET else 'NOT met'}")
    runs = [[run["round"], run["side"], run["requests"], run["errors"], run["tokens"],
             "–" if run["tokens_per_request"] is None else f"{run['tokens_per_request']:.1f}",
             f"{run['tokens_per_s']:.1f}", _ms(run["ttft_p50_ms"]), _ms(run["ttft_p99_ms"]), _ms(run["itl_p50_ms"]),
             _ms(run["itl_p99_ms"]), f"{run['wall_s']:.1f}"] for run in report["runs"]]
    runs += [[row["round"], "json / free", "", "", "", "", f"**{row['json_over_free']:.2f}**", "", "", "", "", ""]
             for row in report["ratios"]]
    compile_rows = [[row["schema"], row["properties"], row["schema_bytes"], f"{row['grammar_ms']:.1f}",
                     f"{row['matcher_ms']:.1f}", f"{row['first_mask_ms']:.2f}", f"**{row['total_ms']:.1f}**",
                     f"{row['total_min_ms']:.1f}–{row['total_max_ms']:.1f}"] for row in report["compile"]]
    lines = [
        "# Structured outputs benchmark (built-in engine)", "",
        f"Command: `{config['command']}`", "",
        f"Machine: {facts['nproc']} cores ({facts['cpu_model']}), {facts['ram_gib']} GiB RAM, "
        f"Python {facts['python']}, torch {facts['torch']}, transformers {facts['transformers']}, "
        f"llguidance {facts['llguidance']}, {facts['date']}, commit {facts['git_commit']}, load average at start "
        f"{' / '.join(str(x) for x in facts['load_average_at_start'])}.", "",
        f"Workload: a {report['model']['parameters'] / 1e6:.1f}M-parameter Llama, float32, passes "
        f"{'compiled' if report['model']['compiled'] else 'eager'}, torch threads on cores "
        f"{report['bind_cpus'] or 'unbound'}; {config['requests']} requests per side and round, closed loop at "
        f"concurrency {config['concurrency']} (max batch size {config['concurrency']}); prompts of random token ids, "
        f"lengths triangular {work['min']}–{work['max']} (mode {work['mode']}; this run's median {work['median']}, "
        f"mean {work['mean']:.0f}), at most {config['new_tokens']} new tokens, sampled at temperature 1 with a seed "
        f"per request, the same prompts and seeds for both sides of a round and fresh ones every round; "
        f"rounds: {config['rounds']}, round 1 free then json, the order reversed every other round. free: no "
        f"constraint, every request runs to {config['new_tokens']} tokens (the model has no EOS). json: every request "
        f"constrained by one of {len(SCHEMAS)} schemas (compact JSON, as the API makes them; compiled in the warm-up), "
        f"ended by its grammar's EOS (named as a stop token) or at {config['new_tokens']} tokens. Latencies in ms.", "",
        "## Target", "", target, "",
        "## Tokens/s per side and round", "",
        *_table(["round", "side", "requests", "errors", "tokens", "tokens/request", "tokens/s", "TTFT p50",
                 "TTFT p99", "ITL p50", "ITL p99", "wall s"], runs), "",
        f"## Compile time of a new schema (cold, median of {config['compile_repeats']})", "",
        "`grammar()`: common.constraints.grammar (the grammar text, validated); `LLMatcher`: the matcher on the "
        "engine's llguidance tokenizer; first mask: its `fill_next_token_bitmask` of one row. The llguidance "
        f"tokenizer itself is made once per worker (here {report['grammar_tokenizer_ms']:.0f} ms).", "",
        *_table(["schema", "properties", "schema bytes", "grammar() ms", "LLMatcher ms", "first mask ms", "total ms",
                 "total min–max"], compile_rows), "",
        f"Took {report['duration_s']:.0f} s.", "",
    ]
    errors = [(run["round"], run["side"], run["first_error"]) for run in report["runs"] if run["first_error"]]
    if errors:
        lines += ["## First error of each run that had errors", "",
                  *(f"- round {r} {side}: {message}" for r, side, message in errors), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64, help="requests per side and round")
    parser.add_argument("--prompt-tokens", type=int, nargs=3, default=[16, 120, 600], metavar=("MIN", "MODE", "MAX"),
                        help="prompt lengths, a triangular draw")
    parser.add_argument("--new-tokens", type=int, default=128, help="max new tokens per request")
    parser.add_argument("--compile-repeats", type=int, default=5, help="cold compiles per schema (section 2)")
    parser.add_argument("--bind", choices=["auto", "none"], default="auto",
                        help="torch threads: on the cores a worker takes (CPU_THREADS_BIND auto), or unbound")
    parser.add_argument("--eager", action="store_true", help="leave the model's passes eager (no torch.compile)")
    parser.add_argument("--model-dir", type=Path, default=BENCH / "out" / "models" / "llama-28m")
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    args = parser.parse_args(argv)
    low, mode, high = args.prompt_tokens
    if not low <= mode <= high:
        parser.error("--prompt-tokens wants MIN <= MODE <= MAX")

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()  # load average at start, before anything of this run
    facts |= {"transformers": importlib.metadata.version("transformers"),
              "llguidance": importlib.metadata.version("llguidance")}
    model = ensure_bench_model(args.model_dir)
    cpus = auto_cores(os.sched_getaffinity(0)) if args.bind == "auto" else []
    if cpus:  # before the load, as a worker places its threads: compiled passes are guarded on the thread count
        torch.set_num_threads(len(cpus))
    engine = load_engine(model, args.concurrency, args.eager)
    tokenizer = engine.tokenizer
    count = args.rounds * args.requests
    ids = make_prompts(tokenizer, len(tokenizer), count + 8, high)
    lengths = prompt_lengths(count + 8, low, mode, high, seed=0)
    prompts = [prompt[:length] for prompt, length in zip(ids, lengths, strict=True)]
    report: dict[str, Any] = {
        "config": {"command": " ".join([".venv/bin/python", "bench/structured_bench.py", *sys.argv[1:]]),
                   **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}},
        "machine": facts,
        "model": {"path": str(model), "parameters": parameter_count(model), "shape": MODEL_SHAPE,
                  "compiled": engine.compiled},
        "workload": {"min": low, "mode": mode, "max": high, "median": statistics.median(lengths[:count]),
                     "mean": statistics.mean(lengths[:count])},
        "schemas": list(SCHEMAS),
        "bind_cpus": cpus,
    }
    print(f"command: {report['config']['command']}\nmachine: {facts}\nmodel: {report['model']}", flush=True)

    with affinity(cpus):  # nothing when unbound
        begun = time.perf_counter()
        grammar_tokenizer = engine._grammar_tokenizer  # made once per worker, by its first constrained request
        report["grammar_tokenizer_ms"] = 1000 * (time.perf_counter() - begun)
        stop_ids = [grammar_tokenizer.eos_token]
        warm = Workload([], prompts[count:], high, 16)  # first-call costs and the schemas' grammars, off the clock
        for side in SIDES:
            stats = run_side(engine, side, warm, 0, min(4, args.concurrency), stop_ids)
            if stats["errors"]:
                raise RuntimeError(f"warm-up ({side}) failed: {stats['first_error']}")
        report["runs"] = measure(args, engine, prompts, stop_ids)
        report["ratios"] = ratios(report["runs"])
        report["compile"] = compile_times(grammar_tokenizer, args.compile_repeats)
    engine.close()
    report["duration_s"] = time.monotonic() - started

    (args.out / "structured.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "structured.md").write_text(text)
    print(text)
    print(f"\nwrote {args.out}/structured.md, structured.json in {report['duration_s']:.0f} s")


if __name__ == "__main__":
    main()
