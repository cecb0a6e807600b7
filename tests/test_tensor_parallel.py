"""Tensor parallelism through Accelerate's ParallelismConfig on CPU processes (gloo): TP 2, and TP 2 × FSDP2 over 2.

The processes of one tensor-parallel group read the same batches (Accelerate's loader deals batches by data-parallel
rank, ``process_index // tp_size``), so everything trainfold counts per process's data is counted per data-parallel
rank here: evaluation's every sample once, the data position a checkpoint records, the resume on another layout.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    cli,
    evaluate,
    evaluate_metrics,
    latest_checkpoint,
    load_checkpoint,
    local_sgd,
    loop,
    make_step,
    max_steps,
    nan_guard,
    predict,
    run_epoch,
    save_checkpoint,
    testing,
)

import helpers

pytestmark = [pytest.mark.multiprocess, helpers.needs_tp_site]


def _accelerator(layout, **kwargs):
    """``"tp"``: TP 2 (2 processes); ``"tp_fsdp2"``: TP 2 × FSDP2 over 2 (4); ``"fsdp2"``: FSDP2; ``"ddp"``: Accelerate's choice."""
    if layout == "tp":
        return helpers.tp_accelerator(tp=2, **kwargs)
    if layout == "tp_fsdp2":
        return helpers.tp_accelerator(tp=2, dp_shard=2, **kwargs)
    return {"fsdp2": helpers.fsdp2_accelerator}.get(layout, lambda **kw: Accelerator(cpu=True, **kw))(**kwargs)


def _model(acc, layout, dropout=0.1):
    torch.manual_seed(0)
    model = helpers.mlp(dropout=dropout)
    return helpers.tensor_parallel(model, acc) if layout.startswith("tp") else model


def _full_params(model):
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def _ids_data(n=48):
    x, y = helpers.classification_data(n).tensors
    return torch.utils.data.TensorDataset(x, y, torch.arange(n))


def _loss(seen):
    def loss_fn(model, batch):
        x, y, ids = batch
        seen.extend(ids.tolist())
        return torch.nn.functional.cross_entropy(model(x), y)

    return loss_fn


# --- the composed loop equals Accelerate's own ------------------------------------------------


def _accelerates_loop(layout, ga, clip):
    acc = _accelerator(layout, gradient_accumulation_steps=ga)
    model = _model(acc, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    dl = torch.utils.data.DataLoader(helpers.classification_data(48), batch_size=4, shuffle=True)
    params, _ = helpers.canonical_loop(
        acc,
        model,
        opt,
        sched,
        dl,
        helpers.ce_loss,
        epochs=2,
        clip_norm=clip,
        read=lambda acc, model: _full_params(acc.unwrap_model(model)),
    )
    return params


def _composed_and_accelerates(layout, ga, clip):
    expected = _accelerates_loop(layout, ga, clip)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()  # keep the process group, forget the Accelerator's settings
    GradientState._reset_state()
    acc = _accelerator(layout, gradient_accumulation_steps=ga)
    ctx = Context(accelerator=acc)
    model = _model(acc, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(48), batch_size=4, shuffle=True)
    )
    state = loop(run_epoch(ctx, make_step(ctx, helpers.ce_loss, clip_grad_norm=clip), dl), max_epochs=2)(state)
    weight = state.accelerator.unwrap_model(state.model)[0].weight
    got = _full_params(state.accelerator.unwrap_model(state.model))
    ctx.close()
    return expected, got, weight.device_mesh.mesh_dim_names, str(weight.placements)


@pytest.mark.parametrize("layout,nprocs,ga,clip", [("tp", 2, 2, 0.5), ("tp_fsdp2", 4, 2, 0.5)])
def test_composed_loop_equals_accelerates_loop_under_tensor_parallelism(layout, nprocs, ga, clip):
    """The same parameters bit for bit as Accelerate's loop under the same ParallelismConfig (accumulation, clipping, a
    scheduler, 2 epochs): the first layer's weight split by rows over ``tp`` (a column-wise layer), and under TP × FSDP2
    also sharded over ``dp_shard``."""
    for expected, got, dims, placements in testing.run_distributed(
        _composed_and_accelerates, layout, ga, clip, nprocs=nprocs
    ):
        assert "tp" in dims and "Shard(dim=0)" in placements
        if layout == "tp_fsdp2":
            assert dims == ("dp_shard_cp", "tp")
        testing.assert_params_equal(expected, got)


# --- checkpoints: sharded over the mesh, resumed exactly, resharded to other layouts ---------------


def _run(layout, root, *, stop_after=None, resume=False, ga=1, epochs=1, every=1, async_save=False, n=48):
    """Train ``epochs`` epochs over ``n`` numbered samples, saving every ``every`` updates (sharded: DCP's DTensors on
    the mesh); stop after ``stop_after`` updates; or resume from ``root``. Returns the ids this process trained on, the
    model, step, scheduler and optimizer it started and ended with, the epoch, and the global-batch warnings."""
    import warnings

    acc = _accelerator(layout, gradient_accumulation_steps=ga)
    ctx = Context(accelerator=acc)
    model = _model(acc, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(_ids_data(n), batch_size=4, shuffle=True))
    seen = []
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        if resume:
            state = load_checkpoint(ctx, root, state)
        at_start = _position(state)
        step = make_step(ctx, _loss(seen))
        if stop_after is not None:
            step = max_steps(stop_after)(step)
        saving = checkpoint_every(ctx, every, root, keep_last=1, async_save=async_save)
        step = saving(step)
        state = saving.at_end(loop(run_epoch(ctx, step, dl), max_epochs=epochs)(state))
    warned = [str(w.message) for w in log if "global batch" in str(w.message)]
    at_end = _position(state)
    ctx.close()
    return seen, at_start, at_end, state.epoch, warned


def _position(state):
    """The model (whole), step, scheduler and optimizer state (whole tensors) of a state."""
    moments = state.optimizer.optimizer.state_dict()["state"]
    whole = {
        k: {name: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for name, v in per.items()}
        for k, per in moments.items()
    }
    return (
        _full_params(state.accelerator.unwrap_model(state.model)),
        state.step,
        state.scheduler.state_dict()["last_epoch"],
        whole,
    )


def _launch(layout, *args, **kwargs):
    nprocs = {"tp": 2, "tp_fsdp2": 4, "ddp": 2, "one": 1}[layout]
    return helpers.on_processes(nprocs, _run, layout if nprocs > 1 else "ddp", *args, **kwargs)


@pytest.mark.parametrize("layout,ga,async_save", [("tp", 1, False), ("tp_fsdp2", 2, True)])
def test_a_tensor_parallel_checkpoint_resumes_mid_epoch_exactly(layout, ga, async_save, tmp_path):
    """Stopped at update 5 (inside the second epoch), resumed in new processes: the run ends as an uninterrupted one, bit
    for bit, and every sample of the interrupted epoch is trained once per data-parallel rank's share; under TP 2 with a
    blocking save, and under TP 2 × FSDP2 with accumulation and a background save (each parameter a DTensor over
    ``(dp_shard_cp, tp)``, written once per piece)."""
    full = _launch(layout, str(tmp_path / "a"), epochs=2, ga=ga, every=2)
    first = _launch(layout, str(tmp_path / "b"), epochs=2, ga=ga, every=2, stop_after=5, async_save=async_save)
    second = _launch(layout, str(tmp_path / "b"), epochs=2, ga=ga, every=2, resume=True, async_save=async_save)

    assert all(end[1] == full[0][2][1] for *_, end, _, _ in second)  # the same number of updates in all
    for (_, _, done, *_), (_, _, resumed_end, *_) in zip(full, second):
        testing.assert_params_equal(done[0], resumed_end[0])
    assert first[0][2][1] == second[0][1][1] == 5  # stopped at update 5 (the stop's own checkpoint), resumed there
    by_group = 2  # a tensor-parallel group's processes read the same batches
    second_epoch = [sorted(seen) for seen, *_ in second]
    assert all(second_epoch[r] == second_epoch[r - r % by_group] for r in range(len(second)))


def test_tp_checkpoint_reshards(tmp_path):
    """TP 2 (2 processes, one data-parallel rank) stopped after 2 updates; resumed under DDP on as many processes (2
    ranks: the same number of processes, another layout of the data, so the epoch goes on by its position in samples)
    for one update; then under TP 2 × FSDP2 over 2 (4 processes, 2 ranks) for one more; then on one process to the
    epoch's end. Every sample once over the four runs, and each run starts with the model, optimizer and scheduler the
    one before stopped with (DCP reshards the DTensors between the meshes)."""
    root = str(tmp_path)
    first = _launch("tp", root, stop_after=2)
    tp_layout = _inspected(root)
    second = _launch("ddp", root, resume=True, stop_after=3)
    third = _launch("tp_fsdp2", root, resume=True, stop_after=4)
    tp_fsdp2_layout = _inspected(root)
    fourth = _launch("one", root, resume=True)

    counted = [first[0], second[0], second[1], third[0], third[2], fourth[0]]  # one process per data-parallel rank
    assert sorted(i for seen, *_ in counted for i in seen) == list(range(48))  # 2 updates of 4, 1 of 8, 1 of 8, 6 of 4
    assert sorted(first[1][0]) == sorted(first[0][0]) and sorted(third[1][0]) == sorted(third[0][0])  # a group's copies
    helpers.continues_exactly(first, second)
    helpers.continues_exactly(second, third)
    helpers.continues_exactly(third, fourth)
    assert "global batch of 4 samples per update" in second[0][4][0] and "this run's is 8" in second[0][4][0]
    assert (fourth[0][2][1], fourth[0][3]) == (10, 1)  # 10 updates in all, the epoch ended
    assert (tp_layout, tp_fsdp2_layout) == (
        (2, 1),
        (4, 2),
    )  # processes and data-parallel ranks, as `trainfold inspect` tells


def _inspected(root):
    """``trainfold inspect --json`` of the newest checkpoint under ``root``: (processes, data-parallel ranks), which
    the text form tells as well."""
    out, text = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out):
        assert 0 == cli.main(["inspect", str(latest_checkpoint(root)), "--json"])
    with contextlib.redirect_stdout(text):
        assert 0 == cli.main(["inspect", str(latest_checkpoint(root))])
    doc = json.loads(out.getvalue())
    assert f"{doc['processes']} process(es) in {doc['data_ranks']} data-parallel rank(s)" in text.getvalue()
    return doc["processes"], doc["data_ranks"]


# --- evaluation and prediction: each sample once ----------------------------------------------------


def _evaluate_and_predict(layout):
    acc = _accelerator(layout)
    ctx = Context(accelerator=acc)
    model = _model(acc, layout)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None)
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(_ids_data(50), batch_size=4)
    )  # 50 = 6 rounds of 8 + 2: padded

    def loss_fn(model, batch):
        x, y, ids = batch
        return torch.nn.functional.cross_entropy(model(x), y), {"id": ids.double().mean()}

    state = evaluate(ctx, loss_fn, dl, state)
    ids = predict(ctx, lambda m, b: b[2], dl, state)
    losses = predict(ctx, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction="none"), dl, state)
    refused = []
    for attempt in (
        lambda: evaluate_metrics(ctx, {"n": _Count()}, lambda m, b: [f"sample {int(i)}" for i in b[2]], dl, state),
        lambda: nan_guard(3).bind(ctx),
        lambda: local_sgd(ctx, 2),
        lambda: save_checkpoint(ctx, "unused", state, sharded=False),
    ):
        try:
            attempt()
        except (TypeError, ValueError) as exc:
            refused.append(str(exc))
    ctx.close()
    return state.metrics, ids.tolist(), losses.double().mean().item(), refused


class _Count:
    def update(self, *args):
        pass

    def compute(self):
        return 0.0

    def reset(self):
        pass


def test_tp_evaluation_counts_each_sample_once():
    """TP 2 × FSDP2 over 2 (4 processes, 2 data-parallel ranks), 50 samples in batches of 4: the last round is padded.
    ``evaluate`` counts each real sample once (the mean id is the dataset's), and ``predict`` returns each sample once,
    in order; its per-sample losses average to ``eval_loss``. (Accelerate's own ``gather_for_metrics`` keeps a group's
    copies and cuts real samples at the remainder.) Outputs that are not tensors are refused, naming the fix; so are
    what needs whole gradients or parameters on every process (``nan_guard``, ``local_sgd``, ``sharded=False``)."""
    for metrics, ids, mean_loss, refused in testing.run_distributed(_evaluate_and_predict, "tp_fsdp2", nprocs=4):
        assert ids == list(range(50))
        tensors_only, guard, local, gathered = refused
        assert "gathers per-sample tensors only" in tensors_only and "Return tensors" in tensors_only
        assert "nan_guard cannot guard a step under tensor parallelism" in guard
        assert "under tensor parallelism each process holds shards" in local
        assert "sharded parameters of tensor parallelism do not allow here" in gathered
        assert metrics["eval_id"] == 24.5
        assert metrics["eval_loss"] == pytest.approx(mean_loss, rel=1e-6)


def _token_normalized(layout):
    """SGD with make_step(normalize="tokens") over batches with different token counts; returns the whole parameters."""
    acc = _accelerator(layout, gradient_accumulation_steps=2)
    ctx = Context(accelerator=acc)
    model = _model(acc, layout, dropout=0.0)  # dropout's masks on a split layer are not one process's
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), scheduler=None)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(_ids_data(48), batch_size=4))

    def summed(model, batch):
        x, y, ids = batch
        mask = (ids % 3 != 0).float()  # a third of the samples are padding
        return (torch.nn.functional.cross_entropy(model(x), y, reduction="none") * mask).sum(), {"tokens": mask.sum()}

    state = run_epoch(ctx, make_step(ctx, summed, normalize="tokens"), dl, state)
    params = _full_params(state.accelerator.unwrap_model(state.model))
    ctx.close()
    return params


def test_tp_token_normalization():
    """``normalize="tokens"`` under TP 2 (one data-parallel rank over 2 processes) trains as one process does: the
    token count summed over the processes counts the group's batch twice, and the scale counts both processes, so
    the ratio is one rank's. To float tolerance: the split matmuls add in another order."""
    (one,) = helpers.on_processes(1, _token_normalized, "ddp")
    for params in helpers.on_processes(2, _token_normalized, "tp"):
        testing.assert_params_equal(one, params, rtol=1e-5, atol=1e-6)
