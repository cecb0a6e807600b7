"""``nan_guard``: the stage that skips updates whose gradients are not finite, counts them, and stops a run.

Owned here: :func:`nan_guard` (a stage for ``make_step(stages=...)``), its
record :class:`NanGuardState` in ``state.extras["nan_guard"]`` and the device
buffer of flags it reads once per ``check_every`` updates. How a flagged update
is skipped (on the device, after a read, by the loss scaler) is the step's
gated update (``trainfold._src.core.update``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch

from trainfold._src.backend.engine import engine_name, grads_whole_in_params
from trainfold._src.backend.optim import inner_optimizer
from trainfold._src.base.checks import positive_int
from trainfold._src.base.records import register_record
from trainfold._src.core.stages import MicroBatch, Stage
from trainfold._src.core.stop import Stop

if TYPE_CHECKING:
    from trainfold._src.core.context import Context

NAME = "nan_guard"
#: The most flag slots a new buffer gets at once; a buffer that fills up is copied into one twice
#: as large. With the default check_every (50) one buffer serves each read; a huge check_every
#: does not make (and unbind) a huge buffer up front.
MAX_SLOTS = 1024


@register_record
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


@register_record
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
            skipped += bool(bad)  # sync: none: host ints, read above
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
    ``found_inf``. The guard's own check (:class:`_Target`) calls the kernel
    directly when every gradient is on the flag's device.
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


#: The attribute of a torch optimizer that holds the guard's :class:`_Target` for it.
_TARGET = "_trainfold_guard_target"


@attrs.frozen
class _Target:
    """Where one optimizer's parameters were when the guard first checked them, and the check's scale there.

    While the gradients are on that device the check is one kernel call; gradients
    elsewhere (a model moved since) take :func:`check_finite`. A model split across
    devices after the first check is refused by the kernel ("scaled_grads must be
    on the same device"), not checked wrongly.
    """

    device: torch.device | None
    one: torch.Tensor | None = attrs.field(repr=False)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> _Target:
        devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        device = devices.pop() if len(devices) == 1 else None
        return cls(device, None if device is None else _one(device))


@attrs.frozen
class NanGuard:
    """The ``nan_guard`` stage before it is bound to a Context (see :func:`nan_guard`)."""

    max_consecutive: int
    check_every: int

    def bind(self, ctx: Context) -> Stage:
        accelerator = ctx.accelerator
        if not grads_whole_in_params(accelerator):
            raise ValueError(
                f"nan_guard cannot guard a step under {engine_name(accelerator)}: the gradients it checks "
                "are sharded there (or held by the engine, not in param.grad), so processes could take different "
                "decisions or none. Under DeepSpeed, use its fp16 loss scaling, which skips non-finite updates; "
                "otherwise remove nan_guard."
            )
        max_consecutive, check_every = self.max_consecutive, self.check_every

        def check(mb: MicroBatch) -> None:
            guard = mb.extras.get(NAME)
            if guard is None:
                guard = NanGuardState(max_consecutive, check_every)
            optimizer = inner_optimizer(mb.state.optimizer)
            target = optimizer.__dict__.get(_TARGET)
            if target is None:  # the first update of this optimizer: kept on it, so it goes with it
                target = optimizer.__dict__[_TARGET] = _Target.of(optimizer)
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            device = grads[0].device if grads else target.device
            guard, flag = guard.claim(device)
            if grads:
                if device == target.device:  # the usual case: one kernel, no grouping
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grads, flag, cast(torch.Tensor, target.one)
                    )  # set with device
                else:
                    check_finite(grads, flag)
            mb.skip = flag
            mb.extras = MappingProxyType({**mb.extras, NAME: guard})

        def settle(mb: MicroBatch) -> None:
            guard = mb.extras[NAME]
            if guard.unread >= guard.check_every:
                guard = guard.settle()  # sync: once every check_every updates
                mb.extras = MappingProxyType({**mb.extras, NAME: guard})
                if guard.tripped and mb.stop is None:
                    mb.stop = Stop("nan_guard")

        name = f"nan_guard({max_consecutive})"
        return Stage(name, on_update=check, after_update=settle, gates_update=True, masks_nonfinite=True)

    def __call__(self, step: Any) -> Any:
        raise TypeError(
            "nan_guard is a stage of make_step, not a step transformer: pass it as "
            f"make_step(ctx, loss_fn, stages=[nan_guard({self.max_consecutive}, check_every={self.check_every})]) "
            "(or fit(..., stages=[...]))."
        )


def nan_guard(max_consecutive: int = 3, *, check_every: int = 50) -> NanGuard:
    """A stage that skips updates whose gradients are not finite, counts them, and stops after ``max_consecutive`` in a row.

    Use it as ``make_step(ctx, loss_fn, stages=[nan_guard(3)])``. The check and
    the skip happen on the device, inside the step, between the backward pass
    (and clipping, which comes first) and the optimizer update:

    - with a fused torch optimizer (``Adam(..., fused=True)``, ``AdamW``, ``SGD``,
      ``Adagrad``) the update is skipped on the device with no host sync, by the
      same ``found_inf`` protocol torch's GradScaler uses;
    - with any other optimizer the step reads the finiteness flag once per
      update (one host sync per update, not per micro-batch);
    - under fp16, Accelerate's loss scaler already skips non-finite updates; the
      guard only counts them.

    A batch whose loss is not finite adds nothing to the running loss;
    ``train_loss`` is the mean over finite batches and ``train_nonfinite`` the
    share of non-finite ones. ``state.step`` still counts a skipped update
    (knowing otherwise would need a sync), and a scheduler still advances; the
    counts are ``state.extras["nan_guard"].skipped`` (in the run),
    ``.consecutive`` (in a row now) and ``.longest`` (in a row, at most), ints.

    Each update's flag stays on the device; every ``check_every`` updates the
    guard reads them all (one sync), counts them and decides whether to stop;
    reading a count between two checks costs one sync. Gradients are averaged
    over processes before the check, so every process takes the same decision.
    The gradients checked are those of the optimizer's parameters: the ones the
    update would change.

    Args:
        max_consecutive: stop the run after this many skipped updates in a row (a positive int).
        check_every: how often, in updates, the count is read on the host to decide to stop (a positive int).

    Returns:
        A stage spec for ``make_step(..., stages=[...])``; put it last.

    Raises:
        ValueError: a non-positive count; and (when ``make_step`` binds it) under
            FSDP, DeepSpeed or Megatron-LM, where no process holds every whole
            gradient in ``param.grad``.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> nan_loss = lambda m, b: loss_fn(m, b) * float("nan")
        >>> state = run_epoch(ctx, make_step(ctx, nan_loss, stages=[nan_guard(2, check_every=1)]), loader, state)
        >>> state.should_stop, state.extras["nan_guard"].skipped, state.model.weight.isfinite().all().item()
        (True, 2, True)
    """
    positive_int("max_consecutive", max_consecutive)
    positive_int("check_every", check_every)
    return NanGuard(max_consecutive, check_every)
