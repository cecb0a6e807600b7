"""make_step(compile=...): compiled, proven compiled, no recompiles after warm-up, equal to eager, checkpoints of one format."""

import functools
import re

import helpers
import pytest
import torch
import torch._dynamo
from accelerate import Accelerator
from torch.optim.optimizer import register_optimizer_step_post_hook

from trainfold import (
    Compile,
    Context,
    TrainState,
    evaluate,
    latest_checkpoint,
    load_checkpoint,
    log_every,
    loop,
    lr_schedule,
    make_step,
    max_steps,
    nan_guard,
    run_epoch,
    save_checkpoint,
    testing,
    warmup_cosine,
)


AOT = Compile(backend="aot_eager")  # traced by dynamo and AOTAutograd, run by eager kernels: exact where eager is
AOT_LOSS = Compile(backend="aot_eager", optimizer=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with dynamo's caches empty and its recompile check off, and leaves them so."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _setup(*, ga=2, seed=0, optimizer="sgd", accelerator=None, data=21, batch_size=4):
    """A fresh Context, an MLP, SGD momentum (or AdamW) with a step scheduler, and a loader whose last batch is short."""
    testing.reset_accelerate_state()
    torch.manual_seed(seed)
    ctx = Context(accelerator=accelerator or Accelerator(cpu=True, gradient_accumulation_steps=ga))
    model = helpers.mlp()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=optimizer == "sgd-fused")
        if optimizer.startswith("sgd")
        else torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(data), batch_size=batch_size, shuffle=True)
    )
    return ctx, state, dl


def _epochs(ctx, step, dl, state, n):
    return loop(run_epoch(ctx, step, dl), max_epochs=n)(state)


def _train(compile, *, epochs=3, **kwargs):
    ctx, state, dl = _setup(**kwargs)
    return _epochs(ctx, make_step(ctx, helpers.ce_loss, compile=compile), dl, state, epochs)


def test_a_compiled_loss_trains_bit_for_bit_as_the_eager_step(caplog):
    """Accumulation 2, a shuffled loader with a short last batch, a scheduler: 3 epochs, the same parameters and history;
    the log says what compiles, and how long it took once it was checked."""
    eager = _train(False)
    with caplog.at_level("INFO", logger="trainfold"):
        compiled = _train(AOT_LOSS)

    testing.assert_params_equal(eager, compiled)
    assert eager.history == compiled.history
    said = [r.getMessage() for r in caplog.records if "make_step(compile=...)" in r.getMessage()]
    assert 2 == len(said)
    assert said[0].startswith(
        "make_step(compile=...): compiling the loss (compiled_loss[ce_loss]) at its first call (backend aot_eager"
    )
    assert re.fullmatch(
        r"make_step\(compile=\.\.\.\): the loss \(compiled_loss\[ce_loss\]\) compiled in \d+\.\d s \(checked: .*\)",
        said[1],
    )


def test_a_compiled_update_trains_as_the_eager_step_within_rounding():
    """torch's compiled optimizers read the learning rate as a tensor: its multiply and add round apart where the eager
    kernel fuses them (one unit in the last place, here and there). SGD with momentum and AdamW."""
    for optimizer in ("sgd", "adamw"):
        eager, compiled = _train(False, optimizer=optimizer), _train(AOT, optimizer=optimizer)

        testing.assert_params_equal(eager, compiled, rtol=1e-5, atol=1e-6)
        assert compiled.step == eager.step


def test_nothing_recompiles_after_the_warm_up(tmp_path):
    """The warm-up is the first epoch and the first evaluation (the short last batch compiles once more). After it, with
    dynamo's recompile check on: accumulation boundaries, epoch ends, evaluation between epochs, a learning rate set
    every step (lr_schedule) and by the scheduler, a checkpoint saved and loaded back into the live state."""
    ctx, state, dl = _setup()
    step = lr_schedule(warmup_cosine(0.1, warmup_steps=2, total_steps=40))(make_step(ctx, helpers.ce_loss, compile=AOT))
    val = evaluate(ctx, helpers.ce_loss, dl)
    state = val(run_epoch(ctx, step, dl, state))  # the warm-up

    lr = state.optimizer.param_groups[0]["lr"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        state = val(run_epoch(ctx, step, dl, state))
        assert (
            state.optimizer.param_groups[0]["lr"] is lr
        )  # filled in place by lr_schedule and the scheduler, not replaced
        state = save_checkpoint(ctx, tmp_path, run_epoch(ctx, max_steps(state.step + 3)(step), dl, state))
        state = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
        state = val(run_epoch(ctx, step, dl, state))

    assert state.epoch == 3 and "eval_loss" in state.history.names


@pytest.mark.parametrize("sharded", [False, True])
def test_a_resumed_compiled_run_ends_as_the_uninterrupted_one_bit_for_bit(tmp_path, sharded):
    """Compiled loss and update: a run stopped mid-epoch, saved (whole, or sharded: DCP's flattened optimizer state,
    where the learning rate, a tensor for the compiled update, is kept as a number too), and resumed by a new step
    (compiled anew) in a new state; an eager run reads the checkpoint, its learning rate a float."""
    expected = _train(AOT, epochs=3)
    ctx, state, dl = _setup()
    step = make_step(ctx, helpers.ce_loss, compile=AOT)
    state = _epochs(ctx, step, dl, state, 1)
    state = run_epoch(ctx, max_steps(state.step + 2)(step), dl, state)
    assert (state.epoch, state.batch_in_epoch) == (1, 4)  # inside the second epoch
    save_checkpoint(ctx, tmp_path, state, sharded=sharded)

    ctx, state, dl = _setup(seed=7)  # other initial weights: everything comes from the checkpoint
    state = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
    resumed = _epochs(ctx, make_step(ctx, helpers.ce_loss, compile=AOT), dl, state, 3)

    testing.assert_params_equal(expected, resumed)
    assert expected.history == resumed.history
    ctx, state, dl = _setup()
    assert type(load_checkpoint(ctx, latest_checkpoint(tmp_path), state).optimizer.param_groups[0]["lr"]) is float


def test_compiled_and_eager_runs_resume_from_each_other_s_checkpoints(tmp_path):
    """One format: the model's names as an eager run's (no ``_orig_mod.``), the learning rate a number in the optimizer's
    and the scheduler's state. An eager run resumed from a compiled run's checkpoint (and the other way round) ends as
    the uninterrupted eager run, with the compiled part the loss (bit for bit)."""
    expected = _train(False)
    for first, then in ((AOT_LOSS, False), (False, AOT_LOSS)):
        root = tmp_path / f"{bool(first)}"
        ctx, state, dl = _setup()
        save_checkpoint(
            ctx, root, run_epoch(ctx, max_steps(2)(make_step(ctx, helpers.ce_loss, compile=first)), dl, state)
        )

        ctx, state, dl = _setup(seed=7)
        resumed = _epochs(
            ctx,
            make_step(ctx, helpers.ce_loss, compile=then),
            dl,
            load_checkpoint(ctx, latest_checkpoint(root), state),
            3,
        )

        testing.assert_params_equal(expected, resumed)

    ctx, state, dl = _setup()
    saved = save_checkpoint(
        ctx,
        tmp_path / "compiled",
        run_epoch(ctx, max_steps(2)(make_step(ctx, helpers.ce_loss, compile=AOT)), dl, state),
    )
    assert isinstance(saved.optimizer.param_groups[0]["lr"], torch.Tensor)  # the live one, for the compiled update
    ckpt = latest_checkpoint(tmp_path / "compiled")
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(testing.parameters(helpers.mlp()))
    text = (ckpt / "state.json").read_text()
    assert "_orig_mod" not in text
    ctx, state, dl = _setup()
    eager = load_checkpoint(ctx, ckpt, state)
    assert type(eager.optimizer.param_groups[0]["lr"]) is float and all(
        type(v) is float for v in eager.scheduler.get_last_lr()
    )


def _canonical_compiled(backend):
    """Accelerate's own way: its dynamo plugin compiles the model at prepare; the loop of its accumulation guide."""
    testing.reset_accelerate_state()
    torch._dynamo.reset()
    model, opt, sched, dl = helpers.build(0, scheduler=True)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, dynamo_backend=backend)
    params, _ = helpers.canonical_loop(
        acc,
        model,
        opt,
        sched,
        dl,
        helpers.ce_loss,
        epochs=2,
        read=lambda acc, prepared: testing.parameters(acc.unwrap_model(prepared, keep_torch_compile=False)),
    )
    return params


def test_a_compiled_loss_equals_accelerate_s_compiled_loop_bit_for_bit():
    """Accelerate compiles the model (its plugin, aot_eager); trainfold compiles the loss with the model inside: equal.
    And compile=True under that plugin takes its backend."""
    expected = _canonical_compiled("aot_eager")

    testing.reset_accelerate_state()
    torch._dynamo.reset()
    model, opt, sched, dl = helpers.build(0, scheduler=True)
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(dl)
    state = _epochs(ctx, make_step(ctx, helpers.ce_loss, compile=AOT_LOSS), dl, state, 2)

    testing.assert_params_equal(expected, state)

    from trainfold._src.core.compiling import compile_spec

    testing.reset_accelerate_state()
    assert (
        compile_spec(Context(accelerator=Accelerator(cpu=True, dynamo_backend="aot_eager")), True).backend
        == "aot_eager"
    )
    testing.reset_accelerate_state()
    assert compile_spec(Context(accelerator=Accelerator(cpu=True)), True) == Compile()


def test_a_step_dynamo_cannot_compile_says_so():
    """A step asked to compile where Dynamo compiles nothing says so at its first call."""
    ctx, state, dl = _setup()
    step = make_step(ctx, helpers.ce_loss, compile=AOT)
    batch = next(iter(dl))

    with (
        torch._dynamo.config.patch(disable=True),
        pytest.raises(
            RuntimeError, match=r"the loss \(compiled_loss\[ce_loss\]\) was to be compiled and dynamo compiled nothing"
        ),
    ):
        step(state, batch)


def test_each_step_compiles_its_own_update():
    """The update is compiled from a code object of the step's own (the body of SGD.step inlined, the gradients set to
    None), not from SGD.step, which every SGD in the process shares: three optimizers under a limit of two versions each
    compile their update (the step's check raises at the first update where one ran eagerly)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch._dynamo.config.patch(recompile_limit=2):
        for i in range(3):
            ctx, state, dl = _setup(ga=1)
            before = len(graphs)
            new = make_step(ctx, helpers.ce_loss, compile=Compile(backend=counting))(state, next(iter(dl)))

            assert len(graphs) == before + 2, (
                f"step {i}: {len(graphs) - before} graphs, not the loss's and the update's"
            )
            assert all(p.grad is None for p in new.model.parameters())


def test_a_gated_update_compiles_optimizer_step():
    """A gated update (nan_guard) may skip the step and still zero the gradients: its step is optimizer.step compiled, a
    frame of torch's shared by every optimizer of the class. Each optimizer is another version of it; past dynamo's limit
    it would run eagerly, so the step raises."""
    with torch._dynamo.config.patch(recompile_limit=2):
        for i in range(3):
            ctx, state, dl = _setup(ga=1)
            step = make_step(ctx, helpers.ce_loss, compile=AOT, stages=[nan_guard(3)])
            if i < 2:
                step(state, next(iter(dl)))
                continue
            with pytest.raises(
                RuntimeError,
                match=r"the optimizer's update \(SGD.step\) ran eagerly: dynamo already holds 2 compiled versions",
            ):
                step(state, next(iter(dl)))


@pytest.mark.parametrize("hook", ["the optimizer's pre-hook", "the optimizer's post-hook", "a global post-hook"])
def test_a_step_hook_runs_at_compiled_updates(hook):
    """The compiled update leaves torch's wrapper of optimizer.step out (its profiler range, its hooks) where it has
    nothing to do. A hook registered mid-run sends each update through optimizer.step (compiled) and zero_grad from
    then on; removed, the update goes back to the one compiled function. Parameters bit for bit as the run without a hook."""

    def train(with_hook):
        ctx, state, dl = _setup(ga=1, optimizer="adamw")
        step, calls, handle = make_step(ctx, helpers.ce_loss, compile=AOT), [], None
        try:
            for i, batch in enumerate(batches):
                if with_hook and i == 2:
                    register = {
                        "the optimizer's pre-hook": state.optimizer.optimizer.register_step_pre_hook,
                        "the optimizer's post-hook": state.optimizer.optimizer.register_step_post_hook,
                        "a global post-hook": register_optimizer_step_post_hook,
                    }[hook]
                    handle = register(lambda opt, args, kwargs: calls.append(opt))
                if with_hook and i == 5:
                    handle.remove()
                state = step(state, batch)
        finally:
            if handle is not None:
                handle.remove()  # (a global hook must not outlive the test)
        return state, calls

    batches = [batch for _ in range(2) for batch in _setup()[2]]
    expected, _ = train(with_hook=False)
    state, calls = train(with_hook=True)

    assert len(calls) == 3
    assert all(p.grad is None for p in state.model.parameters())
    testing.assert_params_equal(expected, state)


def test_a_fused_optimizers_compiled_update():
    """A fused optimizer (one kernel already) is updated as torch.compile(optimizer.step) and zero_grad(), not as one
    compiled function: within rounding of the eager step after 3 epochs, every gradient None after each update."""
    eager, compiled = _train(False, optimizer="sgd-fused"), _train(AOT, optimizer="sgd-fused")

    testing.assert_params_equal(eager, compiled, rtol=1e-5, atol=1e-6)
    assert compiled.step == eager.step and all(p.grad is None for p in compiled.model.parameters())


def test_an_optimizer_whose_step_was_replaced_is_updated_through_it():
    """A step put on the optimizer itself (a user's wrapper; not a scheduler's, whose wrapper only marks the call) is
    what the update calls: not the body of the class's step."""
    ctx, state, dl = _setup(ga=1)
    inner, calls = state.optimizer.optimizer, []
    own = inner.step  # the scheduler's wrapper of SGD.step

    @functools.wraps(own)  # (its marks too: the scheduler sees its own wrapper inside)
    def counted(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    inner.step = counted
    step = make_step(ctx, helpers.ce_loss, compile=AOT)
    for batch in dl:
        state = step(state, batch)

    assert len(calls) == state.step == 6
    assert all(p.grad is None for p in state.model.parameters())


def test_many_steps_built_in_one_process_each_compile_their_loss():
    """Each step's loss is a code object of its own, so its compiled versions are its own: dynamo's limit of versions (8)
    is per step, not per process. Ten steps: each compiles a graph of its own."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for i in range(10):
        ctx, state, dl = _setup(ga=1)
        before = len(graphs)
        make_step(ctx, lambda m, b, i=i: helpers.ce_loss(m, b), compile=Compile(backend=counting, optimizer=False))(
            state, next(iter(dl))
        )

        assert len(graphs) == before + 1, f"step {i} compiled no graph"


def test_a_watched_compiled_step_counts_flops():
    """Watch counts the first step's FLOPs under FlopCounterMode, a dispatch mode under which dynamo compiles nothing (and
    would not try again): that step runs eagerly, the next ones compiled (the step's check at its second call would
    raise otherwise), and the counts are the eager step's."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    reports = {}
    for compile in (False, Compile(backend=counting)):
        ctx, state, dl = _setup(ga=1)
        step = log_every(ctx, 2, watch=True)(make_step(ctx, helpers.ce_loss, compile=compile))
        reports[bool(compile)] = run_epoch(ctx, step, dl, state).extras["log_every"].values

    assert reports[True]["flops"] == reports[False]["flops"] > 0
    assert reports[True]["samples"] == reports[False]["samples"]
    assert graphs  # the loss's and the update's, compiled at the second step


def test_an_update_needing_accelerates_wrapper():
    """fp16's loss scaler, XLA or another engine's wrapper steps the optimizer on every micro-batch: nothing plain to compile."""
    from trainfold._src.backend.optim import OptimizerOps
    from trainfold._src.core.update import compiled

    wrapped = OptimizerOps(
        step=lambda: None, zero_grad=lambda: None, was_skipped=lambda: False, fast=False, scaled=True
    )
    with pytest.raises(ValueError, match=r"Accelerate's optimizer wrapper must run it .* Compile\(optimizer=False\)"):
        compiled(wrapped, AOT)


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.linear(x))


class Tower(torch.nn.Module):
    def __init__(self, width=8, depth=3, classes=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tower_run(compile):
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    model = Tower()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(24), batch_size=4))
    step = make_step(ctx, helpers.ce_loss, compile=compile)
    state = run_epoch(ctx, step, dl, state)
    first = [getattr(block.forward, "__func__", None) for block in model.blocks]
    with torch._dynamo.config.patch(error_on_recompile=True):
        state = run_epoch(ctx, step, dl, state)
    assert [
        getattr(block.forward, "__func__", None) for block in model.blocks
    ] == first  # compiled once, not per micro-batch
    return state, model


#: dynamo reads ``.grad`` of a block's input while tracing it (any regional compile: ``block.compile()`` too), and torch
#: warns when that input is not a leaf
TRACING_WARNING = "ignore:The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"


@pytest.mark.filterwarnings(TRACING_WARNING)
def test_regions_compile_each_repeated_block_once_and_train_as_eager():
    eager, _ = _tower_run(False)
    regional, model = _tower_run(Compile(backend="aot_eager", regions=True, optimizer=False))

    testing.assert_params_equal(eager, regional)
    from trainfold._src.core.compiling import compiled_versions

    forwards = {block.forward.__func__ for block in model.blocks}
    assert len(forwards) == 1  # one compiled function, shared by the three blocks
    assert compiled_versions(Block.forward.__code__) == 0  # the class's own forward is untouched
    assert sorted(testing.parameters(model)) == sorted(testing.parameters(Tower()))


@pytest.mark.filterwarnings(TRACING_WARNING)
def test_regions_of_a_named_class_and_a_model_without_repeated_blocks():
    _, model = _tower_run(Compile(backend="aot_eager", regions=Block, optimizer=False))
    assert all(hasattr(block.forward, "__func__") for block in model.blocks)

    ctx, state, dl = _setup()
    step = make_step(ctx, helpers.ce_loss, compile=Compile(backend="aot_eager", regions=True))
    with pytest.raises(
        ValueError, match=r"the model \(Sequential\) has no ModuleList of two or more blocks of one class to compile"
    ):
        step(state, next(iter(dl)))
    with pytest.raises(TypeError, match="a module class"):
        Compile(regions="Block")
    with pytest.raises(TypeError, match=r"compile=\.\.\.\) takes True, False or a trainfold.Compile"):
        make_step(ctx, helpers.ce_loss, compile="inductor")


def test_inductor_on_cpu_trains_within_float_tolerance_of_eager():
    """gcc compiles inductor's C++ kernels on this machine: a fused kernel rounds differently, within float tolerance."""
    eager, compiled = _train(False, epochs=2), _train(Compile(), epochs=2)

    testing.assert_params_equal(eager, compiled, rtol=1e-4, atol=1e-5)


def _ddp_runs():
    """The three runs on one Accelerator (its process group once: set up again and again, gloo may find the port busy)."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    runs = []
    for compile in (False, AOT_LOSS, AOT):
        torch._dynamo.reset()
        torch.manual_seed(0)
        ctx = Context(accelerator=acc)
        model = helpers.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = TrainState.create(
            ctx, model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        )
        (dl,) = ctx.prepare_loaders(
            torch.utils.data.DataLoader(helpers.classification_data(32), batch_size=4, shuffle=True)
        )
        runs.append(testing.parameters(_epochs(ctx, make_step(ctx, helpers.ce_loss, compile=compile), dl, state, 2)))
    return runs


@pytest.mark.multiprocess
def test_compiled_step_under_ddp():
    """The loss compiled with the DDP-wrapped model inside (dynamo's DDP support), accumulation 2: bit for bit; with the
    update compiled too, within rounding."""
    for eager, loss_only, whole in testing.run_distributed(_ddp_runs, nprocs=2, timeout=300):
        testing.assert_params_equal(eager, loss_only)
        testing.assert_params_equal(eager, whole, rtol=1e-5, atol=1e-6)


def _fsdp2_runs():
    """Eager, compiled loss, compiled loss and update (an MLP), eager and regions (the Tower), each under FSDP2 on one
    Accelerator; the parameters gathered whole."""
    acc = helpers.fsdp2_accelerator(gradient_accumulation_steps=2)
    runs = []
    for make, compile in (
        (helpers.mlp, False),
        (helpers.mlp, AOT_LOSS),
        (helpers.mlp, AOT),
        (Tower, False),
        (Tower, Compile(backend="aot_eager", regions=True, optimizer=False)),
    ):
        torch._dynamo.reset()
        torch.manual_seed(0)
        ctx = Context(accelerator=acc)
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        state = TrainState.create(ctx, model=model, optimizer=opt)
        (dl,) = ctx.prepare_loaders(
            torch.utils.data.DataLoader(helpers.classification_data(32), batch_size=4, shuffle=True)
        )
        state = _epochs(ctx, make_step(ctx, helpers.ce_loss, compile=compile), dl, state, 2)
        assert type(acc.unwrap_model(state.model)).__name__.startswith("FSDP")  # sharded by fully_shard
        runs.append({n: p.full_tensor().detach().clone() for n, p in acc.unwrap_model(state.model).named_parameters()})
    return runs


@pytest.mark.multiprocess
def test_compiled_step_under_fsdp2():
    """FSDP2's hooks stay outside what is compiled: the loss compiled with the sharded model inside, and each repeated
    block compiled on its own (regions), train bit for bit as the eager FSDP2 step; the update compiled over the DTensor
    shards too, within rounding."""
    for eager, loss_only, whole, tower, regions in testing.run_distributed(_fsdp2_runs, nprocs=2, timeout=300):
        testing.assert_params_equal(eager, loss_only)
        testing.assert_params_equal(eager, whole, rtol=1e-5, atol=1e-6)
        testing.assert_params_equal(tower, regions)
