"""The NaN guard's state and its gate, the stage of a step between backward and the update."""

from __future__ import annotations

from typing import Any, Iterable

import attrs
import torch

NAME = "nan_guard"
#: The aux name under which a guarded step counts its non-finite batches.
NONFINITE = "nonfinite"


@attrs.frozen
class NanGuardState:
    """What ``nan_guard`` keeps in ``state.extras["nan_guard"]``.

    ``skipped`` (updates skipped in the whole run), ``consecutive`` (skipped in a
    row now) and ``tripped`` (``consecutive`` reached ``max_consecutive`` at some
    point) are 0-d tensors on the device, updated without host syncs.
    """

    max_consecutive: int
    check_every: int
    skipped: torch.Tensor = attrs.field(eq=False)
    consecutive: torch.Tensor = attrs.field(eq=False)
    tripped: torch.Tensor = attrs.field(eq=False)

    def record(self, finite: torch.Tensor) -> NanGuardState:
        bad = (~finite).to(self.skipped.dtype)
        consecutive = (self.consecutive + 1) * bad
        # the constructor, not attrs.evolve: this runs on every update
        return NanGuardState(
            self.max_consecutive,
            self.check_every,
            self.skipped + bad,
            consecutive,
            self.tripped | (consecutive >= self.max_consecutive),
        )


_ONES: dict[torch.device, torch.Tensor] = {}


def grads_finite(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """A 0-d bool tensor: every gradient is finite (one fused kernel per device, no host sync).

    Uses the check torch's GradScaler uses, with a scale of exactly 1.0 (which
    leaves every gradient bit-identical).
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_device.setdefault(p.grad.device, []).append(p.grad)
    if not by_device:
        return torch.ones((), dtype=torch.bool)
    found = []
    for device, grads in by_device.items():
        one = _ONES.get(device)
        if one is None:
            one = _ONES[device] = torch.ones(1, device=device)
        flag = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, one)
        found.append(flag.to(next(iter(by_device))))
    return (found[0] if len(found) == 1 else torch.stack(found).sum()).squeeze() == 0


def supports_found_inf(optimizer: Any) -> bool:
    """Fused torch optimizers skip an update on the device when given ``found_inf``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def guarded_update(optimizer: Any, finite: torch.Tensor, fallback_step: Any) -> None:
    """Apply the update only if ``finite``: on the device for fused optimizers, else after one host read."""
    if supports_found_inf(optimizer):
        # The protocol torch's GradScaler uses: the fused kernel skips the update (and undoes
        # its step count) where found_inf is non-zero.
        optimizer.grad_scale = None
        optimizer.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif bool(finite):  # sync: once per update, only for a non-fused optimizer under nan_guard
        fallback_step()
