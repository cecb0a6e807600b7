"""Misuse and bad input: each mistake gets an error that names the thing and the fix."""

import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, evaluate, make_step, predict, run_epoch, testing


def _step_with(loss_fn):
    ctx, state, loader, _ = testing.tiny_setup()
    return make_step(ctx, loss_fn), state, next(iter(loader))


@pytest.mark.parametrize(
    "loss_fn,error,words",
    [
        (lambda m, b: testing.mse_loss(m, b).item(), TypeError, "loss that is a float, not a tensor"),
        (lambda m, b: [testing.mse_loss(m, b)], TypeError, "returned a list"),
        (lambda m, b: (m(b[0]) - b[1]) ** 2, ValueError, r"shape \(4, 1\).*reduce it"),
        (lambda m, b: torch.tensor(3), TypeError, "dtype torch.int64.*integer tensor"),
        (lambda m, b: testing.mse_loss(m, b).detach(), ValueError, "no gradient"),
        (lambda m, b: (testing.mse_loss(m, b), {"acc": torch.ones(4)}), TypeError, r"aux\['acc'\].*0-d tensors"),
        (lambda m, b: (testing.mse_loss(m, b), [1]), TypeError, "returned a tuple"),
    ],
    ids=["python_float", "list", "non_scalar", "integer", "no_grad", "aux_not_scalar", "aux_not_mapping"],
)
def test_a_bad_loss_is_refused_with_the_fix(loss_fn, error, words):
    step, state, batch = _step_with(loss_fn)

    with pytest.raises(error, match=words):
        step(state, batch)


def test_a_loss_fn_that_cannot_take_the_batch_shows_the_batch_structure():
    """The user's own exception keeps its type; a note shows the batch's types and shapes."""
    step, state, batch = _step_with(lambda m, b: testing.mse_loss(m, b["x"]))

    with pytest.raises(TypeError) as info:
        step(state, batch)

    assert "batch of structure list(Tensor[4, 1] float32, Tensor[4, 1] float32)" in "\n".join(info.value.__notes__)


def test_aux_names_must_not_change_within_an_epoch():
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        loss = testing.mse_loss(model, batch)
        return loss, {f"name{len(calls) % 2}": loss.detach()}

    step, state, batch = _step_with(loss_fn)
    with pytest.raises(ValueError, match="same names for every batch"):
        step(step(state, batch), batch)


@pytest.mark.parametrize("primitive", ["run_epoch", "evaluate", "predict"])
def test_an_empty_loader_is_an_error(primitive):
    ctx, state, _, loss_fn = testing.tiny_setup()
    empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1)), batch_size=4)
    (empty,) = ctx.prepare_loaders(empty)
    call = {
        "run_epoch": lambda: run_epoch(ctx, make_step(ctx, loss_fn), empty, state),
        "evaluate": lambda: evaluate(ctx, loss_fn, empty, state),
        "predict": lambda: predict(ctx, lambda m, b: m(b[0]), empty, state),
    }[primitive]

    with pytest.raises(ValueError, match=rf"{primitive}: the loader yielded no batches.*dataset of 0 samples"):
        call()


def test_a_state_from_another_context_is_refused():
    ctx, state, loader, loss_fn = testing.tiny_setup()
    other_ctx = Context(accelerator=Accelerator(cpu=True))

    with pytest.raises(ValueError, match="created with another Accelerator"):
        run_epoch(other_ctx, make_step(other_ctx, loss_fn), loader, state)
    with pytest.raises(ValueError, match="created with another Accelerator"):
        make_step(other_ctx, loss_fn)(state, next(iter(loader)))


def test_two_contexts_with_conflicting_accumulation_are_detected():
    """Accelerate's state is process-wide: a second Accelerator silently changes the first one's accumulation."""
    first = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=4))
    Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))

    with pytest.raises(RuntimeError, match=r"made with gradient_accumulation_steps=4.*now gradient_accumulation_steps=2"):
        make_step(first, testing.mse_loss)


def test_a_state_where_the_step_expects_one():
    ctx, _, loader, loss_fn = testing.tiny_setup()

    with pytest.raises(TypeError, match="needs a TrainState"):
        run_epoch(ctx, make_step(ctx, loss_fn), loader, {"step": 0})


@pytest.mark.parametrize("kw,words", [({"clip_grad_norm": 0}, "positive finite"), ({"clip_grad_value": float("nan")}, "positive finite"), ({"clip_grad_norm": 1.0, "clip_grad_value": 1.0}, "not both")])
def test_bad_clipping_options(kw, words):
    ctx, *_ = testing.tiny_setup()

    with pytest.raises(ValueError, match=words):
        make_step(ctx, testing.mse_loss, **kw)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"model": "net"}, "'model' must be a torch.nn.Module"),
        ({"optimizer": None}, "'optimizer' must be a torch.optim.Optimizer"),
        ({"scheduler": 3}, "'scheduler' must have a step"),
    ],
)
def test_create_checks_its_arguments(kw, words):
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), **kw}

    with pytest.raises(TypeError, match=words):
        TrainState.create(ctx, **args)


def test_context_needs_an_accelerator():
    with pytest.raises(TypeError, match="'accelerator' must be an accelerate.Accelerator"):
        Context(accelerator="cpu")
