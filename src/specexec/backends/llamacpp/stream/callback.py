"""llama.cpp's eval callback (a context's `cb_eval`), telling a listener of each layer's output."""

from __future__ import annotations

from typing import Protocol

from specexec.backends.llamacpp.library import tensor_name

LAYER_OUTPUT = b"l_out-"  # llama.cpp names each layer's output "l_out-<layer>" (llama-graph.cpp, `cb`)


class LayerListener(Protocol):
    def layer_done(self, layer: int) -> None: ...


class LayerEvents:
    """`callback`, a context's `cb_eval`, calls `listener.layer_done` at each layer's output. The listener
    may be set after the callback is made: llama-cpp-python's `Llama` makes its context as it loads the
    model, before the model's streamer exists; nothing is computed before. It holds the listener, not the
    model, so the model is freed when its last user lets go."""

    def __init__(self, listener: LayerListener | None = None) -> None:
        import llama_cpp

        self.listener = listener
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def _on_eval(self, tensor: int, ask: bool, user_data: int) -> bool:
        name = tensor_name(tensor)
        if ask:
            return name.startswith(LAYER_OUTPUT)
        self.listener.layer_done(int(name[len(LAYER_OUTPUT) :]))
        return True  # go on computing
