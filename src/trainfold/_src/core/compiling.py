"""A compiled step: what ``make_step(..., compile=...)`` hands to ``torch.compile``, and the proof that it was compiled.

Owned here: :class:`Compile` (the user's choice), :func:`compile_spec` (``True``,
a ``Compile`` or Accelerate's dynamo plugin, checked against the Context), and the
compiled parts of a step: the loss with the model inside it (:func:`loss_of`), an
optimizer's update (:func:`update_of`; with the gradients set to None, :func:`step_and_zero_of`),
the model's repeated blocks (:func:`compile_regions`).

Each part is compiled from a code object of its own. Dynamo keeps compiled code,
and its limit of eight versions (``torch._dynamo.config.recompile_limit``), per
code object: parts that shared one (a wrapper of trainfold's, say) across many
steps built in one process (a sweep, a test suite) would reach the limit and run
eagerly without a word. With a code object per part, the code dynamo made is
exactly that part's, which is also what the check reads: after a part's first
call, dynamo must hold compiled code for it, or the step raises instead of running
eagerly while called compiled.
"""

from __future__ import annotations

import logging
import time
import types
from typing import Any, Callable, Mapping

import attrs
import torch

from trainfold._src.base.types import Batch, LossFn

log = logging.getLogger("trainfold")


def _regions_value(value: Any) -> bool | tuple[type, ...]:
    if isinstance(value, bool):
        return value
    classes = value if isinstance(value, tuple) else (value,)
    if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
        raise TypeError(
            f"Compile(regions=...) takes True, False, or a module class (or a tuple of them) whose instances are the "
            f"repeated blocks (got {value!r})."
        )
    return classes


def _backend_value(instance: Any, attribute: Any, value: Any) -> None:
    if not (isinstance(value, str) or callable(value)):
        raise TypeError(
            f"Compile(backend=...) takes a backend's name ('inductor', 'aot_eager', ...) or a callable (got {value!r})."
        )


@attrs.frozen(kw_only=True)
class Compile:
    """How :func:`~trainfold.make_step` compiles the step (``make_step(ctx, loss_fn, compile=Compile(...))``).

    ``compile=True`` is ``Compile()``, or where the Accelerator has a dynamo plugin
    (``accelerate launch --dynamo_backend``, ``Accelerator(dynamo_backend=...)``) its
    backend, mode, fullgraph and dynamic, which then also compile the loss and the update.

    What is compiled:

    - the loss with the model inside it: ``loss_fn(model, batch)``, forward and (by
      AOTAutograd) backward, one graph where dynamo can trace it whole;
    - with ``regions``, instead, each repeated block's ``forward`` (the blocks of a
      ``ModuleList`` of one class, or the classes given): compiled once, reused by every
      block, seconds instead of minutes for a deep model, and the way under FSDP2,
      whose hooks stay outside the compiled code. The loss and the rest of the model run eagerly;
    - with ``optimizer`` (the default), the optimizer's update, with the learning rate a 0-d
      tensor (dynamo specialises on a float: each new value a scheduler sets would compile again);
      where torch's wrappers of ``optimizer.step`` have nothing to do (no step hook, no fused
      optimizer, no gating stage), the body of its ``step`` and the gradients set to None as one
      compiled function (:func:`step_and_zero_of`).

    The model itself is not wrapped (no ``_orig_mod.`` in its names), so checkpoints
    of compiled and eager runs are one format. Evaluation and prediction call the
    model as it is (eagerly, or its compiled regions).

    Attributes:
        backend: ``torch.compile``'s ``backend``: ``"inductor"`` (the default), ``"aot_eager"``
            (traced, run eagerly: for checking), or a callable.
        mode: ``torch.compile``'s ``mode`` (inductor: ``"max-autotune"``, ``"reduce-overhead"``...).
        options: ``torch.compile``'s ``options`` (inductor's configuration).
        dynamic: ``torch.compile``'s ``dynamic``.
        fullgraph: ``torch.compile``'s ``fullgraph``: a graph break is an error.
        regions: ``True``: compile the blocks of each ``ModuleList`` of the model whose entries are of
            one class; a module class (or a tuple of them): compile each block of that class.
        optimizer: compile the optimizer's update (``optimizer.step()``).

    Examples:
        >>> Compile(backend="aot_eager", optimizer=False)
        Compile(backend='aot_eager', mode=None, options=None, dynamic=None, fullgraph=False, regions=False, optimizer=False)
        >>> Compile(regions=torch.nn.Linear).regions
        (<class 'torch.nn.modules.linear.Linear'>,)
    """

    backend: str | Callable[..., Any] = attrs.field(default="inductor", validator=_backend_value)
    mode: str | None = None
    options: Mapping[str, Any] | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    regions: bool | tuple[type, ...] = attrs.field(default=False, converter=_regions_value)
    optimizer: bool = True

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.compile(fn)`` with these settings."""
        return torch.compile(
            fn,
            backend=self.backend,
            mode=self.mode,
            options=dict(self.options) if self.options else None,
            dynamic=self.dynamic,
            fullgraph=self.fullgraph,
        )


def compile_spec(ctx: Any, value: Any) -> Compile | None:
    """What ``make_step(compile=value)`` compiles with, or None; refusals by name.

    ``True`` takes Accelerate's dynamo plugin where the Accelerator has one.
    """
    if value is None or value is False:
        return None
    if value is True:
        spec = _from_accelerate(ctx.accelerator)
    elif isinstance(value, Compile):
        spec = value
    else:
        raise TypeError(f"make_step(compile=...) takes True, False or a trainfold.Compile (got {value!r}).")
    from trainfold._src.backend.engine import is_deepspeed

    if is_deepspeed(ctx.accelerator):
        raise ValueError(
            "make_step(compile=...): under DeepSpeed the engine runs the model and the optimizer: compile with "
            "DeepSpeed's own setting (its config's \"compile\" section, or Accelerate's dynamo plugin, which hands "
            "the model to engine.compile), and leave make_step's compile unset."
        )
    return spec


def _from_accelerate(accelerator: Any) -> Compile:
    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    backend = getattr(getattr(plugin, "backend", None), "value", "NO")
    if plugin is None or backend == "NO":
        return Compile()
    return Compile(
        backend=backend.lower(),
        mode=plugin.mode,
        options=plugin.options,
        dynamic=plugin.dynamic,
        fullgraph=bool(plugin.fullgraph),  # sync: none: a config flag
    )


def own_code(fn: types.FunctionType, name: str) -> types.FunctionType:
    """A copy of ``fn`` with a code object of its own, named ``name`` (in dynamo's logs): see the module's docstring."""
    code = (
        fn.__code__.replace(co_name=name, co_qualname=name)
        if hasattr(fn.__code__, "co_qualname")
        else fn.__code__.replace(co_name=name)
    )
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compiled_versions(code: types.CodeType) -> int:
    """How many compiled versions of ``code`` dynamo holds (0: it compiled none)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def _limit() -> int:
    import torch._dynamo.config as config

    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def checked(
    fn: Callable[..., Any], spec: Compile, codes: tuple[types.CodeType, ...], what: str, *, shared: bool = False
) -> Callable[..., Any]:
    """``fn`` compiled with ``spec``, which after its first call must have compiled code in dynamo.

    Under a dispatch mode (``Watch``'s ``FlopCounterMode`` on the first step) ``fn`` runs
    eagerly: dynamo would not compile it there, and would not try again after.

    ``codes``: the code objects dynamo compiles for it, one of which must hold compiled
    code after the first call. ``shared``: they are shared with other callers (torch's
    optimizers' ``step``, one per class): compiled versions of other optimizers may be
    there already, so the first call must add one, reuse one, and not find the limit reached.

    Raises (at the first call):
        RuntimeError: dynamo compiled nothing for it, so it ran eagerly.
    """
    compiled, first = spec.compile(fn), [True]

    def call(*args: Any) -> Any:
        if not first[0]:
            return compiled(*args)
        if _counting():
            return fn(*args)  # the same computation; the check waits for the next call
        before = [compiled_versions(c) for c in codes]
        log.info(
            "make_step(compile=...): compiling %s at its first call (backend %s; this can take minutes)",
            what,
            getattr(spec.backend, "__name__", spec.backend),
        )
        started = time.perf_counter()
        out = compiled(*args)
        first[0] = False
        _check(what, before, [compiled_versions(c) for c in codes], shared)
        log.info(
            "make_step(compile=...): %s compiled in %.1f s (checked: dynamo holds compiled code for it)",
            what,
            time.perf_counter() - started,
        )
        return out

    return call


def _counting() -> bool:
    """True under a dispatch mode (``Watch``'s ``FlopCounterMode`` counting the first step)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def _check(what: str, before: list[int], after: list[int], shared: bool) -> None:
    if not any(after):
        raise RuntimeError(
            f"make_step(compile=...): {what} was to be compiled and dynamo compiled nothing for it, so it ran eagerly: "
            "dynamo is off (the TORCHDYNAMO_DISABLE variable, torch._dynamo.config.disable, or a torch.compiler.disable "
            "around it) or skipped the function (TORCH_LOGS=dynamo says why). Turn dynamo on, or build the step without compile."
        )
    if shared and after == before and max(after) >= _limit():
        raise RuntimeError(
            f"make_step(compile=...): {what} ran eagerly: dynamo already holds {max(after)} compiled versions of it in this "
            f"process (other optimizers of the class, compiled earlier), its limit (torch._dynamo.config.recompile_limit). "
            "Raise the limit, or call torch._dynamo.reset() between runs that build new optimizers."
        )


def loss_of(loss_fn: LossFn, spec: Compile) -> LossFn:
    """``loss_fn`` compiled with the model inside it: ``(model, batch) -> loss_fn(model, batch)``."""

    def loss(model: torch.nn.Module, batch: Batch) -> Any:
        return loss_fn(model, batch)

    name = f"compiled_loss[{getattr(loss_fn, '__name__', type(loss_fn).__name__)}]"
    fn = own_code(loss, name)  # type: ignore[arg-type]
    return checked(fn, spec, (fn.__code__,), f"the loss ({name})")


def update_of(optimizer: torch.optim.Optimizer, spec: Compile) -> Callable[[], Any]:
    """``optimizer.step()`` compiled, with the learning rate a tensor (:func:`~trainfold._src.backend.optim.lr_as_tensor`).

    Compiled as torch's tutorials do, ``torch.compile(optimizer.step)``: no frame of
    trainfold's in between. torch's optimizers break the graph around their ``step``
    body, which dynamo compiles as a frame of its own: the class's, shared by every
    optimizer of it in the process (the check counts the versions of each function
    ``optimizer.step`` wraps).
    """
    from trainfold._src.backend.optim import lr_as_tensor

    name = f"the optimizer's update ({type(optimizer).__name__}.step)"
    step = checked(optimizer.step, spec, _wrapped_codes(optimizer.step), name, shared=True)

    def compiled_update() -> Any:
        lr_as_tensor(optimizer)  # again after a load_state_dict, which puts the saved number back
        return step()

    return compiled_update


def step_and_zero_of(optimizer: torch.optim.Optimizer, spec: Compile) -> Callable[[], Any]:
    """The optimizer's update and then its gradients set to None, compiled as one function where torch's optimizer allows.

    ``optimizer.step()`` passes through torch's wrappers before its body: the profiler's
    (its ``record_function``, and the step hooks) and the grad mode's, which breaks the
    graph on both sides of the body; ``zero_grad()`` is kept out of dynamo altogether
    and loops over the parameters in Python. Where neither wrapper has anything to do,
    the body of the optimizer's ``step`` and the gradients set to None are compiled as
    one function of their own (:func:`lean_update_body`), run with the grad mode off as
    torch's wrapper sets it: the same kernels, one compiled frame instead of several, and no
    ``zero_grad`` in Python (on the tiny MLP with AdamW, 29 to 90 µs less an update in
    ``benchmarks/bench_compile.py``'s runs). Where they have
    something to do (a step hook registered, now or later; the step patched on the
    optimizer by something else than a scheduler; a subclass's own ``zero_grad``; a fused or
    differentiable optimizer), the update is :func:`update_of` followed by ``zero_grad()``.
    """
    from torch.optim import optimizer as torch_optimizer

    from trainfold._src.backend.optim import lr_as_tensor

    standard = update_of(optimizer, spec)
    body = lean_update_body(optimizer)
    if body is None:

        def step_then_zero() -> None:
            standard()
            optimizer.zero_grad()

        return step_then_zero

    name = f"compiled_update[{type(optimizer).__name__}]"
    fn = own_code(body, name)  # type: ignore[arg-type]
    lean = checked(fn, spec, (fn.__code__,), f"the optimizer's update ({name})")
    pre, post = torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks
    class_step = type(optimizer).step

    def step_and_zero() -> None:
        own_step = optimizer.__dict__.get("step")
        by_scheduler = (
            own_step is not None
            and getattr(own_step, "__wrapped__", None) is class_step
            and hasattr(own_step, "_wrapped_by_lr_sched")
        )
        if (
            pre
            or post
            or optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks
            or (own_step is not None and not by_scheduler)
        ):
            standard()
            optimizer.zero_grad()
            return
        lr_as_tensor(optimizer)
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # what torch's wrapper sets around the body (a non-differentiable optimizer)
        try:
            lean(optimizer)
        finally:
            torch.set_grad_enabled(grad)
        if by_scheduler:
            optimizer._opt_called = True  # type: ignore[attr-defined]  # what the scheduler's own wrapper records

    return step_and_zero


def lean_update_body(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], None] | None:
    """``update(optimizer)``: the body of the optimizer's ``step``, then each gradient set to None; or None where it is not that.

    Only for torch's own pattern, recognised by code object rather than by name: the
    class's ``step`` is the profiler's wrapper (``Optimizer.profile_hook_step``) around
    the grad mode's (``_use_grad_for_differentiable``) around the body; ``zero_grad`` and
    the profiler's no-op ``_optimizer_step_code`` are ``Optimizer``'s own; the optimizer
    is neither fused (one kernel already; dynamo leaves it alone) nor differentiable.
    """
    from torch.optim import optimizer as torch_optimizer

    cls, base = type(optimizer), torch.optim.Optimizer
    if (
        cls.zero_grad is not base.zero_grad
        or cls._optimizer_step_code is not base._optimizer_step_code
        or optimizer.defaults.get("fused")
        or optimizer.defaults.get("differentiable")
    ):
        return None
    profiled = getattr(cls.step, "__wrapped__", None)
    body = getattr(profiled, "__wrapped__", None)
    if (
        body is None
        or getattr(cls.step, "__code__", None) not in _inner_codes(base.profile_hook_step)
        or getattr(profiled, "__code__", None) not in _inner_codes(torch_optimizer._use_grad_for_differentiable)
    ):
        return None

    def update(optimizer: torch.optim.Optimizer) -> None:
        body(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    return update


def _inner_codes(fn: Any) -> tuple[types.CodeType, ...]:
    """The code objects of the functions defined inside ``fn`` (a decorator's wrapper)."""
    return tuple(
        c
        for c in getattr(fn, "__code__", types.SimpleNamespace(co_consts=())).co_consts
        if isinstance(c, types.CodeType)
    )


def _wrapped_codes(fn: Any) -> tuple[types.CodeType, ...]:
    """The code objects of ``fn`` and of each function it wraps (``__wrapped__``, as ``functools.wraps`` records)."""
    codes = []
    while fn is not None:
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes.append(code)
        fn = getattr(fn, "__wrapped__", None)
    return tuple(codes)


def repeated_blocks(model: torch.nn.Module, regions: bool | tuple[type, ...]) -> list[torch.nn.Module]:
    """The blocks ``regions`` names in ``model``: of the given classes, or every ``ModuleList``'s of one class (2 or more)."""
    if isinstance(regions, tuple):
        return [m for m in model.modules() if isinstance(m, regions)]
    blocks: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and len({type(b) for b in m}) == 1:
            blocks.extend(m)
    return blocks


#: where a model keeps the settings its regions were compiled with (so a later micro-batch, or step, compiles none again)
_REGIONS = "_trainfold_compiled_regions"


def compile_regions(model: torch.nn.Module, spec: Compile) -> None:
    """Give each repeated block a compiled ``forward``: one compiled function per block class, shared by its blocks.

    Done once per model and settings (kept on the model). The blocks' hooks (FSDP2's
    among them) stay outside the compiled code; their parameters and names do not change.

    Raises:
        ValueError: the model has no such block.
    """
    done = model.__dict__.get(_REGIONS)
    if done is not None and (done is spec or done == spec):  # (at every micro-batch: a lookup)
        return
    blocks = repeated_blocks(model, spec.regions)
    if not blocks:
        wanted = (
            "ModuleList of two or more blocks of one class"
            if spec.regions is True
            else f"module of class {', '.join(c.__name__ for c in spec.regions)}"  # type: ignore[union-attr]
        )
        raise ValueError(
            f"make_step(compile=Compile(regions=...)): the model ({type(model).__name__}) has no {wanted} to compile; "
            "name the block class (Compile(regions=MyBlock)) or compile the whole loss (regions=False)."
        )
    by_class: dict[type, Callable[..., Any]] = {}
    for block in blocks:
        cls = type(block)
        if cls not in by_class:
            forward = own_code(cls.forward, f"compiled_region[{cls.__name__}]")  # type: ignore[arg-type]
            by_class[cls] = checked(forward, spec, (forward.__code__,), f"the region {cls.__name__}.forward")
        block.forward = types.MethodType(by_class[cls], block)
    model.__dict__[_REGIONS] = spec
