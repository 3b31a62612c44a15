"""``glassbox``: the command line.

Subcommands (more arrive with the process tree and the API server):

- ``glassbox serve [MODEL]`` — the OpenAI-compatible API server on the engine tree.
- ``glassbox generate PROMPT...`` — run prompts through the offline ``LLM`` and print the
  completions (vLLM has no exact twin; it is ``LLM.generate`` from a shell).
- ``glassbox ps`` — list running instances from their run directories: each process's
  role, pid, stage, uptime and memory, and the found/expected process count.
- ``glassbox doctor`` — diagnose a running, hung or dead instance: stages, heartbeats,
  crash reports, every process's stack, and a diagnosis with a hint; exit 0 when healthy.
- ``glassbox bench serve`` — load-test a running OpenAI-compatible server and report
  throughput, TTFT, TPOT and ITL (vLLM: ``vllm bench serve``).
- ``glassbox trace FILE`` — read a ``--trace-file`` span file: list its traces, or draw a
  start-up or a request as a waterfall in the terminal.

Flags are ``vllm serve``'s engine flags. The config is validated before anything heavy is
imported; a bad value prints one line naming the flag and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

from engine import __version__


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad value is one line (no usage block): ``prog: error: --flag: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _make_parser() -> argparse.ArgumentParser:
    from engine.cli import bench, doctor, generate, ps, serve, trace

    parser = ArgumentParser(
        prog="glassbox",
        description="Glassbox: a see-through LLM serving engine (the vLLM V1 architecture, watchable).",
        epilog="The live view of a running instance is its own command: engine-top (docs/engine-top.md).",
    )
    parser.add_argument("--version", action="version", version=f"glassbox {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    serve.add_subparser(sub)
    generate.add_subparser(sub)
    ps.add_subparser(sub)
    doctor.add_subparser(sub)
    bench.add_subparser(sub)
    trace.add_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _make_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 2
    subparser = parser._subparsers._group_actions[0].choices[args.command]
    if unknown:  # named by the subcommand, whose --help lists what it takes
        subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from engine import envs

    try:
        envs.validate_all()  # every GLASSBOX_* variable, before anything starts
    except ValueError as e:
        print(f"{subparser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args, subparser)
    except KeyboardInterrupt:
        print(f"{subparser.prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `glassbox ps --json | head`: the reader left; not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        from engine.config import ConfigError
        from engine.utils.processes import EngineDeadError, EngineStartupTimeout

        if isinstance(e, ConfigError):
            # A bad setting found after validation (by the engine core or a worker during
            # start-up, e.g. a KV cache too small): one line naming the flag, exit 2.
            print(f"{subparser.prog}: error: {e}", file=sys.stderr)
            return 2
        if not isinstance(e, (EngineDeadError, EngineStartupTimeout)):
            raise
        # The root cause (which process, which stage, which exception) is printed last.
        what = str(e) if isinstance(e, EngineStartupTimeout) else "the engine died"
        print(f"{subparser.prog}: error: {what}", file=sys.stderr)
        print(e.root_cause, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
