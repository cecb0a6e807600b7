"""TrainState: everything a run knows, as one frozen value."""

from __future__ import annotations

import uuid
from types import MappingProxyType
from typing import Any, Callable, Mapping, TypeVar

import attrs
import torch
from accelerate import Accelerator

from ._guard import NAME as GUARD
from .context import Context
from .history import History
from .metrics import Entry, fold

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _freeze(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


_COPIERS: dict[tuple[type, tuple[str, ...]], Callable[..., Any]] = {}
_A = TypeVar("_A")


def replace(state: _A, /, **changes: Any) -> _A:
    """``attrs.evolve`` for the hot path: the same result (attrs' ``__init__`` runs), with less Python.

    Works on any attrs instance (the state, and the extras' records such as the EMA's).
    """
    return copier(type(state), *changes)(state, **changes)


def copier(cls: type[_A], *changed: str) -> Callable[..., _A]:
    """``copy(old, *values) -> cls``: ``old`` with the fields ``changed`` set to ``values``, in that order.

    Generated once per class and set of changed fields (as attrs generates
    ``__init__``), and cached: one call of the constructor with every field
    passed by position, no loop over the fields and no dict of them. A step
    that replaces the same fields every time keeps the function and calls it
    positionally; :func:`replace` is the keyword form.
    """
    key = (cls, changed)
    made = _COPIERS.get(key)
    if made is None:
        made = _COPIERS[key] = _copier(cls, changed)
    return made


def _copier(cls: type, changed: tuple[str, ...]) -> Callable[..., Any]:
    fields = [f for f in attrs.fields(cls) if f.init]
    if unknown := set(changed) - {f.alias for f in fields}:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    # the generated names cannot clash with a field's (fields named "state" or "cls" are fine)
    values = {f.alias: f.alias if f.alias in changed else f"__old.{f.name}" for f in fields}
    # by position where __init__ takes it (attrs keeps the fields' order), by keyword otherwise
    args = [values[f.alias] for f in fields if not f.kw_only] + [f"{f.alias}={values[f.alias]}" for f in fields if f.kw_only]
    source = f"def copy(__old{''.join(f', {name}' for name in changed)}):\n    return __cls({', '.join(args)})\n"
    namespace: dict[str, Any] = {"__cls": cls}
    exec(compile(source, f"<trainfold replace of {cls.__name__}>", "exec"), namespace)  # noqa: S102 (field names only)
    return namespace["copy"]


def _handle() -> Any:
    """A field that holds a live object: not part of repr or ==."""
    return attrs.field(repr=False, eq=False)


@attrs.frozen(eq=True)
class TrainState:
    """The state of a training run: handles to the live objects, and values.

    A step or epoch function returns a new TrainState made with
    ``attrs.evolve``; the old one is never changed. The model, optimizer and
    scheduler are *handles*: their tensors are updated in place, as a JAX step
    with donated buffers would. After ``new = step(old, batch)``, ``old.step``
    is still the old count, but ``old.model is new.model``. Use
    :func:`~trainfold.snapshot` for a detached copy.

    Counters:
        step: optimizer updates performed (not micro-batches; an update that a
            mixed-precision gradient scaler skipped for overflow is not counted).
        micro_step: batches consumed by the step function in the whole run.
        epoch: completed epochs.
        batch_in_epoch: batches consumed in the current epoch (the position to
            resume from).

    Records:
        loss_sum, aux_sums: running sums of the batch losses and aux values of
            the current epoch, kept on the device (never synchronised by a step);
            divided by ``batch_in_epoch`` they are the epoch's running means.
            A step launches no kernel to add to them: it appends the micro-batch's
            detached ``(loss, aux)`` to ``unsummed``, and every 64 micro-batches
            adds those with one stack and one sum per name. The two properties
            include the ``unsummed`` micro-batches.
        history: epoch-level :class:`~trainfold.History` of train and eval metrics.
        should_stop: set by epoch functions such as ``early_stop``; ``loop`` reads it.
        extras: named states of step transformers and epoch functions
            (``extras["nan_guard"]``...), a read-only mapping.

    Position:
        cursor: a handle to the epoch being iterated (set by ``run_epoch``; between
            epochs it keeps only the loader, whose generators a checkpoint records),
            or what ``load_checkpoint`` found to resume it; None before the first epoch.
        run_id: a random id given by ``create`` and kept by checkpoints, so that
            two runs never write into one checkpoint folder.

    Subclass only to add fields (as flax's TrainState allows).

    .. versionadded:: 0.1.0
    """

    model: torch.nn.Module = _handle()
    optimizer: torch.optim.Optimizer = _handle()
    scheduler: Any = _handle()
    accelerator: Accelerator = _handle()
    step: int = 0
    micro_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    # The sums up to the micro-batches in ``unsummed``: read them through the properties
    # ``loss_sum`` and ``aux_sums``, which add those (``summed``).
    _loss_sum: torch.Tensor | None = attrs.field(default=None, alias="loss_sum", eq=False, repr=False)
    _aux_sums: Mapping[str, torch.Tensor] = attrs.field(default=_EMPTY, alias="aux_sums", eq=False, repr=False)
    unsummed: tuple[Entry, ...] = attrs.field(default=(), eq=False, repr=False)
    history: History = History()
    should_stop: bool = False
    extras: Mapping[str, Any] = _EMPTY
    cursor: Any = attrs.field(default=None, repr=False, eq=False)
    run_id: str = attrs.field(default="", repr=False, eq=False)

    @classmethod
    def create(
        cls,
        ctx: Context,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extras: Mapping[str, Any] | None = None,
        sync_batchnorm: bool = False,
    ) -> TrainState:
        """Prepare the model, optimizer and scheduler through the Accelerator and start counting.

        Args:
            ctx: the run's :class:`~trainfold.Context`.
            model: an unprepared ``torch.nn.Module``.
            optimizer: an optimizer over ``model``'s parameters.
            scheduler: an optional ``torch.optim.lr_scheduler`` object; Accelerate
                steps it on every optimizer update (``num_processes`` times per update
                unless ``split_batches=True``: see the README's scheduler section), or
                a trainfold schedule already built into the optimizer.
            extras: initial values for ``state.extras``.
            sync_batchnorm: on several processes, convert BatchNorm layers to
                ``torch.nn.SyncBatchNorm`` first (statistics over the global batch). The
                optimizer keeps working: the converted layers share their parameters.
                A no-op on one process; torch supports it on GPU and XPU only.

        Returns:
            A TrainState at step 0, epoch 0.

        Raises:
            TypeError: ``model`` or ``optimizer`` is not what it must be.

        Example:
            >>> import torch
            >>> from accelerate import Accelerator
            >>> ctx = Context(accelerator=Accelerator(cpu=True))
            >>> model = torch.nn.Linear(1, 1)
            >>> state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            >>> state.step, state.epoch
            (0, 0)
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"'model' must be a torch.nn.Module (got {model!r} that is a {type(model).__name__})."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"'optimizer' must be a torch.optim.Optimizer (got {optimizer!r} that is a "
                f"{type(optimizer).__name__}): build it over model.parameters()."
            )
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                f"'scheduler' must have a step() method, like torch.optim.lr_scheduler objects "
                f"(got a {type(scheduler).__name__}); pass scheduler=None for none."
            )
        ctx.check()
        acc = ctx.accelerator
        if sync_batchnorm and acc.num_processes > 1:
            model = convert_sync_batchnorm(model, acc.device)
        if scheduler is None:
            model, optimizer = acc.prepare(model, optimizer)
        else:
            model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
        return cls(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            accelerator=acc,
            loss_sum=torch.zeros((), device=acc.device),
            extras=_freeze(extras),
            run_id=uuid.uuid4().hex[:12],  # os.urandom: draws nothing from the training RNGs
        )

    @property
    def loss_sum(self) -> torch.Tensor | None:
        """The sum of the current epoch's batch losses, a 0-d float32 tensor on the device (None before any batch)."""
        return self.summed()._loss_sum

    @property
    def aux_sums(self) -> Mapping[str, torch.Tensor]:
        """The sums of the current epoch's aux values, by name (0-d float32 tensors on the device)."""
        return self.summed()._aux_sums

    def summed(self) -> TrainState:
        """This state with the micro-batches in ``unsummed`` added to its sums (a few kernels, no sync).

        Read both sums from the result when you need both: each property sums on its own.
        """
        if not self.unsummed:
            return self
        loss_sum, aux_sums = fold(self._loss_sum, self._aux_sums, self.unsummed, mask_nonfinite=GUARD in self.extras)
        return replace(self, loss_sum=loss_sum, aux_sums=aux_sums, unsummed=())

    @property
    def metrics(self) -> Mapping[str, float]:
        """The latest value of every recorded metric (``{"train_loss": ..., "eval_loss": ...}``)."""
        return self.history.latest_values()

    def with_extra(self, name: str, value: Any) -> TrainState:
        """Return a state whose ``extras[name]`` is ``value`` (the others kept)."""
        return replace(self, extras=MappingProxyType({**self.extras, name: value}))


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
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
