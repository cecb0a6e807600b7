"""fit is the composition it documents: the same parameters and records as the loop composed by hand."""

import attrs
import torch
from accelerate import Accelerator
from toolz import compose

from trainfold import (
    Context,
    TrainState,
    early_stop,
    ema,
    evaluate,
    fit,
    latest_checkpoint,
    load_checkpoint,
    log_epoch,
    log_every,
    loop,
    make_step,
    nan_guard,
    run_epoch,
    save_checkpoint,
    testing,
)

import helpers


def _setup():
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    model = helpers.mlp(dropout=0.2)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    train_dl, eval_dl = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(40), batch_size=4, shuffle=True),
        torch.utils.data.DataLoader(helpers.classification_data(20, seed=9), batch_size=8),
    )
    return ctx, state, train_dl, eval_dl


def test_fit_equals_the_loop_composed_by_hand(tmp_path):
    ctx, state, train_dl, eval_dl = _setup()
    by_fit = fit(
        ctx,
        helpers.ce_loss,
        train_dl,
        state,
        max_epochs=8,
        eval_loader=eval_dl,
        clip_grad_norm=0.5,
        patience=2,
        checkpoint_dir=tmp_path / "fit",
        keep_last=2,
        log_every_n=3,
        progress=False,
        transforms=[ema(0.9)],
        stages=[nan_guard(3)],
    )

    ctx, state, train_dl, eval_dl = _setup()
    step = log_every(ctx, 3)(ema(0.9)(make_step(ctx, helpers.ce_loss, clip_grad_norm=0.5, stages=[nan_guard(3)])))
    epoch = compose(
        save_checkpoint(ctx, tmp_path / "hand", keep_last=2),
        log_epoch(ctx),
        early_stop("eval_loss", patience=2),
        evaluate(ctx, helpers.ce_loss, eval_dl),
        run_epoch(ctx, step, train_dl),
    )
    by_hand = loop(epoch, max_epochs=8)(state)

    testing.assert_params_equal(by_hand, by_fit)
    assert by_hand.history == by_fit.history
    assert "train_nonfinite" in by_fit.history  # the guard ran inside fit's step
    assert (by_hand.epoch, by_hand.should_stop) == (by_fit.epoch, by_fit.should_stop)
    assert latest_checkpoint(tmp_path / "fit").name == latest_checkpoint(tmp_path / "hand").name


def test_fit_resumes_from_its_checkpoints(tmp_path):
    """A fit stopped after 2 epochs and called again continues to the same end as one uninterrupted fit."""
    ctx, state, train_dl, eval_dl = _setup()
    whole = fit(
        ctx,
        helpers.ce_loss,
        train_dl,
        state,
        max_epochs=4,
        eval_loader=eval_dl,
        checkpoint_dir=tmp_path / "a",
        progress=False,
    )

    ctx, state, train_dl, eval_dl = _setup()
    fit(
        ctx,
        helpers.ce_loss,
        train_dl,
        state,
        max_epochs=2,
        eval_loader=eval_dl,
        checkpoint_dir=tmp_path / "b",
        progress=False,
    )
    ctx, state, train_dl, eval_dl = _setup()
    resumed = fit(
        ctx,
        helpers.ce_loss,
        train_dl,
        state,
        max_epochs=4,
        eval_loader=eval_dl,
        checkpoint_dir=tmp_path / "b",
        progress=False,
    )

    testing.assert_params_equal(whole, resumed)
    assert whole.history == resumed.history


def test_fit_checkpoints_after_its_epoch_fns(tmp_path):
    """An epoch function that draws random numbers (a metric over a shuffled loader) runs before the save.

    Saved before it, the resumed run's generators would be behind and its history would miss the
    epoch function's record; saved last, the resumed run ends where one uninterrupted run ends.
    """

    def shuffled_metric(state):
        order = torch.randperm(8)  # draws from the global generator, as a shuffled loader would
        return attrs.evolve(
            state, history=state.history.add(epoch=state.epoch, step=state.step, values={"probe": float(order[0])})
        )

    ctx, state, train_dl, eval_dl = _setup()
    whole = fit(
        ctx,
        helpers.ce_loss,
        train_dl,
        state,
        max_epochs=4,
        checkpoint_dir=tmp_path / "a",
        progress=False,
        epoch_fns=[shuffled_metric],
    )

    ctx, state, train_dl, eval_dl = _setup()
    fit(
        ctx,
        helpers.ce_loss,
        train_dl,
        state,
        max_epochs=2,
        checkpoint_dir=tmp_path / "b",
        progress=False,
        epoch_fns=[shuffled_metric],
    )
    ctx, state, train_dl, eval_dl = _setup()
    resumed = fit(
        ctx,
        helpers.ce_loss,
        train_dl,
        state,
        max_epochs=4,
        checkpoint_dir=tmp_path / "b",
        progress=False,
        epoch_fns=[shuffled_metric],
    )

    testing.assert_params_equal(whole, resumed)
    assert whole.history == resumed.history
    assert 4 == len(resumed.history["probe"])
    assert 4 == load_checkpoint(ctx, tmp_path / "b", state).epoch  # the run's last checkpoint is its end


def test_fit_checks_its_own_arguments_at_the_call_in_its_own_words():
    """Before, a swapped state and loader failed inside loop, and an uncalled factory in epoch_fns after a whole epoch,
    naming log_epoch."""
    import pytest

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    before = {k: v.clone() for k, v in testing.parameters(state).items()}
    with pytest.raises(TypeError, match=r"^fit: loader, the third argument of fit\(ctx, loss_fn, train_loader, state"):
        fit(ctx, loss_fn, state, loader, max_epochs=1)
    with pytest.raises(TypeError, match=r"^fit needs a TrainState"):
        fit(ctx, loss_fn, loader, loader, max_epochs=1)
    with pytest.raises(
        TypeError, match=r"^fit\(epoch_fns=\[...\]\) calls epoch_fn\(state\).*early_stop still needs metric, state"
    ):
        fit(ctx, loss_fn, loader, state, max_epochs=1, epoch_fns=[early_stop], progress=False)
    with pytest.raises(TypeError, match=r"^fit\(transforms=\[...\]\) takes step transformers"):
        fit(ctx, loss_fn, loader, state, max_epochs=1, transforms=[3], progress=False)
    assert all(torch.equal(before[k], v) for k, v in testing.parameters(state).items())  # refused before any update
