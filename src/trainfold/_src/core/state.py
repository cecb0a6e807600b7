"""TrainState: everything a run knows, as one frozen value."""

from __future__ import annotations

import math
import uuid
from types import MappingProxyType
from typing import Any, Mapping

import attrs
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from trainfold._src.backend.engine import (
    convert_sync_batchnorm,
    engine_builds_optimizers,
    is_config_optimizer,
    is_config_scheduler,
)
from trainfold._src.backend.loaders import deepspeed_micro_batch_unset
from trainfold._src.backend.precision import drop_fp32_outputs
from trainfold._src.base.history import History
from trainfold._src.base.running_sums import RunningSums
from trainfold._src.core.context import Context
from trainfold._src.core.cursor import EpochCursor, Resume
from trainfold._src.core.stop import Stop

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _freeze(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


def _handle() -> Any:
    """A field that holds a live object: not part of repr or ==."""
    return attrs.field(repr=False, eq=False)


def _check_has_values(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """Refuse a model built on the meta device (shapes, no values) where Accelerate would fail to move it: only
    FSDP and DeepSpeed fill such a model themselves."""
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return
    empty = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if empty is not None:
        raise ValueError(
            f"'model' tensor {empty!r} is on the meta device: it has a shape but no values to train. Give the model "
            f"memory first, model.to_empty(device={str(accelerator.device)!r}), then build the optimizer over "
            "model.parameters(); load_checkpoint then fills it (the checkpoint's verified bytes become its tensors, "
            "with no copy), or initialize it yourself."
        )


def _check_optimizer_fits(model: torch.nn.Module, optimizer: Any, scheduler: Any, groups: list[dict[str, Any]]) -> None:
    """Refuse what would train silently wrong: an optimizer over none of the model's parameters, a
    non-finite learning rate, a scheduler built on another optimizer. ``groups`` are the optimizer's
    parameter groups (``params`` and ``lr``)."""
    own = {id(p) for p in model.parameters()}
    params = [p for group in groups for p in group["params"]]
    if params and not any(id(p) in own for p in params):
        raise ValueError(
            "'optimizer' updates none of the model's parameters (it was built over another model, or over a copy): "
            "its updates would leave this model unchanged. Build it over model.parameters() of the model you pass."
        )
    for i, group in enumerate(groups):
        lr = group.get("lr")
        value = None if lr is None else float(lr)  # sync: once, at TrainState.create (a CPU number or 0-d CPU tensor)
        if value is not None and not math.isfinite(value):
            raise ValueError(
                f"'optimizer' parameter group {i} has lr={value}: a non-finite learning rate trains silently to NaN."
            )
    bound = getattr(scheduler, "optimizer", None)
    if scheduler is not None and bound is not None and bound is not optimizer:
        raise ValueError(
            "'scheduler' was built on another optimizer than the one passed: it would change that one's learning "
            "rate, not this one's. Build it as Scheduler(optimizer, ...) over the optimizer you pass."
        )


def _check_config_objects(ctx: Context, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> None:
    """Accelerate's DummyOptim (and DummyScheduler): only where the engine builds them from its config, and
    checked as a real optimizer is. Materialises ``optimizer.params`` (often a generator) so that checking
    it does not empty it."""
    if not engine_builds_optimizers(ctx.accelerator):
        raise TypeError(
            "'optimizer' is Accelerate's DummyOptim, which stands for the optimizer a DeepSpeed (or Megatron-LM) config "
            "defines, but this Accelerator does not run DeepSpeed: pass a torch optimizer, or run under DeepSpeed."
        )
    optimizer.params = list(optimizer.params)
    groups = [item if isinstance(item, dict) else {"params": [item]} for item in optimizer.params]
    lr = (
        optimizer.lr if isinstance(optimizer.lr, (int, float)) else None
    )  # DeepSpeed's "auto" and the like: its config's
    _check_optimizer_fits(model, optimizer, scheduler, [{"lr": lr, **g} for g in groups])


@attrs.frozen(eq=True)
class TrainState:
    """The state of a training run: handles to the live objects, and values.

    A step or epoch function returns a new TrainState made with
    ``attrs.evolve``; the old one is never changed. The model, optimizer and
    scheduler are *handles*: their tensors are updated in place, as a JAX step
    with donated buffers would. After ``new = step(old, batch)``, ``old.step``
    is still the old count, but ``old.model is new.model``. Use
    :func:`~trainfold.snapshot` for a detached copy.

    Its fields (each with an entry in the API reference and a docstring where it is declared): the handles (``model``, ``optimizer``,
    ``scheduler``, ``accelerator``); the counters (``step``, ``micro_step``,
    ``epoch``, ``batch_in_epoch``); the records (``sums``, ``history``, ``stop``,
    ``end_of_epoch``, ``extras``); the position (``cursor``, ``run_id``).

    Subclass only to add fields (as flax's TrainState allows).

    Examples:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> ctx = Context(accelerator=Accelerator(cpu=True))
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> state.step, state.epoch, state.should_stop, state.model is model
        (0, 0, False, True)
    """

    model: torch.nn.Module = _handle()
    """The prepared model: a handle, updated in place by each update."""
    optimizer: torch.optim.Optimizer = _handle()
    """The prepared optimizer: a handle."""
    scheduler: Any = _handle()
    """The prepared learning-rate scheduler, or None: a handle."""
    accelerator: Accelerator = _handle()
    """The run's Accelerator (the Context's)."""
    step: int = 0
    """Optimizer updates performed (not micro-batches; an update that a mixed-precision gradient scaler skipped
    for overflow is not counted)."""
    micro_step: int = 0
    """Batches consumed by the step function in the whole run."""
    epoch: int = 0
    """Completed epochs."""
    batch_in_epoch: int = 0
    """Batches consumed in the current epoch (the position to resume from)."""
    sums: RunningSums = attrs.field(factory=RunningSums, eq=False, repr=False)
    """The :class:`~trainfold.RunningSums` of the current epoch's batch losses and aux values, kept on the device
    (never synchronised by a step); divided by ``batch_in_epoch`` they are the epoch's running means.
    :attr:`loss_sum` and :attr:`aux_sums` read them."""
    history: History = History()
    """The epoch-level :class:`~trainfold.History` of train and eval metrics."""
    stop: Stop | None = None
    """None while the run goes on; a :class:`~trainfold.Stop` (its reason, whether it is final, whether the run is
    finished) once something decided to end this invocation: ``run_epoch``, ``loop`` and the other combinators
    stop when it is set (by ``max_steps``, ``early_stop``, ``nan_guard``, a signal, or your code: :meth:`with_stop`).
    :attr:`should_stop` reads it."""
    end_of_epoch: bool = False
    """End the current epoch after this batch, as if the loader had ended (``stop_when(..., end="epoch")`` sets
    it): ``run_epoch`` records the epoch and clears the flag; training goes on with the next epoch."""
    extras: Mapping[str, Any] = _EMPTY
    """Named states of step transformers and epoch functions (``extras["nan_guard"]``...), a read-only mapping."""
    cursor: EpochCursor | Resume | None = attrs.field(default=None, repr=False, eq=False)
    """A handle to the epoch being iterated (set by ``run_epoch``; between epochs it keeps only the loader, whose
    generators a checkpoint records), or what ``load_checkpoint`` found to resume it; None before the first epoch."""
    run_id: str = attrs.field(default="", repr=False, eq=False)
    """A random id given by :meth:`create` and kept by checkpoints, so that two runs never write into one
    checkpoint folder."""

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
        outputs_to_fp32: bool = True,
    ) -> TrainState:
        """Prepare the model, optimizer and scheduler through the Accelerator and start counting.

        Args:
            ctx: the run's :class:`~trainfold.Context`.
            model: an unprepared ``torch.nn.Module``.
            optimizer: an optimizer over ``model``'s parameters; under DeepSpeed with an
                optimizer in its config, Accelerate's ``DummyOptim(model.parameters(), ...)``.
            scheduler: an optional ``torch.optim.lr_scheduler`` object; Accelerate
                steps it on every optimizer update (``num_processes`` times per update
                unless ``split_batches=True``: see the guide "Composing a loop", Schedulers), or
                a trainfold schedule already built into the optimizer; under DeepSpeed with a
                scheduler in its config, Accelerate's ``DummyScheduler(optimizer, ...)``.
            extras: initial values for ``state.extras``.
            sync_batchnorm: on several processes, convert BatchNorm layers to
                ``torch.nn.SyncBatchNorm`` first (statistics over the global batch). The
                optimizer keeps working: the converted layers share their parameters.
                A no-op on one process; torch supports it on GPU and XPU only.
            outputs_to_fp32: under native mixed precision (``mixed_precision="bf16"`` or
                ``"fp16"``) Accelerate converts every low-precision tensor the model returns
                to float32 (``convert_outputs_to_fp32``). ``False`` keeps autocast and
                drops that copy: the outputs stay in autocast's dtype. For a model that
                computes its loss in ``forward`` (a transformers model given ``labels``)
                the loss is float32 either way and training is the same, bit for bit,
                without copying the logits (about 2% of a GPT-2-small step); a loss
                computed from the outputs sees them in bf16 or fp16. Nothing to drop
                without mixed precision or under DeepSpeed.

        Returns:
            A TrainState at step 0, epoch 0.

        Raises:
            TypeError: ``model`` or ``optimizer`` is not what it must be,
                ``scheduler`` is a class instead of a scheduler, or
                ``outputs_to_fp32`` is not a bool.
            ValueError: the optimizer updates none of the model's parameters, a
                learning rate is NaN or infinite, the scheduler was built on
                another optimizer, or (outside FSDP and DeepSpeed) the model is on
                the meta device (``model.to_empty(device=...)`` gives it memory).

        Examples:
            >>> import torch
            >>> from accelerate import Accelerator
            >>> ctx = Context(accelerator=Accelerator(cpu=True))
            >>> model = torch.nn.Linear(1, 1)
            >>> state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            >>> state.step, state.epoch
            (0, 0)
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"'model' must be a torch.nn.Module (got {model!r} that is a {type(model).__name__}).")
        config_optimizer = is_config_optimizer(optimizer)
        if config_optimizer:
            _check_config_objects(ctx, model, optimizer, scheduler)
        elif not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"'optimizer' must be a torch.optim.Optimizer (got {optimizer!r} that is a "
                f"{type(optimizer).__name__}): build it over model.parameters()."
            )
        if is_config_scheduler(scheduler) and not config_optimizer:
            raise TypeError(
                f"'scheduler' is Accelerate's {type(scheduler).__name__}, which stands for a scheduler in the DeepSpeed (or "
                "Megatron-LM) config, but 'optimizer' is a real one: pass accelerate.utils.DummyOptim as the optimizer "
                "when the config defines it, or a real scheduler."
            )
        if isinstance(scheduler, type):
            raise TypeError(
                f"'scheduler' is the class {scheduler.__name__}, not a scheduler: build one over the optimizer, "
                f"e.g. {scheduler.__name__}(optimizer, ...)."
            )
        if (
            scheduler is not None
            and not is_config_scheduler(scheduler)
            and not callable(getattr(scheduler, "step", None))
        ):
            raise TypeError(
                f"'scheduler' must have a step() method, like torch.optim.lr_scheduler objects "
                f"(got a {type(scheduler).__name__}); pass scheduler=None for none."
            )
        if not config_optimizer:
            _check_optimizer_fits(model, optimizer, scheduler, optimizer.param_groups)
        if not isinstance(outputs_to_fp32, bool):
            raise TypeError(f"'outputs_to_fp32' must be True or False (got {outputs_to_fp32!r}).")
        ctx.check()
        acc = ctx.accelerator
        _check_has_values(model, acc)
        if deepspeed_micro_batch_unset(acc):
            raise ValueError(
                "TrainState.create: under DeepSpeed, the engine is built with the micro-batch size, which Accelerate takes "
                "from the training loader: call ctx.prepare_loaders(train_dl) before TrainState.create, or set "
                "train_micro_batch_size_per_gpu in the DeepSpeed config."
            )
        if sync_batchnorm and acc.num_processes > 1:
            model = convert_sync_batchnorm(model, acc.device)
        if scheduler is None:
            model, optimizer = acc.prepare(model, optimizer)
        else:
            model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
        if not outputs_to_fp32:
            drop_fp32_outputs(model)
        return cls(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            accelerator=acc,
            sums=RunningSums.zero(acc.device),
            extras=_freeze(extras),
            run_id=uuid.uuid4().hex[:12],  # os.urandom: draws nothing from the training RNGs
        )

    @property
    def loss_sum(self) -> torch.Tensor | None:
        """The sum of the current epoch's batch losses, a 0-d float32 tensor on the device (None before any batch)."""
        return self.sums.loss

    @property
    def aux_sums(self) -> Mapping[str, torch.Tensor]:
        """The sums of the current epoch's aux values, by name (0-d float32 tensors on the device)."""
        return self.sums.aux

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The loss of the last batch the step consumed, detached, on the device (no sync to read it).

        What a step transformer reads to act on each batch's value (``stop_when``,
        your own): ``new = step(state, batch); new.last_loss``. The value as recorded
        (a stage may have replaced it, as ``normalize="tokens"`` does by the per-token
        mean), in the loss function's dtype. None before the first batch of an epoch,
        and after ``load_checkpoint`` until the next batch.
        """
        last = self.sums.last
        return None if last is None else last[0]

    @property
    def last_aux(self) -> Mapping[str, torch.Tensor]:
        """The aux values of the last batch the step consumed, detached, on the device (empty when :attr:`last_loss` is None)."""
        last = self.sums.last
        return _EMPTY if last is None else last[1]

    @property
    def metrics(self) -> Mapping[str, float]:
        """Every metric recorded for the model as it is: the values recorded at the current update (``state.step``).

        ``{"train_loss": ..., "eval_loss": ...}`` after an epoch and its evaluation.
        A value recorded at an earlier update is not in it (never a stale value as
        current): asking for one raises a ``KeyError`` that says where it was last
        recorded; ``state.history.latest(name)`` gives it.
        """
        return self.history.at(self.step)

    @property
    def should_stop(self) -> bool:
        """Whether this invocation ends here (:attr:`stop` is set): what ``run_epoch`` and the loops obey."""
        return self.stop is not None

    @property
    def ended_mid_epoch(self) -> bool:
        """True when a final stop (``stop.final``: a budget, ``stop_when``) ended the run in the middle of an epoch.

        The epoch stays open (a checkpoint continues it), but the epoch functions run on
        this state: the final model is evaluated. ``early_stop`` and
        ``reduce_lr_on_plateau`` count completed epochs only and pass it through.
        """
        return self.stop is not None and self.stop.final and self.batch_in_epoch > 0

    @property
    def interrupted(self) -> bool:
        """True between a ``run_epoch`` that stopped before its loader's end and the ``loop`` that ends.

        The epoch stays open (``epoch`` unchanged, ``batch_in_epoch`` its position), so
        a checkpoint of this state continues it, and the epoch-level functions composed
        after ``run_epoch`` (``evaluate``, ``early_stop``, ``log_epoch``, ``save_best``,
        ``reduce_lr_on_plateau``, ``every_epochs``) pass it through: they are about a
        completed epoch. ``save_checkpoint`` saves it. ``loop``, ``repeat`` and ``until``
        return it with this flag cleared (still stopped, still mid-epoch), so code after
        the loop runs as written and tells a stop mid-epoch by ``state.should_stop and
        state.batch_in_epoch > 0``.
        """
        return isinstance(self.cursor, EpochCursor) and self.cursor.interrupted

    def with_stop(self, reason: str, *, finished: bool = False, final: bool = False) -> TrainState:
        """Return this state stopped: :attr:`stop` set to ``Stop(reason, final, finished)``.

        A run already finished stays finished. ``final=True``: the stop is where this invocation
        was meant to end; ``finished=True``: the run is over for good (see :class:`~trainfold.Stop`).

        Examples:
            >>> s = TrainState(model=None, optimizer=None, scheduler=None, accelerator=None).with_stop("max_steps")
            >>> s.should_stop, s.stop
            (True, Stop(reason='max_steps', final=False, finished=False))
        """
        was_finished = self.stop is not None and self.stop.finished
        return attrs.evolve(self, stop=Stop(reason, final=final, finished=was_finished or finished))

    def with_extra(self, name: str, value: Any) -> TrainState:
        """Return a state whose ``extras[name]`` is ``value`` (the others kept)."""
        return attrs.evolve(self, extras=MappingProxyType({**self.extras, name: value}))
