"""Step transformers, each against a fake inner step and in a real loop."""

import logging

import attrs
import pytest
import torch
from accelerate import Accelerator
from toolz import compose

from trainfold import (
    RunningSums,
    Context, TrainState, constant, ema, ema_model, evaluate, every_steps, log_every, loop, lr_schedule, make_step,
    max_steps, nan_guard, progress_bar, run_epoch, testing, warmup_cosine, warmup_linear,
)

from helpers import ce_loss, classification_data, mlp


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
    assert (6, 1, 2, True, False, "max_steps") == (final.step, final.epoch, final.batch_in_epoch, final.should_stop, final.stop.finished, final.stop.reason)
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


def _nan_setup(fused, **acc):
    ctx = Context(accelerator=Accelerator(cpu=True, **acc))
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(classification_data(48), batch_size=8))
    return ctx, state, dl


def _poisoned(bad_micro_steps):
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = ce_loss(model, batch)
        return loss * float("nan") if calls["n"] in bad_micro_steps else loss

    return loss_fn


@pytest.mark.parametrize("fused", [True, False])
def test_nan_guard_skips_the_update_and_counts_it(fused):
    """A NaN batch leaves the weights (and Adam's state) as they were; the next finite one trains."""
    ctx, state, dl = _nan_setup(fused)
    step = make_step(ctx, _poisoned({2}), stages=[nan_guard(3)])
    batches = list(dl)

    one = step(state, batches[0])
    before = testing.parameters(one)
    two = step(one, batches[1])
    testing.assert_params_equal(before, two)
    three = step(two, batches[2])

    testing.assert_params_changed(before, three)
    guard = three.extras["nan_guard"]
    assert (1, 0) == (guard.skipped, guard.consecutive)
    assert not any(torch.isnan(p).any() for p in three.model.parameters())


def test_nan_guard_skips_on_the_device():
    """`nan_guard` skips on the device without a host sync for fused optimizers."""
    ctx, state, dl = _nan_setup(True)
    step = make_step(ctx, _poisoned({2}), stages=[nan_guard(3, check_every=1000)])
    batches = list(dl)
    state = step(state, batches[0])

    with testing.count_host_syncs() as syncs:
        step(step(state, batches[1]), batches[2])

    assert 0 == syncs.total


def test_nan_guard_stops_the_run_after_k_in_a_row():
    """The stop is a preemption, not the run's planned end: the epoch is interrupted, so an evaluation composed after it
    passes the diverged model through instead of recording it as the final one."""
    ctx, state, dl = _nan_setup(True)
    step = make_step(ctx, _poisoned({3, 4}), stages=[nan_guard(2, check_every=1)])

    final = run_epoch(ctx, step, dl, state)

    assert final.should_stop and 4 == final.step and "nan_guard" == final.stop.reason and not final.stop.finished
    assert not final.stop.final and final.interrupted
    assert 2 == final.extras["nan_guard"].skipped
    assert "eval_loss" not in evaluate(ctx, ce_loss, dl, final).history


@pytest.mark.parametrize("fused", [True, False])
def test_nan_guard_counts_exactly_what_it_skipped(fused):
    """Six updates, bad at 2, 4 and 5 (1-based): three skipped, a longest run of two, not tripped at 3."""
    ctx, state, dl = _nan_setup(fused)
    final = run_epoch(ctx, make_step(ctx, _poisoned({2, 4, 5}), stages=[nan_guard(3, check_every=1)]), dl, state)

    guard = final.extras["nan_guard"]
    assert (3, 0, 2) == (guard.skipped, guard.consecutive, guard.longest)
    assert not guard.tripped and not final.should_stop and 6 == final.step
    assert final.metrics["train_nonfinite"] == pytest.approx(3 / 6)


def test_nan_guard_checks_the_gradients_the_optimizer_would_apply():
    """A non-finite gradient on a parameter the optimizer does not hold changes no weight: no skip."""
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD([model.weight], lr=0.1))
    step = make_step(ctx, lambda m, b: (m(b) ** 2).mean() + m.bias.sum() * float("inf"), stages=[nan_guard(3)])

    new = step(state, torch.ones(4, 2))

    assert 0 == new.extras["nan_guard"].skipped
    assert model.weight.isfinite().all() and not model.bias.grad.isfinite().all()


def test_nan_guard_steps_each_optimizer_its_own_way_from_one_step_function():
    """The guard's plan (skip on the device, or after a host read) is per optimizer, not per step function."""
    ctx = Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(0)
    models = [mlp(), mlp()]
    states = [TrainState.create(ctx, model=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.01, fused=fused))
              for m, fused in zip(models, (True, False))]
    poison = {"on": False}
    step = make_step(ctx, lambda m, b: ce_loss(m, b) * (float("nan") if poison["on"] else 1.0), stages=[nan_guard(3)])
    batch = next(iter(torch.utils.data.DataLoader(classification_data(8), batch_size=8)))

    for i, state in enumerate(states):
        before = [testing.parameters(s) for s in states]
        states[i] = step(state, batch)
        testing.assert_params_changed(before[i], states[i])
        testing.assert_params_equal(before[1 - i], states[1 - i])
    poison["on"] = True
    before = [testing.parameters(s) for s in states]
    states = [step(s, batch) for s in states]

    for b, s in zip(before, states):
        testing.assert_params_equal(b, s)
        assert 1 == s.extras["nan_guard"].skipped


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_check_finite_sets_the_flag(bad):
    """`check_finite` sets the flag for a non-finite gradient and changes no gradient."""
    from trainfold._src.core.guard import check_finite

    grads = [torch.randn(3, 2), torch.randn(5)]
    if bad is not None:
        grads[1][4] = bad
    before = [g.clone() for g in grads]
    flag = torch.zeros((), dtype=torch.float32)

    check_finite(grads, flag)

    assert flag.item() == (0.0 if bad is None else 1.0)
    for b, g in zip(before, grads):
        assert torch.equal(b.view(torch.int32), g.view(torch.int32))  # bit for bit, NaN included


@pytest.mark.parametrize("backend", ["DEEPSPEED", "FSDP", "MEGATRON_LM"])
def test_nan_guard_refuses_sharded_gradients(backend, monkeypatch):
    """`nan_guard` refuses backends where gradients are sharded or held by the engine."""
    from accelerate.utils import DistributedType

    ctx, state, loader, loss_fn = testing.tiny_setup()
    monkeypatch.setattr(ctx.accelerator.state, "distributed_type", DistributedType[backend])

    with pytest.raises(ValueError, match=f"nan_guard cannot guard a step under {DistributedType[backend].value}"):
        nan_guard(3).bind(ctx)  # what make_step does with its stages, once


def test_nan_guard_used_as_a_step_transformer_says_where_it_goes_now():
    """nan_guard was a step transformer before 0.2; calling it on a step explains the new place."""
    with pytest.raises(TypeError, match=r"make_step\(ctx, loss_fn, stages=\[nan_guard\(3, check_every=50\)\]\)"):
        nan_guard(3)(lambda state, batch: state)


def test_nan_guard_counts_each_continuation_of_a_state_apart():
    """Stepping one state twice (a branch, a retry) gives two states whose flags never mix.

    The flags of unread updates share one device buffer; a continuation that is not the
    latest copies it before writing its own.
    """
    ctx, state, dl = _nan_setup(True)
    step = make_step(ctx, _poisoned({1, 2, 5}), stages=[nan_guard(3, check_every=1000)])
    b = list(dl)
    first = step(state, b[0])  # call 1: NaN

    bad = step(first, b[1])  # call 2: NaN
    good = step(first, b[2])  # call 3: from the same state, applied
    after_bad = step(bad, b[3])  # call 4: continues the first branch
    after_good = step(good, b[4])  # call 5: NaN, on the second branch

    counts = lambda s: (s.extras["nan_guard"].unread, s.extras["nan_guard"].skipped, s.extras["nan_guard"].consecutive)
    assert [(2, 2, 2), (2, 1, 0), (3, 2, 0), (3, 2, 1)] == [counts(s) for s in (bad, good, after_bad, after_good)]


def test_nan_guard_flags_outlast_check_every_when_nothing_reads_them():
    """An inner step run without the transformer's reads (a unit test of the step) keeps every flag."""
    from trainfold._src.core.guard import NanGuardState

    guard = NanGuardState(3, check_every=2)
    for bad in [0.0, 1.0, 1.0, 0.0, 1.0]:
        guard = guard.record(torch.tensor(bad))

    assert (5, 3, 1, 2) == (guard.unread, guard.skipped, guard.consecutive, guard.longest)


def test_nan_guard_with_a_huge_check_every_grows_its_buffer_as_flags_come():
    """check_every=10**9 (in effect: never read) does not make a 10**9-slot buffer up front."""
    from trainfold._src.core.guard import MAX_SLOTS, NanGuardState

    guard = NanGuardState(3, check_every=10**9)
    for i in range(MAX_SLOTS + 1):
        guard, slot = guard.claim()
        slot.fill_(float(i == MAX_SLOTS))

    assert len(guard.flags.views) == 2 * MAX_SLOTS
    assert (MAX_SLOTS + 1, 1, 1) == (guard.unread, guard.skipped, guard.consecutive)


def test_nan_guard_works_under_a_float64_default_dtype():
    """Its flags are float32 (what the fused check and found_inf take) whatever torch's default dtype."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ctx = Context(accelerator=Accelerator(cpu=True))
        model = torch.nn.Linear(2, 1)
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, fused=True))
        step = make_step(ctx, lambda m, b: (m(b) ** 2).mean() * b.sum(), stages=[nan_guard(3)])

        ok = step(state, torch.ones(4, 2))
        before = testing.parameters(ok)
        skipped = step(ok, torch.full((4, 2), float("nan")))
    finally:
        torch.set_default_dtype(default)

    testing.assert_params_equal(before, skipped)
    assert (1, 2) == (skipped.extras["nan_guard"].skipped, skipped.step)
    assert model.weight.dtype == torch.float64


def test_nan_guard_epoch_loss_is_the_mean_of_the_finite_batches():
    ctx, state, dl = _nan_setup(True)
    losses = []

    def loss_fn(model, batch):
        loss = ce_loss(model, batch)
        losses.append(loss.detach())
        return loss * float("nan") if len(losses) == 2 else loss

    final = run_epoch(ctx, make_step(ctx, loss_fn, stages=[nan_guard(5)]), dl, state)

    finite = [l.item() for i, l in enumerate(losses) if i != 1]
    assert final.metrics["train_loss"] == pytest.approx(sum(finite) / len(finite), rel=1e-6)
    assert final.metrics["train_nonfinite"] == pytest.approx(1 / 6)


def test_without_nan_guard_a_nan_batch_shows_in_the_epoch_record():
    ctx, state, dl = _nan_setup(True)

    with pytest.warns(RuntimeWarning, match=r"epoch 1's train_loss is nan \(update \d+\): the run has diverged.*nan_guard"):
        final = run_epoch(ctx, make_step(ctx, _poisoned({2})), dl, state)

    assert final.metrics["train_loss"] != final.metrics["train_loss"]  # nan


def test_a_diverged_run_is_said_once_not_every_epoch():
    import warnings

    ctx, state, dl = _nan_setup(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop(compose(lambda s: s, run_epoch(ctx, make_step(ctx, _poisoned({2})), dl)), max_epochs=3)(state)
    diverged = [w for w in caught if "has diverged" in str(w.message)]
    assert 1 == len(diverged)
    assert __file__ == diverged[0].filename  # the user's line, through loop, compose and the curried run_epoch


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

    with pytest.raises(ValueError, match=rf"log_every\({outer}\) is composed around another log_every, inside 'log_every\({inner}\)") as raised:
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
    ctx, state, dl = _nan_setup(True)
    step = compose(max_steps(1000), log_every(ctx, 1000), ema(0.9), lr_schedule(warmup_cosine(0.01, 2, 100)),
                   progress_bar(ctx))(make_step(ctx, ce_loss, clip_grad_norm=1.0, stages=[nan_guard(3, check_every=1000)]))
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
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sync_batchnorm=True)
    assert isinstance(state.model[1], torch.nn.BatchNorm1d)

    with pytest.raises(ValueError, match="does not run on CPU across processes"):
        convert_sync_batchnorm(model, torch.device("cpu"))
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted[1].weight is model[1].weight  # the optimizer's parameters stay the same objects


def test_nan_guard_as_a_stage_in_isolation():
    """The guard's hooks, driven by hand: one flag per update (set where a gradient is not finite).

    Every check_every recorded updates the guard reads the flags: a run of max_consecutive
    between two checks stops the run, though it ended before the check.
    """
    from trainfold import MicroBatch

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None, accelerator=ctx.accelerator)
    stage = nan_guard(2, check_every=2).bind(ctx)
    assert (True, True) == (stage.gates_update, stage.masks_nonfinite)

    flags, stops, unread = [], [], []
    extras = state.extras
    for grad in [1.0, float("nan"), float("inf"), 1.0]:
        for p in model.parameters():
            p.grad = torch.full_like(p, grad)
        mb = MicroBatch(state, model, torch.tensor(0.0), {}, True, extras)
        stage.on_update(mb)
        flags.append(mb.skip.item())
        stage.after_update(mb)
        stops.append(mb.stop is not None)
        unread.append(mb.extras["nan_guard"].unread)
        extras = mb.extras

    assert [0.0, 1.0, 1.0, 0.0] == flags
    assert [False, False, False, True] == stops
    assert [1, 0, 1, 0] == unread
    guard = extras["nan_guard"]
    assert (2, 0, 2) == (guard.skipped, guard.consecutive, guard.longest)


def test_a_user_stage_sees_each_update_between_backward_and_the_optimizer():
    """A Stage's on_update runs once per update (not per micro-batch), after clipping, before the update."""
    from trainfold import Stage

    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    seen = []
    record = Stage("record", on_batch=lambda mb: seen.append(("batch", mb.synced)),
                   on_update=lambda mb: seen.append(("update", mb.model.weight.grad.item(), mb.model.weight.item())))
    step = make_step(ctx, lambda m, b: (m(b) - 3.0).pow(2).mean(), clip_grad_norm=1.0, stages=[record])

    state = step(step(state, torch.ones(1, 1)), torch.ones(1, 1))

    # two micro-batches of grad -6 / 2 each: the group's -6 clipped to norm 1, seen before the update
    assert [("batch", False), ("batch", True), ("update", pytest.approx(-1.0), 0.0)] == seen
    assert pytest.approx(1.0) == model.weight.item() and 1 == state.step


def test_log_every_against_a_fake_step_reports_only_on_the_nth_update(caplog):
    ctx = Context(accelerator=Accelerator(cpu=True))

    def fake(state, batch):
        return attrs.evolve(state, step=state.step + batch, micro_step=state.micro_step + 1, batch_in_epoch=state.batch_in_epoch + 1,
                            sums=state.sums.add(torch.tensor(1.0), {}))

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
    s = step(s, 3.0)   # ema: 0.5 * 1 + 0.5 * 3 = 2
    s = step(s, 0.0)   # no update: ema stays 2 although the weight is now 0

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
    loop(compose(log_epoch(ctx, echo=False, axis=axis), run_epoch(ctx, make_step(ctx, loss_fn), loader)), max_epochs=2)(state)
    ctx.close()

    (events,) = tmp_path.rglob("events.out.tfevents.*")
    assert expected == [e.step for e in EventAccumulator(str(events)).Reload().Scalars("train/loss_epoch")]
    with pytest.raises(ValueError, match="axis must be 'update'"):
        log_epoch(ctx, state, axis="time")
