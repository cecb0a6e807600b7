"""The NaN guard's state and its gate, the stage of a step between backward and the update."""

from __future__ import annotations

from typing import Any

import attrs
import torch

NAME = "nan_guard"
#: The aux name under which a guarded step counts its non-finite batches.
NONFINITE = "nonfinite"
#: The most flag slots a new buffer gets at once; a buffer that fills up is copied into one twice
#: as large. With the default check_every (50) one buffer serves each read; a huge check_every
#: does not make (and unbind) a huge buffer up front.
MAX_SLOTS = 1024


@attrs.define(eq=False)
class NanGuardFlags:
    """A zeroed buffer of flags on the device, handed out one 0-d view (a slot) per update.

    One allocation per ``check_every`` updates (up to ``MAX_SLOTS``) instead of
    a new tensor per update, and one read (``values[:n].tolist()``) instead of a stack of them.
    ``taken`` counts the slots handed out: a guard state whose count differs
    (an older state stepped again, a branch) copies the buffer before writing,
    so two continuations never write the same slot.
    """

    values: torch.Tensor
    taken: int
    views: tuple[torch.Tensor, ...] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.views = self.values.unbind()

    @classmethod
    def continuing(cls, old: NanGuardFlags | None, recorded: int, capacity: int, device: torch.device) -> NanGuardFlags:
        """A new buffer on ``device`` holding the first ``recorded`` flags of ``old``."""
        values = torch.zeros(max(capacity, 2 * recorded), dtype=torch.float32, device=device)
        if recorded:
            values[:recorded] = old.values[:recorded]  # type: ignore[union-attr]
        return cls(values, recorded)


@attrs.frozen
class NanGuardState:
    """What ``nan_guard`` keeps in ``state.extras["nan_guard"]``.

    Each update's flag (1.0 if the update was skipped) is written on the
    device into the next slot of a buffer (``claim``) and waits there until the
    guard reads all of them at once, every ``check_every`` updates
    (``settle``): one host sync then, none per update. ``counts`` holds
    ``(skipped, consecutive, longest)`` up to that read and ``unread`` the
    number of flags written since. The properties ``skipped`` (updates skipped
    in the whole run), ``consecutive`` (skipped in a row now), ``longest`` (the
    longest such run) and ``tripped`` (``longest >= max_consecutive``) include
    the unread flags: reading one between checks costs one sync.
    """

    max_consecutive: int
    check_every: int
    counts: tuple[int, int, int] = (0, 0, 0)
    unread: int = 0
    flags: NanGuardFlags | None = attrs.field(default=None, eq=False, repr=False)

    def claim(self, device: torch.device | None = None) -> tuple[NanGuardState, torch.Tensor]:
        """The state that counts one more update, and that update's flag: a zeroed 0-d float32 slot.

        The slot is on ``device`` (default: where the flags already are, or the CPU).
        """
        flags, n = self.flags, self.unread
        if device is None:
            device = flags.values.device if flags is not None else torch.device("cpu")
        if flags is None or flags.taken != n or n == len(flags.views) or flags.values.device != device:
            flags = NanGuardFlags.continuing(flags, n, min(self.check_every, MAX_SLOTS), device)
        flags.taken = n + 1
        # the constructor, not attrs.evolve: this runs on every update
        return NanGuardState(self.max_consecutive, self.check_every, self.counts, n + 1, flags), flags.views[n]

    def record(self, nonfinite: torch.Tensor) -> NanGuardState:
        """Count one update whose flag (1.0: skipped, 0.0: applied) was computed elsewhere."""
        guard, slot = self.claim(nonfinite.device)
        slot.copy_(nonfinite)
        return guard

    def settle(self) -> NanGuardState:
        """Read the unread flags (one host sync) into ``counts``."""
        if not self.unread:
            return self
        skipped, consecutive, longest = self.counts
        flags = self.flags.values[: self.unread].tolist()  # type: ignore[union-attr]  # sync
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


def gradients(optimizer: Any) -> list[torch.Tensor]:
    """The gradients of ``optimizer``'s parameters (those the update would change)."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def check_finite(grads: list[torch.Tensor], flag: torch.Tensor) -> None:
    """Set the 0-d float32 ``flag`` to 1.0 if a gradient has an inf or a NaN; leave it otherwise.

    No host sync. One fused kernel per device: the check torch's GradScaler
    uses, with a scale of exactly 1.0 (which leaves every gradient
    bit-identical), writing the flag in the form fused optimizers take as
    ``found_inf``.
    """
    if not grads:
        return
    device = flag.device
    if all(g.device == device for g in grads):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, _one(device))
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for d, same in by_device.items():
        found = torch.zeros((), dtype=torch.float32, device=d)
        torch._amp_foreach_non_finite_check_and_unscale_(same, found, _one(d))
        flag.copy_(torch.maximum(flag, found.to(device)))


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)  # whatever the default dtype
    return one


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
