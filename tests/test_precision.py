"""``TrainState.create(outputs_to_fp32=False)``: autocast kept, Accelerate's float32 copy of the outputs dropped."""

import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, loop, make_step, run_epoch, testing

from helpers import build, canonical_loop, classification_data, needs_cuda


class LossInForward(torch.nn.Module):
    """A model that computes its loss in ``forward``, as a transformers model given ``labels`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.body(x)
        return torch.nn.functional.cross_entropy(logits, y), logits


def _loss(model, batch):
    x, y = batch
    return model(x, y)[0]


def _objects(seed=0):
    torch.manual_seed(seed)
    model = LossInForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dl = torch.utils.data.DataLoader(classification_data(40), batch_size=8, shuffle=True)
    return model, opt, dl


def _create(mixed_precision="bf16", *, compiled=False, **kwargs):
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, mixed_precision=mixed_precision))
    model = torch.nn.Linear(8, 3)
    if compiled:
        model = torch.compile(model, backend="eager")
    return ctx, TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_outputs_keep_autocasts_dtype_when_asked(compiled):
    """Outputs keep autocast's dtype when asked and are float32 by default."""
    x = torch.randn(4, 8)
    _, default = _create(compiled=compiled)
    _, kept = _create(compiled=compiled, outputs_to_fp32=False)

    assert default.model(x).dtype == torch.float32  # Accelerate's contract
    assert kept.model(x).dtype == torch.bfloat16  # a float32 Linear under autocast: autocast is still on
    assert next(kept.model.parameters()).dtype == torch.float32


def test_unwrapping_without_the_fp32_wrapper_still_takes_autocast_off():
    ctx, state = _create(outputs_to_fp32=False)

    bare = ctx.accelerator.unwrap_model(state.model, keep_fp32_wrapper=False)

    assert bare(torch.randn(4, 8)).dtype == torch.float32
    assert "_original_forward" not in bare.__dict__


def test_an_outputs_to_fp32_that_is_not_a_bool_is_refused():
    with pytest.raises(TypeError, match="'outputs_to_fp32' must be True or False"):
        _create(outputs_to_fp32="no")


def test_without_mixed_precision_there_is_nothing_to_drop():
    _, state = _create("no", outputs_to_fp32=False)

    assert state.model(torch.randn(4, 8)).dtype == torch.float32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_loss_in_forward_without_the_conversion(device):
    """The loss is float32 inside forward either way: dropping the logits' copy changes no update."""
    testing.reset_accelerate_state()
    model, opt, dl = _objects()
    torch.manual_seed(100)
    acc = Accelerator(cpu=device == "cpu", mixed_precision="bf16", gradient_accumulation_steps=2)
    expected, _ = canonical_loop(acc, model, opt, None, dl, _loss, epochs=2, clip_norm=0.5)

    testing.reset_accelerate_state()
    model, opt, dl = _objects()
    torch.manual_seed(100)
    ctx = Context(accelerator=Accelerator(cpu=device == "cpu", mixed_precision="bf16", gradient_accumulation_steps=2))
    state = TrainState.create(ctx, model=model, optimizer=opt, outputs_to_fp32=False)
    (dl,) = ctx.prepare_loaders(dl)
    final = loop(run_epoch(ctx, make_step(ctx, _loss, clip_grad_norm=0.5), dl), max_epochs=2)(state)

    assert final.model(*next(iter(dl)))[1].dtype == torch.bfloat16
    testing.assert_params_equal(expected, testing.parameters(final.model))


def _ddp_output_dtype() -> tuple[str, str]:
    ctx = Context(accelerator=Accelerator(cpu=True, mixed_precision="bf16"))
    model, opt, sched, _ = build(0)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched, outputs_to_fp32=False)
    got = (type(state.model).__name__, str(state.model(torch.randn(4, 8)).dtype))
    ctx.close()
    return got


@pytest.mark.multiprocess
def test_under_ddp_the_conversion_inside_the_wrapper_is_dropped():
    assert testing.run_distributed(_ddp_output_dtype, nprocs=2) == [("DistributedDataParallel", "torch.bfloat16")] * 2
