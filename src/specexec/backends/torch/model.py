"""A Hugging Face causal LM as a `specexec.backends.base.Model`."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specexec.backends.torch.draft_vocab import draft_vocab_size
from specexec.backends.torch.native import forward_label
from specexec.backends.torch.offload import offload_label
from specexec.backends.torch.quant import kernel_tag, quant_label
from specexec.backends.torch.runner import ModelRunner


class TorchModel:
    """The engine's view of a `transformers` model (`module`), which stays usable as itself."""

    runtime = "torch"
    max_tree_leaves = None  # slot-addressed buffers: any tree fits

    def __init__(self, module: PreTrainedModel) -> None:
        self.module = module
        self._text_config = module.config.get_text_config()

    @classmethod
    def of(cls, module: PreTrainedModel) -> TorchModel:
        """The adapter of `module`, made once and kept on it: policies learnt and runners cached per model
        key on its identity."""
        adapter = module.__dict__.get("_specexec_model")
        if adapter is None:
            adapter = module.__dict__["_specexec_model"] = cls(module)
        return adapter

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def vocab_size(self) -> int:
        return self._text_config.vocab_size

    @property
    def context_window(self) -> int | None:
        return getattr(self._text_config, "max_position_embeddings", None)

    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids of its generation config, then its model config."""
        ids: list[int] = []
        for value in (
            getattr(self.module.generation_config, "eos_token_id", None),
            getattr(self.module.config, "eos_token_id", None),
        ):
            for token_id in value if isinstance(value, list) else [value]:
                if token_id is not None and int(token_id) not in ids:
                    ids.append(int(token_id))
        return ids

    @property
    def weights(self) -> str:
        return str(self.module.dtype).removeprefix("torch.")

    @property
    def quantization(self) -> str:
        return quant_label(self.module)

    @property
    def cost_label(self) -> str:
        """What offloading, real or simulated, changes its forward costs ("" for none)."""
        return offload_label(self.module)

    def cost_key(self) -> str:
        """Name, size, dtype, device, quantization and kernel build, scored vocabulary, forward and
        offloading."""
        module = self.module
        size = sum(p.numel() for p in module.parameters())
        quant = f"{quant_label(module)}{kernel_tag(module)}"
        return (
            f"{module.config.name_or_path}:{size}:{module.dtype}:{module.device}:{quant}:"
            f"{draft_vocab_size(module)}:{forward_label(module)}:{self.cost_label}"
        )

    def memory(self) -> None:
        return None  # in memory (offloading streams from host RAM, which holds every weight)

    def placement(self) -> str:
        return ""  # every layer runs in this process

    def make_runner(self, capacity: int, trees: bool = True) -> ModelRunner:
        return ModelRunner(self.module, capacity)  # slot buffers serve trees and plain steps alike
