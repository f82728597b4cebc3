"""Issue 16's server measurements (docs/server.md): `specexec serve` on the default pair, driven over HTTP.

1. Time to first token of each turn of a 5-turn chat (streamed, greedy), with the prefix cache (the
   default) and without it (`--prefix-cache-mb 0`), each on a fresh server. `--shape follow-up`: a
   HumanEval task, then four short follow-ups about the same code; `--shape tasks`: five HumanEval tasks
   in one conversation (long user turns: the new part of each prompt is large).
2. Peak memory of the server while 32 chat requests without max_tokens arrive at once (the first
   server, `--max-queue 32`): its resident set before and its high-water mark after, and the KV bytes
   the prefix cache holds at the end.

    python benchmarks/server_turns.py --out bench-out/server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specexec.bench.report import describe_cpu
from specexec.prompts import _humaneval


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [
        "specexec",
        "serve",
        "--port",
        str(port),
        "--threads",
        "2",
        "--max-queue",
        "32",
        "--model-name",
        "m",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=60).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not come up")


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


FOLLOW_UPS = [
    "Add type hints and a docstring.",
    "Now write three pytest unit tests for it.",
    "Make it raise a clear ValueError on invalid input.",
    "What is its time complexity? Answer briefly.",
]


def chat_turns(url: str, tasks: list[str], max_tokens: int) -> list[dict]:
    """Each turn streamed; time to the first content token, and the usage of the turn."""
    messages = [{"role": "system", "content": "You are a careful Python programmer. Answer with code."}]
    turns = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for task in tasks:
            messages.append({"role": "user", "content": task})
            body = {
                "model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            start = time.perf_counter()
            first = None
            pieces, usage, stats = [], None, None
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    if event.get("specexec"):
                        stats = event["specexec"]
                    for choice in event["choices"]:
                        content = choice["delta"].get("content")
                        if content:
                            first = first or time.perf_counter()
                            pieces.append(content)
            total = time.perf_counter() - start
            answer = "".join(pieces)
            messages.append({"role": "assistant", "content": answer})
            turns.append(
                {
                    "ttft_s": (first or time.perf_counter()) - start,
                    "total_s": total,
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "completion_tokens": usage["completion_tokens"],
                    "prefill_s": stats["prefill_seconds"] if stats else None,
                    "answer": answer,
                }
            )
    return turns


async def concurrent_requests(url: str, tasks: list[str]) -> list[int]:
    async def one(http: httpx.AsyncClient, task: str) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": task}], "temperature": 0}
        r = await http.post("/v1/chat/completions", json=body)
        return r.status_code

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        return await asyncio.gather(*(one(http, t) for t in tasks))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/server"))
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--shape", choices=("follow-up", "tasks"), default="follow-up")
    parser.add_argument("--max-tokens", type=int, default=128, help="completion tokens per chat turn")
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument(
        "--default-max-tokens", type=int, default=32, help="the server's cap for requests without max_tokens"
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = [text for _, text, _ in _humaneval()]
    limits = [
        "--max-model-len",
        str(args.max_model_len),
        "--default-max-tokens",
        str(args.default_max_tokens),
    ]
    results: dict = {
        "machine": {"cpu": describe_cpu()},
        "args": vars(args),
        "runs": {},
    }
    for name, extra in (("prefix cache", []), ("no prefix cache", ["--prefix-cache-mb", "0"])):
        port = free_port()
        proc = start_server(port, limits + extra, args.out / f"serve-{name.replace(' ', '-')}.log")
        url = f"http://127.0.0.1:{port}"
        try:
            user_turns = (
                tasks[: args.turns] if args.shape == "tasks" else [tasks[0], *FOLLOW_UPS][: args.turns]
            )
            turns = chat_turns(url, user_turns, args.max_tokens)
            run = {"turns": turns}
            if name == "prefix cache":
                before = memory_kib(proc.pid)
                start = time.perf_counter()
                statuses = asyncio.run(concurrent_requests(url, tasks[10 : 10 + args.concurrent]))
                after = memory_kib(proc.pid)
                metrics = httpx.get(url + "/metrics").text
                cache_bytes = next(
                    float(line.split()[-1])
                    for line in metrics.splitlines()
                    if line.startswith("specexec_prefix_cache_bytes ")
                )
                run["concurrent"] = {
                    "requests": len(statuses),
                    "statuses": {str(s): statuses.count(s) for s in set(statuses)},
                    "seconds": time.perf_counter() - start,
                    "rss_before_mib": before["VmRSS"] / 1024,
                    "rss_after_mib": after["VmRSS"] / 1024,
                    "peak_mib": after["VmHWM"] / 1024,
                    "prefix_cache_mib": cache_bytes / 2**20,
                }
            results["runs"][name] = run
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))

    reuse, fresh = results["runs"]["prefix cache"]["turns"], results["runs"]["no prefix cache"]["turns"]
    lines = [
        "| turn | prompt tokens | cached | TTFT, prefix cache (s) | TTFT, none (s) | speed-up | same text |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (a, b) in enumerate(zip(reuse, fresh, strict=True), 1):
        lines.append(
            f"| {i} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_s']:.2f} | {b['ttft_s']:.2f} | "
            f"{b['ttft_s'] / a['ttft_s']:.1f}x | {'yes' if a['answer'] == b['answer'] else 'no'} |"
        )
    c = results["runs"]["prefix cache"]["concurrent"]
    lines += [
        "",
        f"{c['requests']} concurrent chat requests without max_tokens: statuses {c['statuses']}, "
        f"{c['seconds']:.0f} s; server RSS {c['rss_before_mib']:.0f} MiB before, "
        f"{c['rss_after_mib']:.0f} MiB after, peak {c['peak_mib']:.0f} MiB; "
        f"prefix cache {c['prefix_cache_mib']:.0f} MiB at the end.",
    ]
    table = "\n".join(lines)
    (args.out / "results.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
