"""Schedule-free optimizers: trainfold switches their train/eval modes where Accelerate's schedule_free.py example does by hand.

A schedule-free optimizer's parameters are the point its gradients are taken at in train mode and the averaged
weights in eval mode; ``optimizer.step()`` refuses to run in eval mode. ``run_epoch`` puts it in train mode;
``evaluate``, ``predict``, ``save_checkpoint`` and ``save_best`` put it in eval mode for their work and back.
"""

import copy

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from toolz import compose

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    evaluate,
    every_steps,
    list_checkpoints,
    load_checkpoint,
    loop,
    make_step,
    predict,
    run_epoch,
    save_best,
    save_checkpoint,
    testing,
)

import helpers

schedulefree = pytest.importorskip("schedulefree")

EPOCHS = 3


def _objects():
    model, _, _, dl = helpers.build(0, shuffle=True)
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05, warmup_steps=3)
    ev = torch.utils.data.DataLoader(helpers.classification_data(50), batch_size=8)
    torch.manual_seed(7)
    return model, opt, dl, ev


def _accelerate_way():
    """examples/by_feature/schedule_free.py: model.train(); optimizer.train() before training, .eval() both before evaluating."""
    accelerator = Accelerator(cpu=True)
    model, opt, dl, ev = accelerator.prepare(*_objects())
    outputs = []
    for _ in range(EPOCHS):
        model.train()
        opt.train()
        for batch in dl:
            loss = helpers.ce_loss(model, batch)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        model.eval()
        opt.eval()
        with torch.no_grad():
            outputs.append(torch.cat([accelerator.gather_for_metrics(model(x)) for x, _ in ev]))
    opt.train()  # trainfold's optimizer is back in train mode after its evaluation
    return testing.parameters(model), outputs


def _trainfold_way():
    ctx = Context(accelerator=Accelerator(cpu=True))
    model, opt, dl, ev = _objects()
    state = TrainState.create(ctx, model=model, optimizer=opt)
    dl, ev = ctx.prepare_loaders(dl, ev)
    outputs = []

    def predicted(state):
        outputs.append(predict(ctx, lambda m, b: m(b[0]), ev, state))
        return state

    state = loop(compose(predicted, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl)), max_epochs=EPOCHS)(state)
    return testing.parameters(state), outputs, opt.param_groups[0]["train_mode"]


def _both_ways():
    return helpers.each_fresh(_accelerate_way, _trainfold_way)


def _check(expected, got):
    (params, outputs), (got_params, got_outputs, train_mode) = expected, got
    testing.assert_params_equal(params, got_params)
    assert len(outputs) == len(got_outputs) == EPOCHS
    for a, b in zip(outputs, got_outputs):
        assert torch.equal(a, b)  # evaluated with the averaged weights, as the example does
    assert train_mode


def test_composed_loop_equals_the_schedule_free_example_on_one_process():
    _check(*_both_ways())


@pytest.mark.multiprocess
def test_composed_loop_equals_the_schedule_free_example_on_two_processes():
    for expected, got in testing.run_distributed(_both_ways, nprocs=2):
        _check(expected, got)


def test_evaluation_inside_an_epoch_puts_the_optimizer_back_in_train_mode():
    """Without it the next step would raise schedulefree's 'Optimizer was not in train mode'."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    model = state.model
    opt = schedulefree.SGDScheduleFree(model.parameters(), lr=0.1)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    modes = []

    def seen(state):  # what the evaluation saw
        modes.append(opt.param_groups[0]["train_mode"])
        return state

    step = every_steps(1, compose(seen, evaluate(ctx, loss_fn, loader)))(make_step(ctx, loss_fn))
    state = run_epoch(ctx, step, loader, state)

    assert state.step == 4 and len([r for r in state.history if r.name == "eval_loss"]) == 4
    assert opt.param_groups[0]["train_mode"]


def test_checkpoints_hold_averaged_weights(tmp_path):
    """Checkpoints and `save_best` hold the averaged weights and training goes on in train mode."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    model = state.model
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
    live = testing.parameters(state)

    # what a save must write, computed by the optimizer's own eval() on a copy of this run
    twin_model = copy.deepcopy(model)
    twin_opt = schedulefree.AdamWScheduleFree(twin_model.parameters(), lr=0.05)
    twin_opt.load_state_dict(opt.state_dict())
    twin_opt.eval()
    averaged = testing.parameters(twin_model)
    assert any(not torch.equal(averaged[k], live[k]) for k in live)  # the two weights differ

    save_checkpoint(ctx, tmp_path / "ckpt", state)
    state = evaluate(ctx, loss_fn, loader, state)
    save_best(ctx, tmp_path / "best.safetensors", "eval_loss", state)

    saved = load_file(str(list_checkpoints(tmp_path / "ckpt")[-1] / "model.safetensors"))
    best = load_file(str(tmp_path / "best.safetensors"))
    testing.assert_params_equal(averaged, saved)
    testing.assert_params_equal(averaged, best)
    assert opt.param_groups[0]["train_mode"]
    run_epoch(ctx, make_step(ctx, loss_fn), loader, state)  # trains on: in train mode


def test_a_schedule_free_run_resumes_exactly_from_any_checkpoint(tmp_path):
    def run(root, resume_from=None):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, shuffle=True)
        model = state.model
        state = TrainState.create(
            ctx, model=model, optimizer=schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05, warmup_steps=2)
        )
        if resume_from is not None:
            state = load_checkpoint(ctx, resume_from, state)
        saving = checkpoint_every(ctx, 3, root)
        step = saving(make_step(ctx, loss_fn))
        return saving.at_end(
            loop(compose(evaluate(ctx, loss_fn, loader), run_epoch(ctx, step, loader)), max_epochs=3)(state)
        )

    uninterrupted = run(tmp_path / "run")
    checkpoints = list_checkpoints(tmp_path / "run")
    assert len(checkpoints) >= 3
    for i, ckpt in enumerate(checkpoints):
        resumed = run(tmp_path / f"resumed{i}", ckpt)
        testing.assert_params_equal(uninterrupted, resumed)
        assert resumed.history == uninterrupted.history


def test_evaluate_metrics_sees_averaged_weights():
    """`evaluate_metrics` sees the averaged weights and hands back train mode."""
    from trainfold import evaluate_metrics

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    model = state.model
    opt = schedulefree.SGDScheduleFree(model.parameters(), lr=0.1)
    state = run_epoch(ctx, make_step(ctx, loss_fn), loader, TrainState.create(ctx, model=model, optimizer=opt))
    modes = []

    class Modes:  # records the optimizer's mode while the metric is fed
        def update(self, *_):
            modes.append(opt.param_groups[0]["train_mode"])

        def compute(self):
            return 0.0

        def reset(self):
            pass

    evaluate_metrics(ctx, {"modes": Modes()}, lambda m, b: m(b[0]), loader, state)

    assert modes and not any(modes)  # eval mode throughout
    assert opt.param_groups[0]["train_mode"]
