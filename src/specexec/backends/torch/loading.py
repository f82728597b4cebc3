"""Loading a Hugging Face folder for the torch backend: dtype, offloading, a reduced draft head, low-bit
weights."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specexec.backends.options import LoadOptions
from specexec.backends.torch.draft_vocab import restrict_draft_vocab
from specexec.backends.torch.quant import QuantError, quantize_model
from specexec.draft_vocab import check_draft_vocab


def load_folder(folder: Path, options: LoadOptions) -> PreTrainedModel:
    """The causal LM in `folder` (safetensors, checked by the caller) in eval mode on the CPU: in
    `options.dtype` (default bfloat16), its decoder layers streamed to the GPU with `options.offload`
    (`offload.offload_model` arguments), scoring only `options.vocab` ids if > 0, and its linear layers
    in low-bit form with `options.quant` ("int8", "int4", "w4a8"), and every forward charged the time to
    stream its weights at `options.simulate_offload_gbps` GB/s if given (a stand-in for a GPU)."""
    if options.quant != "none" and options.offload is not None:
        raise QuantError("--quant is for CPU inference; offloading streams NF4 with --quant-offload nf4")
    if options.vocab:  # refused before the weights load
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        check_draft_vocab(options.vocab, config.get_text_config().vocab_size)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=getattr(torch, options.dtype or "bfloat16"),
        use_safetensors=True,
        trust_remote_code=False,
        local_files_only=True,
    ).eval()
    if options.offload is not None:
        from specexec.backends.torch.offload import offload_model

        offloader = offload_model(model, **options.offload)  # OffloadError without CUDA
        print(f"[{offloader.describe()}]", file=sys.stderr)
    if options.vocab:
        restrict_draft_vocab(model, options.vocab, always=options.always)
    model = quantize_model(model, options.quant)
    if options.simulate_offload_gbps is not None:
        from specexec.backends.torch.simulated import simulate_offload

        label = simulate_offload(model, options.simulate_offload_gbps).label
        print(f"[{label}; every timing below is SIMULATED]", file=sys.stderr)
    return model
