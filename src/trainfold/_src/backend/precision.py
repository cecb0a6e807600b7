"""Accelerate's mixed precision from inside: the float32 conversion it puts on a prepared model's outputs."""

from __future__ import annotations

from types import MethodType

import torch
from accelerate.utils.operations import ConvertOutputsToFp32


def drop_fp32_outputs(model: torch.nn.Module) -> None:
    """Keep autocast on a prepared model's forward but take off the float32 conversion of its outputs.

    Under native mixed precision (``mixed_precision="bf16"`` or ``"fp16"``) Accelerate's
    ``prepare`` replaces the model's ``forward`` with ``convert_outputs_to_fp32(autocast(forward))``:
    every low-precision tensor the forward returns is copied to float32. For a model
    that computes its loss inside ``forward`` (a transformers model given ``labels``)
    the loss is float32 already, and the copy of the logits (batch × sequence × vocabulary
    for a language model) is memory traffic for nothing (about 2% of a GPT-2-small step).

    The replaced ``forward`` sits on the module ``prepare`` was given: inside DDP's
    wrapper, or on a compiled model's wrapper. Each module of the prepared tree whose
    ``forward`` Accelerate replaced gets back the autocast wrapper alone, as a method
    where Accelerate made one; its ``_original_forward`` stays, so
    ``unwrap_model(keep_fp32_wrapper=False)`` still removes autocast. There is none
    to take off under fp32, under DeepSpeed, or with an fp8 backend that does not use one.
    """
    for module in model.modules():
        forward = module.__dict__.get("forward")
        converter = getattr(forward, "__wrapped__", None)
        if isinstance(converter, ConvertOutputsToFp32):
            autocast_forward = converter.model_forward
            module.forward = (
                MethodType(autocast_forward, module) if isinstance(forward, MethodType) else autocast_forward
            )
