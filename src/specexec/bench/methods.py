"""What the benchmark runs: the engine's methods (`specexec.methods`), Hugging Face's assisted
generation and prompt lookup, and llama.cpp's own decoding as outside peers."""

from __future__ import annotations

from specexec.bench.llamacpp import PLAIN, SPECULATIVE
from specexec.methods import METHODS

ENGINE_METHODS = tuple(METHODS)
AUTO_METHODS = tuple(name for name, m in METHODS.items() if m.auto)
HF_METHODS = ("hf-assisted", "hf-lookup")
# Other runtimes, optional extras, never in the default method list: llama.cpp's plain decoding and its
# own speculative decoding (budget: the draft length).
EXTERNAL_METHODS = (PLAIN, SPECULATIVE)
BENCH_METHODS = ENGINE_METHODS + HF_METHODS + EXTERNAL_METHODS
DEFAULT_METHODS = ENGINE_METHODS + HF_METHODS
# The drafted methods the engine runs: those a budget and --draft-vocab apply to.
ENGINE_DRAFT_METHODS = tuple(name for name, m in METHODS.items() if m.drafts)
BUDGET_METHODS = (*ENGINE_DRAFT_METHODS, SPECULATIVE)  # the methods a budget applies to
DRAFT_METHODS = (*ENGINE_DRAFT_METHODS, "hf-assisted")
