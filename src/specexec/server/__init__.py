"""OpenAI-compatible HTTP server: `create_app` for already-loaded models, `serve` for the CLI.

Needs the `server` extra (FastAPI, uvicorn, prometheus-client); importing this package does not, so
`add_serve_arguments` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specexec.server.cli import add_serve_arguments, serve

if TYPE_CHECKING:
    from specexec.server.app import create_app

__all__ = ["add_serve_arguments", "create_app", "serve"]


def __getattr__(name: str):
    if name == "create_app":
        from specexec.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
