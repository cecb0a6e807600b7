"""DeepSpeed through Accelerate (ZeRO-2, ZeRO-3): the composed step equals Accelerate's canonical DeepSpeed loop, on CPU processes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    CheckpointError,
    Context,
    TrainState,
    checkpoint_every,
    checkpoint_weights,
    export_checkpoint,
    latest_checkpoint,
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

pytestmark = [
    helpers.needs_deepspeed,
    pytest.mark.multiprocess,
]  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one


def _objects(seed=0, mixed_precision="no"):
    torch.manual_seed(seed)
    model = helpers.mlp(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = helpers.classification_data(48)
    if (
        mixed_precision == "bf16"
    ):  # DeepSpeed's bf16 casts the model, not its inputs (token ids need no cast; features do)
        data = torch.utils.data.TensorDataset(data.tensors[0].bfloat16(), data.tensors[1])
    dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    return model, opt, sched, dl


def _full_params(accelerator, model):
    """Every parameter whole (ZeRO-3's partitions gathered), by name."""
    import deepspeed

    engine = model
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _canonical(stage, ga, clip, mixed_precision="no"):
    acc = helpers.deepspeed_accelerator(
        stage, gradient_accumulation_steps=ga, clip=clip, mixed_precision=mixed_precision
    )
    model, opt, sched, dl = _objects(mixed_precision=mixed_precision)
    # clipping comes from the DeepSpeed config (clip_norm stays None: Accelerate's clip_grad_norm_ does nothing there)
    return helpers.canonical_loop(acc, model, opt, sched, dl, helpers.ce_loss, epochs=2, read=_full_params)[0]


def _composed(stage, ga, clip, mixed_precision="no"):
    acc = helpers.deepspeed_accelerator(
        stage, gradient_accumulation_steps=ga, clip=clip, mixed_precision=mixed_precision
    )
    ctx = Context(accelerator=acc)
    model, opt, sched, dl = _objects(mixed_precision=mixed_precision)
    (dl,) = ctx.prepare_loaders(dl)  # first: DeepSpeed's engine is built with the loader's micro-batch size
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    state = loop(run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl), max_epochs=2)(state)
    params = _full_params(acc, state.model)
    ctx.close()
    return params, state.step, type(state.model).__name__


_ON_CUDA = [
    pytest.param(2, 3, 0.5, 1, "bf16", marks=helpers.needs_cuda, id="cuda-zero2-bf16"),
    pytest.param(3, 3, 0.5, 1, "bf16", marks=helpers.needs_cuda, id="cuda-zero3-bf16"),
]


# On CPU the resume test below compares its uninterrupted runs with the canonical loop too (ZeRO-2 and ZeRO-3 on 2 processes).
@pytest.mark.parametrize("stage,ga,clip,nprocs,mixed_precision", [(2, 3, 0.5, 1, "no"), *_ON_CUDA])
def test_composed_loop_equals_canonical_deepspeed_loop(stage, ga, clip, nprocs, mixed_precision):
    """Under Accelerate's DeepSpeed ZeRO-2 and ZeRO-3: the same parameters, bit for bit, with accumulation and clipping from the config."""
    nprocs = min(nprocs, torch.cuda.device_count()) if torch.cuda.is_available() else nprocs
    expected = testing.run_distributed(_canonical, stage, ga, clip, mixed_precision, nprocs=nprocs)
    got = testing.run_distributed(_composed, stage, ga, clip, mixed_precision, nprocs=nprocs)

    for want, (params, step, cls) in zip(expected, got):
        assert cls == "DeepSpeedEngine"
        assert step == 2 * 48 // (4 * nprocs * ga)
        testing.assert_params_equal(want, params)
        assert not any(p.isnan().any() for p in params.values())


def _train(stage, root, *, ga=1, stop_after=None, resume=False, epochs=2, async_save=False, mixed_precision="no"):
    """Train under DeepSpeed, saving every 2 updates; stop after ``stop_after`` updates; or resume from ``root``."""
    acc = helpers.deepspeed_accelerator(
        stage, gradient_accumulation_steps=ga, clip=0.5, mixed_precision=mixed_precision
    )
    ctx = Context(accelerator=acc)
    model, opt, sched, dl = _objects(mixed_precision=mixed_precision)
    (dl,) = ctx.prepare_loaders(dl)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    if resume:
        state = load_checkpoint(ctx, root, state)
    step = make_step(ctx, helpers.ce_loss)
    if stop_after is not None:
        step = max_steps(stop_after)(step)
    saving = checkpoint_every(ctx, 2, root, async_save=async_save)
    step = saving(step)
    state = saving.at_end(loop(run_epoch(ctx, step, dl), max_epochs=epochs)(state))
    params = _full_params(acc, state.model)
    ctx.close()
    return params, state.step, state.epoch


@pytest.mark.parametrize(
    "stage,ga,nprocs,stop_after,async_save,mixed_precision",
    [
        (2, 1, 2, 5, False, "no"),
        (3, 3, 2, 3, True, "no"),
        pytest.param(2, 3, 1, 5, False, "bf16", marks=helpers.needs_cuda, id="cuda-zero2-bf16"),
        pytest.param(3, 1, 1, 5, True, "bf16", marks=helpers.needs_cuda, id="cuda-zero3-bf16"),
    ],
)
def test_deepspeed_checkpoint_resumes_mid_epoch_exactly(
    stage, ga, nprocs, stop_after, async_save, mixed_precision, tmp_path
):
    """Stopped mid-epoch, resumed in new processes from trainfold's checkpoint of DeepSpeed's engine: bit for bit,
    and the uninterrupted run equals Accelerate's canonical DeepSpeed loop."""
    nprocs = min(nprocs, torch.cuda.device_count()) if torch.cuda.is_available() else nprocs
    kw = dict(ga=ga, mixed_precision=mixed_precision, nprocs=nprocs)
    full = testing.run_distributed(_train, stage, str(tmp_path / "a"), **kw)
    testing.run_distributed(_train, stage, str(tmp_path / "b"), stop_after=stop_after, async_save=async_save, **kw)
    manifest = verify_checkpoint(latest_checkpoint(tmp_path / "b"))
    resumed = testing.run_distributed(_train, stage, str(tmp_path / "b"), resume=True, async_save=async_save, **kw)

    assert manifest["format"] == 3 and manifest["step"] == stop_after
    engine = {n for n in manifest["files"] if n.endswith(".pt")}
    prefix = "bf16_" if mixed_precision == "bf16" else ""  # DeepSpeed's name for a bf16 engine's partitions
    assert {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(nprocs)} <= engine
    for (want, *_), (got, step, epoch) in zip(full, resumed):
        testing.assert_params_equal(want, got)
        assert epoch == 2
    if (
        mixed_precision == "no"
    ):  # the uninterrupted run is Accelerate's canonical DeepSpeed loop too (clipping from the config)
        for want, (got, *_) in zip(testing.run_distributed(_canonical, stage, ga, 0.5, nprocs=nprocs), full):
            testing.assert_params_equal(want, got)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _replace_file(folder, name, data):
    """Plant ``data`` as ``name`` and rewrite the manifest to match it: what someone who controls the files can do."""
    (folder / name).write_bytes(data)
    doc = json.loads((folder / "MANIFEST.json").read_text())
    doc["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "MANIFEST.json").write_text(json.dumps(doc))


def _refusals(root, workdir):
    """On one process under ZeRO-2 with accumulation: what a DeepSpeed checkpoint refuses, each before anything changes."""
    os.chdir(workdir)
    acc = helpers.deepspeed_accelerator(2, gradient_accumulation_steps=2)
    ctx = Context(accelerator=acc)
    model, opt, sched, dl = _objects()
    (dl,) = ctx.prepare_loaders(dl)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    step = make_step(ctx, helpers.ce_loss)
    batches = iter(dl)
    state = step(state, next(batches))  # inside an accumulation group
    errors = {}
    try:
        save_checkpoint(ctx, root, state)
    except ValueError as exc:
        errors["mid_group"] = str(exc)
    try:
        save_checkpoint(ctx, root, state, sharded=False)
    except ValueError as exc:
        errors["gathered"] = str(exc)
    state = step(state, next(batches))  # the update
    save_checkpoint(ctx, root, state)
    folder = latest_checkpoint(root)
    buffer = io.BytesIO()
    torch.save({"optimizer_state_dict": _Boom()}, buffer)
    _replace_file(folder, "zero_pp_rank_0_mp_rank_00_optim_states.pt", buffer.getvalue())
    before = _full_params(acc, state.model)
    state = step(state, next(batches))
    state = step(state, next(batches))  # another update: a load that changed anything would show
    trained = _full_params(acc, state.model)
    try:
        load_checkpoint(ctx, folder, state)
    except CheckpointError as exc:
        errors["hostile"] = str(exc)
    save_checkpoint(ctx, f"{root}-clean", state)  # a sound checkpoint, then a file its manifest does not list
    clean = latest_checkpoint(f"{root}-clean")
    (clean / "mp_rank_01_model_states.pt").write_bytes((clean / "mp_rank_00_model_states.pt").read_bytes())
    try:
        load_checkpoint(ctx, clean, state)
    except CheckpointError as exc:  # DeepSpeed's own loader failed on it with an AssertionError
        errors["unlisted"] = str(exc)
    after = _full_params(acc, state.model)
    ctx.close()
    return errors, before, trained, after, state.step


def test_deepspeed_refuses_mid_group_and_pickles(tmp_path):
    """A save inside an accumulation group is refused (DeepSpeed's checkpoint does not hold its partial gradients);
    an engine file whose pickle calls a function (its manifest rewritten to match) is refused by torch's restricted
    unpickler: the function never runs and the live model is not changed."""
    work = tmp_path / "work"
    work.mkdir()
    [(errors, before, trained, after, step)] = testing.run_distributed(
        _refusals, str(tmp_path / "ckpts"), str(work), nprocs=1
    )

    assert "at an optimizer update" in errors["mid_group"] and "accumulation group" in errors["mid_group"]
    assert "under DeepSpeed" in errors["gathered"] and "Leave sharded unset" in errors["gathered"]
    assert (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt" in errors["hostile"] and "restricted unpickler" in errors["hostile"]
    )
    assert "'mp_rank_01_model_states.pt', which its manifest does not list" in errors["unlisted"]
    assert not (work / "pwned").exists()
    assert step == 2
    testing.assert_params_equal(trained, after)  # nothing changed by the refused load
    with pytest.raises(AssertionError):
        testing.assert_params_equal(before, after)


def _save_under_zero2(root, nprocs_note):
    acc = helpers.deepspeed_accelerator(2)
    ctx = Context(accelerator=acc)
    model, opt, sched, dl = _objects()
    (dl,) = ctx.prepare_loaders(dl)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    save_checkpoint(ctx, root, state)
    ctx.close()
    return nprocs_note


def _load_on(root, deepspeed, stage=2, classes=3):
    acc = helpers.deepspeed_accelerator(stage) if deepspeed else Accelerator(cpu=True)
    ctx = Context(accelerator=acc)
    model, opt, sched, dl = _objects()
    if classes != 3:  # another model: its last layer has another shape
        model = helpers.mlp(classes=classes)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    (dl,) = ctx.prepare_loaders(dl)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    try:
        load_checkpoint(ctx, root, state)
    except CheckpointError as exc:
        return str(exc)
    finally:
        ctx.close()
    return None


def test_deepspeed_checkpoint_refused_elsewhere(tmp_path):
    """A DeepSpeed checkpoint is refused without DeepSpeed and on another number of processes."""
    testing.run_distributed(_save_under_zero2, str(tmp_path), 2, nprocs=2)

    [without] = testing.run_distributed(_load_on, str(tmp_path), False, nprocs=1)
    [elsewhere] = testing.run_distributed(_load_on, str(tmp_path), True, nprocs=1)

    assert "under DeepSpeed and this run does not use it" in without
    assert (
        "written by 2 processes under DeepSpeed and this run has 1" in elsewhere
        and "Resume it on 2 processes" in elsewhere
    )


def _create_before_loaders():
    ctx = Context(accelerator=helpers.deepspeed_accelerator(2))
    model, opt, sched, _ = _objects()
    try:
        TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    except ValueError as exc:
        return str(exc)
    finally:
        ctx.close()
    return None


def test_create_before_the_loaders_under_deepspeed_says_what_to_do():
    """DeepSpeed's engine is built with the micro-batch size; Accelerate takes it from loaders prepared with the model."""
    [message] = testing.run_distributed(_create_before_loaders, nprocs=1)

    assert "ctx.prepare_loaders(train_dl) before TrainState.create" in message
    assert "train_micro_batch_size_per_gpu" in message


# --- an optimizer and a scheduler defined in the DeepSpeed config (Accelerate's DummyOptim / DummyScheduler) ---


def _config(stage, ga):
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": ga,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage},
        # torch_adam: torch's AdamW, not DeepSpeed's fused kernel (which needs its compiled ops)
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 3},
        },
    }


def _config_objects(stage, ga):
    from accelerate.utils import DummyOptim, DummyScheduler

    acc = helpers.deepspeed_accelerator(stage, gradient_accumulation_steps=ga, config=_config(stage, ga))
    model, _, _, dl = _objects()
    opt = DummyOptim(model.parameters(), lr=0.01)
    return acc, model, opt, DummyScheduler(opt, warmup_num_steps=3), dl


def _config_canonical(stage, ga):
    acc, model, opt, sched, dl = _config_objects(stage, ga)
    params, _ = helpers.canonical_loop(acc, model, opt, sched, dl, helpers.ce_loss, epochs=2, read=_full_params)
    return params


def _config_composed(stage, ga, root):
    acc, model, opt, sched, dl = _config_objects(stage, ga)
    ctx = Context(accelerator=acc)
    (dl,) = ctx.prepare_loaders(dl)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    saving = checkpoint_every(ctx, 2, root)
    state = saving.at_end(loop(run_epoch(ctx, saving(make_step(ctx, helpers.ce_loss)), dl), max_epochs=2)(state))
    params = _full_params(acc, state.model)
    lr = state.optimizer.param_groups[0]["lr"]
    ctx.close()
    return params, state.step, lr


def test_optimizer_from_the_deepspeed_config(tmp_path):
    """DummyOptim and DummyScheduler (deepspeed_with_config_support.py's way): the engine builds AdamW and WarmupLR from the
    config; the composed loop's parameters equal the canonical loop's, and checkpoint_every saves it."""
    [expected] = testing.run_distributed(_config_canonical, 3, 2, nprocs=1)
    [(got, step, lr)] = testing.run_distributed(_config_composed, 3, 2, str(tmp_path), nprocs=1)

    testing.assert_params_equal(expected, got)
    assert step == 2 * 48 // (4 * 2) and lr == pytest.approx(0.01)  # past the 3 warm-up updates
    assert verify_checkpoint(latest_checkpoint(tmp_path))["step"] == step


def test_another_zero_stage_or_model_is_refused(tmp_path):
    """A DeepSpeed checkpoint of another ZeRO stage or model is refused before DeepSpeed is given it."""
    testing.run_distributed(_save_under_zero2, str(tmp_path), 1, nprocs=1)

    [stage] = testing.run_distributed(_load_on, str(tmp_path), True, 3, nprocs=1)
    [model] = testing.run_distributed(_load_on, str(tmp_path), True, 2, 4, nprocs=1)
    [same] = testing.run_distributed(_load_on, str(tmp_path), True, nprocs=1)

    assert "holds ZeRO stage 2 optimizer states and this run uses stage 3" in stage
    assert "is from another model: parameter '3.bias' has shape (3,) in the checkpoint and (4,) in this model" in model
    assert same is None  # the same settings load


class _Tangled(torch.nn.Module):
    """What a merge of ZeRO partitions can get wrong: a frozen layer, a weight tied to another layer's, a buffer, and
    sizes that are no multiple of 2 x processes (DeepSpeed pads its flat groups)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 7).requires_grad_(False)
        self.hidden = torch.nn.Linear(7, 7)
        self.out = torch.nn.Linear(7, 7)
        self.out.weight = self.hidden.weight  # shared: one parameter under two names
        self.head = torch.nn.Linear(7, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = torch.relu(self.hidden(self.embed(x)))
        return self.head(torch.relu(self.out(h)) * self.scale)


def _train_and_save(stage, root, ga, model="mlp"):
    """A few updates under ZeRO ``stage``, then one checkpoint; the whole parameters at that moment. ``model``
    "tangled" and "aligned" train :class:`_Tangled` and give its state_dict (frozen, shared and buffers included);
    "aligned" with DeepSpeed's ``parameter_alignment``, which pads each parameter inside ZeRO-1/2's flat groups."""
    tangled = model != "mlp"
    config = (
        None
        if model != "aligned"
        else {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": ga,
            "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage, "parameter_alignment": True},
        }
    )
    acc = helpers.deepspeed_accelerator(stage, gradient_accumulation_steps=ga, clip=0.5, config=config)
    ctx = Context(accelerator=acc)
    model, opt, sched, dl = _objects()
    if tangled:
        torch.manual_seed(1)
        model = _Tangled()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    (dl,) = ctx.prepare_loaders(dl)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    state = run_epoch(ctx, max_steps(3)(make_step(ctx, helpers.ce_loss)), dl)(state)
    save_checkpoint(ctx, root, state)
    params = _full_state_dict(state.model) if tangled else _full_params(acc, state.model)
    ctx.close()
    return params


def _full_state_dict(engine):
    """The module's state_dict whole (ZeRO-3's partitions gathered): every name, shared ones and buffers too."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: t.detach().clone() for n, t in engine.module.state_dict().items()}


@pytest.mark.parametrize(
    "stage,ga,model", [(2, 1, "mlp"), (3, 2, "mlp"), (0, 1, "tangled"), (2, 1, "aligned"), (3, 1, "tangled")]
)
def test_a_deepspeed_checkpoint_exports_its_whole_model_offline(stage, ga, model, tmp_path):
    """ZeRO's partitions of 2 processes put together with no process group, from verified files read by the restricted
    unpickler: the trained model's parameters, bit for bit (checkpoint_weights, export_checkpoint and `trainfold diff`);
    of a model with a frozen layer, a shared weight and a buffer, every name of its state_dict, under ZeRO 0, 2 (with
    DeepSpeed's per-parameter alignment paddings) and 3."""
    [want, _] = testing.run_distributed(_train_and_save, stage, str(tmp_path / "root"), ga, model, nprocs=2)

    got = checkpoint_weights(tmp_path / "root")
    written = export_checkpoint(tmp_path / "root", tmp_path / "model.safetensors")
    cli = subprocess.run(
        [sys.executable, "-m", "trainfold", "diff", str(written), str(tmp_path / "root")],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(300),
    )

    assert sorted(got) == sorted(want)
    testing.assert_params_equal(want, got)
    assert cli.returncode == 0 and "bit for bit" in cli.stdout, cli.stdout + cli.stderr


def test_the_cli_reads_a_deepspeed_checkpoint(tmp_path):
    """The command line lists verifies and inspects a DeepSpeed checkpoint."""
    testing.run_distributed(_train_and_save, 3, str(tmp_path / "root"), 1, nprocs=2)
    run = lambda *argv: subprocess.run(
        [sys.executable, "-m", "trainfold", *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(300),
    )

    listed, verified, inspected = (
        run("ls", str(tmp_path / "root")),
        run("verify", str(tmp_path / "root")),
        run("inspect", str(tmp_path / "root")),
    )

    [entry] = json.loads(listed.stdout)["checkpoints"]
    assert ("deepspeed", 2, 3, True, True) == (
        entry["format"],
        entry["processes"],
        entry["update"],
        entry["complete"],
        entry["latest"],
    )
    assert json.loads(verified.stdout)["ok"] is True
    doc = json.loads(inspected.stdout)
    assert ("deepspeed", 2, 3) == (doc["format"], doc["processes"], doc["update"])


def test_partitions_that_do_not_add_up(tmp_path):
    """One rank's ZeRO-2 optimizer partition forged (manifest rewritten to match) shorter: refused, naming the group, nothing written."""
    testing.run_distributed(_train_and_save, 2, str(tmp_path / "root"), 1, nprocs=2)
    folder = latest_checkpoint(tmp_path / "root")
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    states = torch.load(folder / name, weights_only=False)
    groups = states["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    groups[0] = groups[0][: groups[0].numel() // 2].clone()
    buffer = io.BytesIO()
    torch.save(states, buffer)
    _replace_file(folder, name, buffer.getvalue())

    with pytest.raises(CheckpointError, match="parameter group 0"):
        export_checkpoint(folder, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


def _train_on_store(stage, root, options, *, stop_after=None, resume=False):
    """As ``_train`` (ga 1, clip 0.5), with the checkpoints on an S3 root."""
    acc = helpers.deepspeed_accelerator(stage, gradient_accumulation_steps=1, clip=0.5)
    ctx = Context(accelerator=acc)
    model, opt, sched, dl = _objects()
    (dl,) = ctx.prepare_loaders(dl)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    if resume:
        state = load_checkpoint(ctx, root, state, storage_options=options)
    step = make_step(ctx, helpers.ce_loss)
    if stop_after is not None:
        step = max_steps(stop_after)(step)
    saving = checkpoint_every(ctx, 2, root, storage_options=options)
    step = saving(step)
    state = saving.at_end(loop(run_epoch(ctx, step, dl), max_epochs=2)(state))
    params = _full_params(acc, state.model)
    ctx.close()
    return params, state.step


def test_a_deepspeed_checkpoint_on_s3_resumes_exactly_on_two_processes(tmp_path):
    """ZeRO-3's engine files saved to an S3-protocol server (moto on 127.0.0.1) and loaded from it, without a local copy:
    DeepSpeed finds its files' names in a scratch folder and is given the values trainfold read, verified and parsed."""
    with helpers.moto_server() as server:
        root, options = server.bucket("deepspeed") + "/run", server.options()
        full = testing.run_distributed(_train_on_store, 3, root + "-full", options, nprocs=2)
        testing.run_distributed(_train_on_store, 3, root, options, stop_after=3, nprocs=2)
        assert latest_checkpoint(root, storage_options=options).endswith("ckpt-0000000003")
        resumed = testing.run_distributed(_train_on_store, 3, root, options, resume=True, nprocs=2)

    for (want, steps), (got, resumed_steps) in zip(full, resumed):
        assert steps == resumed_steps
        testing.assert_params_equal(want, got)


def test_plain_values_in_a_deepspeed_file(tmp_path, capsys):
    """Values of the wrong kind in ZeRO-2's optimizer file (re-signed, as a forger who can write the folder would):
    `trainfold export` says so in one line with exit status 2, never a traceback, and writes nothing."""
    import shutil

    from trainfold import cli

    testing.run_distributed(_train_and_save, 2, str(tmp_path / "root"), 1, nprocs=2)
    original = latest_checkpoint(tmp_path / "root")
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    forgeries = {
        "a number for the partitions": lambda o: o.__setitem__("single_partition_of_fp32_groups", [3.0]),
        "a string for the partitions": lambda o: o.__setitem__("single_partition_of_fp32_groups", "abc"),
        "no partitions": lambda o: o.__setitem__("single_partition_of_fp32_groups", []),
        "a word for the stage": lambda o: o.__setitem__("zero_stage", "two"),
        "a string among the partitions": lambda o: o.__setitem__("single_partition_of_fp32_groups", ["abc"]),
    }
    for what, forge in forgeries.items():
        folder = tmp_path / what.replace(" ", "-") / original.name
        shutil.copytree(original, folder)
        states = torch.load(folder / name, weights_only=False)
        forge(states["optimizer_state_dict"])
        buffer = io.BytesIO()
        torch.save(states, buffer)
        _replace_file(folder, name, buffer.getvalue())

        code = cli.main(["export", str(folder), str(tmp_path / "model.safetensors")])
        out, err = capsys.readouterr()
        assert 2 == code and 1 == len(err.strip().splitlines()) and err.startswith("trainfold export: "), (what, err)
        assert not (tmp_path / "model.safetensors").exists(), what
