"""The gradient norm as a metric: recorded on the device at every update, averaged over updates, no sync of its own."""

import math

import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, clip_by_norm, log_every, loop, make_step, run_epoch, testing

import helpers

EPOCHS = 2


def _accelerate_way(ga, clip):
    """Accelerate's gradient_accumulation_for_autoregressive_models.py: grad_norm = accelerator.clip_grad_norm_(...) on sync steps."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ga)
    model, opt, _, dl = helpers.build(0, shuffle=True, dropout=0.2)
    torch.manual_seed(7)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    norms = []
    for _ in range(EPOCHS):
        model.train()
        epoch = []
        for batch in dl:
            with accelerator.accumulate(model):
                accelerator.backward(helpers.ce_loss(model, batch))
                if accelerator.sync_gradients:
                    epoch.append(accelerator.clip_grad_norm_(model.parameters(), clip))
                opt.step()
                opt.zero_grad()
        norms.append(torch.stack(epoch).mean().item())
    return testing.parameters(model), norms


def _trainfold_way(ga, clip):
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=ga))
    model, opt, _, dl = helpers.build(0, shuffle=True, dropout=0.2)
    torch.manual_seed(7)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    if math.isinf(clip):
        step = make_step(ctx, helpers.ce_loss, record_grad_norm=True)
    else:
        step = make_step(ctx, helpers.ce_loss, clip_grad_norm=clip, record_grad_norm=True)
    state = loop(run_epoch(ctx, step, dl), max_epochs=EPOCHS)(state)
    return testing.parameters(state), state.history["train_grad_norm"], sorted(state.metrics)


def _both_ways(ga, clip):
    return helpers.each_fresh(lambda: _accelerate_way(ga, clip), lambda: _trainfold_way(ga, clip))


def _check(expected, got):
    (params, norms), (got_params, got_norms, names) = expected, got
    testing.assert_params_equal(params, got_params)
    assert got_norms == pytest.approx(norms, rel=1e-6)
    assert names == ["train_grad_norm", "train_loss"]  # the weight is not a metric


@pytest.mark.parametrize("ga,clip", [(1, 0.5), (3, 0.5), (1, math.inf), (3, math.inf)])
def test_the_recorded_norm_is_the_epoch_mean(ga, clip):
    """With clipping (the norm before clipping) and without (the norm alone: training unchanged, as clip_grad_norm_(inf) is)."""
    _check(*_both_ways(ga, clip))


@pytest.mark.multiprocess
def test_on_two_processes_the_norm_is_that_of_the_averaged_gradients():
    for expected, got in testing.run_distributed(_both_ways, 3, 0.5, nprocs=2):
        _check(expected, got)


def test_recording_the_norm_leaves_training_bit_for_bit_unchanged():
    def run(record):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, shuffle=True)
        return loop(run_epoch(ctx, make_step(ctx, loss_fn, record_grad_norm=record), loader), max_epochs=3)(state)

    plain, recorded = run(False), run(True)

    testing.assert_params_equal(plain, recorded)
    assert plain.history["train_loss"] == recorded.history["train_loss"]
    assert len(recorded.history["train_grad_norm"]) == 3


def test_log_every_reports_the_mean_norm():
    """`log_every` reports the mean norm of the updates since its last report."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=32)  # 8 updates
    norms = []

    def reading(step):
        def read(state, batch):
            new = step(state, batch)
            norms.append(new.last_aux["grad_norm"].item())
            return new

        return read

    step = log_every(ctx, 3)(reading(make_step(ctx, loss_fn, record_grad_norm=True)))
    state = run_epoch(ctx, step, loader, state)

    report = state.extras["log_every"]
    assert report.step == 6
    assert report.values["grad_norm"] == pytest.approx(sum(norms[3:6]) / 3, rel=1e-6)
    assert "grad_norm@weight" not in report.values


def test_recording_the_norm_adds_no_host_sync_to_a_step():
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    batches = list(loader)
    for record in (False, True):
        with testing.count_host_syncs() as syncs:
            testing.run_steps(make_step(ctx, loss_fn, record_grad_norm=record), state, batches)
        assert syncs.total == 0


def test_record_grad_norm_must_be_a_bool():
    ctx, *_ = testing.tiny_setup(seed=0)
    with pytest.raises(TypeError, match="record_grad_norm must be True or False"):
        make_step(ctx, lambda m, b: m(b[0]).sum(), record_grad_norm="yes")


def test_clip_by_norm_records_its_norm():
    """One way to record the norm: with a clip_by_norm among the stages it is that stage's norm, computed once, and the
    run is the one clip_grad_norm= gives, bit for bit."""

    calls = []

    def run(**options):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, shuffle=True)
        clip = ctx.accelerator.clip_grad_norm_
        ctx.accelerator.clip_grad_norm_ = lambda *args: calls.append(args[1]) or clip(*args)  # counted, Accelerate's own
        return loop(run_epoch(ctx, make_step(ctx, loss_fn, record_grad_norm=True, **options), loader), max_epochs=2)(state)

    by_option, by_stage = run(clip_grad_norm=0.5), run(stages=[clip_by_norm(0.5)])

    assert calls == [0.5] * 16  # 8 updates each: one norm per update, the clipping's
    testing.assert_params_equal(by_option, by_stage)
    assert by_option.history == by_stage.history
    assert len(by_stage.history["train_grad_norm"]) == 2
