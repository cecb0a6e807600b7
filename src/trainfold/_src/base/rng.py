"""Every random number generator a training run draws from: capture and restore, as plain values."""

from __future__ import annotations

import random
from typing import Any, Iterable

import attrs
import numpy as np
import torch


@attrs.frozen
class RngStates:
    """The states of the global torch (CPU and CUDA), Python and NumPy RNGs, and of given torch Generators."""

    torch_cpu: torch.Tensor = attrs.field(eq=False)
    torch_cuda: tuple[torch.Tensor, ...] = attrs.field(eq=False)
    python: Any = attrs.field(eq=False)
    numpy: Any = attrs.field(eq=False)
    generators: tuple[torch.Tensor, ...] = attrs.field(eq=False)


def capture(generators: Iterable[torch.Generator] = ()) -> RngStates:
    """The current states (copies). Costs ~60 us: once per epoch or checkpoint, never per step."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else ()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    return RngStates(
        torch_cpu=torch.get_rng_state(),
        torch_cuda=cuda,
        python=random.getstate(),
        numpy=np.random.get_state(),
        generators=tuple(g.get_state() for g in generators),
    )


def restore(states: RngStates, generators: Iterable[torch.Generator] = ()) -> None:
    """Put every generator back to ``states``."""
    torch.set_rng_state(states.torch_cpu)
    if states.torch_cuda:
        torch.cuda.set_rng_state_all(list(states.torch_cuda))
    random.setstate(states.python)
    np.random.set_state(states.numpy)
    gens = list(generators)
    if not states.generators:
        return  # recorded before any epoch: the loader's generators are as the script seeded them
    if len(gens) != len(states.generators):
        raise ValueError(
            f"the loader has {len(gens)} random generators but the checkpoint recorded {len(states.generators)}: "
            "resume with the loader built as in the interrupted run (same sampler, same generator= argument)."
        )
    for g, s in zip(gens, states.generators):
        g.set_state(s)


def restore_loosely(states: RngStates, generators: Iterable[torch.Generator] = ()) -> None:
    """As :func:`restore`, for a run laid out otherwise (another number of processes): where the loader has
    another number of generators than were recorded, only the global states are restored."""
    gens = list(generators)
    restore(states if len(gens) == len(states.generators) else attrs.evolve(states, generators=()), gens)


def to_record(states: RngStates) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split into tensors (for safetensors) and JSON values."""
    tensors = {"torch_cpu": states.torch_cpu}
    tensors.update({f"torch_cuda.{i}": t for i, t in enumerate(states.torch_cuda)})
    tensors.update({f"generator.{i}": t for i, t in enumerate(states.generators)})
    version, internal, gauss = states.python
    name, keys, pos, has_gauss, cached = states.numpy
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [
            name,
            keys.tolist(),  # sync: none: numpy's state, on the host
            int(pos),
            int(has_gauss),
            float(cached),  # sync: none: as above
        ],
        "cuda_devices": len(states.torch_cuda),
        "generators": len(states.generators),
    }
    return tensors, meta


def from_record(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> RngStates:
    version, internal, gauss = meta["python"]
    name, keys, pos, has_gauss, cached = meta["numpy"]
    return RngStates(
        torch_cpu=tensors["torch_cpu"],
        torch_cuda=tuple(tensors[f"torch_cuda.{i}"] for i in range(meta["cuda_devices"])),
        python=(version, tuple(internal), gauss),
        numpy=(name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
        generators=tuple(tensors[f"generator.{i}"] for i in range(meta["generators"])),
    )
