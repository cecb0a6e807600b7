"""Sharded checkpoints (torch.distributed.checkpoint on trainfold's storage): FSDP2 and DDP on CPU processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    CheckpointError,
    Context,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    loop,
    make_step,
    max_steps,
    run_epoch,
    save_checkpoint,
    testing,
    verify_checkpoint,
)

import helpers


def _full_params(state):
    """Every parameter whole, on every process (FSDP2's DTensors gathered), by name."""
    model = state.accelerator.unwrap_model(state.model)
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def _accelerator(engine, **kwargs):
    """``"fsdp2"``: FSDP2 over every process; ``"hsdp"``: HSDP on a 2 × 2 mesh (4 processes); ``"ddp"``: Accelerate's choice."""
    return {"fsdp2": helpers.fsdp2_accelerator, "hsdp": helpers.mesh_accelerator}.get(
        engine, lambda **kw: Accelerator(cpu=True, **kw)
    )(**kwargs)


def _setup(engine, *, ga=1, seed=0, n=48, batch_size=4, shuffle=True, mixed_precision="no"):
    acc = _accelerator(
        engine, gradient_accumulation_steps=ga, **({"mixed_precision": mixed_precision} if engine != "ddp" else {})
    )
    ctx = Context(accelerator=acc)
    torch.manual_seed(seed)
    model = helpers.mlp(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    dl = torch.utils.data.DataLoader(helpers.classification_data(n), batch_size=batch_size, shuffle=shuffle)
    (dl,) = ctx.prepare_loaders(dl)
    return ctx, state, dl


def _canonical_fsdp2(ga, clip, mixed_precision="no", engine="fsdp2"):
    acc = _accelerator(engine, gradient_accumulation_steps=ga, mixed_precision=mixed_precision)
    torch.manual_seed(0)
    model = helpers.mlp(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    dl = torch.utils.data.DataLoader(helpers.classification_data(48), batch_size=4, shuffle=True)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    for _ in range(2):
        model.train()
        for batch in dl:
            with acc.accumulate(model):
                loss = helpers.ce_loss(model, batch)
                acc.backward(loss)
                if clip is not None and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                sched.step()
                opt.zero_grad()
    return {n: p.full_tensor().detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}


def _fsdp2_equivalence(ga, clip, mixed_precision="no", engine="fsdp2"):
    expected = _canonical_fsdp2(ga, clip, mixed_precision, engine)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()  # keep the process group, forget the Accelerator's settings
    GradientState._reset_state()
    ctx, state, dl = _setup(engine, ga=ga, mixed_precision=mixed_precision)
    state = loop(run_epoch(ctx, make_step(ctx, helpers.ce_loss, clip_grad_norm=clip), dl), max_epochs=2)(state)
    weight = state.accelerator.unwrap_model(state.model)[0].weight
    return (
        expected,
        _full_params(state),
        type(state.accelerator.unwrap_model(state.model)).__name__,
        str(weight.device_mesh.mesh_dim_names),
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "engine,ga,clip,nprocs,mixed_precision",
    [
        ("fsdp2", 1, None, 2, "no"),
        ("fsdp2", 3, 0.5, 2, "no"),
        ("fsdp2", 3, None, 1, "bf16"),
        ("hsdp", 1, 0.5, 4, "no"),
        ("hsdp", 2, None, 4, "no"),
    ],
)
def test_composed_loop_equals_canonical_fsdp2_loop(engine, ga, clip, nprocs, mixed_precision):
    """Under Accelerate's FSDP2 (CPU processes): the same parameters, bit for bit, with and without accumulation and clipping;
    on one process too, where Accelerate still turns FSDP2's gradient sync off inside an accumulation group (with bf16
    parameters, accumulating unsharded bf16 gradients is not the same arithmetic as reducing each micro-batch); and under
    HSDP through ParallelismConfig (dp_replicate 2 × dp_shard 2 on 4 processes: each parameter sharded over 2, replicated
    over 2)."""
    ranks = testing.run_distributed(_fsdp2_equivalence, ga, clip, mixed_precision, engine, nprocs=nprocs)

    for expected, got, cls, mesh in ranks:
        assert cls.startswith("FSDP")  # the model really is sharded by fully_shard
        if engine == "hsdp":  # a 2-D mesh: sharded over dp_shard, replicated over dp_replicate
            assert mesh == "('dp_replicate', 'dp_shard_cp')"
        testing.assert_params_equal(expected, got)


def _train(engine, root, *, stop_after=None, resume=False, sharded=None, ga=1, epochs=2, async_save=False):
    """Train ``epochs`` epochs, saving every 2 updates; stop after ``stop_after`` updates; or resume from ``root``."""
    ctx, state, dl = _setup(engine, ga=ga)
    if resume:
        state = load_checkpoint(ctx, root, state)
    step = make_step(ctx, helpers.ce_loss)
    if stop_after is not None:
        step = max_steps(stop_after)(step)
    end = lambda s: s  # noqa: E731
    if sharded is None:
        saving = checkpoint_every(ctx, 2, root, async_save=async_save)
        step, end = saving(step), saving.at_end
    state = end(loop(run_epoch(ctx, step, dl), max_epochs=epochs)(state))
    if sharded is not None:
        save_checkpoint(ctx, root, state, sharded=sharded)
    params = _full_params(state)
    ctx.close()
    return params, state.step, state.epoch


# DDP's sharded mid-epoch resume: test_distributed's checkpoint test (sharded is the default on several processes)
@pytest.mark.multiprocess
# HSDP in the background with accumulation only: its blocking save is the same DCP write (suite time)
@pytest.mark.parametrize(
    "engine,ga,async_save", [("fsdp2", 1, False), ("fsdp2", 3, False), ("fsdp2", 3, True), ("hsdp", 3, True)]
)
def test_sharded_checkpoint_resumes_mid_epoch_exactly(engine, ga, async_save, tmp_path):
    """Stopped mid-epoch (at update 5, inside the second epoch), resumed in new processes: the run ends as an uninterrupted one,
    bit for bit; under FSDP2 on 2 processes, and under HSDP on a 2 × 2 mesh (DCP's DTensors on a 2-D mesh: each
    parameter in as many pieces as dp_shard ranks, each piece written once, by one of its replicas)."""
    nprocs = 4 if engine == "hsdp" else 2
    (full, *_), *_ = testing.run_distributed(_train, engine, str(tmp_path / "a"), ga=ga, nprocs=nprocs)
    testing.run_distributed(
        _train, engine, str(tmp_path / "b"), stop_after=5, ga=ga, async_save=async_save, nprocs=nprocs
    )
    manifest = verify_checkpoint(latest_checkpoint(tmp_path / "b"))
    (resumed, step, epoch), *_ = testing.run_distributed(
        _train, engine, str(tmp_path / "b"), resume=True, ga=ga, async_save=async_save, nprocs=nprocs
    )

    assert 2 == manifest["format"] and nprocs == manifest["world_size"]
    assert {"tensors.json", *(f"shard-{r}.safetensors" for r in range(nprocs)), f"rank-{nprocs - 1}.json"} <= set(
        manifest["files"]
    )
    assert "model.safetensors" not in manifest["files"]  # nothing gathered to one process
    pieces = json.loads((latest_checkpoint(tmp_path / "b") / "tensors.json").read_text())["tensors"]["model.0.weight"][
        "chunks"
    ]
    assert 2 == len(pieces)  # sharded over the 2 dp_shard ranks; under HSDP, not once more per replica
    testing.assert_params_equal(full, resumed)
    assert epoch == 2


def test_one_process_writes_a_sharded_checkpoint_when_asked(tmp_path):
    ctx, state, dl = _setup("ddp")
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    save_checkpoint(ctx, tmp_path, state, sharded=True)
    before = _full_params(state)
    expected_opt = state.optimizer.optimizer.state_dict()
    ctx.close()

    ctx, fresh, dl = _setup("ddp", seed=1)
    loaded = load_checkpoint(ctx, tmp_path, fresh)

    assert {"tensors.json", "shard-0.safetensors"} <= set(verify_checkpoint(latest_checkpoint(tmp_path))["files"])
    testing.assert_params_equal(before, _full_params(loaded))
    got_opt = loaded.optimizer.optimizer.state_dict()
    for i, per_param in expected_opt["state"].items():
        for k, v in per_param.items():
            assert torch.equal(v, got_opt["state"][i][k]), (i, k)
    assert expected_opt["param_groups"] == got_opt["param_groups"]
    assert loaded.step == state.step and loaded.scheduler.state_dict() == state.scheduler.state_dict()


# --- elastic: a checkpoint of N processes resumes on M ---------------------------------------


def _ids_data(n=48):
    x, y = helpers.classification_data(n).tensors
    return torch.utils.data.TensorDataset(x, y, torch.arange(n))


def _elastic_run(
    engine, root, *, stop_after=None, resume=False, batch_size=4, ga=1, sharded=True, elastic=True, samples=48
):
    """One epoch over 48 numbered samples; returns the ids this process trained on, and the model at the start and end.
    ``resume``: from ``root``'s checkpoint, saved on another number of processes (``elastic``) or this one."""
    import contextlib
    import warnings

    ctx = Context(accelerator=_accelerator(engine, gradient_accumulation_steps=ga))
    torch.manual_seed(0)
    model = helpers.mlp(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(_ids_data(samples), batch_size=batch_size, shuffle=True))
    seen = []

    def loss_fn(model, batch):
        x, y, ids = batch
        seen.extend(ids.tolist())
        return torch.nn.functional.cross_entropy(model(x), y)

    caught = []
    if resume:
        with (
            pytest.warns(UserWarning, match="running train sums were each process's own")
            if elastic
            else contextlib.nullcontext()
        ):
            state = load_checkpoint(ctx, root, state)
    at_start = (
        _full_params(state),
        state.step,
        state.scheduler.state_dict()["last_epoch"],
        state.optimizer.optimizer.state_dict()["state"],
    )
    at_start = (
        at_start[0],
        at_start[1],
        at_start[2],
        {
            k: {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for n, v in per.items()}
            for k, per in at_start[3].items()
        },
    )
    step = make_step(ctx, loss_fn)
    if stop_after is not None:
        step = max_steps(stop_after)(step)
    step = checkpoint_every(ctx, 1, root, keep_last=1, sharded=sharded)(step)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        state = run_epoch(ctx, step, dl, state)
    caught = [str(w.message) for w in log if "global batch" in str(w.message)]
    at_end = (
        _full_params(state),
        state.step,
        state.scheduler.state_dict()["last_epoch"],
        {
            k: {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for n, v in per.items()}
            for k, per in state.optimizer.optimizer.state_dict()["state"].items()
        },
    )
    ctx.close()
    return seen, at_start, at_end, state.epoch, caught


def _run(engine, nprocs, *args, **kwargs):
    return helpers.on_processes(nprocs, _elastic_run, engine if nprocs > 1 else "ddp", *args, **kwargs)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "engine,saved,resumed,stop_after", [("ddp", 2, 1, 3), ("ddp", 1, 2, 4), ("ddp", 2, 3, 3), ("fsdp2", 2, 1, 3)]
)
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(engine, saved, resumed, stop_after, tmp_path):
    """Stopped mid-epoch on N processes, resumed on M: every sample of the epoch is trained on exactly once over the
    two runs, and the model, optimizer and scheduler continue exactly where they stopped (resharded)."""
    first = _run(engine, saved, str(tmp_path), stop_after=stop_after)
    second = _run("ddp", resumed, str(tmp_path), resume=True)

    trained = sorted(i for seen, *_ in first + second for i in seen)
    assert trained == list(range(48))  # none skipped, none repeated
    stopped, started = first[0][2], second[0][1]
    testing.assert_params_equal(stopped[0], started[0])
    assert stopped[1] == started[1] == stop_after  # state.step continues
    assert stopped[2] == started[2]  # the scheduler too
    for k, per in stopped[3].items():  # the optimizer's moments and counts, whole
        for name, value in per.items():
            assert torch.equal(value, started[3][k][name]), (k, name)
    assert all(epoch == 1 for *_, epoch, _ in second)
    warned = second[0][4]
    assert (
        len(warned) == 1
        and f"global batch of {4 * saved} samples per update" in warned[0]
        and f"this run's is {4 * resumed}" in warned[0]
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("resumed", [1, 3])
def test_an_epoch_whose_last_round_was_completed_resumes_elsewhere(resumed, tmp_path):
    """46 samples on 2 processes in batches of 4: Accelerate completes the epoch's sixth and last round with 2 samples
    from its start. Saved at that update, the epoch is done: resumed on another number of processes it has nothing
    left (its position counted the repeats, 48 of 46 samples, and was refused as belonging to other data)."""
    first = _run("ddp", 2, str(tmp_path), stop_after=6, samples=46)
    second = _run("ddp", resumed, str(tmp_path), resume=True, samples=46)

    trained = sorted(i for seen, *_ in first for i in seen)
    assert sorted(set(trained)) == list(range(46)) and len(trained) == 48
    assert all(seen == [] and epoch == 1 for seen, *_, epoch, _ in second)


@pytest.mark.multiprocess
def test_resumed_elsewhere_then_back(tmp_path):
    """2 processes stopped after update 3, resumed on 1 and stopped again after update 5 (inside the same epoch), resumed
    on 1: the last checkpoint's epoch began on 2 processes, whose loader had a generator that one process's has not. The
    resume was refused ("the loader has 0 random generators but the checkpoint recorded 1"), though the loader was built
    as before: every checkpoint of the rest of that epoch was unusable on the layout that saved it. Every sample once;
    each run continues the one before exactly."""
    first = _run("ddp", 2, str(tmp_path), stop_after=3)
    second = _run("ddp", 1, str(tmp_path), resume=True, stop_after=5)
    third = _run("ddp", 1, str(tmp_path), resume=True, elastic=False)

    assert sorted(i for seen, *_ in first + second + third for i in seen) == list(range(48))
    helpers.continues_exactly(first, second)
    helpers.continues_exactly(second, third)
    assert 1 == third[0][3]  # the epoch ended


@pytest.mark.multiprocess
def test_an_hsdp_checkpoint_reshards_to_fsdp2_on_two_processes_then_to_one(tmp_path):
    """HSDP 2 × 2 (4 processes) stopped after 2 updates, resumed under FSDP2 on 2 processes and stopped after one more,
    resumed on one process to the epoch's end: every sample once over the three runs, and each run continues the
    model, optimizer and scheduler exactly where the one before stopped (DCP reshards between the meshes)."""
    first = _run("hsdp", 4, str(tmp_path), stop_after=2)
    second = _run("fsdp2", 2, str(tmp_path), resume=True, stop_after=3)
    third = _run("ddp", 1, str(tmp_path), resume=True)

    trained = sorted(i for seen, *_ in first + second + third for i in seen)
    assert trained == list(range(48))  # 2 updates of 16 samples, 1 of 8, 2 of 4
    helpers.continues_exactly(first, second)
    helpers.continues_exactly(second, third)
    assert "global batch of 16 samples per update" in second[0][4][0] and "this run's is 8" in second[0][4][0]
    assert (3, 1) == (third[0][2][1] - 2, third[0][3])  # 5 updates in all, the epoch ended


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "saved,resumed,stop_after", [(1, 2, 4), (2, 1, 3), (1, 3, 3)]
)  # the rest divides evenly: no padding
def test_a_gathered_checkpoint_resumes_on_another_number_of_processes(saved, resumed, stop_after, tmp_path):
    """A one-process run (the gathered format, the default there) scales out, and a gathered checkpoint of several
    processes continues on one: the whole model and optimizer are in it, and the data position in samples. Every sample
    of the epoch once over the two runs; model, optimizer and scheduler exact (it was refused: 'cannot be dealt out')."""
    first = _run("ddp", saved, str(tmp_path), stop_after=stop_after, sharded=False)
    second = _run("ddp", resumed, str(tmp_path), resume=True, sharded=False)
    warned = second[0][4]
    assert (
        len(warned) == 1
        and f"global batch of {4 * saved} samples per update" in warned[0]
        and f"this run's is {4 * resumed}" in warned[0]
    )

    assert "model.safetensors" in verify_checkpoint(latest_checkpoint(tmp_path))["files"]  # still gathered: one file
    trained = sorted(i for seen, *_ in first + second for i in seen)
    assert trained == list(range(48))
    stopped, started = first[0][2], second[0][1]
    testing.assert_params_equal(stopped[0], started[0])
    assert stopped[1] == started[1] == stop_after and stopped[2] == started[2]
    for k, per in stopped[3].items():
        for name, value in per.items():
            assert torch.equal(value, started[3][k][name]), (k, name)


@pytest.mark.multiprocess
def test_a_one_process_gathered_checkpoint_is_dealt_out_into_fsdp2_shards(tmp_path):
    """One process (the gathered format) stopped mid-epoch, resumed under FSDP2 over 2 processes: the whole tensors are
    dealt out into the shards; every sample of the epoch once over the two runs; model, optimizer and scheduler exact."""
    first = _run("ddp", 1, str(tmp_path), stop_after=4, sharded=False)
    assert "model.safetensors" in verify_checkpoint(latest_checkpoint(tmp_path))["files"]
    second = _run("fsdp2", 2, str(tmp_path), resume=True)

    warned = second[0][4]
    assert len(warned) == 1 and "global batch of 4 samples per update" in warned[0] and "this run's is 8" in warned[0]
    assert sorted(i for seen, *_ in first + second for i in seen) == list(range(48))
    stopped, started = first[0][2], second[0][1]
    testing.assert_params_equal(stopped[0], started[0])
    assert stopped[1] == started[1] == 4 and stopped[2] == started[2]
    for k, per in stopped[3].items():
        for name, value in per.items():
            assert torch.equal(value, started[3][k][name]), (k, name)


def _ddp_saves_gathered(root):
    """2 DDP processes, accumulation 2: a gathered checkpoint in the middle of a group (3 micro-batches), one at an update (4)."""
    ctx, state, dl = _setup("ddp", ga=2)
    step = make_step(ctx, helpers.ce_loss)
    state = run_epoch(ctx, step, dl, state, max_batches=3)
    save_checkpoint(ctx, f"{root}/mid", state, sharded=False)
    state = run_epoch(ctx, step, dl, state, max_batches=1)
    save_checkpoint(ctx, f"{root}/update", state, sharded=False)
    params = _full_params(state)
    ctx.close()
    return params


def _fsdp2_loads_gathered(root):
    ctx, state, _ = _setup("fsdp2", ga=2, seed=7)
    try:
        load_checkpoint(ctx, f"{root}/mid", state)
        refused = ""
    except CheckpointError as exc:
        refused = str(exc)
    loaded = _full_params(load_checkpoint(ctx, f"{root}/update", state))
    ctx.close()
    return refused, loaded


@pytest.mark.multiprocess
def test_ddp_checkpoint_into_fsdp2_shards(tmp_path):
    """The same number of processes, another layout: DDP's gathered checkpoint at an update goes into FSDP2's shards
    exactly; one in the middle of an accumulation group is refused (its whole partial gradients cannot be sharded)."""
    expected = testing.run_distributed(_ddp_saves_gathered, str(tmp_path), nprocs=2)[0]
    for refused, loaded in testing.run_distributed(_fsdp2_loads_gathered, str(tmp_path), nprocs=2):
        assert "in the middle of an accumulation group" in refused and "resume it without FSDP" in refused
        testing.assert_params_equal(expected, loaded)


def _gathered_under_fsdp2(root):
    ctx, state, _ = _setup("fsdp2")
    try:
        save_checkpoint(ctx, root, state, sharded=False)
    except ValueError as exc:
        return str(exc)
    finally:
        ctx.close()


@pytest.mark.multiprocess
def test_a_gathered_checkpoint_is_refused_under_fsdp2_with_the_way_out(tmp_path):
    for message in testing.run_distributed(_gathered_under_fsdp2, str(tmp_path), nprocs=2):
        assert (
            "sharded=False gathers the whole model into one process's files" in message
            and "leave sharded unset" in message
        )


def _save_one_process(root, *, ga=1, iterable=False, max_batches=None, stop_after=None):
    """One process: train part of an epoch and write a sharded checkpoint there."""
    from trainfold.testing import reset_accelerate_state

    reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=ga))
    torch.manual_seed(0)
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = helpers.classification_data(48)
    if iterable:
        samples = data

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(samples)

        data = Stream()
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=4))
    step = make_step(ctx, helpers.ce_loss)
    state = run_epoch(ctx, max_steps(stop_after)(step) if stop_after else step, dl, state, max_batches=max_batches)
    save_checkpoint(ctx, root, state, sharded=True)
    ctx.close()
    reset_accelerate_state()


def _load_on_this_rank(root, ga):
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=ga))
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    before = testing.parameters(state)
    try:
        load_checkpoint(ctx, root, state)
        return None
    except CheckpointError as exc:
        return str(exc), all(torch.equal(before[k], v) for k, v in testing.parameters(state).items())
    finally:
        ctx.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case,match",
    [
        (
            {"ga": 2, "max_batches": 3},
            r"saved by 1 process in the middle of an accumulation group .* resume it on 1 process, or from a checkpoint at an optimizer update",
        ),
        (
            {"iterable": True, "stop_after": 3},
            r"in the middle of an epoch over a stream, and this run has 2 processes: its position in samples is unknown: "
            r"the stream had no state .*a datasets shuffle buffer.*\. Resume it on 1 process, or from a checkpoint between epochs",
        ),
    ],
)
def test_an_undealable_checkpoint_is_refused(case, match, tmp_path):
    """Mid-accumulation, or mid-epoch over an iterable dataset: refused on every process, with the way out; nothing changed."""
    import re

    _save_one_process(str(tmp_path), **case)
    ranks = testing.run_distributed(_load_on_this_rank, str(tmp_path), case.get("ga", 1), nprocs=2)

    for message, unchanged in ranks:
        assert re.search(match, message), message
        assert unchanged


def _context_on_a_context_parallel_mesh():
    acc = helpers.mesh_accelerator(dp_replicate=1, dp_shard=2, cp=2)
    try:
        Context(accelerator=acc)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
def test_a_context_parallel_mesh_is_refused():
    """cp 2 × dp_shard 2 on 4 processes: each process of a cp group must train on a slice of every batch's sequence,
    which Accelerate cuts only inside maybe_context_parallel, and make_step does not enter it. Refused when the Context
    is made, with the dimension and the way out."""
    for message in testing.run_distributed(_context_on_a_context_parallel_mesh, nprocs=4):
        assert "ParallelismConfig has cp_size=2 (context parallelism)" in message
        assert "use Accelerate's own loop for context parallelism" in message


def _host_copies_of_fsdp2_shards():
    """A background save's copy of FSDP2's CPU shards (checkpoint/formats/common.py's to_host): one copy each, apart."""
    from trainfold._src.checkpoint.formats import dcp
    from trainfold._src.checkpoint.formats.common import to_host

    ctx, state, _ = _setup("fsdp2")
    shards, _ = dcp.split_state(state.accelerator.unwrap_model(state.model), state.optimizer.optimizer)
    copies = to_host(shards)
    checks = []
    for name, live in shards.items():
        copy = copies[name]
        checks.append(
            (
                type(copy) is type(live),
                getattr(copy, "placements", None) == getattr(live, "placements", None),
                torch.equal(dcp.local(copy), dcp.local(live)),
                dcp.local(copy).data_ptr() != dcp.local(live).data_ptr(),
            )
        )
    weight = state.accelerator.unwrap_model(state.model)[0].weight
    before = dcp.local(copies["model.0.weight"]).clone()
    with torch.no_grad():
        weight.add_(1.0)  # training goes on: the copy must not see it
    unchanged = torch.equal(dcp.local(copies["model.0.weight"]), before)
    ctx.close()
    return checks, unchanged


@pytest.mark.multiprocess
def test_a_background_copy_of_fsdp2_shards():
    """A background save's copy of FSDP2 shards keeps their layout and shares no memory."""
    for checks, unchanged in testing.run_distributed(_host_copies_of_fsdp2_shards, nprocs=2):
        assert checks and all(all(c) for c in checks), checks
        assert unchanged


def _loads_a_root_damaged_on_one_rank(root, sharded, damaged):
    """2 DDP processes save checkpoints at updates 2, 4, 6; a bit of the newest's file ``damaged``, which only process 1
    reads, flips; both load the root."""
    import warnings

    ctx, state, dl = _setup("ddp", n=48)  # 6 batches a process
    state = run_epoch(ctx, checkpoint_every(ctx, 2, root, sharded=sharded)(make_step(ctx, helpers.ce_loss)), dl, state)
    names = [p.name for p in list_checkpoints(root)]
    ctx.accelerator.wait_for_everyone()
    if ctx.accelerator.process_index == 1:  # what only process 1 reads
        shard = Path(root) / names[-1] / damaged
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    ctx.accelerator.wait_for_everyone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_checkpoint(ctx, root, state)
    ctx.close()
    return names, loaded.step, [str(w.message) for w in caught if "the newest checkpoint before it" in str(w.message)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharded, damaged", [(True, "shard-1.safetensors"), (False, "rank-1.safetensors")])
def test_every_process_falls_back_together(sharded, damaged, tmp_path):
    """Only process 1 reads the file and finds the flipped bit; the processes agree, and both load ckpt-4 (none loads
    ckpt-6 while the other falls back, which would train two models)."""
    (names, step0, warned0), (_, step1, warned1) = testing.run_distributed(
        _loads_a_root_damaged_on_one_rank, str(tmp_path), sharded, damaged, nprocs=2
    )
    assert ["ckpt-0000000002", "ckpt-0000000004", "ckpt-0000000006"] == names
    assert (4, 4) == (step0, step1)
    assert 1 == len(warned0) == len(warned1)
    assert f"{damaged} does not match its digest" in warned1[0]


def _elastic_means(root, *, stop_after=None, resume=False):
    """One epoch over 48 samples with log_every(2), a checkpoint at every update; returns each batch loss this process
    computed, log_every's reports and the epoch's train_loss."""
    import warnings

    from trainfold import log_every

    ctx, state, dl = _setup("ddp")
    losses, reports = [], []

    def loss_fn(model, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        return loss

    step = checkpoint_every(ctx, 1, root, keep_last=1)(make_step(ctx, loss_fn))
    if stop_after is not None:
        step = max_steps(stop_after)(step)
    logged = log_every(ctx, 2)(step)

    def recorded(state, batch):
        new = logged(state, batch)
        if "log_every" in new.extras and new.extras["log_every"].step == new.step != state.step:
            reports.append((new.step, new.extras["log_every"].values["loss"]))
        return new

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the sums restart, the global batch changed: said (tests above)
        if resume:
            state = load_checkpoint(ctx, root, state)
        state = run_epoch(ctx, recorded, dl, state)
    ctx.close()
    return losses, reports, state.history["train_loss"] if "train_loss" in state.history else None


@pytest.mark.multiprocess
def test_resumed_elsewhere_records_its_means(tmp_path):
    """Stopped after update 3 on 2 processes, resumed on 1: the epoch's running sums were each process's own and restart
    empty. log_every's first report is then the mean of its interval's batches since the resume, and the epoch's
    train_loss the mean of the batches trained since: neither divides by batches the sums do not hold, nor subtracts
    sums of the run before (the report was -0.63, the loss 0.71 instead of 1.06). Stopped again after update 6 and
    resumed on 1 process, the checkpoint says where the sums start, and the epoch's end is the same."""
    _ = helpers.on_processes(2, _elastic_means, str(tmp_path), stop_after=3)
    ((losses, reports, train_loss),) = helpers.on_processes(1, _elastic_means, str(tmp_path), resume=True, stop_after=6)
    assert train_loss is None and [4, 6] == [step for step, _ in reports]
    ((rest, more_reports, train_loss),) = helpers.on_processes(1, _elastic_means, str(tmp_path), resume=True)

    assert 3 == len(losses) == len(rest)  # 24 samples of 48 left, in batches of 4: updates 4 to 9
    assert [8] == [step for step, _ in more_reports]
    assert reports[0][1] == pytest.approx(
        losses[0], rel=1e-6
    )  # update 4 alone: the interval's update 3 was the run before's
    assert reports[1][1] == pytest.approx(sum(losses[1:3]) / 2, rel=1e-6)
    assert more_reports[0][1] == pytest.approx(sum(rest[:2]) / 2, rel=1e-6)
    assert train_loss[-1] == pytest.approx(sum(losses + rest) / 6, rel=1e-6)


def _elastic_sent(root, *, stop_after=None, resume=False):
    """One epoch over 48 samples with log_every(2) outside checkpoint_every(1); returns what a tracker was sent."""
    import warnings

    from trainfold import init_trackers, log_every

    sent = helpers.own_tracker()
    ctx = Context(accelerator=Accelerator(cpu=True, log_with=[sent]))
    torch.manual_seed(0)
    model = helpers.mlp(dropout=0.1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(48), batch_size=4, shuffle=True)
    )
    step = checkpoint_every(ctx, 1, root, keep_last=1)(make_step(ctx, helpers.ce_loss))
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", UserWarning
        )  # the sums restart, the global batch changed, the tracker cannot cut back: said
        if resume:
            state = load_checkpoint(ctx, root, state)
        init_trackers(ctx, "proj", state)
        state = run_epoch(ctx, log_every(ctx, 2)(max_steps(stop_after)(step) if stop_after else step), dl, state)
    ctx.accelerator.end_training()
    ctx.close()
    return [(at, values["train/loss"]) for at, values in sent.logged if "train/loss" in values]


@pytest.mark.multiprocess
def test_no_report_from_restarted_sums(tmp_path):
    """Stopped on 2 processes at update 4, whose report log_every (outside checkpoint_every) made after the checkpoint;
    resumed on 1, where the epoch's sums restart empty. A resumed run makes such a report again for the trackers that
    lack it, from the checkpoint's sums; these hold none of its batches, so it is not made (it was a NaN loss): the
    tracker is sent the reports from update 6 on, each of finite values."""
    before = helpers.on_processes(2, _elastic_sent, str(tmp_path), stop_after=4)
    ((after,),) = [helpers.on_processes(1, _elastic_sent, str(tmp_path), resume=True)]

    assert [2, 4] == [at for at, _ in before[0]]
    assert [6, 8] == [at for at, _ in after], after  # 16 samples left: updates 5 to 8 on one process
    assert all(loss == loss and abs(loss) < 1e3 for _, loss in after)


@pytest.mark.multiprocess
def test_resumed_at_the_last_update_elsewhere(tmp_path):
    """Stopped on 2 processes at update 6, the epoch's last, and resumed on 1: the epoch's sums restart empty where no
    batch is left, so they hold none of it. Its record has no train_loss (it was 0.0 once, then NaN with a warning that
    the run had diverged)."""
    helpers.on_processes(2, _elastic_means, str(tmp_path), stop_after=6)
    ((losses, reports, train_loss),) = helpers.on_processes(1, _elastic_means, str(tmp_path), resume=True)

    assert [] == losses and [] == reports and train_loss is None


def _commit_reports(root, layers):
    """A sharded save of ``layers`` Linear(8, 8) layers on this process: the bytes it sent in each of torch's
    gather_object calls (watched: the object pickled; DCP's own planning gathers first, trainfold's commit report is the
    last), and whether it received each call's objects."""
    import pickle

    import torch.distributed as dist

    sent, received = [], []
    gather = dist.gather_object

    def watched(obj, object_gather_list=None, dst=None, group=None, **kwargs):
        sent.append(len(pickle.dumps(obj)))
        gather(obj, object_gather_list, dst=dst, group=group, **kwargs)
        received.append(object_gather_list is not None)

    ctx = Context(accelerator=Accelerator(cpu=True), signals=())
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    state = make_step(ctx, lambda m, b: m(b).pow(2).mean())(state, torch.randn(2, 8))
    dist.gather_object = watched
    try:
        save_checkpoint(ctx, root, state)
    finally:
        dist.gather_object = gather
    ctx.close()
    return sent, received


@pytest.mark.multiprocess
def test_what_a_process_sends_to_commit_does_not_grow_with_the_model_or_the_processes(tmp_path):
    """Each process reports its own files' entries to the main process alone: a few hundred bytes for 2 layers or for
    64 (its one shard file), and only the main process receives the reports."""
    few = testing.run_distributed(_commit_reports, str(tmp_path / "few"), 2, nprocs=2)
    many = testing.run_distributed(_commit_reports, str(tmp_path / "many"), 64, nprocs=2)

    for rank, ((sent_few, received), (sent_many, _)) in enumerate(zip(few, many)):
        assert sent_few[-1] < 1024 and abs(sent_many[-1] - sent_few[-1]) < 16, (sent_few, sent_many)  # (sizes' digits)
        assert received[-1] == (rank == 0)
