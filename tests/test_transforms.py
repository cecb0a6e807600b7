"""Step transformers, each against a fake inner step and in a real loop."""

import logging

import attrs
import pytest
import torch
from accelerate import Accelerator
from toolz import compose

from trainfold import (
    RunningSums,
    Context,
    TrainState,
    constant,
    ema,
    ema_model,
    evaluate,
    every_steps,
    log_every,
    loop,
    lr_schedule,
    make_step,
    max_steps,
    nan_guard,
    progress_bar,
    reduce_lr_on_plateau,
    run_epoch,
    testing,
    warmup_cosine,
    warmup_linear,
)

import helpers
from helpers import ce_loss


def _fake_state(**kw):
    return TrainState(model=None, optimizer=None, scheduler=None, accelerator=None, **kw)


def _counting_step(calls):
    def step(state, batch):
        calls.append(batch)
        return attrs.evolve(state, step=state.step + 1, micro_step=state.micro_step + 1)

    return step


def test_max_steps_stops_at_n_and_does_not_call_the_step_after():
    calls = []
    step = max_steps(2)(_counting_step(calls))

    s = step(step(step(_fake_state(), "a"), "b"), "c")

    assert ["a", "b"] == calls
    assert (2, True) == (s.step, s.should_stop)


def test_max_steps_ends_run_epoch_early_and_loop_stops():
    ctx, state, loader, loss_fn = testing.tiny_setup()

    final = loop(run_epoch(ctx, max_steps(6)(make_step(ctx, loss_fn)), loader), max_epochs=10)(state)

    # 4 batches an epoch: stopped in the second epoch, which stays open at batch 2 (not counted, not recorded)
    assert (6, 1, 2, True, False, "max_steps") == (
        final.step,
        final.epoch,
        final.batch_in_epoch,
        final.should_stop,
        final.stop.finished,
        final.stop.reason,
    )
    assert [1] == [r.epoch for r in final.history if r.name == "train_loss"]
    assert not final.interrupted  # loop has returned: code after it runs as written


def test_every_steps_runs_the_epoch_function_after_every_nth_update():
    calls = []
    seen = []

    def mark(s):
        seen.append(s.step)
        return s

    step = every_steps(3, mark)(_counting_step(calls))
    s = _fake_state()
    for i in range(7):
        s = step(s, i)

    assert [3, 6] == seen


def test_every_steps_with_evaluate_inside_an_epoch():
    ctx, state, loader, loss_fn = testing.tiny_setup()
    step = every_steps(2, evaluate(ctx, loss_fn, loader))(make_step(ctx, loss_fn))

    final = run_epoch(ctx, step, loader, state)

    assert [(0, 2), (0, 4)] == [(r.epoch, r.step) for r in final.history if r.name == "eval_loss"]


def test_lr_schedule_sets_the_rate_from_the_update_count():
    ctx, state, loader, loss_fn = testing.tiny_setup()
    seen = []

    def spy(s, b):
        seen.append(s.optimizer.param_groups[0]["lr"])
        return make_step(ctx, loss_fn)(s, b)

    run_epoch(ctx, lr_schedule(warmup_linear(0.4, warmup_steps=2, total_steps=4))(spy), loader, state)

    assert [0.0, 0.2, 0.4, 0.2] == seen


def test_schedules_do_not_depend_on_anything_but_the_step():
    s = warmup_cosine(1.0, warmup_steps=0, total_steps=4, end_lr=0.5)
    assert [1.0, 0.75, 0.5, 0.5] == [round(s(k), 6) for k in (0, 2, 4, 9)]
    assert 0.3 == constant(0.3)(10**9)
    with pytest.raises(ValueError, match="warmup_steps <= total_steps"):
        warmup_linear(1.0, warmup_steps=5, total_steps=4)


def test_ema_tracks_the_weights_every_update():
    """With decay d, after one update ema = d * w0 + (1 - d) * w1, exactly on the device."""
    ctx, state, loader, loss_fn = testing.tiny_setup()
    w0 = testing.parameters(state)
    step = ema(0.75)(make_step(ctx, loss_fn))

    one = step(state, next(iter(loader)))

    w1 = testing.parameters(one)
    averaged = testing.parameters(ema_model(one))
    for k in w0:
        torch.testing.assert_close(averaged[k], torch.lerp(w0[k], w1[k], 0.25), rtol=0, atol=0)
    assert 1 == one.extras["ema"].updates
    assert "ema" not in state.extras


def test_ema_model_can_be_evaluated():
    ctx, state, loader, loss_fn = testing.tiny_setup()
    state = run_epoch(ctx, ema(0.5)(make_step(ctx, loss_fn)), loader, state)

    new = evaluate(ctx, loss_fn, loader, state, prefix="ema", model=ema_model)

    assert "ema_loss" in new.metrics
    assert new.metrics["ema_loss"] != evaluate(ctx, loss_fn, loader, state).metrics["eval_loss"]


def test_ema_model_without_ema_says_how_to_get_one():
    with pytest.raises(KeyError, match=r"wrap the step with ema\(decay\)"):
        ema_model(_fake_state())


def test_log_every_reports_interval_means_to_logging(caplog):
    ctx, state, loader, loss_fn = testing.tiny_setup(n=32)
    losses = []

    def spy(model, batch):
        loss = loss_fn(model, batch)
        losses.append(loss.item())
        return loss

    with caplog.at_level(logging.INFO, logger="trainfold"):
        final = run_epoch(ctx, log_every(ctx, 4)(make_step(ctx, spy)), loader, state)

    reports = [r.getMessage() for r in caplog.records]
    assert 2 == len(reports) and reports[0].startswith("step 4:") and reports[1].startswith("step 8:")
    assert final.extras["log_every"].values["loss"] == pytest.approx(sum(losses[4:]) / 4, rel=1e-6)
    assert "lr" in final.extras["log_every"].values


@pytest.mark.parametrize("periods", [(2, 3), (4, 4), (4, 2)])
def test_log_every_composed_twice_is_refused(periods):
    """Both would keep their report in ``state.extras["log_every"]``, each taking the other's as where its interval
    began: log_every(3) inside log_every(2) reported at update 3 the mean of update 3 alone, and log_every(2) at
    update 4 that of update 4 alone, silently (watched, both counted every batch's samples). The outer one refuses it,
    naming both, when the inner one first reports."""
    outer, inner = periods
    ctx, state, loader, loss_fn = testing.tiny_setup(n=64)
    step = log_every(ctx, outer)(log_every(ctx, inner)(make_step(ctx, loss_fn)))

    with pytest.raises(
        ValueError, match=rf"log_every\({outer}\) is composed around another log_every, inside 'log_every\({inner}\)"
    ) as raised:
        run_epoch(ctx, step, loader, state)
    assert "Use one log_every per step" in str(raised.value)


def test_log_every_does_not_change_the_epoch_loss_even_in_the_last_bit():
    """Reports fold the waiting micro-batches for reading only; the run's sums add the same groups."""
    results = []
    for wrap in (lambda step: step, lambda step: log_every(ctx, 7)(step)):
        ctx, state, loader, loss_fn = testing.tiny_setup(n=400)  # 100 batches: a fold at 64, reports between
        results.append(run_epoch(ctx, wrap(make_step(ctx, loss_fn)), loader, state).metrics["train_loss"])

    assert results[0] == results[1]


def test_log_every_writes_to_tensorboard(tmp_path):
    acc = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    acc.init_trackers("run")
    ctx, state, loader, loss_fn = testing.tiny_setup(accelerator=acc)

    run_epoch(ctx, log_every(ctx, 2)(make_step(ctx, loss_fn)), loader, state)
    ctx.close()

    assert list(tmp_path.rglob("events.out.tfevents.*"))


def test_trackers_get_one_key_scheme_from_log_every_and_log_epoch(tmp_path):
    """<where>/<name>, as TensorBoard groups them: log_every's running values as train/..., log_epoch's epoch records as
    train/<name>_epoch and eval/<name>; epoch on its own."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainfold import evaluate, log_epoch

    acc = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    acc.init_trackers("run")
    ctx, state, loader, loss_fn = testing.tiny_setup(accelerator=acc)
    state = run_epoch(ctx, log_every(ctx, 2)(make_step(ctx, loss_fn)), loader, state)
    log_epoch(ctx, evaluate(ctx, loss_fn, loader, state), echo=False)
    ctx.close()

    (events,) = tmp_path.rglob("events.out.tfevents.*")
    tags = set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    assert {"train/loss", "train/lr", "epoch", "train/loss_epoch", "eval/loss"} == tags


def test_log_every_adds_no_sync_between_reports():
    ctx, state, loader, loss_fn = testing.tiny_setup(n=64)
    step = log_every(ctx, 100)(make_step(ctx, loss_fn))
    batches = list(loader)

    with testing.count_host_syncs() as syncs:
        for b in batches:
            state = step(state, b)

    assert 0 == syncs.total


def test_progress_bar_is_off_when_not_a_terminal_and_can_be_forced(capsys):
    ctx, state, loader, loss_fn = testing.tiny_setup()
    plain = make_step(ctx, loss_fn)

    assert plain is progress_bar(ctx, total=4)(plain)

    run_epoch(ctx, progress_bar(ctx, total=4, force=True)(log_every(ctx, 2)(plain)), loader, state)
    err = capsys.readouterr().err
    assert "epoch 1" in err and "4/4" in err and "loss=" in err


def test_all_transformers_together_keep_the_step_sync_free():
    """With every sync-free transformer composed, a step has no host sync (fused optimizer)."""
    ctx, state, dl = helpers.nan_setup(True)
    step = compose(
        max_steps(1000), log_every(ctx, 1000), ema(0.9), lr_schedule(warmup_cosine(0.01, 2, 100)), progress_bar(ctx)
    )(make_step(ctx, ce_loss, clip_grad_norm=1.0, stages=[nan_guard(3, check_every=1000)]))
    batches = list(dl)
    state = step(state, batches[0])

    with testing.count_host_syncs() as syncs:
        for b in batches[1:]:
            state = step(state, b)

    assert 0 == syncs.total


def test_composed_transformers_have_readable_names():
    step = compose(max_steps(5), ema(0.9))(lambda s, b: s)

    assert "max_steps(5)(ema(0.9)(<lambda>))" == step.__qualname__


def test_a_step_is_named_after_its_loss_function_and_stages():
    ctx, state, loader, loss_fn = testing.tiny_setup()

    step = make_step(ctx, loss_fn, clip_grad_norm=1.0, stages=[nan_guard(2)])

    assert "step[mse_loss, clip_by_norm(1.0), nan_guard(2)]" == step.__qualname__


def test_run_epoch_and_evaluate_can_limit_batches():
    """max_batches ends an epoch (or an evaluation) early: pytorch-accelerated's limit-batches, for smoke runs."""
    from trainfold import evaluate

    ctx, state, loader, loss_fn = testing.tiny_setup(n=32)
    state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state, max_batches=3)
    state = evaluate(ctx, loss_fn, loader, state, max_batches=2)

    assert (3, 1, 0) == (state.step, state.epoch, state.batch_in_epoch)
    x, y = loader.dataset.tensors
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(state.model(x[:8]), y[:8]).item()
    assert state.metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)


def test_sync_batchnorm():
    """Sync batchnorm is a no-op on one process and refused on CPU processes."""
    from trainfold._src.backend.engine import convert_sync_batchnorm

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    state = TrainState.create(
        ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sync_batchnorm=True
    )
    assert isinstance(state.model[1], torch.nn.BatchNorm1d)

    with pytest.raises(ValueError, match="does not run on CPU across processes"):
        convert_sync_batchnorm(model, torch.device("cpu"))
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted[1].weight is model[1].weight  # the optimizer's parameters stay the same objects


def test_log_every_against_a_fake_step_reports_only_on_the_nth_update(caplog):
    ctx = Context(accelerator=Accelerator(cpu=True))

    def fake(state, batch):
        return attrs.evolve(
            state,
            step=state.step + batch,
            micro_step=state.micro_step + 1,
            batch_in_epoch=state.batch_in_epoch + 1,
            sums=state.sums.add(torch.tensor(1.0), {}),
        )

    step = log_every(ctx, 2)(fake)
    s = _fake_state(sums=RunningSums.zero("cpu"))
    with caplog.at_level(logging.INFO, logger="trainfold"):
        for batch in (0, 1, 0, 1, 1):  # updates only where batch == 1: steps 1, 2, 3
            s = step(s, batch)

    assert ["step 2"] == [r.getMessage()[:6] for r in caplog.records]
    assert 1.0 == s.extras["log_every"].values["loss"]


def test_ema_against_a_fake_step_updates_only_when_the_inner_step_updates():
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)

    def fake(state, batch):
        with torch.no_grad():
            model.weight.fill_(batch)
        return attrs.evolve(state, step=state.step + (batch != 0))

    step = ema(0.5)(fake)
    s = TrainState(model=model, optimizer=None, scheduler=None, accelerator=None)
    s = step(s, 3.0)  # ema: 0.5 * 1 + 0.5 * 3 = 2
    s = step(s, 0.0)  # no update: ema stays 2 although the weight is now 0

    assert 2.0 == ema_model(s).weight.item()
    assert 1 == s.extras["ema"].updates


@pytest.mark.parametrize("axis,expected", [("update", [4, 8]), ("epoch", [1, 2])])
def test_log_epoch_sends_its_records_on_the_axis_asked_for(axis, expected, tmp_path):
    """By update (the axis log_every reports on) by default; by epoch, as Accelerate's examples log them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainfold import log_epoch

    acc = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    acc.init_trackers("run")
    ctx, state, loader, loss_fn = testing.tiny_setup(accelerator=acc)
    loop(compose(log_epoch(ctx, echo=False, axis=axis), run_epoch(ctx, make_step(ctx, loss_fn), loader)), max_epochs=2)(
        state
    )
    ctx.close()

    (events,) = tmp_path.rglob("events.out.tfevents.*")
    assert expected == [e.step for e in EventAccumulator(str(events)).Reload().Scalars("train/loss_epoch")]
    with pytest.raises(ValueError, match="axis must be 'update'"):
        log_epoch(ctx, state, axis="time")


def test_lr_schedule_multiplies_by_the_factor_reduce_lr_on_plateau_records():
    """lr_schedule composes with reduce_lr_on_plateau: extras["lr_scale"] scales the scheduled rate."""
    ctx, state, loader, loss_fn = testing.tiny_setup(lr=0.1)
    for flat in (1.0, 1.0):  # the best, then a flat epoch: patience 1 is spent
        state = reduce_lr_on_plateau("eval_loss", helpers.with_metric(state, flat), factor=0.5, patience=1)
    assert 0.5 == state.extras["lr_scale"]

    state = testing.run_steps(lr_schedule(constant(0.2))(make_step(ctx, loss_fn)), state, loader, n=1)

    assert 0.1 == state.optimizer.param_groups[0]["lr"]  # 0.2 scheduled x 0.5 recorded


def test_every_steps_fires_on_updates_not_on_micro_batches():
    """With 2 accumulation steps, 8 batches are 4 updates: every_steps(1, fn) runs fn 4 times, after each update."""
    ctx, state, loader, loss_fn = testing.tiny_setup(
        n=32, accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2)
    )
    seen = []

    def record(s):
        seen.append(s.step)
        return s

    run_epoch(ctx, every_steps(1, record)(make_step(ctx, loss_fn)), loader, state)

    assert [1, 2, 3, 4] == seen
