"""For the server tests: tiny models, a byte-level tokenizer, a real uvicorn server on a loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT_WINDOW = 512


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: one token per byte (ids 0-255) plus the chat specials (256-258).

    Any text encodes, and a random model's output is arbitrary bytes, so multi-byte characters split
    across tokens and invalid UTF-8 both occur.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for special in SPECIALS:
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_of(ch: str) -> int:
    """The byte GPT-2's bytes_to_unicode maps to `ch`."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def tiny_pair(
    vocab_size: int, eos_id: int, seed: int = 0, window: int = CONTEXT_WINDOW
) -> tuple[Qwen2ForCausalLM, Qwen2ForCausalLM]:
    """A random float32 target and a draft that is the target with noise, so drafts are partly accepted."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        eos_token_id=eos_id,
    )
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(config).eval()
    draft = Qwen2ForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    return target, draft


class SlowModel:
    """Makes every forward of `model` take at least `seconds`, so a generation lasts long enough to watch."""

    def __init__(self, model: torch.nn.Module, seconds: float) -> None:
        self.seconds = seconds
        self.handle = model.register_forward_pre_hook(lambda *_: time.sleep(self.seconds))

    def remove(self) -> None:
        self.handle.remove()


class LiveServer:
    """A uvicorn server for `app` in a background thread, on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        self.app = app
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only then (else Nagle
        # and delayed ACKs add ~40 ms to every keep-alive request).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@contextmanager
def live_server(app) -> Iterator[LiveServer]:
    server = LiveServer(app).start()
    try:
        yield server
    finally:
        server.stop()


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent-event response, in order."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def wait_serving(process, url: str, seconds: float) -> None:
    """Wait until the server `process` (a `subprocess.Popen` with its output piped) answers `url`'s
    /health with 200; fail with its output if it exits first, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
