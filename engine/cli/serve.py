"""``glassbox serve [MODEL]``: the OpenAI-compatible API server on the engine tree.

Flags are ``vllm serve``'s: every engine flag, plus ``--host``, ``--port``, ``--api-key``,
``--served-model-name``, ``--allowed-origins``, ``--uvicorn-log-level``. The whole config
is validated first; a bad value (or a port already in use) is one line and exit 2, with
nothing started.
"""

from __future__ import annotations

import argparse
import json
import signal

from engine.cli.help_formatter import DefaultsHelpFormatter
from engine.distributed.topology import ProcessRole
from engine.engine_args import EngineArgs

# limits.DEFAULT_MAX_REQUEST_BODY_BYTES (not imported: that module pulls in the HTTP stack).
DEFAULT_MAX_REQUEST_BODY_BYTES = 10 * 1024 * 1024

# The default tree's titles, named by the topology plan's roles.
_API, _CORE, _WORKER = (r.title for r in (ProcessRole.api_server(0), ProcessRole.engine_core(0),
                                          ProcessRole.worker(0, 0, 0)))  # fmt: skip
DESCRIPTION = f"""Serve a model over an OpenAI-compatible HTTP API (/v1/completions,
/v1/chat/completions, /v1/models, ...). By default starts three processes: {_API}
(this one: HTTP, tokenization, streaming), {_CORE} (scheduler, KV cache) and
{_WORKER} (the model). With parallelism: A API servers + DP engine cores +
DP x PP x TP workers (+ 1 DPCoordinator when DP > 1). Uses the bundled tiny model
unless MODEL is given. Multi-node data parallelism: the head serves with
--data-parallel-size-local below -dp and --data-parallel-address; each other node runs
--headless (its engine cores only), see docs/multi-node.md."""

EXIT_STATUS = """exit status:
  0    stopped by SIGTERM, or by Ctrl-C once serving (the whole tree stopped cleanly)
  1    the engine died (the root cause is printed last)
  2    a bad flag or setting, found before or during start-up (one line naming the flag)
  130  interrupted by Ctrl-C during start-up"""


def _json_origins(text: str) -> list[str]:
    """``--allowed-origins``: a JSON list of origin strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of origins, e.g. '[\"http://localhost:3000\"]', got {text!r}"
        )
    return value


def _json_list(flag: str, example: str):
    """A parser for ``flag``: a JSON list of strings."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(
                f"must be a JSON list of strings, e.g. '{example}', got {text!r}"
            )
        return value

    parse.__name__ = flag  # argparse names the type in its errors
    return parse


def _non_negative_int(text: str) -> int:
    """``--max-request-body-bytes``: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _at_least_one(text: str) -> int:
    """``--api-server-count``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """``--http-header-timeout``, ``--http-body-timeout``: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _whole_seconds(text: str) -> int:
    """``--shutdown-timeout``: a whole number of seconds >= 0 (vLLM's type)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds >= 0, got {text!r}")
    return value


def add_subparser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description=DESCRIPTION,
        epilog=EXIT_STATUS,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="Model directory (or use --model)."
    )
    g = p.add_argument_group("Server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
    g.add_argument(
        "--port",
        type=int,
        default=8000,
        help="Port to listen on; 0 picks a free one (written to the log and the manifest).",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="Require this key (Authorization: Bearer ...) on /v1/* (see --api-key-scope); also "
        "GLASSBOX_API_KEY.",
    )
    g.add_argument(
        "--allowed-origins",
        type=_json_origins,
        default=None,
        help="CORS origins as JSON, e.g. '[\"http://localhost:3000\"]'. Default: none, so a "
        'web page from another origin cannot use the server (vLLM\'s default is ["*"]).',
    )
    g.add_argument(
        "--allowed-methods",
        type=_json_list("--allowed-methods", '["GET", "POST"]'),
        default=None,
        help='CORS methods as JSON (default ["*"]); only with --allowed-origins.',
    )
    g.add_argument(
        "--allowed-headers",
        type=_json_list("--allowed-headers", '["Authorization", "Content-Type"]'),
        default=None,
        help='CORS request headers as JSON (default ["*"]); only with --allowed-origins.',
    )
    g.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: let pages of the allowed origins send cookies and credentials.",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Completions' and chats' usage say how many prompt tokens came from the prefix "
        "cache: prompt_tokens_details.cached_tokens, present when it is not 0 (as vLLM).",
    )
    g.add_argument(
        "--api-key-scope",
        choices=("v1", "all"),
        default="v1",
        help="What --api-key guards: v1 = /v1/* only, as vLLM (/tokenize, /metrics, ... stay "
        "open); all = every route but /health and /ping.",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=_non_negative_int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Largest request body accepted; a larger one gets a 413 before it is read whole. 0: no limit.",
    )
    g.add_argument(
        "--api-server-count",
        "-asc",
        type=_at_least_one,
        default=None,
        help="API server processes sharing the listening socket (each talks to every engine "
        "core); default: the data-parallel size on this node (--data-parallel-size-local), as vLLM.",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="Log level of uvicorn's own lines (access log at info).",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=_whole_seconds,
        default=0,
        help="Seconds SIGTERM lets requests in flight finish (new connections are refused "
        "meanwhile); those still running then end with a 503 (a stream: an error event and "
        "[DONE]) and the server exits 0. 0, as vLLM: end them at once.",
    )
    g.add_argument(
        "--http-header-timeout",
        type=_seconds,
        default=10.0,
        help="Seconds a client has to send a request's headers (from connecting, or from the "
        "request's first byte on a kept-alive connection); then 408 and the connection is closed.",
    )
    g.add_argument(
        "--http-body-timeout",
        type=_seconds,
        default=30.0,
        help="Seconds a client has to send a request's body once its headers arrived; then 408 "
        "and the connection is closed.",
    )
    EngineArgs.add_cli_args(p, serving=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine import envs
    from engine.config import ConfigError
    from engine.entrypoints.openai.api_server import PortInUseError, ServerArgs, bind_socket
    from tracing import catalogue, stage

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; give one")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        parser.error(f"--port: invalid value {args.port} (must be in 0..65535)")
    from tracing.faults import arm_before_config

    # Until the start-up installs its own handlers, a SIGTERM is a clean stop (exit 0), not
    # death by the signal: nothing has been started yet.
    signal.signal(signal.SIGTERM, _clean_exit)
    arm_before_config(ProcessRole.api_server(0).name, args.inject_fault)
    with stage(catalogue.CLI_VALIDATE_CONFIG):
        try:
            config = EngineArgs.from_cli_args(args).create_engine_config(usage_context="serve")
        except ConfigError as e:
            parser.error(str(e))
    try:
        from engine.distributed import topology

        headless = config.parallel_config.headless
        if headless and args.api_server_count is not None:
            parser.error(
                "--api-server-count: a --headless node runs no API server (the head's serve its ranks)"
            )
        tree = topology.plan(config, frontend="headless" if headless else "serve",
                             api_server_count=args.api_server_count)  # fmt: skip
        tree.check_fault_targets(config.observability_config.inject_fault)
    except ValueError as e:
        parser.error(f"{'--inject-fault' if args.inject_fault else 'GLASSBOX_FAULT'}: {e}")
    if args.inject_fault:  # --inject-fault: every process of the tree inherits it (docs/faults.md)
        import os

        os.environ["GLASSBOX_FAULT"] = config.observability_config.inject_fault
    if config.parallel_config.headless:  # engine cores only; they join the head over TCP
        from engine.entrypoints.headless import run_headless

        return run_headless(config)
    # Bind before anything is spawned: a taken port fails here, in a second.
    try:
        sock = bind_socket(args.host, args.port)
    except PortInUseError as e:
        parser.error(f"{e.flag}: {e}")
    from engine.entrypoints.openai.api_server import run_server

    server_args = ServerArgs(
        host=args.host,
        port=args.port,
        api_key=args.api_key or envs.GLASSBOX_API_KEY,
        served_model_name=args.served_model_name,
        allowed_origins=args.allowed_origins,
        uvicorn_log_level=args.uvicorn_log_level,
        api_server_count=args.api_server_count,
        shutdown_timeout=args.shutdown_timeout,
        http_header_timeout=args.http_header_timeout,
        http_body_timeout=args.http_body_timeout,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        api_key_scope=args.api_key_scope,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    return run_server(config, server_args, sock)


def _clean_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)
