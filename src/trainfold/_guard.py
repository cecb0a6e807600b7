"""The NaN guard's state and its gate, the stage of a step between backward and the update."""

from __future__ import annotations

from typing import Any, Callable

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


def check_finite(grads: list[torch.Tensor], flag: torch.Tensor) -> None:
    """Set the 0-d float32 ``flag`` to 1.0 if a gradient has an inf or a NaN; leave it otherwise.

    No host sync. One fused kernel per device: the check torch's GradScaler
    uses, with a scale of exactly 1.0 (which leaves every gradient
    bit-identical), writing the flag in the form fused optimizers take as
    ``found_inf``. The step's own path (:class:`GuardedUpdate`) calls the
    kernel directly when every gradient is on the flag's device.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for d, same in by_device.items():
        found = flag if d == flag.device else torch.zeros((), dtype=torch.float32, device=d)
        torch._amp_foreach_non_finite_check_and_unscale_(same, found, _one(d))
        if found is not flag:
            flag.copy_(torch.maximum(flag, found.to(flag.device)))


def _one(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)  # float32 whatever the default dtype


def supports_found_inf(optimizer: Any) -> bool:
    """Fused torch optimizers skip an update on the device when given ``found_inf``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


@attrs.frozen
class GuardedUpdate:
    """How a step under ``nan_guard`` checks and applies one optimizer's updates, decided once per optimizer.

    ``apply(flag)`` applies the update unless the flag is set: on the device for
    a fused optimizer (:func:`skip_on_device`), after one host read for any
    other (:func:`skip_after_read`), or by the fp16 loss scaler
    (:func:`left_to_scaler`). ``device`` is where every parameter was when this
    was decided (None if on several devices), and ``one`` the check's scale
    there: while the gradients are on that device the check is one kernel call;
    gradients elsewhere (a model moved since) take :func:`check_finite`. A model
    split across devices after the first guarded update is refused by the
    kernel ("scaled_grads must be on the same device"), not checked wrongly.
    """

    optimizer: torch.optim.Optimizer
    apply: Callable[[torch.Tensor], Any]
    device: torch.device | None
    one: torch.Tensor | None = attrs.field(repr=False)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, step: Callable[[], Any], *, fast: bool, scaled: bool) -> GuardedUpdate:
        """The plan for ``optimizer`` (the torch optimizer), whose update is ``step()``.

        ``fast``: ``step`` is ``optimizer.step`` itself (no Accelerate wrapper), so a
        fused optimizer can take ``found_inf``. ``scaled``: a loss scaler steps it.
        """
        if scaled:
            apply = left_to_scaler(step)
        elif fast and supports_found_inf(optimizer):
            apply = skip_on_device(optimizer)
        else:
            apply = skip_after_read(step)
        devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        device = devices.pop() if len(devices) == 1 else None
        return cls(optimizer, apply, device, None if device is None else _one(device))

    def __call__(self, guard: NanGuardState) -> NanGuardState:
        """Claim a flag from ``guard``, check the gradients into it, and apply (or skip) the update."""
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = grads[0].device if grads else self.device
        guard, flag = guard.claim(device)
        if grads:
            if device == self.device:  # the usual case: one kernel, no grouping
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, self.one)
            else:
                check_finite(grads, flag)
        self.apply(flag)
        return guard


def skip_on_device(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    """A fused optimizer's update, skipped on the device where ``flag`` is set: no host sync."""

    def apply(flag: torch.Tensor) -> None:
        # The protocol torch's GradScaler uses: the fused kernel skips the update (and undoes
        # its step count) where found_inf is non-zero.
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = flag  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]

    return apply


def skip_after_read(step: Callable[[], Any]) -> Callable[[torch.Tensor], None]:
    """Any other optimizer's update, applied after reading ``flag`` on the host (one sync per update)."""

    def apply(flag: torch.Tensor) -> None:
        if not flag:  # sync: once per update, only for a non-fused optimizer under nan_guard
            step()

    return apply


def left_to_scaler(step: Callable[[], Any]) -> Callable[[torch.Tensor], None]:
    """The update under the fp16 loss scaler, which skips non-finite updates itself and must see every step."""

    def apply(flag: torch.Tensor) -> None:
        step()

    return apply
