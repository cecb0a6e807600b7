"""Performance guards that are correctness: no recompiles, flat memory. (Timing lives in benchmarks/.)"""

import contextlib
import gc
import warnings

import pytest
import torch
from toolz import compose

from trainfold import ema, log_every, make_step, nan_guard, run_epoch, testing, Context, TrainState

import helpers
from helpers import needs_cuda


ON_GPU_WITH_INDUCTOR = pytest.param(
    False,
    "inductor",
    marks=[needs_cuda, pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")],
    id="cuda-inductor",
)


@pytest.mark.multiprocess  # torch.compile starts worker processes
@pytest.mark.parametrize("cpu, backend", [pytest.param(True, "eager", id="cpu-eager"), ON_GPU_WITH_INDUCTOR])
def test_a_compiled_model_is_not_recompiled_after_the_first_steps(cpu, backend):
    """torch.compile keeps working inside make_step: the graph count stops growing after warm-up."""
    from accelerate import Accelerator
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ctx = Context(accelerator=Accelerator(cpu=cpu, gradient_accumulation_steps=2))
    torch.manual_seed(0)
    model = torch.compile(helpers.mlp(), backend=backend, dynamic=False)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(64), batch_size=8, drop_last=True)
    )
    step = make_step(ctx, helpers.ce_loss, clip_grad_norm=1.0)

    state = run_epoch(ctx, step, dl, state)
    after_warmup = dict(counters["stats"])
    for _ in range(3):
        state = run_epoch(ctx, step, dl, state)

    assert after_warmup.get("unique_graphs", 0) >= 1  # it really was compiled
    assert after_warmup == dict(counters["stats"])
    torch._dynamo.reset()


def _allocated_kb():
    """What the process has allocated and not freed (glibc's mallinfo2), or its resident memory where that is missing.

    Not resident memory where it can be helped: after other tests in the same process,
    the heap's free pages are reused and trimmed unpredictably, and resident memory
    moved by a few MB in a full suite run while nothing was allocated per step.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")

        class MallInfo2(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in (
                    "arena",
                    "ordblks",
                    "smblks",
                    "hblks",
                    "hblkhd",
                    "usmblks",
                    "fsmblks",
                    "uordblks",
                    "fordblks",
                    "keepcost",
                )
            ]

        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
        return (info.uordblks + info.hblkhd) // 1024
    except (OSError, AttributeError):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _growth_over_20000_steps_kb():
    ctx, state, loader, loss_fn = testing.tiny_setup(n=1000, batch_size=1)
    step = compose(log_every(ctx, 50), ema(0.9))(make_step(ctx, loss_fn, stages=[nan_guard(3, check_every=100)]))
    for _ in range(2):  # warm-up: allocator pools, first-epoch objects
        state = run_epoch(ctx, step, loader, state)
    gc.collect()
    before = _allocated_kb()

    for _ in range(20):
        state = run_epoch(ctx, step, loader, state)
    gc.collect()

    assert 22_000 == state.micro_step
    return _allocated_kb() - before


@pytest.mark.multiprocess  # a fresh interpreter, 20,000 steps
def test_memory_is_flat_over_20000_steps_with_transformers_on():
    """The state accumulates nothing per step: allocated memory grows by less than 1 MB over 20,000 steps.

    Measured in a fresh interpreter: in the suite's own process, what earlier tests left
    running (torch.compile's workers after the compile test) allocated ~3.7 MB meanwhile.
    """
    import subprocess
    import sys
    from pathlib import Path

    code = "import test_performance as t; print(t._growth_over_20000_steps_kb())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=helpers.scaled(300),
    )

    assert 0 == done.returncode, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) < 1024


@needs_cuda
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_no_host_sync_in_a_step_on_the_gpu(precision):
    """On a GPU, a step with every sync-free transformer runs under set_sync_debug_mode('error')."""
    from accelerate import Accelerator

    ctx = Context(accelerator=Accelerator(mixed_precision=precision, gradient_accumulation_steps=2))
    torch.manual_seed(0)
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(64), batch_size=8))
    step = compose(log_every(ctx, 1000), ema(0.9))(
        make_step(ctx, helpers.ce_loss, clip_grad_norm=1.0, stages=[nan_guard(3, check_every=1000)])
    )
    batches = list(dl)
    state = step(state, batches[0])
    torch.cuda.synchronize()

    with _syncs_raise():
        for b in batches[1:]:
            state = step(state, b)
    torch.cuda.synchronize()


@contextlib.contextmanager
def _syncs_raise():
    """Inside, a synchronising CUDA call raises (``set_sync_debug_mode("error")``); off after."""
    try:
        with warnings.catch_warnings():  # "a prototype feature" (a UserWarning, which pytest makes an error)
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@needs_cuda
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")
def test_no_host_sync_in_a_compiled_step_on_the_gpu():
    """On a GPU, a step compiled with inductor (the loss with the model inside, and the update as one compiled function)
    runs under set_sync_debug_mode('error') after its warm-up, across accumulation boundaries."""
    from accelerate import Accelerator

    from trainfold import Compile

    torch._dynamo.reset()
    ctx = Context(accelerator=Accelerator(gradient_accumulation_steps=2))
    torch.manual_seed(0)
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(64), batch_size=8))
    step = log_every(ctx, 1000)(make_step(ctx, helpers.ce_loss, compile=Compile(backend="inductor")))
    batches = list(dl)
    for b in batches[:2]:  # the warm-up: one micro-batch of each kind compiles
        state = step(state, b)
    torch.cuda.synchronize()

    try:
        with _syncs_raise():
            for b in batches[2:]:
                state = step(state, b)
    finally:
        torch._dynamo.reset()
    torch.cuda.synchronize()
    assert state.step == len(batches) // 2


def _calls(funcs, run) -> int:
    """How many calls of ``funcs`` (torch functions, tensor methods) ``run()`` makes."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += func in funcs
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return Count.calls


def test_nan_guard_makes_one_flag_buffer_per_check_every_updates():
    """The guard's per-update flag is a slot of a buffer made once per read, not a new tensor each update
    kept alive until the read (see benchmarks/README.md for what that did and did not change in time)."""
    factories = (torch.zeros, torch.empty, torch.tensor, torch.zeros_like, torch.stack)
    ctx, state, loader, loss_fn = testing.tiny_setup(n=80, batch_size=4)  # 20 updates
    batches = list(loader)
    plain = _calls(factories, lambda: testing.run_steps(make_step(ctx, loss_fn), state, batches))
    guarded = _calls(
        factories,
        lambda: testing.run_steps(make_step(ctx, loss_fn, stages=[nan_guard(3, check_every=10)]), state, batches),
    )

    assert guarded - plain == 2  # one buffer for each 10 updates


def _to_calls(loader) -> int:
    """How many ``Tensor.to`` calls iterating ``loader`` makes."""
    return _calls((torch.Tensor.to,), lambda: [None for _ in loader])


def test_a_cpu_loader_yields_its_batches_without_moving_them():
    """On a CPU device the batches are where the model is: no per-batch walk and `.to("cpu")` as in Accelerate's loader."""
    from accelerate import Accelerator

    def loader():
        return torch.utils.data.DataLoader(helpers.classification_data(32), batch_size=8)

    ctx = Context(accelerator=Accelerator(cpu=True))
    (ours,) = ctx.prepare_loaders(loader())
    accelerates = ctx.accelerator.prepare(loader())

    assert _to_calls(accelerates) == 4 * 2  # x and y of each of the 4 batches
    assert _to_calls(ours) == 0
    assert all(torch.equal(a, b) for ba, bo in zip(accelerates, ours) for a, b in zip(ba, bo))


@needs_cuda
def test_a_gpu_loader_moves_its_batches_to_the_gpu():
    from accelerate import Accelerator

    ctx = Context(accelerator=Accelerator())
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(16), batch_size=8))

    assert {t.device.type for batch in dl for t in batch} == {"cuda"}


@needs_cuda
def test_gpu_epoch_syncs_only_where_it_reports(tmp_path):
    """A whole composed epoch on the GPU (log_every, a progress bar, background checkpoints, nan_guard, EMA, clipping,
    accumulation, bf16): every synchronising CUDA call (set_sync_debug_mode('warn')) falls in a step that logs, saves or
    ends the epoch, never in another."""
    from accelerate import Accelerator

    from trainfold import checkpoint_every, progress_bar, run_epoch

    ctx = Context(accelerator=Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2))
    torch.manual_seed(0)
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(480), batch_size=8))
    import threading

    synced_at: list[int] = []
    caught: list[
        str
    ] = []  # the training thread's synchronising calls (the saver's thread copies to the host on its own)

    def where(step):  # outermost: which micro-batch each synchronising call fell in
        def marking(s, b):
            seen = len(caught)
            new = step(s, b)
            if len(caught) > seen:
                synced_at.append(new.micro_step)
            return new

        return marking

    log_n, save_n = 5, 7  # updates
    step = compose(
        where,
        progress_bar(ctx, total=len(dl)),
        log_every(ctx, log_n),
        checkpoint_every(ctx, save_n, tmp_path, async_save=True),
        ema(0.9),
    )(make_step(ctx, helpers.ce_loss, clip_grad_norm=1.0, stages=[nan_guard(3, check_every=log_n)]))
    state = step(state, next(iter(dl)))  # the first step builds what it needs
    torch.cuda.synchronize()

    def seen(message, category, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            caught.append(str(message))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            state = run_epoch(ctx, step, dl, state)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    ctx.wait_for_checkpoints()

    allowed = {
        m for m in range(2, 2 * len(dl) + 2, 2) if (m // 2) % log_n == 0 or (m // 2) % save_n == 0
    }  # updates that log or save
    assert synced_at and set(synced_at) <= allowed, (sorted(set(synced_at) - allowed), caught[:3])
