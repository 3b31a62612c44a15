"""``glassbox bench serve``: measure a running OpenAI-compatible server (ours, vLLM's, any).

Mirrors ``vllm bench serve`` (``vllm/benchmarks/serve.py``'s arguments): the same flag names
for the random dataset, the arrival process and the result file, and the same result table.
The work is in ``engine/bench/serve.py``; this file parses and checks the flags, runs it,
prints the table and writes ``--result-json``.

A bad flag is one line naming it and exit status 2 (checked before anything is sent); a
server that cannot be reached is one line and exit status 1; so is a run where no request
succeeded (the table is printed first, with the errors). Imports stay light — no torch, and
httpx only once the flags are good.

Left out (vLLM has them): other datasets and backends, ``--percentile-metrics``, goodput,
``--save-result``'s file naming, ramp-up and profiling flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from engine.cli.help_formatter import DefaultsHelpFormatter

DESCRIPTION = """Benchmark a running OpenAI-compatible server the way `vllm bench serve` does: send
--num-prompts random prompts as streaming completions, at --request-rate (Poisson arrivals;
inf = all at once) with at most --max-concurrency in flight, and report request and token
throughput with TTFT, TPOT and ITL (mean, median, p99)."""


def add_subparser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="Benchmark a running server.",
        description="Benchmarks.",
        formatter_class=DefaultsHelpFormatter,
    )
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", parser_class=type(bench))
    bench.set_defaults(func=lambda args, parser: _help(parser))

    p = bench_sub.add_parser(
        "serve",
        help="Load-test an OpenAI-compatible server.",
        description=DESCRIPTION,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="Server host, with --port (default %(default)s).")
    p.add_argument("--port", type=int, default=8000, help="Server port (default %(default)s).")
    p.add_argument(
        "--base-url", default=None, help="Server URL; overrides --host and --port (e.g. https://host:8443)."
    )
    p.add_argument("--endpoint", default="/v1/completions", help="API route (default %(default)s).")
    p.add_argument("--model", default=None, help="Model name to send (default: the first of GET /v1/models).")
    p.add_argument(
        "--api-key",
        default=None,
        help="Sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, if set).",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="Requests to send (default %(default)s).")
    d = p.add_argument_group("random dataset")
    d.add_argument("--random-input-len", type=int, default=128, help="Prompt tokens (default %(default)s).")
    d.add_argument("--random-output-len", type=int, default=64, help="max_tokens (default %(default)s).")
    d.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Draw lengths uniformly from [len*(1-r), len*(1+r)]; 0 <= r < 1 (default %(default)s).",
    )
    d.add_argument(
        "--tokenizer", default=None, help="Model dir with tokenizer.json: send text prompts, not token ids."
    )
    d.add_argument(
        "--vocab-range",
        type=int,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=None,
        help="Draw prompt token ids from [LOW, HIGH) (default 100 1000; with --tokenizer its vocabulary).",
    )
    d.add_argument("--seed", type=int, default=0, help="Seeds the dataset and the arrivals (default 0).")
    t = p.add_argument_group("traffic")
    t.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Requests per second, Poisson arrivals; inf sends all at once (default inf).",
    )
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 steadier (default 1).",
    )
    t.add_argument(
        "--max-concurrency", type=int, default=None, help="Most requests in flight (default: no limit)."
    )
    t.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Ask the server to generate all max_tokens past EOS (vLLM's ignore_eos; default on).",
    )
    t.add_argument(
        "--timeout", type=float, default=600.0, help="Seconds per request, stream included (default 600)."
    )
    p.add_argument("--result-json", default=None, help="Write settings, metrics and every request here.")
    p.set_defaults(func=lambda args, parser: run(args, p))


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Reject bad values with one line naming the flag (exit 2), before anything is sent."""
    positive = {
        "--num-prompts": args.num_prompts,
        "--random-input-len": args.random_input_len,
        "--random-output-len": args.random_output_len,
        "--request-rate": args.request_rate,
        "--burstiness": args.burstiness,
        "--timeout": args.timeout,
    }
    if args.max_concurrency is not None:
        positive["--max-concurrency"] = args.max_concurrency
    for flag, value in positive.items():
        if not value > 0:  # also catches nan
            parser.error(f"{flag}: must be > 0, got {value}")
    if not 0 <= args.random_range_ratio < 1:
        parser.error(f"--random-range-ratio: must be in [0, 1), got {args.random_range_ratio}")
    if not 0 < args.port < 65536:
        parser.error(f"--port: must be in 1..65535, got {args.port}")
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    elif not args.base_url.startswith(("http://", "https://")):
        parser.error(f"--base-url: must start with http:// or https://, got {args.base_url!r}")
    if not args.endpoint.startswith("/"):
        parser.error(f"--endpoint: must start with '/', got {args.endpoint!r}")
    if args.vocab_range is not None and not 0 <= args.vocab_range[0] < args.vocab_range[1]:
        parser.error(f"--vocab-range: need 0 <= LOW < HIGH, got {args.vocab_range[0]} {args.vocab_range[1]}")
    if args.tokenizer is not None and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        parser.error(f"--tokenizer: no tokenizer.json in {args.tokenizer}")
    if args.endpoint.rstrip("/").endswith("chat/completions") and args.tokenizer is None:
        parser.error("--endpoint: a chat endpoint takes text; pass --tokenizer to build text prompts")
    if args.result_json is not None and not Path(args.result_json).resolve().parent.is_dir():
        parser.error(f"--result-json: no directory {Path(args.result_json).resolve().parent}")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check(args, parser)
    from engine.bench.serve import BenchmarkConfig, BenchmarkError, format_table, run_benchmark

    config = BenchmarkConfig(
        base_url=args.base_url.rstrip("/"),
        endpoint=args.endpoint,
        model=args.model,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        tokenizer=args.tokenizer,
        vocab_range=tuple(args.vocab_range) if args.vocab_range else None,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        timeout=args.timeout,
    )
    print(
        f"Benchmarking {config.base_url}{config.endpoint}: {config.num_prompts} random prompts "
        f"({config.random_input_len} in, {config.random_output_len} out tokens), "
        f"request rate {config.request_rate:g} req/s, max concurrency {config.max_concurrency or 'none'}",
        flush=True,
    )
    try:
        result = run_benchmark(config)
    except (BenchmarkError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=2)
        print(f"Results written to {args.result_json}")
    if result.metrics.completed == 0:
        print(f"{parser.prog}: error: no request succeeded (see the errors above)", file=sys.stderr)
        return 1
    return 0
