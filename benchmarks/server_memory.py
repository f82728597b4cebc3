"""Peak memory of `specexec serve` for one chat request without max_tokens (docs/server.md).

Starts the server (the default pair, plus any arguments after `--`), reads its resident set, streams one
chat request that sets no max_tokens, closes it after `--chunks` content events, and reads the server's
high-water mark since the request was sent. Run it against an older checkout with PYTHONPATH=OLD/src to
compare.

    python benchmarks/server_memory.py
    PYTHONPATH=/tmp/old/src python benchmarks/server_memory.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
from server_turns import free_port, memory_kib, start_server


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--log", type=Path, default=Path("bench-out/server-memory.log"))
    parser.add_argument("serve_args", nargs="*", help="more `specexec serve` arguments (after --)")
    args = parser.parse_args()
    args.log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_server(port, args.serve_args, args.log)
    try:
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # the high-water mark restarts from now
        before = memory_kib(proc.pid)
        body = {
            "model": "m", "messages": [{"role": "user", "content": "Write a long story about a cat."}],
            "stream": True, "temperature": 0,
        }  # fmt: skip
        chunks = 0
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            r.raise_for_status()
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks > args.chunks:
                    break
        time.sleep(2)
        after = memory_kib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(
        f"one request without max_tokens, closed after {args.chunks} events: "
        f"RSS {before['VmRSS'] / 1024:.0f} MiB before, peak {after['VmHWM'] / 1024:.0f} MiB "
        f"(+{(after['VmHWM'] - before['VmRSS']) / 1024:.0f} MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
