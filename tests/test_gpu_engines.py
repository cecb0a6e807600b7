"""FSDP2 on CUDA with bf16 (Accelerate's own FSDP2 path, NCCL): the step and sharded checkpoints. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    load_checkpoint,
    loop,
    make_step,
    max_steps,
    run_epoch,
    testing,
    verify_checkpoint,
)

import helpers

pytestmark = [
    helpers.needs_cuda,
    pytest.mark.multiprocess,
]  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one


def _accelerator(ga: int) -> Accelerator:
    from accelerate.utils import FullyShardedDataParallelPlugin

    return Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        mixed_precision="bf16",
        gradient_accumulation_steps=ga,
    )


def _objects():
    torch.manual_seed(0)
    model = helpers.mlp(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    dl = torch.utils.data.DataLoader(helpers.classification_data(48), batch_size=4, shuffle=True)
    return model, opt, sched, dl


def _full(acc, model):
    return {n: p.full_tensor().detach().float().cpu().clone() for n, p in acc.unwrap_model(model).named_parameters()}


def _canonical(ga, clip):
    acc = _accelerator(ga)
    model, opt, sched, dl = _objects()
    return helpers.canonical_loop(acc, model, opt, sched, dl, helpers.ce_loss, epochs=2, clip_norm=clip, read=_full)[0]


def _composed(ga, clip):
    acc = _accelerator(ga)
    ctx = Context(accelerator=acc)
    model, opt, sched, dl = _objects()
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(dl)
    state = loop(run_epoch(ctx, make_step(ctx, helpers.ce_loss, clip_grad_norm=clip), dl), max_epochs=2)(state)
    got = _full(acc, state.model)
    kind = (str(acc.distributed_type), type(acc.unwrap_model(state.model)).__name__)
    ctx.close()
    return got, kind


@pytest.mark.parametrize("ga,clip", [(1, None), (3, 0.5)])
def test_composed_loop_equals_canonical_fsdp2_loop_on_cuda_in_bf16(ga, clip):
    n = torch.cuda.device_count()
    expected = testing.run_distributed(_canonical, ga, clip, nprocs=n)
    composed = testing.run_distributed(_composed, ga, clip, nprocs=n)

    for want, (got, (engine, cls)) in zip(expected, composed):
        assert engine == "DistributedType.FSDP" and cls.startswith("FSDP")
        testing.assert_params_equal(want, got)


def _train(root, *, stop_after=None, resume=False, ga=1):
    ctx = Context(accelerator=_accelerator(ga))
    model, opt, sched, dl = _objects()
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(dl)
    if resume:
        state = load_checkpoint(ctx, root, state)
    step = make_step(ctx, helpers.ce_loss)
    if stop_after is not None:
        step = max_steps(stop_after)(step)
    saving = checkpoint_every(ctx, 2, root)
    state = saving.at_end(loop(run_epoch(ctx, saving(step), dl), max_epochs=2)(state))
    params = _full(ctx.accelerator, state.model)
    ctx.close()
    return params, state.step


@pytest.mark.parametrize("ga", [1, 3])
def test_sharded_checkpoint_resumes_mid_epoch_exactly_on_cuda_in_bf16(ga, tmp_path):
    n = torch.cuda.device_count()
    [(full, _)] = testing.run_distributed(_train, str(tmp_path / "a"), ga=ga, nprocs=n)[:1]
    testing.run_distributed(_train, str(tmp_path / "b"), stop_after=3, ga=ga, nprocs=n)
    manifest = verify_checkpoint(latest_checkpoint(tmp_path / "b"))
    [(resumed, _)] = testing.run_distributed(_train, str(tmp_path / "b"), resume=True, ga=ga, nprocs=n)[:1]

    assert manifest["format"] == 2 and manifest["step"] == 3
    testing.assert_params_equal(full, resumed)


# --- fp8 (torchao's float8 training through Accelerate's AO backend): needs an H100-class GPU ----------------


def _fp8_capable() -> bool:
    import importlib.util

    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (8, 9)
        and importlib.util.find_spec("torchao") is not None
    )


def _fp8_objects():
    torch.manual_seed(0)
    # torchao's float8 matmuls need dimensions divisible by 16; Accelerate leaves the first and last Linear in bf16
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 16),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 16, (96,), generator=g))
    return model, opt, torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)


def _fp8_accelerator(ga):
    from accelerate.utils import AORecipeKwargs

    return Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()], gradient_accumulation_steps=ga)


def _fp8_canonical(ga):
    acc = _fp8_accelerator(ga)
    model, opt, dl = _fp8_objects()
    model, opt, dl = acc.prepare(model, opt, dl)
    for _ in range(2):
        for batch in dl:
            with acc.accumulate(model):
                acc.backward(helpers.ce_loss(model, batch))
                opt.step()
                opt.zero_grad()
    converted = sorted({type(m).__name__ for m in acc.unwrap_model(model).modules()})
    return {n: p.detach().float().cpu().clone() for n, p in acc.unwrap_model(model).named_parameters()}, converted


def _fp8_composed(ga):
    ctx = Context(accelerator=_fp8_accelerator(ga))
    model, opt, dl = _fp8_objects()
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    state = loop(run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl), max_epochs=2)(state)
    params = {
        n: p.detach().float().cpu().clone() for n, p in ctx.accelerator.unwrap_model(state.model).named_parameters()
    }
    ctx.close()
    return params


@pytest.mark.skipif(not _fp8_capable(), reason="needs a GPU with fp8 (compute capability 8.9+) and torchao")
@pytest.mark.parametrize("ga", [1, 2])
def test_composed_loop_equals_canonical_loop_in_fp8(ga):
    """Accelerate's fp8 through torchao (Float8Linear in the middle layers): the composed loop's parameters equal the canonical loop's."""
    [(expected, converted)] = testing.run_distributed(_fp8_canonical, ga, nprocs=1)
    [got] = testing.run_distributed(_fp8_composed, ga, nprocs=1)

    assert "Float8Linear" in converted  # fp8 really ran
    testing.assert_params_equal(expected, got)
