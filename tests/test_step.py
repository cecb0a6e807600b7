"""A step in isolation: exact numbers on Linear(1, 1) with SGD."""

import pytest
import torch
from accelerate import Accelerator

from torch.utils._python_dispatch import TorchDispatchMode

from trainfold import Context, TrainState, make_step, testing
from trainfold._src.base.running_sums import FOLD_EVERY
from trainfold._src.core.step import record


def _setup(gradient_accumulation_steps=1, lr=0.25):
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps))
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    return ctx, state


BATCH = (torch.tensor([[1.0]]), torch.tensor([[1.0]]))


def _weight(state):
    return state.model.weight.detach().item()


def test_step_returns_new_state_and_leaves_old_counters():
    """A step advances the counters on the new state only; the handles are shared."""
    ctx, state = _setup()
    step = make_step(ctx, testing.mse_loss)

    new = step(state, BATCH)

    assert (0, 0, 0) == (state.step, state.micro_step, state.batch_in_epoch)
    assert (1, 1, 1) == (new.step, new.micro_step, new.batch_in_epoch)
    assert new.model is state.model
    assert new.optimizer is state.optimizer


def test_two_sgd_steps_give_exact_weights():
    """w=0, lr=0.25, loss (w-1)^2: the gradient is -2 then -1, so w is 0.5 then 0.75."""
    ctx, state = _setup()
    step = make_step(ctx, testing.mse_loss)

    one = step(state, BATCH)
    w1 = _weight(one)
    two = step(one, BATCH)

    assert (0.5, 0.75) == (w1, _weight(two))
    assert 2 == two.step


def test_running_loss_sum_is_kept_on_the_device():
    """The losses 1.0 and 0.25 are summed into a 0-d tensor without being read back."""
    ctx, state = _setup()
    step = make_step(ctx, testing.mse_loss)

    two = step(step(state, BATCH), BATCH)

    assert isinstance(two.loss_sum, torch.Tensor) and two.loss_sum.ndim == 0
    assert 1.25 == two.loss_sum.item()
    assert 0.0 == state.loss_sum.item()


def test_accumulation_updates_once_per_group_with_the_mean_gradient():
    """Accumulation 2: the first micro-batch only accumulates, the second updates with the mean gradient."""
    ctx, state = _setup(gradient_accumulation_steps=2)
    step = make_step(ctx, testing.mse_loss)

    one = step(state, BATCH)
    w_after_one = _weight(one)
    two = step(one, BATCH)

    assert (0.0, 0) == (w_after_one, one.step)
    assert (0.5, 1, 2) == (_weight(two), two.step, two.micro_step)


def test_clip_grad_norm_limits_the_update():
    """The gradient -2 clipped to norm 1 moves w by lr * 1 = 0.25."""
    ctx, state = _setup()
    step = make_step(ctx, testing.mse_loss, clip_grad_norm=1.0)

    new = step(state, BATCH)

    assert 0.25 == pytest.approx(_weight(new), abs=1e-6)


def test_clip_grad_value_limits_each_element():
    """The gradient -2 clipped to [-0.5, 0.5] moves w by 0.25 * 0.5."""
    ctx, state = _setup()
    step = make_step(ctx, testing.mse_loss, clip_grad_value=0.5)

    new = step(state, BATCH)

    assert 0.125 == _weight(new)


def test_a_step_updates_despite_sync_gradients():
    """With one accumulation step the step does not call Accelerate's _do_sync each time, unless it must."""
    ctx, state = _setup()
    ctx.accelerator.gradient_state._set_sync_gradients(False)  # as a foreign accumulate() or no_sync might

    new = make_step(ctx, testing.mse_loss)(state, BATCH)

    assert (0.5, 1) == (_weight(new), new.step)
    assert ctx.accelerator.sync_gradients


def test_aux_sums_add_bool_int_and_half_values_as_float32():
    """Whatever the values' dtypes, the sums are float32 and exact."""
    ctx, state = _setup()
    aux = {
        "flag": torch.tensor(True),
        "count": torch.tensor(3),
        "half": torch.tensor(0.5, dtype=torch.float16),
        "double": torch.tensor(0.25, dtype=torch.float64),
    }
    step = make_step(ctx, lambda m, b: (testing.mse_loss(m, b), aux))

    three = step(step(step(state, BATCH), BATCH), BATCH)

    assert {k: torch.float32 for k in aux} == {k: v.dtype for k, v in three.aux_sums.items()}
    assert {"flag": 3.0, "count": 9.0, "half": 1.5, "double": 0.75} == {k: v.item() for k, v in three.aux_sums.items()}


def test_aux_values_are_summed_alongside_the_loss():
    """aux tensors returned by loss_fn become running sums under their names."""
    ctx, state = _setup()

    def loss_fn(model, batch):
        loss = testing.mse_loss(model, batch)
        return loss, {"twice": 2 * loss.detach()}

    step = make_step(ctx, loss_fn)
    two = step(step(state, BATCH), BATCH)

    assert {"twice": 2.5} == {k: v.item() for k, v in two.aux_sums.items()}


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_recording_a_micro_batch_runs_no_tensor_op_until_its_sums_are_due():
    """Each micro-batch's (loss, aux) waits in state.sums.pending; every FOLD_EVERY-th, one stack and sum per name."""
    ctx, state = _setup()
    ops_per_record = []
    for i in range(FOLD_EVERY + 1):
        loss, aux = torch.tensor(float(i)), {"one": torch.tensor(1.0)}
        with _CountOps() as counted:
            state = record(state, loss, aux, updated=True)
        ops_per_record.append(len(counted.ops))

    assert [0] * (FOLD_EVERY - 1) == ops_per_record[: FOLD_EVERY - 1]
    assert 0 < ops_per_record[FOLD_EVERY - 1] <= 8
    assert 0 == ops_per_record[FOLD_EVERY]
    assert 1 == len(state.sums.pending)
    assert sum(range(FOLD_EVERY + 1)) == state.loss_sum.item()
    assert {"one": FOLD_EVERY + 1.0} == {k: v.item() for k, v in state.aux_sums.items()}


def test_pending_micro_batches_hold_no_autograd_graph():
    """The waiting losses and aux values are detached: they do not keep the activations alive."""
    ctx, state = _setup()
    step = make_step(ctx, lambda m, b: (testing.mse_loss(m, b), {"again": testing.mse_loss(m, b)}))

    two = step(step(state, BATCH), BATCH)

    assert 2 == len(two.sums.pending)
    assert not any(loss.requires_grad or aux["again"].requires_grad for loss, aux in two.sums.pending)
    assert (1.25, 1.25) == (two.loss_sum.item(), two.aux_sums["again"].item())


def test_folded_adds_the_waiting_micro_batches():
    """`folded` adds the waiting micro-batches and leaves the sums unchanged."""
    ctx, state = _setup()
    step = make_step(ctx, testing.mse_loss)
    two = step(step(state, BATCH), BATCH)

    folded = two.sums.folded()

    assert (0, 2) == (len(folded.pending), len(two.sums.pending))
    assert 1.25 == folded.loss.item() == two.loss_sum.item()
    assert folded.folded() is folded


def test_a_trainstate_subclass_through_steps():
    """As flax's TrainState allows: a subclass adds fields, and every new state is of the subclass."""
    import attrs

    from trainfold import run_epoch

    @attrs.frozen
    class LabelledState(TrainState):
        label: str = "none"
        seen: int = attrs.field(default=0, kw_only=True)

    ctx, base = _setup()
    state = LabelledState(
        base.model, base.optimizer, base.scheduler, base.accelerator, sums=base.sums, label="run-a", seen=3
    )
    (loader,) = ctx.prepare_loaders(torch.utils.data.DataLoader(testing.regression_data(8), batch_size=2))

    new = run_epoch(ctx, make_step(ctx, testing.mse_loss), loader, state)

    assert type(new) is LabelledState
    assert ("run-a", 3, 4, 1) == (new.label, new.seen, new.step, new.epoch)


def test_step_has_a_readable_name():
    ctx, _ = _setup()

    assert "step[mse_loss]" == make_step(ctx, testing.mse_loss).__qualname__


def test_a_step_function_keeps_no_model_alive_once_its_state_is_gone():
    """A host runs many trials with one step function: the step's per-optimizer caches must not hold them."""
    import gc
    import weakref

    from trainfold import nan_guard

    ctx, _ = _setup()
    steps = [make_step(ctx, testing.mse_loss), make_step(ctx, testing.mse_loss, stages=[nan_guard(3)])]

    def trial():
        model = torch.nn.Linear(1, 1)
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        for step in steps:
            state = step(state, BATCH)
        return weakref.ref(model.weight)

    weight = trial()
    ctx.accelerator.free_memory()  # Accelerate's own references to what it prepared
    gc.collect()

    assert weight() is None


def _clip_setup():
    """Linear(2, 1) from zero, SGD with lr 1, 2 accumulation steps: the update is minus the clipped gradient."""
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    return ctx, state


def _summed(model, batch):
    return model(batch).sum()  # the gradient of the weight is the sum of the inputs


@pytest.mark.parametrize(
    "option,second,expected",
    [
        # norm: the group's gradient (2, 1) / sqrt(5); clipped after each micro-batch it would be (0.707, 0.707)
        ({"clip_grad_norm": 1.0}, [0.0, 2.0], [-2 / 5**0.5, -1 / 5**0.5]),
        # value: the group's gradient (1, 0) is inside [-1.5, 1.5]; clipped after each micro-batch it would be (0.5, 0)
        ({"clip_grad_value": 1.5}, [-2.0, 0.0], [-1.0, 0.0]),
    ],
)
def test_clipping_acts_once_on_the_accumulated_gradient_of_an_update(option, second, expected):
    """The first micro-batch's partial gradient, (2, 0) after Accelerate's division by 2, already exceeds the limit:
    clipping it (and not the update's whole gradient) gives another update. The accumulation tests' partial
    gradients never reached their limit, so a per-micro-batch clip passed them."""
    ctx, state = _clip_setup()
    step = make_step(ctx, _summed, **option)

    new = step(step(state, torch.tensor([[4.0, 0.0]])), torch.tensor([second]))

    assert 1 == new.step
    torch.testing.assert_close(new.model.weight.detach(), torch.tensor([expected]), rtol=0, atol=1e-6)


def test_an_aux_value_with_a_weight_is_averaged_by_its_weights():
    """acc 0 over 1 sample, then acc 1 over 3 samples: 3/4, not the mean of the two batch values (1/2)."""
    from trainfold import run_epoch

    ctx, state = _setup()
    values = iter([(0.0, 1.0), (1.0, 3.0)])

    def loss_fn(model, batch):
        acc, weight = next(values)
        return testing.mse_loss(model, batch), {"acc": torch.tensor(acc), "acc@weight": torch.tensor(weight)}

    final = run_epoch(ctx, make_step(ctx, loss_fn), [BATCH, BATCH], state)

    assert 0.75 == final.metrics["train_acc"]
