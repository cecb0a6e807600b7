"""Misuse and bad input: each mistake gets an error that names the thing and the fix."""

import re

import pytest
import torch
from accelerate import Accelerator

import helpers

from trainfold import (
    Context,
    TrainState,
    constant,
    evaluate,
    load_checkpoint,
    make_step,
    predict,
    run_epoch,
    save_checkpoint,
    testing,
    warmup_cosine,
    warmup_linear,
)


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


def test_a_loss_fn_with_swapped_arguments():
    """loss_fn(batch, model): the batch is taken as the model; the note says trainfold calls loss_fn(model, batch)."""
    step, state, batch = _step_with(lambda batch, model: testing.mse_loss(model, batch))

    with pytest.raises(Exception) as info:
        step(state, batch)

    assert "trainfold calls as loss_fn(model, batch): the model first" in "\n".join(
        getattr(info.value, "__notes__", [])
    )


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
    empty = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1)), batch_size=4
    )
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

    with pytest.raises(
        RuntimeError, match=r"made with gradient_accumulation_steps=4.*now gradient_accumulation_steps=2"
    ):
        make_step(first, testing.mse_loss)


def test_a_state_where_the_step_expects_one():
    ctx, _, loader, loss_fn = testing.tiny_setup()

    with pytest.raises(TypeError, match="needs a TrainState"):
        run_epoch(ctx, make_step(ctx, loss_fn), loader, {"step": 0})


@pytest.mark.parametrize(
    "kw,error,words",
    [
        ({"clip_grad_norm": 0}, ValueError, "positive finite"),
        ({"clip_grad_value": float("nan")}, ValueError, "positive finite"),
        ({"clip_grad_norm": True}, ValueError, r"clip_grad_norm must be a positive finite number \(got True\)"),
        ({"clip_grad_norm": 1.0, "clip_grad_value": 1.0}, ValueError, "not both"),
        ({"stages": [object()]}, TypeError, r"make_step\(stages=...\) takes Stage objects"),
        ({"stages": [lambda mb: None]}, TypeError, "takes Stage objects"),
    ],
)
def test_bad_step_options(kw, error, words):
    ctx, *_ = testing.tiny_setup()

    with pytest.raises(error, match=words):
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


def _other_optimizer(model):
    return torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)


@pytest.mark.parametrize(
    "build,error,words",
    [
        (_other_optimizer, ValueError, "updates none of the model's parameters"),
        (lambda m: torch.optim.SGD(m.parameters(), lr=float("nan")), ValueError, "lr=nan: a non-finite learning rate"),
        (lambda m: torch.optim.AdamW(m.parameters(), lr=float("inf")), ValueError, "lr=inf"),
    ],
    ids=["other_parameters", "nan_lr", "inf_lr"],
)
def test_create_refuses_an_optimizer_that_would_train_silently_wrong(build, error, words):
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    with pytest.raises(error, match=words):
        TrainState.create(ctx, model=model, optimizer=build(model))


def test_create_refuses_a_foreign_scheduler():
    """Create refuses a scheduler of another optimizer or a scheduler class."""
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.raises(ValueError, match="built on another optimizer"):
        TrainState.create(ctx, model=model, optimizer=opt, scheduler=other)
    with pytest.raises(TypeError, match=r"the class StepLR, not a scheduler: .*StepLR\(optimizer"):
        TrainState.create(ctx, model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR)


def test_create_refuses_deepspeeds_stand_ins_where_they_stand_for_nothing():
    """DummyOptim / DummyScheduler stand for what a DeepSpeed config defines: without DeepSpeed, or a DummyScheduler
    over a real optimizer, nothing would build them (Accelerate's prepare passes them through, to fail at the first step)."""
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    with pytest.raises(TypeError, match="DummyOptim.*does not run DeepSpeed"):
        TrainState.create(ctx, model=model, optimizer=DummyOptim(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="DummyScheduler.*'optimizer' is a real one"):
        TrainState.create(ctx, model=model, optimizer=opt, scheduler=DummyScheduler(opt))


def test_create_knows_megatrons_scheduler_stand_in_too():
    """Megatron-LM's MegatronLMDummyScheduler (importable without Megatron-LM) is a stand-in as DeepSpeed's is: over a
    real optimizer it is refused, not passed through to fail at the first step. (A Megatron-LM run needs GPUs and
    Megatron-LM: the accepting side is tested under DeepSpeed, which takes the same path.)"""
    from accelerate.utils.megatron_lm import MegatronLMDummyScheduler

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="MegatronLMDummyScheduler.*'optimizer' is a real one"):
        TrainState.create(ctx, model=model, optimizer=opt, scheduler=MegatronLMDummyScheduler(opt, total_num_steps=10))


@pytest.mark.parametrize(
    "make",
    [
        lambda: constant(float("nan")),
        lambda: warmup_cosine(float("inf"), warmup_steps=1, total_steps=10),
        lambda: warmup_linear(0.1, warmup_steps=1, total_steps=10, end_lr=float("nan")),
    ],
    ids=["constant_nan", "cosine_inf", "linear_end_nan"],
)
def test_schedules_refuse_non_finite_learning_rates(make):
    with pytest.raises(ValueError, match="finite, non-negative learning rate"):
        make()


def test_save_checkpoint_refuses_an_empty_root():
    ctx, state, _, _ = testing.tiny_setup()
    from trainfold import save_checkpoint

    with pytest.raises(ValueError, match="needs a folder for its checkpoints"):
        save_checkpoint(ctx, "", state)


def test_context_needs_an_accelerator():
    with pytest.raises(TypeError, match="'accelerator' must be an accelerate.Accelerator"):
        Context(accelerator="cpu")


# --- loaders ---------------------------------------------------------------------------------


def test_a_loader_shorter_than_the_accumulation_steps_is_refused():
    ctx, state, loader, loss_fn = testing.tiny_setup(
        n=8, accelerator=Accelerator(cpu=True, gradient_accumulation_steps=4)
    )

    with pytest.raises(ValueError, match=r"2 batches per epoch but gradient_accumulation_steps=4.*silently smaller"):
        run_epoch(ctx, make_step(ctx, loss_fn), loader, state)


class GrowingData(torch.utils.data.Dataset):
    def __init__(self, n):
        self.data = testing.regression_data(64)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.data[i]


def test_a_loader_whose_length_changes_between_epochs_is_counted_right():
    ctx, state, _, loss_fn = testing.tiny_setup()
    data = GrowingData(8)
    (loader,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=4))
    step = make_step(ctx, loss_fn)

    state = run_epoch(ctx, step, loader, state)
    data.n = 20
    state = run_epoch(ctx, step, loader, state)

    assert (2, 7, 7) == (state.epoch, state.step, state.micro_step)
    assert 2 == len(state.history["train_loss"])


def test_resuming_with_a_loader_of_another_length_is_refused(tmp_path):
    from trainfold import load_checkpoint, save_checkpoint

    ctx, state, _, loss_fn = testing.tiny_setup()
    data = GrowingData(16)
    (loader,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=4))
    step = make_step(ctx, loss_fn)

    def save_at_two(s, b):
        new = step(s, b)
        return save_checkpoint(ctx, tmp_path, new) if new.micro_step == 2 else new

    run_epoch(ctx, save_at_two, loader, state)
    data.n = 24
    resumed = load_checkpoint(ctx, tmp_path, state)

    with pytest.raises(ValueError, match="interrupted epoch had 4 batches, this loader has 6"):
        run_epoch(ctx, step, loader, resumed)


# --- contexts --------------------------------------------------------------------------------


def test_two_contexts_with_conflicting_precision_are_refused():
    """Accelerate itself refuses the second Accelerator; the first Context keeps working."""
    first = Context(accelerator=Accelerator(cpu=True))

    with pytest.raises(ValueError, match="AcceleratorState has already been initialized"):
        Context(accelerator=Accelerator(cpu=True, mixed_precision="bf16"))
    first.check()


# --- checkpoints -----------------------------------------------------------------------------


def test_a_checkpoint_from_another_trainfold_format_names_both(tmp_path):
    import json

    from trainfold import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

    ctx, state, *_ = testing.tiny_setup()
    save_checkpoint(ctx, tmp_path, state)
    manifest = latest_checkpoint(tmp_path) / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    doc.update(format=7, trainfold_version="9.0.0")
    manifest.write_text(json.dumps(doc))

    with pytest.raises(
        CheckpointError,
        match=r"written by trainfold 9.0.0 in checkpoint format 7; this trainfold .* reads formats 1, 2",
    ):
        load_checkpoint(ctx, tmp_path, state)


def test_a_checkpoint_root_shared_by_two_runs_is_refused(tmp_path):
    from trainfold import CheckpointError, load_checkpoint, save_checkpoint

    ctx, first, *_ = testing.tiny_setup()
    save_checkpoint(ctx, tmp_path, first)
    other = torch.nn.Linear(1, 1)
    second = TrainState.create(ctx, model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))

    with pytest.raises(CheckpointError, match=r"holds checkpoints of another run .* Use one folder per run"):
        save_checkpoint(ctx, tmp_path, second)
    resumed = load_checkpoint(ctx, tmp_path, first)  # the same run, resumed: allowed
    save_checkpoint(ctx, tmp_path, resumed)


import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "interruptible_run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.multiprocess
def test_a_full_disk_during_save_leaves_the_previous_checkpoint_intact(tmp_path):
    from trainfold import latest_checkpoint, list_checkpoints, verify_checkpoint

    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), str(tmp_path / "out"), "--disk-full-after-first-save"],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(600),
        env=ENV,
    )

    assert 3 == result.returncode, result.stderr[-2000:]
    assert "save failed: OSError" in result.stdout
    assert ["ckpt-0000000000"] == [p.name for p in list_checkpoints(tmp_path)]
    verify_checkpoint(latest_checkpoint(tmp_path))  # the previous checkpoint is whole


@pytest.mark.multiprocess
def test_ctrl_c_stops_with_a_final_checkpoint(tmp_path):
    """Ctrl-C stops at a step boundary with a final checkpoint and resume is exact."""
    from safetensors.torch import load_file

    from trainfold import list_checkpoints

    clean = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "clean"), str(tmp_path / "clean.st")],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(600),
        env=ENV,
    )
    assert 0 == clean.returncode, clean.stderr[-2000:]

    root = tmp_path / "interrupted"
    with subprocess.Popen(
        [sys.executable, str(SCRIPT), str(root), str(tmp_path / "resumed.st")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    ) as proc:
        assert "ready" == proc.stdout.readline().strip()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=helpers.scaled(60))
    assert 130 == proc.returncode, err[-2000:]
    assert "interrupted at update" in out
    assert 1 == len(list_checkpoints(root))
    assert [".trainfold.lock"] == [p.name for p in root.iterdir() if p.name.startswith(".")]  # nothing half-written

    resumed = subprocess.run(
        [sys.executable, str(SCRIPT), str(root), str(tmp_path / "resumed.st")],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(600),
        env=ENV,
    )
    assert 0 == resumed.returncode, resumed.stderr[-2000:]
    testing.assert_params_equal(load_file(str(tmp_path / "clean.st")), load_file(str(tmp_path / "resumed.st")))


# --- arguments in the wrong order (issue 23, item 5): each place named, checked once, not per step -------


def _misplaced_calls():
    ctx, state, dl, loss_fn = testing.tiny_setup()
    step = make_step(ctx, loss_fn)
    batch = next(iter(dl))
    return {
        "run_epoch(ctx, loader, step, state)": (
            lambda: run_epoch(ctx, dl, step, state),
            r"run_epoch: step, the second argument of run_epoch\(ctx, step, loader, state\), must be a function; got a loader",
        ),
        "run_epoch(state, ctx, step, loader)": (
            lambda: run_epoch(state, ctx, step, dl),
            r"run_epoch: the first argument of run_epoch\(ctx, step, loader, state\) must be the Context; got a TrainState",
        ),
        "make_step(loss_fn, ctx)": (
            lambda: make_step(loss_fn, ctx),
            r"make_step: the first argument of make_step\(ctx, loss_fn, ...\) must be the Context; got the function 'mse_loss'",
        ),
        "step(batch, state)": (
            lambda: step(batch, state),
            r"step\(state, batch\): the arguments are swapped: the TrainState comes first",
        ),
        "evaluate(ctx, loader, loss_fn, state)": (
            lambda: evaluate(ctx, dl, loss_fn, state),
            r"evaluate: loss_fn, the second argument of evaluate\(ctx, loss_fn, loader, state\), must be a function",
        ),
        "evaluate(ctx, loss_fn, state, loader)": (
            lambda: evaluate(ctx, loss_fn, state, dl),
            r"evaluate: loader, the third argument of evaluate\(ctx, loss_fn, loader, state\), must be an iterable of batches \(a DataLoader\); got a TrainState",
        ),
        "predict(ctx, loader, fn, state)": (
            lambda: predict(ctx, dl, lambda m, b: m(b[0]), state),
            r"predict: fn, the second argument of predict\(ctx, fn, loader, state\), must be a function",
        ),
        "save_checkpoint(state, root, ctx)": (
            lambda: save_checkpoint(state, "unused", ctx),
            r"save_checkpoint: the first argument of save_checkpoint\(ctx, root, state\) must be the Context; got a TrainState",
        ),
        "load_checkpoint(state, path, ctx)": (
            lambda: load_checkpoint(state, "unused", ctx),
            r"load_checkpoint: the first argument of load_checkpoint\(ctx, path, state\) must be the Context; got a TrainState",
        ),
    }


@pytest.mark.parametrize("call", list(_misplaced_calls()))
def test_arguments_in_the_wrong_order_are_named_by_place(call):
    fn, match = _misplaced_calls()[call]

    with pytest.raises(TypeError, match=match):
        fn()


_TWO_COPIES = """
from accelerate import Accelerator
from trainfold import Context
Context(accelerator=Accelerator())  # no cpu=True, on a machine without GPUs
"""


@pytest.mark.multiprocess
def test_torchrun_without_cpu_true_on_a_machine_without_gpus_is_refused(tmp_path):
    """Two processes that do not form one job each trained the whole job ('1 process'), silently."""
    import os
    import subprocess
    import sys

    from trainfold._src.distributed.launch import free_port

    if torch.cuda.is_available():
        pytest.skip("with GPUs the Accelerator forms the group itself")
    script = tmp_path / "two_copies.py"
    script.write_text(_TWO_COPIES)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(600),
        env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
    )

    assert 0 != proc.returncode
    assert "the launcher started 2 processes (WORLD_SIZE=2), but this Accelerator runs 1 process" in proc.stderr
    assert "Accelerator(cpu=True)" in proc.stderr


def test_log_with_without_init_trackers_says_that_nothing_is_sent():
    """Accelerator(log_with='tensorboard') without init_trackers wrote nothing and said nothing."""
    from trainfold import log_epoch

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir="unused")
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, accelerator=accelerator)
    state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)

    with pytest.warns(
        UserWarning, match=r"log_with=\['tensorboard'\] but its trackers were never started.*init_trackers"
    ):
        log_epoch(ctx, state, echo=False)


def _reuse_after_close():
    testing.reset_accelerate_state()  # this module's parametrize lists built a one-process state at import
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    ctx.close()
    try:
        run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
    except RuntimeError as exc:
        return str(exc)
    return "trained"


def test_a_closed_context_is_refused_by_name():
    assert _reuse_after_close().startswith("this Context was closed")


@pytest.mark.multiprocess
def test_a_closed_context_on_two_processes():
    """It failed with 'Default process group has not been initialized' from inside torch."""
    messages = testing.run_distributed(_reuse_after_close, nprocs=2, timeout=600)
    assert all(m.startswith("this Context was closed") for m in messages), messages


def test_fit_with_patience_and_nothing_to_watch_is_refused_before_training():
    """It failed after a whole epoch, advising a composition the user never wrote."""
    from trainfold import fit

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    with pytest.raises(
        ValueError, match=r"fit: patience=3 watches 'eval_loss'.*pass eval_loader=.*monitor='train_loss'"
    ):
        fit(ctx, loss_fn, loader, state, max_epochs=2, patience=3, progress=False)
    assert 0 == state.step
    assert (
        2
        == fit(
            ctx, loss_fn, loader, state, max_epochs=2, patience=3, monitor="train_loss", progress=False, echo=False
        ).epoch
    )


def test_a_released_state_is_refused():
    """ctx.release(state) gave its objects back; 16 more updates were accepted."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    ctx.release(state, loader)
    (loader,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.zeros(4, 1)), batch_size=2)
    )

    with pytest.raises(ValueError, match=r"run_epoch: this state's objects were given back with ctx.release\(state\)"):
        run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
    with pytest.raises(ValueError, match=r"evaluate: this state's objects were given back"):
        evaluate(ctx, loss_fn, loader, state)


def test_a_checkpoint_path_of_none_says_where_the_none_came_from():
    """verify_checkpoint(latest_checkpoint(root)) of an empty root failed inside pathlib."""
    from trainfold import verify_checkpoint

    ctx, state, _, _ = testing.tiny_setup(seed=0)
    with pytest.raises(
        TypeError,
        match=r"verify_checkpoint needs the path of a checkpoint folder or root \(got None: latest_checkpoint",
    ):
        verify_checkpoint(None)
    with pytest.raises(TypeError, match=r"load_checkpoint needs the path .* \(got None"):
        load_checkpoint(ctx, None, state)


def test_checkpoint_error_is_defined_where_users_import_it_from():
    import trainfold
    from trainfold.errors import CheckpointError

    assert trainfold.CheckpointError is CheckpointError
    assert "trainfold.errors" == CheckpointError.__module__


@pytest.mark.parametrize(
    "sizes,named",
    [
        ({"sp_size": 2}, "sp_size=2 (sequence parallelism)"),
        ({"dp_shard_size": 2, "cp_size": 2}, "cp_size=2 (context parallelism)"),
    ],
)
def test_context_and_sequence_parallelism_are_refused_naming_them(sizes, named):
    """The check a Context makes of its Accelerator's ParallelismConfig (tests/test_sharded.py makes a real one on 4
    processes): make_step does not enter Accelerate's maybe_context_parallel, which splits each batch's sequence;
    HSDP's dimensions pass (tensor parallelism too: tests/test_tensor_parallel.py, whose Accelerator needs transformers)."""
    from types import SimpleNamespace

    from accelerate.utils import ParallelismConfig

    from trainfold._src.core.context import check_parallelism

    with pytest.raises(ValueError, match=re.escape(named)):
        check_parallelism(SimpleNamespace(parallelism_config=ParallelismConfig(**sizes)))
    with pytest.raises(ValueError, match="make_step does not enter"):
        check_parallelism(SimpleNamespace(parallelism_config=ParallelismConfig(**sizes)))
    check_parallelism(SimpleNamespace(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)))
    check_parallelism(SimpleNamespace(parallelism_config=None))


def test_an_own_step_that_records_no_batch():
    """A Step that returns a state without recording the batch (no make_step inside) left the epoch with no position and
    a train_loss of nan, and a warning that the run had diverged. Refused at the epoch's end, naming the step and the fix."""
    ctx, state, loader, _ = testing.tiny_setup(seed=0)

    def count_batches(state, batch):
        return state.with_extra("batches", state.extras.get("batches", 0) + 1)

    with pytest.raises(ValueError, match=r"the step 'count_batches' was given 4 batches and recorded none.*Wrap one"):
        run_epoch(ctx, count_batches, loader, state)


@pytest.mark.parametrize(
    "before", [0, 1, 63, 64, 65]
)  # a fold group's first batch, inside one, after a fold (64 a group)
@pytest.mark.parametrize("first, then", [(False, True), (True, False)])
def test_aux_values_that_appear_or_vanish(before, first, then):
    """Batches without aux values, then one with them (or the reverse): refused, never the names silently dropped."""
    seen = []

    def loss_fn(model, batch):
        seen.append(1)
        loss = testing.mse_loss(model, batch)
        has_aux = first if len(seen) <= max(before, 1) else then
        return (loss, {"acc": loss.detach()}) if has_aux else loss

    step, state, batch = _step_with(loss_fn)
    for _ in range(max(before, 1)):
        state = step(state, batch)
    with pytest.raises(
        ValueError, match=r"aux names \[(|'acc')\] but earlier batches of this epoch returned \[('acc'|)\]"
    ):
        step(state, batch)


def test_a_runtime_name_on_the_context_points_to_ctx_runtime():
    """``ctx.saver`` (what a run holds lives in ``ctx.runtime``) names where it is; another missing name is plain."""
    ctx = Context(accelerator=Accelerator(cpu=True))

    with pytest.raises(AttributeError, match=r"no attribute 'saver': .*ctx\.runtime\.saver"):
        ctx.saver
    with pytest.raises(AttributeError, match=r"^'Context' object has no attribute 'nothing'$"):
        ctx.nothing
    ctx.close()
