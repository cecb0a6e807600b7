"""The NaN guard's state and its gate, the stage of a step between backward and the update."""

from __future__ import annotations

from typing import Any

import attrs
import torch

NAME = "nan_guard"
#: The aux name under which a guarded step counts its non-finite batches.
NONFINITE = "nonfinite"


@attrs.frozen
class NanGuardState:
    """What ``nan_guard`` keeps in ``state.extras["nan_guard"]``.

    Each update's flag (a 0-d device tensor, 1.0 if the update was skipped)
    waits in ``pending`` until the guard reads all of them at once, every
    ``check_every`` updates: one host sync then, none per update, and no kernel
    per update to count. ``counts`` holds ``(skipped, consecutive, longest)`` up
    to that read. The properties ``skipped`` (updates skipped in the whole run),
    ``consecutive`` (skipped in a row now), ``longest`` (the longest such run)
    and ``tripped`` (``longest >= max_consecutive``) include the pending flags:
    reading one between checks costs one sync.
    """

    max_consecutive: int
    check_every: int
    counts: tuple[int, int, int] = (0, 0, 0)
    pending: tuple[torch.Tensor, ...] = attrs.field(default=(), eq=False, repr=False)

    def record(self, nonfinite: torch.Tensor) -> NanGuardState:
        """Add one update's flag (:func:`nonfinite_grads`; 1.0: skipped, 0.0: applied) to ``pending``."""
        # the constructor, not attrs.evolve: this runs on every update
        return NanGuardState(self.max_consecutive, self.check_every, self.counts, (*self.pending, nonfinite))

    def settle(self) -> NanGuardState:
        """Read the pending flags (one host sync) into ``counts``."""
        if not self.pending:
            return self
        skipped, consecutive, longest = self.counts
        device = self.pending[0].device
        flags = torch.stack([f.to(device) for f in self.pending]).tolist()  # sync
        if not any(flags):  # the usual case: every update applied
            return NanGuardState(self.max_consecutive, self.check_every, (skipped, 0, longest))
        for bad in flags:
            consecutive = consecutive + 1 if bad else 0
            skipped += bool(bad)
            longest = max(longest, consecutive)
        return NanGuardState(self.max_consecutive, self.check_every, (skipped, consecutive, longest))

    @property
    def skipped(self) -> int:
        return self.settle().counts[0]

    @property
    def consecutive(self) -> int:
        return self.settle().counts[1]

    @property
    def longest(self) -> int:
        return self.settle().counts[2]

    @property
    def tripped(self) -> bool:
        return self.longest >= self.max_consecutive


_ONES: dict[torch.device, torch.Tensor] = {}


def nonfinite_grads(optimizer: Any) -> torch.Tensor:
    """A 0-d float32 flag: 1.0 if a gradient of ``optimizer``'s parameters has an inf or a NaN, else 0.0.

    No host sync. One fused kernel per device: the check torch's GradScaler
    uses, with a scale of exactly 1.0 (which leaves every gradient
    bit-identical). The parameters are read from ``optimizer.param_groups``
    (those the update would change; cheaper than walking the modules), and the
    flag is in the form fused optimizers take as ``found_inf``.
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    if all(g.device == device for g in grads):
        return _check(grads, device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    return torch.stack([_check(same, d).to(device) for d, same in by_device.items()]).amax()


def _check(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, device=device)
    flag = torch.zeros((), device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, one)
    return flag


def supports_found_inf(optimizer: Any) -> bool:
    """Fused torch optimizers skip an update on the device when given ``found_inf``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def guarded_update(optimizer: Any, nonfinite: torch.Tensor, fallback_step: Any) -> None:
    """Apply the update unless ``nonfinite``: on the device for fused optimizers, else after one host read."""
    if supports_found_inf(optimizer):
        # The protocol torch's GradScaler uses: the fused kernel skips the update (and undoes
        # its step count) where found_inf is non-zero.
        optimizer.grad_scale = None
        optimizer.found_inf = nonfinite
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif not nonfinite:  # sync: once per update, only for a non-fused optimizer under nan_guard
        fallback_step()
