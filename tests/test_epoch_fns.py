"""Epoch functions: early stopping, save-best, LR on plateau, epoch logging, plotting."""

import logging

import attrs
import pytest
from hypothesis import given, settings, strategies as st
from toolz import compose

from trainfold import (
    early_stop,
    evaluate,
    log_epoch,
    loop,
    make_step,
    plot_history,
    reduce_lr_on_plateau,
    restore_best,
    run_epoch,
    save_best,
    testing,
    TrainState,
)
import helpers


def _fake_state():
    return TrainState(model=None, optimizer=None, scheduler=None, accelerator=None)


def _run_early_stop(values, **kw):
    state = _fake_state()
    stopped_at = None
    for i, v in enumerate(values):
        state = early_stop("eval_loss", helpers.with_metric(state, v), **kw)
        if state.should_stop and stopped_at is None:
            stopped_at = i
    return stopped_at, state


def test_early_stop_after_patience_epochs_without_improvement():
    stopped_at, state = _run_early_stop([1.0, 0.8, 0.9, 0.85], patience=2)

    assert 3 == stopped_at
    assert 0.8 == state.extras["early_stop:eval_loss"].best


def test_early_stop_max_mode_and_min_delta():
    stopped_at, _ = _run_early_stop([0.5, 0.55, 0.56, 0.6], patience=2, mode="max", min_delta=0.06)

    assert 2 == stopped_at  # 0.55 and 0.56 are not 0.06 better than 0.5


def test_early_stop_counts_nan_as_no_improvement():
    stopped_at, _ = _run_early_stop([1.0, float("nan"), float("nan")], patience=2)

    assert 2 == stopped_at


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(0, 10), min_size=1, max_size=20), patience=st.integers(1, 5))
def test_early_stop_stops_exactly_when_the_best_is_patience_epochs_old(values, patience):
    """It stops at the first epoch that is `patience` epochs after the last strict improvement."""
    stopped_at, _ = _run_early_stop(values, patience=patience)

    best, last_improvement, expected = None, 0, None
    for i, v in enumerate(values):
        if best is None or v < best:
            best, last_improvement = v, i
        if expected is None and i - last_improvement >= patience:
            expected = i
    assert expected == stopped_at


def test_early_stop_without_the_metric_says_what_to_compose():
    with pytest.raises(KeyError, match=r"no 'eval_loss' has been recorded.*compose\(early_stop"):
        early_stop("eval_loss", _fake_state())


def test_early_stop_ends_a_real_loop():
    ctx, state, loader, loss_fn = testing.tiny_setup(lr=2.5)  # diverges: eval loss grows
    epoch = compose(
        early_stop("eval_loss", patience=2),
        evaluate(ctx, loss_fn, loader),
        run_epoch(ctx, make_step(ctx, loss_fn), loader),
    )

    final = loop(epoch, max_epochs=50)(state)

    assert final.should_stop and final.epoch < 50


def test_save_best_and_restore_best(tmp_path):
    """`save_best` writes on improvement and `restore_best` puts the weights back."""
    ctx, state, loader, loss_fn = testing.tiny_setup()
    path = tmp_path / "best.safetensors"
    step = make_step(ctx, loss_fn)
    state = save_best(ctx, path, "eval_loss", evaluate(ctx, loss_fn, loader, run_epoch(ctx, step, loader, state)))
    best_params = testing.parameters(state)
    for _ in range(3):  # a too-large lr from here makes every later epoch worse
        for g in state.optimizer.param_groups:
            g["lr"] = 3.0
        state = save_best(ctx, path, "eval_loss", evaluate(ctx, loss_fn, loader, run_epoch(ctx, step, loader, state)))

    record = state.extras["save_best:eval_loss"]
    assert (1, 4) == (record.epoch, record.step)
    restored = restore_best(ctx, path, state)
    testing.assert_params_equal(best_params, restored)
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind


def test_restore_best_without_a_file(tmp_path):
    ctx, state, *_ = testing.tiny_setup()

    with pytest.raises(FileNotFoundError, match="save_best writes them"):
        restore_best(ctx, tmp_path / "none.safetensors", state)


def test_reduce_lr_on_plateau_scales_the_learning_rate():
    """Patience 2: the 3rd and 5th flat epochs each halve the rate (the count restarts after a cut)."""
    ctx, state, *_ = testing.tiny_setup(lr=0.1)
    rates = []
    for v in (1.0, 1.0, 1.0, 1.0, 1.0):
        state = reduce_lr_on_plateau("eval_loss", helpers.with_metric(state, v), factor=0.5, patience=2)
        rates.append(state.optimizer.param_groups[0]["lr"])

    assert [0.1, 0.1, 0.05, 0.05, 0.025] == rates
    assert 0.25 == state.extras["lr_scale"]


def test_log_epoch_prints_the_epoch_records_without_any_logging_set_up(capsys, caplog):
    ctx, state, loader, loss_fn = testing.tiny_setup()
    state = evaluate(ctx, loss_fn, loader, run_epoch(ctx, make_step(ctx, loss_fn), loader, state))

    with caplog.at_level(logging.INFO, logger="trainfold"):
        log_epoch(ctx, state)

    line = capsys.readouterr().out.strip()
    assert line.startswith("epoch 1 (update 4): train_loss ") and "  eval_loss " in line
    assert [] == caplog.records  # printed, not logged twice


def test_log_epoch_with_echo_off_logs_instead(capsys, caplog):
    ctx, state, loader, loss_fn = testing.tiny_setup()
    state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)

    with caplog.at_level(logging.INFO, logger="trainfold"):
        log_epoch(ctx, state, echo=False)

    assert "" == capsys.readouterr().out
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("epoch 1 (update 4): train_loss ")


def test_plot_history_writes_a_png(tmp_path):
    ctx, state, loader, loss_fn = testing.tiny_setup()
    epoch = compose(evaluate(ctx, loss_fn, loader), run_epoch(ctx, make_step(ctx, loss_fn), loader))
    state = loop(epoch, max_epochs=3)(state)

    out = plot_history(state, tmp_path / "curves.png")

    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_history_of_an_empty_history():
    with pytest.raises(ValueError, match="history is empty"):
        plot_history(_fake_state(), "x.png")


# --- which way is better: mode="auto" -------------------------------------------------------------


def _recorded(name, values):
    s = TrainState(model=None, optimizer=None, scheduler=None, accelerator=None)
    for i, v in enumerate(values):
        s = early_stop(name, attrs.evolve(s, history=s.history.add(epoch=i, step=i, values={name: v})), patience=2)
    return s


def test_early_stop_infers_the_direction_from_the_metrics_name():
    """A rising accuracy is improving: with the old default mode='min' this run was stopped after 2 epochs."""
    rising = _recorded("eval_accuracy", [0.5, 0.6, 0.7, 0.8])
    falling_loss = _recorded("eval_loss", [1.0, 0.9, 0.8, 0.7])
    rising_loss = _recorded("eval_loss", [0.7, 0.8, 0.9, 1.0])

    assert (False, False, True) == (rising.should_stop, falling_loss.should_stop, rising_loss.should_stop)


@pytest.mark.parametrize(
    "name,mode",
    [
        ("eval_loss", "min"),
        ("train_error", "min"),
        ("eval_perplexity", "min"),
        ("eval_acc", "max"),
        ("eval_f1", "max"),
        ("val_auroc", "max"),
        ("eval_bleu", "max"),
        ("eval_max_error", "min"),
    ],
)
def test_auto_mode_knows_the_common_names(name, mode):
    from trainfold._src.compose.epoch_fns import resolve_mode

    assert mode == resolve_mode(name, "auto", "early_stop")


@pytest.mark.parametrize("fn", ["early_stop", "reduce_lr_on_plateau"])
def test_a_name_that_says_no_direction_needs_an_explicit_mode(fn):
    import trainfold

    s = TrainState(model=None, optimizer=None, scheduler=None, accelerator=None)
    s = attrs.evolve(s, history=s.history.add(epoch=1, step=1, values={"eval_widgets": 3.0}))
    with pytest.raises(
        ValueError, match=rf"{fn}: cannot tell from the name 'eval_widgets'.*pass mode='min' or mode='max'"
    ):
        getattr(trainfold, fn)("eval_widgets", s)
    assert not getattr(trainfold, fn)("eval_widgets", s, mode="max").should_stop


@pytest.mark.parametrize(
    "make",
    [
        lambda ctx, tmp: early_stop("eval_los"),
        lambda ctx, tmp: save_best(ctx, tmp / "best.safetensors", "eval_los"),
        lambda ctx, tmp: reduce_lr_on_plateau("eval_los"),
    ],
)
def test_a_misspelt_metric_is_named(make, tmp_path):
    """'eval_los' says no direction, but the real cause is that no such record exists: that comes first."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    epoch = compose(
        make(ctx, tmp_path), evaluate(ctx, loss_fn, loader), run_epoch(ctx, make_step(ctx, loss_fn), loader)
    )
    with pytest.raises(
        KeyError,
        match=r"no 'eval_los' has been recorded \(recorded: \['train_loss', 'eval_loss'\]\)\. Did you mean 'eval_loss'\?",
    ):
        loop(epoch, max_epochs=2)(state)
    ctx.close()


def test_early_stop_keeps_a_stop_set_before_it():
    """An improving metric does not clear a stop another function set (a budget, a signal)."""
    ctx, state, *_ = testing.tiny_setup()
    state = helpers.with_metric(state, 1.0).with_stop("max_steps")

    after = early_stop("eval_loss", state, patience=2)

    assert after.should_stop and "max_steps" == after.stop.reason


def test_reduce_lr_on_plateau_never_goes_below_min_lr():
    ctx, state, *_ = testing.tiny_setup(lr=0.1)
    for flat in (1.0, 1.0):  # the best, then a flat epoch: 0.1 x 0.1 would be 0.01
        state = reduce_lr_on_plateau("eval_loss", helpers.with_metric(state, flat), factor=0.1, patience=1, min_lr=0.05)

    assert 0.05 == state.optimizer.param_groups[0]["lr"]


def test_save_best_in_max_mode_keeps_the_highest_value(tmp_path):
    ctx, state, *_ = testing.tiny_setup()
    path = tmp_path / "best.safetensors"
    for accuracy in (0.5, 0.7, 0.6):
        state = save_best(ctx, path, "accuracy", helpers.with_metric(state, accuracy, "accuracy"), mode="max")

    assert 0.7 == state.extras["save_best:accuracy"].value
