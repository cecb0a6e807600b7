"""Which engine runs the model (DDP, FSDP, DeepSpeed), and what that changes: unwrapping, clipping, sharded tensors, process state.

Decisions here are taken once, when a step or an evaluation is built, never per
batch. How the step calls the optimizer is ``optim.py``'s; Accelerate's loaders
from inside, ``loaders.py``'s.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from trainfold._src.backend.mesh import is_tensor_parallel


def wait_for_everyone(accelerator: Accelerator) -> None:
    """Block until every process gets here: ``accelerator.wait_for_everyone()``, except across CPU processes.

    Accelerate's barrier passes ``device_ids=[local_process_index]`` for every
    backend, and torch turns that into a device of the machine's accelerator
    type: CPU processes (gloo) on a machine with fewer GPUs than processes
    fail there with "CUDA error: invalid device ordinal". A gloo barrier needs
    no device, so across CPU processes this calls torch's barrier without one.
    """
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        torch.distributed.barrier()
    else:
        accelerator.wait_for_everyone()


def grads_whole_in_params(accelerator: Accelerator) -> bool:
    """True when, at the update, every process holds each parameter's whole gradient in ``param.grad``.

    Not under FSDP or tensor parallelism (each process holds a shard), DeepSpeed or
    Megatron-LM (the engine holds the gradients).
    """
    engines = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM)
    return accelerator.distributed_type not in engines and not is_tensor_parallel(accelerator)


def convert_sync_batchnorm(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Replace BatchNorm layers by SyncBatchNorm layers that share their parameters.

    Raises:
        ValueError: on a CPU, where torch's SyncBatchNorm does not run on several processes.
    """
    if device.type == "cpu":
        raise ValueError(
            "sync_batchnorm=True needs GPUs (or XPUs): torch's SyncBatchNorm does not run on CPU "
            "across processes. Leave it off for CPU runs."
        )
    return cast(torch.nn.Module, torch.nn.SyncBatchNorm.convert_sync_batchnorm(model))  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def engine_name(accelerator: Accelerator) -> str:
    """What runs the model, for messages: ``"tensor parallelism"`` (whose distributed type says MULTI_GPU), or the type."""
    return "tensor parallelism" if is_tensor_parallel(accelerator) else str(accelerator.distributed_type.value)


def shards_parameters(accelerator: Accelerator) -> bool:
    """True under FSDP or tensor parallelism: each process holds a shard of every parameter (a DTensor), never the whole model."""
    fsdp = bool(accelerator.distributed_type == DistributedType.FSDP)  # sync: none: an enum
    return fsdp or is_tensor_parallel(accelerator)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 shard); cheap: if torch's DTensor was never imported, nothing is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard, or the tensor."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A gradient read back from this process's file, in its parameter's layout (a DTensor for a DTensor)."""
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor

        g = grad.to(param.device, param.dtype, copy=True)
        mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
        return DTensor.from_local(g, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
    return grad.to(param.device, param.dtype, copy=True)


def owns_clipping(accelerator: Accelerator) -> bool:
    """True where the engine clips and scales gradients itself (DeepSpeed, from its config)."""
    return bool(accelerator.distributed_type == DistributedType.DEEPSPEED)  # sync: none: an enum


def unwrap(accelerator: Accelerator | None, model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside Accelerate's wrappers (DDP, FSDP, compile), or ``model`` with no Accelerator."""
    return accelerator.unwrap_model(model) if accelerator is not None else model


def reset_process_state() -> None:
    """Forget Accelerate's process-wide state, as Accelerate's own tests do between tests."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def is_deepspeed(accelerator: Accelerator | None) -> bool:
    """True where Accelerate hands the model and optimizer to a DeepSpeed engine."""
    return bool(getattr(accelerator, "distributed_type", None) == DistributedType.DEEPSPEED)  # sync: none: an enum


def is_config_optimizer(optimizer: Any) -> bool:
    """Accelerate's ``DummyOptim``: a stand-in for the optimizer a DeepSpeed config defines."""
    from accelerate.utils.deepspeed import (
        DummyOptim,  # exported by accelerate.utils only when deepspeed is installed
    )

    return isinstance(optimizer, DummyOptim)


def is_config_scheduler(scheduler: Any) -> bool:
    """Accelerate's ``DummyScheduler`` or ``MegatronLMDummyScheduler``: a stand-in for an engine-defined scheduler."""
    from accelerate.utils.deepspeed import DummyScheduler
    from accelerate.utils.megatron_lm import (
        MegatronLMDummyScheduler,  # importable without Megatron-LM
    )

    return isinstance(scheduler, (DummyScheduler, MegatronLMDummyScheduler))


def engine_builds_optimizers(accelerator: Accelerator) -> bool:
    """True where the engine builds the optimizer and scheduler from its config (DeepSpeed, Megatron-LM)."""
    engines = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
    return bool(accelerator.distributed_type in engines)  # sync: none: an enum


def release_prepared(accelerator: Accelerator, state: Any, loaders: tuple[Any, ...]) -> None:
    """Remove ``state``'s model, optimizer and scheduler and ``loaders`` from the lists ``accelerator.prepare`` keeps.

    By identity, so other prepared objects stay; a DeepSpeed engine that is the
    state's model is destroyed first. Then ``gc.collect()`` and the device cache
    emptied (Accelerate's ``clear_device_cache``).
    """
    import gc

    from accelerate.utils.memory import clear_device_cache

    # Accelerate keeps the model it was given (under DDP, the module inside the wrapper), or its own wrapper
    model = state.model
    inner = unwrap(accelerator, model) if model is not None else None
    ours = {id(o) for o in (model, inner, state.optimizer, state.scheduler, *loaders) if o is not None}
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None and getattr(wrapped, "engine", None) is state.model:
        wrapped.engine.destroy()
        accelerator.deepspeed_engine_wrapped = None
    for name in ("_models", "_optimizers", "_schedulers", "_dataloaders"):
        kept = getattr(accelerator, name, None)
        if isinstance(kept, list):
            kept[:] = [o for o in kept if id(o) not in ours]
    gc.collect()
    clear_device_cache()
