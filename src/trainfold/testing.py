"""Helpers for users who unit-test their steps: tiny seeded fixtures, isolation, sync counting; and a kit that checks
that a loader resumes exactly (``check_resume``).

Example test file:

    from trainfold import make_step, testing

    def test_my_step_learns(isolated):           # isolated: see isolated_accelerate
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        step = make_step(ctx, loss_fn, clip_grad_norm=1.0)
        new = testing.run_steps(step, state, loader, n=3)
        assert new.step == 3 and state.step == 0
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator

import torch
from accelerate import Accelerator

from trainfold._src.backend.engine import reset_process_state
from trainfold._src.base.types import Batch
from trainfold._src.conformance.kit import check_resume, default_cases
from trainfold._src.conformance.report import CaseResult, ResumeCase, ResumeCost, ResumeReport
from trainfold._src.conformance.run import LoaderRequest
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import Step
from trainfold._src.distributed.launch import free_port, run_distributed

__all__ = [
    "SYNC_METHODS",
    "CaseResult",
    "LoaderRequest",
    "ResumeCase",
    "ResumeCost",
    "ResumeReport",
    "SyncCounter",
    "assert_params_changed",
    "assert_params_equal",
    "check_resume",
    "count_host_syncs",
    "default_cases",
    "free_port",
    "isolated_accelerate",
    "mse_loss",
    "parameters",
    "regression_data",
    "reset_accelerate_state",
    "run_distributed",
    "run_steps",
    "tiny_setup",
]

#: The Tensor methods that force a host-device synchronisation on an accelerator.
SYNC_METHODS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state (what Accelerate's own tests do between tests).

    Examples:
        >>> from accelerate import Accelerator
        >>> _ = Accelerator(cpu=True, gradient_accumulation_steps=3)
        >>> reset_accelerate_state()
        >>> Accelerator(cpu=True).gradient_accumulation_steps
        1
    """
    reset_process_state()


@contextlib.contextmanager
def isolated_accelerate() -> Iterator[None]:
    """Run a block with fresh Accelerate process state, and reset it again after.

    Accelerate keeps ``AcceleratorState``/``GradientState`` per process, so tests
    that build Accelerators with different settings must be isolated. The handlers
    of SIGINT and SIGTERM are put back too: a Context installs its own for its life,
    and a test rarely closes its Context. As a
    pytest fixture:

        @pytest.fixture(autouse=True)
        def isolated():
            with testing.isolated_accelerate():
                yield

    Examples:
        >>> from accelerate import Accelerator
        >>> with isolated_accelerate():
        ...     Accelerator(cpu=True, gradient_accumulation_steps=2).gradient_accumulation_steps
        2
    """
    import signal
    import threading

    handlers = (
        {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    reset_accelerate_state()
    try:
        yield
    finally:
        reset_accelerate_state()
        for s, handler in handlers.items():
            signal.signal(s, handler)


class SyncCounter:
    """What :func:`count_host_syncs` counted: ``total`` (all calls) and ``by_method`` (calls per method name).

    Plain attributes, read during or after the ``with`` block.

    Examples:
        >>> with count_host_syncs() as syncs:
        ...     _ = torch.ones(2).sum().item(), torch.ones(2).tolist()
        >>> syncs.total, syncs.by_method
        (2, {'item': 1, 'tolist': 1})
    """

    def __init__(self) -> None:
        self.total = 0
        self.by_method: dict[str, int] = {}

    def add(self, method: str) -> None:
        self.total += 1
        self.by_method[method] = self.by_method.get(method, 0) + 1

    def __repr__(self) -> str:
        return f"SyncCounter(total={self.total}, by_method={self.by_method})"


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    """Count calls of ``Tensor.item``, ``tolist``, ``numpy``, ``bool()``, ``float()``, ``int()``.

    Each of them makes the host wait for the device on a GPU; on CPU they are
    counted all the same, so a CPU test can prove a step has none. Calls made
    inside torch's C++ are not seen (torch's own fp16 scaler, for example).

    Examples:
        >>> with count_host_syncs() as syncs:
        ...     _ = torch.ones(2).sum().item()
        >>> syncs.total
        1
    """
    counts = SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counting(name: str, original: Any) -> Any:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts.add(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def regression_data(n: int = 16, *, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` seeded samples of ``y = 2x + 1 + noise`` with ``x`` of shape ``(1,)``.

    Examples:
        >>> len(regression_data(8)), regression_data(8)[0][0].shape
        (8, torch.Size([1]))
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, generator=g)
    y = 2 * x + 1 + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def mse_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``mean((model(x) - y) ** 2)`` for a batch ``(x, y)``.

    Examples:
        >>> mse_loss(torch.nn.Identity(), (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))).item()
        2.0
    """
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def tiny_setup(
    *,
    seed: int = 0,
    n: int = 16,
    batch_size: int = 4,
    lr: float = 0.1,
    shuffle: bool = False,
    accelerator: Accelerator | None = None,
) -> tuple[Context, TrainState, Any, Any]:
    """A seeded ``Linear(1, 1)`` regression: ``(ctx, state, prepared loader, loss_fn)``.

    CPU, SGD with learning rate ``lr``, ``n`` samples in batches of ``batch_size``.
    Pass ``accelerator`` to use your own (for accumulation or precision).

    Examples:
        >>> ctx, state, loader, loss_fn = tiny_setup(seed=0)
        >>> state.step, len(loader), loss_fn.__name__
        (0, 4, 'mse_loss')
    """
    torch.manual_seed(seed)
    ctx = Context(accelerator=accelerator or Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    loader = torch.utils.data.DataLoader(regression_data(n, seed=seed), batch_size=batch_size, shuffle=shuffle)
    (loader,) = ctx.prepare_loaders(loader)
    return ctx, state, loader, mse_loss


def run_steps(step: Step, state: TrainState, batches: Iterable[Batch], n: int | None = None) -> TrainState:
    """Apply ``step`` to the first ``n`` batches (all if ``None``) and return the final state.

    Examples:
        >>> from trainfold import make_step
        >>> ctx, state, loader, loss_fn = tiny_setup(seed=0)
        >>> run_steps(make_step(ctx, loss_fn), state, loader, n=3).step
        3
    """
    for i, batch in enumerate(batches):
        if n is not None and i >= n:
            break
        state = step(state, batch)
    return state


def parameters(state_or_model: TrainState | torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the parameters, by name (the model unwrapped from DDP if needed).

    Examples:
        >>> sorted(parameters(torch.nn.Linear(1, 1)))
        ['bias', 'weight']
    """
    model = state_or_model.model if isinstance(state_or_model, TrainState) else state_or_model
    model = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _named_message(name: str, message: str) -> str:
    return f"parameter {name!r}: {message}"


def assert_params_equal(
    a: TrainState | torch.nn.Module | dict[str, torch.Tensor],
    b: TrainState | torch.nn.Module | dict[str, torch.Tensor],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> None:
    """Assert two models (or states, or parameter dicts) have the same parameters (exactly, by default).

    Examples:
        >>> model = torch.nn.Linear(1, 1)
        >>> assert_params_equal(model, parameters(model))
    """
    pa = a if isinstance(a, dict) else parameters(a)
    pb = b if isinstance(b, dict) else parameters(b)
    if pa.keys() != pb.keys():
        raise AssertionError(f"parameter names differ: {sorted(pa)} != {sorted(pb)}")
    for name in pa:
        torch.testing.assert_close(
            pa[name], pb[name], rtol=rtol, atol=atol, msg=functools.partial(_named_message, name)
        )


def assert_params_changed(before: dict[str, torch.Tensor], after: TrainState | torch.nn.Module) -> None:
    """Assert every parameter in ``before`` (from :func:`parameters`) differs from ``after``'s.

    Examples:
        >>> model = torch.nn.Linear(1, 1)
        >>> before = parameters(model)
        >>> with torch.no_grad():
        ...     _ = [p.add_(1.0) for p in model.parameters()]
        >>> assert_params_changed(before, model)
    """
    now = parameters(after)
    same = [k for k in before if torch.equal(before[k], now[k])]
    if same:
        raise AssertionError(f"parameters did not change: {same}")
