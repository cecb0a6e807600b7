"""The stages of a step (``make_step(stages=[...])``): ``clip_by_norm`` recording the gradient norm on the device at
every update, averaged over updates, with no sync of its own; ``nan_guard`` skipping non-finite updates on the
device and stopping a diverged run; a user's own stage between backward and the optimizer."""

import math

import pytest
import torch
from accelerate import Accelerator
from toolz import compose

from trainfold import (
    Context,
    TrainState,
    clip_by_norm,
    evaluate,
    log_every,
    loop,
    make_step,
    nan_guard,
    run_epoch,
    testing,
)

import helpers
from helpers import ce_loss, classification_data, mlp

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
    ctx, state, loader, loss_fn = testing.tiny_setup(
        seed=0, accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2)
    )
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
        ctx.accelerator.clip_grad_norm_ = lambda *args: (
            calls.append(args[1]) or clip(*args)
        )  # counted, Accelerate's own
        return loop(run_epoch(ctx, make_step(ctx, loss_fn, record_grad_norm=True, **options), loader), max_epochs=2)(
            state
        )

    by_option, by_stage = run(clip_grad_norm=0.5), run(stages=[clip_by_norm(0.5)])

    assert calls == [0.5] * 16  # 8 updates each: one norm per update, the clipping's
    testing.assert_params_equal(by_option, by_stage)
    assert by_option.history == by_stage.history
    assert len(by_stage.history["train_grad_norm"]) == 2


@pytest.mark.parametrize("fused", [True, False])
def test_nan_guard_skips_the_update_and_counts_it(fused):
    """A NaN batch leaves the weights (and Adam's state) as they were; the next finite one trains."""
    ctx, state, dl = helpers.nan_setup(fused)
    step = make_step(ctx, helpers.poisoned({2}), stages=[nan_guard(3)])
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
    ctx, state, dl = helpers.nan_setup(True)
    step = make_step(ctx, helpers.poisoned({2}), stages=[nan_guard(3, check_every=1000)])
    batches = list(dl)
    state = step(state, batches[0])

    with testing.count_host_syncs() as syncs:
        step(step(state, batches[1]), batches[2])

    assert 0 == syncs.total


def test_nan_guard_stops_the_run_after_k_in_a_row():
    """The stop is a preemption, not the run's planned end: the epoch is interrupted, so an evaluation composed after it
    passes the diverged model through instead of recording it as the final one."""
    ctx, state, dl = helpers.nan_setup(True)
    step = make_step(ctx, helpers.poisoned({3, 4}), stages=[nan_guard(2, check_every=1)])

    final = run_epoch(ctx, step, dl, state)

    assert final.should_stop and 4 == final.step and "nan_guard" == final.stop.reason and not final.stop.finished
    assert not final.stop.final and final.interrupted
    assert 2 == final.extras["nan_guard"].skipped
    assert "eval_loss" not in evaluate(ctx, ce_loss, dl, final).history


@pytest.mark.parametrize("fused", [True, False])
def test_nan_guard_counts_exactly_what_it_skipped(fused):
    """Six updates, bad at 2, 4 and 5 (1-based): three skipped, a longest run of two, not tripped at 3."""
    ctx, state, dl = helpers.nan_setup(fused)
    final = run_epoch(ctx, make_step(ctx, helpers.poisoned({2, 4, 5}), stages=[nan_guard(3, check_every=1)]), dl, state)

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
    states = [
        TrainState.create(ctx, model=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.01, fused=fused))
        for m, fused in zip(models, (True, False))
    ]
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
    ctx, state, dl = helpers.nan_setup(True)
    step = make_step(ctx, helpers.poisoned({1, 2, 5}), stages=[nan_guard(3, check_every=1000)])
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
    ctx, state, dl = helpers.nan_setup(True)
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
    ctx, state, dl = helpers.nan_setup(True)

    with pytest.warns(
        RuntimeWarning, match=r"epoch 1's train_loss is nan \(update \d+\): the run has diverged.*nan_guard"
    ):
        final = run_epoch(ctx, make_step(ctx, helpers.poisoned({2})), dl, state)

    assert final.metrics["train_loss"] != final.metrics["train_loss"]  # nan


def test_a_diverged_run_is_said_once_not_every_epoch():
    import warnings

    ctx, state, dl = helpers.nan_setup(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop(compose(lambda s: s, run_epoch(ctx, make_step(ctx, helpers.poisoned({2})), dl)), max_epochs=3)(state)
    diverged = [w for w in caught if "has diverged" in str(w.message)]
    assert 1 == len(diverged)
    assert __file__ == diverged[0].filename  # the user's line, through loop, compose and the curried run_epoch


def test_nan_guard_as_a_stage_in_isolation():
    """The guard's hooks, driven by hand: one flag per update (set where a gradient is not finite).

    Every check_every recorded updates the guard reads the flags: a run of max_consecutive
    between two checks stops the run, though it ended before the check.
    """
    from trainfold import MicroBatch

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    state = TrainState(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None, accelerator=ctx.accelerator
    )
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
    record = Stage(
        "record",
        on_batch=lambda mb: seen.append(("batch", mb.synced)),
        on_update=lambda mb: seen.append(("update", mb.model.weight.grad.item(), mb.model.weight.item())),
    )
    step = make_step(ctx, lambda m, b: (m(b) - 3.0).pow(2).mean(), clip_grad_norm=1.0, stages=[record])

    state = step(step(state, torch.ones(1, 1)), torch.ones(1, 1))

    # two micro-batches of grad -6 / 2 each: the group's -6 clipped to norm 1, seen before the update
    assert [("batch", False), ("batch", True), ("update", pytest.approx(-1.0), 0.0)] == seen
    assert pytest.approx(1.0) == model.weight.item() and 1 == state.step


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nan_guard_keeps_an_infinite_loss_out_of_the_epoch_mean(bad):
    """Under nan_guard a non-finite batch loss (NaN, +inf or -inf) is left out of train_loss, which stays the finite batches' mean."""
    ctx, state, loader, loss_fn = testing.tiny_setup(lr=0.0)  # lr 0: every batch sees the same model
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss = loss_fn(model, batch)
        return loss * 0 + bad if calls["n"] == 2 else loss

    clean = run_epoch(ctx, make_step(ctx, loss_fn), loader, state).history.latest("train_loss")
    finite = [loss_fn(state.model, b).item() for i, b in enumerate(loader) if i != 1]
    guarded = run_epoch(ctx, make_step(ctx, poisoned, stages=[nan_guard(3)]), loader, state).history.latest(
        "train_loss"
    )

    assert math.isfinite(clean)
    assert guarded == pytest.approx(sum(finite) / len(finite), rel=1e-6)
