"""profile: a window of steps traced with torch.profiler, one Chrome trace per process, training unchanged."""

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProfileKwargs

from trainfold import Context, TrainState, loop, make_step, max_steps, profile, run_epoch, testing

import helpers


def _events(path):
    return {e.get("name") for e in json.loads(Path(path).read_text())["traceEvents"]}


def test_the_window_is_traced_to_one_file_and_training_is_unchanged(tmp_path):
    def run(wrap):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, shuffle=True)
        return loop(run_epoch(ctx, wrap(ctx)(make_step(ctx, loss_fn)), loader), max_epochs=2)(state)

    plain = run(lambda ctx: lambda step: step)
    traced = run(lambda ctx: profile(ctx, tmp_path, wait=1, warmup=1, active=2))

    testing.assert_params_equal(plain, traced)
    record = traced.extras[f"profile:{tmp_path}"]
    assert record.done and record.traces == (str(tmp_path / "profile_0.json"),)
    assert "aten::addmm" in _events(tmp_path / "profile_0.json")  # the Linear's forward was recorded
    assert not torch.autograd.profiler._is_profiler_enabled  # closed after the window


def test_a_stop_inside_the_window_writes_what_was_recorded(tmp_path):
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    step = max_steps(2)(make_step(ctx, loss_fn))
    state = run_epoch(ctx, profile(ctx, tmp_path, wait=0, warmup=1, active=10)(step), loader, state)

    assert state.step == 2 and state.extras[f"profile:{tmp_path}"].done
    assert (tmp_path / "profile_0.json").exists()
    assert not torch.autograd.profiler._is_profiler_enabled


def test_a_second_window_later_in_the_run_is_profiled_too(tmp_path):
    """It recorded nothing: both windows shared one record, which the first had marked done."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = run_epoch(
        ctx, profile(ctx, tmp_path / "a", wait=0, warmup=1, active=1)(make_step(ctx, loss_fn)), loader, state
    )
    state = run_epoch(
        ctx, profile(ctx, tmp_path / "b", wait=0, warmup=1, active=1)(make_step(ctx, loss_fn)), loader, state
    )

    assert (tmp_path / "a" / "profile_0.json").exists() and (tmp_path / "b" / "profile_0.json").exists()


def test_a_window_already_profiled_is_not_profiled_again_and_says_so(tmp_path):
    """What a run resumed from a checkpoint does: the window is done; nothing is silently skipped."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    window = lambda: profile(ctx, tmp_path, wait=0, warmup=1, active=1)(make_step(ctx, loss_fn))  # noqa: E731
    state = run_epoch(ctx, window(), loader, state)
    (tmp_path / "profile_0.json").unlink()

    with pytest.warns(UserWarning, match="was profiled already in this run"):
        state = run_epoch(ctx, window(), loader, state)
    assert not (tmp_path / "profile_0.json").exists()


def test_the_accelerators_output_trace_dir_is_where_the_trace_goes(tmp_path):
    """ProfileKwargs(output_trace_dir=D) with profile(ctx): nothing was written and no trace recorded."""
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ProfileKwargs(output_trace_dir=str(tmp_path / "traces"))])
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, accelerator=accelerator)

    state = run_epoch(ctx, profile(ctx, wait=0, warmup=1, active=1)(make_step(ctx, loss_fn)), loader, state)

    assert (str(tmp_path / "traces" / "profile_0.json"),) == state.extras[f"profile:{tmp_path / 'traces'}"].traces
    assert "aten::addmm" in _events(tmp_path / "traces" / "profile_0.json")


def test_the_accelerators_profile_kwargs_give_the_profilers_settings(tmp_path):
    seen = []
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ProfileKwargs(record_shapes=True, on_trace_ready=seen.append)])
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, accelerator=accelerator)

    run_epoch(ctx, profile(ctx, wait=0, warmup=1, active=1)(make_step(ctx, loss_fn)), loader, state)

    assert len(seen) == 1  # the handler's own on_trace_ready ran, once
    shapes = [e.input_shapes for e in seen[0].events() if e.name == "aten::addmm"]
    assert shapes and all(shapes)  # record_shapes came from the handler


def _profiled_on_this_rank(root):
    ctx = Context(accelerator=Accelerator(cpu=True))
    model, opt, _, dl = helpers.build(0)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    state = run_epoch(ctx, profile(ctx, root, wait=1, warmup=1, active=1)(make_step(ctx, helpers.ce_loss)), dl, state)
    ctx.close()
    return state.extras[f"profile:{root}"].traces


@pytest.mark.multiprocess
def test_each_process_writes_its_own_trace(tmp_path):
    traces = testing.run_distributed(_profiled_on_this_rank, str(tmp_path), nprocs=2)

    assert traces == [(str(tmp_path / "profile_0.json"),), (str(tmp_path / "profile_1.json"),)]
    for (path,) in traces:
        assert "aten::addmm" in _events(path)


def test_bad_windows_are_refused():
    ctx, *_ = testing.tiny_setup(seed=0)
    with pytest.raises(ValueError, match="active must be a positive int"):
        profile(ctx, active=0)
    with pytest.raises(ValueError, match="wait must be a non-negative int"):
        profile(ctx, wait=-1)
