"""``glassbox generate``: prompts in, completions out, through the offline ``LLM``."""

from __future__ import annotations

import argparse
import signal
import sys

from engine.cli.help_formatter import DefaultsHelpFormatter
from engine.engine_args import EngineArgs

DESCRIPTION = """Generate completions for PROMPT(s) with the offline engine (the same scheduler,
KV cache and worker lifecycle as the server) and print them. Uses the bundled tiny model
unless --model is given: trained on Python's standard-library docstrings, it continues text in
that style but does not follow chat instructions."""


EXIT_STATUS = """exit status:
  0    every prompt was answered
  1    the engine died (the root cause is printed last)
  2    a bad flag or setting, found before or during start-up (one line naming the flag)
  130  interrupted by Ctrl-C
  143  stopped by SIGTERM (the engine's processes are stopped too)"""


def add_subparser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="Generate text offline from prompts.",
        description=DESCRIPTION,
        epilog=EXIT_STATUS,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="Prompt text (several allowed).")
    p.add_argument("--prompts-file", help="Read more prompts from this file, one per line.")
    p.add_argument(
        "--chat", action="store_true", help="Wrap each prompt as a user message in the chat template."
    )
    s = p.add_argument_group("SamplingParams")
    s.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt (default 64).")
    s.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the model's generation_config, else 1.0).",
    )
    s.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="Nucleus sampling mass, in (0, 1] (default: the model's, else 1.0).",
    )
    s.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="Keep the k likeliest tokens; 0 = off (default: the model's, else 0).",
    )
    s.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="Drop tokens below min_p × the top probability (default: the model's, else 0.0).",
    )
    s.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    s.add_argument(
        "--sampling-seed", type=int, default=None, help="Per-request seed for reproducible sampling."
    )
    s.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    s.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS.")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine.config import ConfigError
    from tracing import catalogue, stage

    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            parser.error(f"--prompts-file: {e}")
    if not prompts:
        parser.error("give at least one PROMPT (or --prompts-file)")
    flags = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
             "seed": "--sampling-seed", "max_tokens": "--max-tokens", "n": "--n", "stop": "--stop"}  # fmt: skip
    # Validate everything — engine flags and sampling flags — before starting the engine.
    from engine.distributed.topology import ProcessRole
    from tracing.faults import arm_before_config

    # Until the start-up installs its own handlers, a SIGTERM is a clean stop (exit 0), not
    # death by the signal: nothing has been started yet.
    signal.signal(signal.SIGTERM, _clean_exit)
    arm_before_config(ProcessRole.frontend().name, args.inject_fault)
    with stage(catalogue.CLI_VALIDATE_CONFIG):
        engine_args = EngineArgs.from_cli_args(args)
        try:
            config = engine_args.create_engine_config()
        except ConfigError as e:
            parser.error(str(e))
        if config.model_config.runner_type != "generate":  # before any engine starts
            parser.error(f"--runner {config.model_config.runner_type}: glassbox generate generates text; "
                         "embed with LLM.embed or glassbox serve --runner pooling")  # fmt: skip
        from engine.sampling_params import SamplingParams

        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                    "seed": args.sampling_seed}  # fmt: skip
        try:
            params = SamplingParams.from_defaults(
                config.model_config.get_diff_sampling_param(),
                max_tokens=args.max_tokens,
                n=args.n,
                stop=args.stop,
                ignore_eos=args.ignore_eos,
                **{k: v for k, v in sampling.items() if v is not None},
            )
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            parser.error(f"{flags.get(field, field)}: {e}")
    from engine.entrypoints.llm import LLM

    try:
        llm = LLM(**vars(engine_args))
    except ValueError as e:  # e.g. the KV budget cannot hold one request
        parser.error(str(e))
    with llm:
        try:
            if args.chat:
                conversations = [[{"role": "user", "content": p}] for p in prompts]
                outputs = llm.chat(conversations, params, use_tqdm=_progress(len(prompts)))
            else:
                outputs = llm.generate(prompts, params, use_tqdm=_progress(len(prompts)))
        except ValueError as e:
            parser.error(str(e))
    _print_outputs(prompts, outputs, chat=args.chat)
    return 0


def _progress(total: int):
    """A Rich progress bar on stderr for many prompts; None for one."""
    if total < 2:
        return False
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("Processed prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True,
    )  # fmt: skip
    task = progress.add_task("generate", total=total)
    progress.start()

    def update(done: int, total_: int) -> None:
        progress.update(task, completed=done)
        if done >= total_:
            progress.stop()

    return update


def _print_outputs(prompts: list[str], outputs, chat: bool = False) -> None:
    """A completion continues its prompt, so it is printed glued to it (prompt in bold);
    a chat reply is not a continuation, so both turns are labelled on their own lines."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    for prompt, out in zip(prompts, outputs):
        if chat:
            console.print(f"[bold]user:[/bold] {escape(prompt)}")
        for completion in out.outputs:
            tag = f" [{completion.index}]" if len(out.outputs) > 1 else ""
            if chat:
                console.print(f"[bold]assistant{tag}:[/bold] [cyan]{escape(completion.text)}[/cyan]")
            else:
                console.print(f"[bold]{escape(prompt)}[/bold]{tag}[cyan]{escape(completion.text)}[/cyan]")
            console.print(
                f"[dim]({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})[/dim]"
            )


def _clean_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)
