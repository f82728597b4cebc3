"""`specexec serve`: its arguments, and the entry point that loads the models and runs uvicorn.

Importing this module needs nothing beyond specexec itself, so the CLI can offer the subcommand even
where the `server` extra is not installed; `serve` says what to install.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import socket
import sys
from pathlib import Path

from specexec.cli_args import EXIT_FAILURE, non_negative_int, pair_spec, positive_int
from specexec.loading import load_pair
from specexec.server.limits import DEFAULT_MAX_TOKENS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 16
DEFAULT_PREFIX_CACHE_MB = 1024
_INSTALL_HINT = "pip install 'specexec[server]'"


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own options (the model and method options come from the CLI's shared helpers)."""
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPECEXEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $SPECEXEC_API_KEY; none = no check)",
    )
    parser.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests that may wait while one generates; more get 429 (default {DEFAULT_MAX_QUEUE})",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="most tokens of prompt plus completion per request (default: the model's context window)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        help=f"completion tokens of a chat request that sets no max_tokens (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=non_negative_int,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="MiB of the last requests' KV caches kept for requests that start with the same tokens, such "
        f"as the next turn of a chat (default {DEFAULT_PREFIX_CACHE_MB}; 0 = off)",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: the --target folder or file name)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )


def serve(args: argparse.Namespace) -> int:
    """Load the pair named by `args`, bind, and serve until interrupted. Returns the exit status.

    `args` carries the CLI's model arguments (`specexec.cli_args.add_model_args`: --target, --draft,
    --dtype, offloading), --method, --budget (optionally --lookahead-schedule) and those of
    `add_serve_arguments`.
    """
    try:
        import uvicorn

        from specexec.server.app import LOOPBACK_HOSTS, app_for
        from specexec.server.pair import PairLost
    except ImportError as err:
        print(f"specexec: error: the server needs {err.name}: {_INSTALL_HINT}", file=sys.stderr)
        return EXIT_FAILURE

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    log = logging.getLogger("specexec.server")
    # Bind before the (slow) model load, so a busy port fails at once.
    sock = _bind(args.host, args.port)
    if args.api_key is None and not _is_loopback(args.host):
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    try:
        pair, tokenizer, budget = _load(args)
        app = app_for(
            pair,
            tokenizer,
            method=args.method,
            budget=budget,
            api_key=args.api_key or None,
            max_queue=args.max_queue,
            model_name=args.model_name or _model_id(args.target),
            max_model_len=args.max_model_len,
            default_max_tokens=args.default_max_tokens,
            # On a loopback bind, only loopback names: a web page's host that resolves here is refused.
            allowed_hosts=[*LOOPBACK_HOSTS, args.host] if _is_loopback(args.host) else None,
        )
    except (ValueError, PairLost) as err:
        print(f"specexec: error: {err}", file=sys.stderr)
        return EXIT_FAILURE
    host, port = sock.getsockname()[:2]
    log.info(
        "serving %s (%s, %s) on http://%s:%d/v1",
        app.state.model_name,
        args.method,
        pair.facts.backend_label,
        host,
        port,
    )
    if pair.facts.memory:
        log.info("target %s", pair.facts.memory)
    if pair.facts.placement:
        log.info("%s", pair.facts.placement)
    # Connections beyond what the queue admits, plus room for /health and /metrics, get uvicorn's 503.
    config = uvicorn.Config(
        app, log_level=args.log_level, timeout_graceful_shutdown=5, limit_concurrency=2 * args.max_queue + 32
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _load(args: argparse.Namespace):
    """The pair to serve (loaded here, or in a child process for a target on RPC workers), the
    tokenizer, and the budget resolved."""
    from specexec.server.pair import ChildPair, LocalPair, check_engine_config

    spec = pair_spec(args, with_draft=args.method != "ar")
    options = {}
    if getattr(args, "lookahead_schedule", None) is not None:
        options["lookahead_schedule"] = args.lookahead_schedule
    if getattr(args, "ngram", 0):
        options["ngram"] = args.ngram
    if getattr(args, "draft_ahead", False):
        options["draft_ahead"] = True
    options, budget = check_engine_config(
        args.method, getattr(args, "budget", None), options, spec.draft is not None
    )
    config = dict(
        method=args.method, budget=budget, options=options, prefix_cache_bytes=args.prefix_cache_mb << 20
    )
    if spec.load.rpc:
        # ggml-rpc ends the process holding a model whose worker is lost: that process is a child the
        # server starts again, so the server itself stays up and answers 503 meanwhile.
        from specexec.models import load_tokenizer

        return ChildPair(spec, **config), load_tokenizer(spec.target), budget
    loaded = load_pair(spec)
    return LocalPair.of(loaded, **config), loaded.tokenizer, budget


def _model_id(source: str) -> str:
    """What clients call the model: a packaged name as is, a folder's or a .gguf file's own name (a split
    GGUF's without its first file's -00001-of-0000N)."""
    path = Path(source.rstrip("/\\"))
    if path.suffix.lower() == ".gguf":
        return re.sub(r"-00001-of-\d{5}$", "", path.stem)
    return path.name or source


def _bind(host: str, port: int) -> socket.socket:
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    # proto is IPPROTO_TCP here; asyncio sets TCP_NODELAY on accepted connections only for such sockets.
    family, kind, proto, _, address = info[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
