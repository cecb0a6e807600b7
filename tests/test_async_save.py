"""Background saves (``async_save=True``): the step only copies the state to host memory; a thread writes,
hashes and commits; at most one save is in flight; a crash or a failure in the background loses nothing."""

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
    verify_checkpoint,
)

import helpers

ROOT = Path(__file__).resolve().parents[1]


def _big_setup(features=2048, seed=0):
    """A 2048 x 4096 linear layer (33 MB of weights): a write that takes tens of milliseconds."""
    testing.reset_accelerate_state()
    torch.manual_seed(seed)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(features, 4096)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return ctx, state


def _nudge(state):
    """What training does meanwhile: change every weight in place."""
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)


@pytest.mark.parametrize("sharded", [False, True])
def test_an_async_save_holds_its_moment(sharded, tmp_path):
    """An async save returns before the write and holds the state of its moment."""
    ctx, state = _big_setup()
    before = testing.parameters(state)

    save_checkpoint(ctx, tmp_path, state, async_save=True, sharded=sharded)
    in_flight, visible = ctx.runtime.saver.in_flight, latest_checkpoint(tmp_path)
    _nudge(state)  # training goes on while the thread writes
    ctx.wait_for_checkpoints()

    assert in_flight and visible is None  # returned at once; committed only later
    verify_checkpoint(latest_checkpoint(tmp_path))
    ctx.close()
    ctx, fresh = _big_setup(seed=1)
    testing.assert_params_equal(
        before, load_checkpoint(ctx, tmp_path, fresh)
    )  # the weights of the save, not the nudged ones


def test_a_second_save_waits_for_the_first_and_closing_waits_for_the_last(tmp_path):
    ctx, state = _big_setup()
    save_checkpoint(ctx, tmp_path, state, async_save=True)
    state = attrs.evolve(state, step=1)
    save_checkpoint(ctx, tmp_path, state, async_save=True)
    after_second_call = [p.name for p in list_checkpoints(tmp_path)]
    ctx.close()

    assert ["ckpt-0000000000"] == after_second_call  # the first was committed before the second began
    assert ["ckpt-0000000000", "ckpt-0000000001"] == [p.name for p in list_checkpoints(tmp_path)]


_KILLED_MID_WRITE = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import test_async_save as t
    from trainfold import save_checkpoint
    import attrs
    ctx, state = t._big_setup()
    save_checkpoint(ctx, sys.argv[1], state)  # a complete checkpoint at update 0
    save_checkpoint(ctx, sys.argv[1], attrs.evolve(state, step=1), async_save=True)
    staging = os.path.join(sys.argv[1], ".tmp-ckpt-0000000001")
    while not os.path.isdir(staging):  # the saver thread has begun the checkpoint's staging
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)  # while the thread writes update 1
""")


@pytest.mark.multiprocess
def test_a_kill_during_a_background_write(tmp_path):
    """A process killed during a background write leaves the previous checkpoint the newest."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_MID_WRITE.format(tests=str(ROOT / "tests")))
    root = tmp_path / "ckpts"

    proc = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=helpers.scaled(600)
    )

    assert -signal.SIGKILL == proc.returncode, proc.stderr[-2000:]
    assert ["ckpt-0000000000"] == [p.name for p in list_checkpoints(root)]
    verify_checkpoint(latest_checkpoint(root))
    assert any(p.name.startswith(".tmp-ckpt-0000000001") for p in root.iterdir())  # the unfinished one: never committed


_ENDS_WITHOUT_CLOSING = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import attrs
    import test_async_save as t
    from trainfold import save_checkpoint
    ctx, state = t._big_setup()
    if len(sys.argv) > 2:  # a complete checkpoint first, then one the disk has no room for
        save_checkpoint(ctx, sys.argv[1], state)
        state = attrs.evolve(state, step=1)
    save_checkpoint(ctx, sys.argv[1], state, async_save=True)
    print("returned", flush=True)
    # the script ends with the save in flight: no ctx.close(), no 'with ctx:'
""")


@pytest.mark.multiprocess
def test_a_background_save_in_flight_when_the_script_ends_is_committed(tmp_path):
    """The README's first example never closes its Context: its last background save must still land (it was lost
    about half the time: the interpreter's shutdown refused the write's thread pool and the process exited 0)."""
    script = tmp_path / "ends.py"
    script.write_text(_ENDS_WITHOUT_CLOSING.format(tests=str(ROOT / "tests")))
    for attempt in range(4):  # a race: one run could pass by luck
        root = tmp_path / f"ckpts{attempt}"
        proc = subprocess.run(
            [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=helpers.scaled(600)
        )

        assert 0 == proc.returncode, proc.stderr[-2000:]
        assert ["ckpt-0000000000"] == [p.name for p in list_checkpoints(root)]
        verify_checkpoint(latest_checkpoint(root))


@pytest.mark.multiprocess
def test_a_failed_save_after_the_script_exits_nonzero(small_disk):
    """48 MB hold one checkpoint of 33 MB: the second fails after the script's last line, and the process says so."""
    script = small_disk.parent / "ends.py"
    script.write_text(_ENDS_WITHOUT_CLOSING.format(tests=str(ROOT / "tests")))
    root = small_disk / "ckpts"

    proc = subprocess.run(
        [sys.executable, str(script), str(root), "fill"], capture_output=True, text=True, timeout=helpers.scaled(600)
    )

    assert "returned" in proc.stdout
    assert 1 == proc.returncode
    assert "the checkpoint being written in the background when the program ended failed" in proc.stderr
    assert "No space left on device" in proc.stderr
    assert ["ckpt-0000000000"] == [p.name for p in list_checkpoints(root)]


@pytest.fixture
def small_disk(tmp_path):
    yield from helpers.small_disk(tmp_path / "disk", "48m")


def test_a_failed_background_save_raises_when_waited(small_disk):
    """48 MB hold one checkpoint of 33 MB, not two: the second, written in the background, fails on a full disk."""
    ctx, state = _big_setup()
    root = small_disk / "ckpts"
    save_checkpoint(ctx, root, state)
    first = latest_checkpoint(root)

    save_checkpoint(ctx, root, attrs.evolve(state, step=1), async_save=True)
    with pytest.raises(
        OSError, match=r"writing .*ckpt-0000000001 failed \(.*No space left on device.*\); nothing was committed"
    ):
        ctx.wait_for_checkpoints()

    assert [first] == list_checkpoints(root)
    assert [] == [p.name for p in root.iterdir() if p.name.startswith(".tmp")]
    verify_checkpoint(first)
    ctx.close()


def _async_run(root, stop_after=None, resume=False):
    from trainfold import loop, max_steps

    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    torch.manual_seed(0)
    model = helpers.mlp(dropout=0.1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(48), batch_size=4, shuffle=True)
    )
    if resume:
        state = load_checkpoint(ctx, root, state)
    step = make_step(ctx, helpers.ce_loss)
    if stop_after:
        step = max_steps(stop_after)(step)
    state = loop(run_epoch(ctx, checkpoint_every(ctx, 1, root, async_save=True)(step), dl), max_epochs=2)(state)
    with ctx:  # waits for the last background save, then every process, then closes
        return testing.parameters(state), state.step


@pytest.mark.multiprocess
def test_async_checkpoints_on_two_processes_resume_exactly(tmp_path):
    """checkpoint_every(..., async_save=True) on 2 processes: stopped at update 5 (its last save committed before the
    step returned), resumed in new processes, the run ends as an uninterrupted one, bit for bit."""
    full = testing.run_distributed(_async_run, str(tmp_path / "a"), nprocs=2)
    stopped = testing.run_distributed(_async_run, str(tmp_path / "b"), stop_after=5, nprocs=2)
    last_saved = latest_checkpoint(tmp_path / "b").name
    resumed = testing.run_distributed(_async_run, str(tmp_path / "b"), resume=True, nprocs=2)

    assert 5 == stopped[0][1] and "ckpt-0000000005" == last_saved
    testing.assert_params_equal(full[0][0], resumed[0][0])
    testing.assert_params_equal(resumed[0][0], resumed[1][0])
    assert full[0][1] == resumed[0][1]


def test_a_signal_in_the_last_wait_lets_the_save_land(tmp_path):
    """with ctx:'s wait for the last save: a SIGTERM there killed the process with the save half-written."""
    import os
    import threading

    ctx, state = _big_setup()
    save_checkpoint(ctx, tmp_path, state, async_save=True)
    threading.Timer(0.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # arrives while the main thread waits
    with ctx:
        pass  # waits for the save, then closes

    assert ["ckpt-0000000000"] == [p.name for p in list_checkpoints(tmp_path)]
    verify_checkpoint(latest_checkpoint(tmp_path))
    assert 0 != ctx.runtime.interrupt.requested  # recorded as a stop request, nothing more


@pytest.mark.parametrize("end, every", [("max_epochs", 100), ("max_steps", 100), ("max_steps", 6)])
def test_the_run_end_save_waits_for_its_commit(end, every, tmp_path, monkeypatch):
    """With async_save=True the loop's end is saved (checkpoint_every's at_end) in the background, and at_end waits for
    its commit: code after it sees it (and a kill after it loses nothing). The background write is held on an event, so
    a call that returned before the commit is seen returning while it is held. A budget's stop (max_steps) is saved by
    checkpoint_every's step itself; where its periodic save falls on that update, the run's end is that save, already
    submitted: at_end waits for it too."""
    import threading

    from trainfold import checkpoint_every, latest_checkpoint, loop, make_step, max_steps, run_epoch, testing
    from trainfold._src.checkpoint import save

    release, writing = threading.Event(), threading.Event()
    commit = save.write_and_commit

    def held(ctx, job, *rest):
        writing.set()
        release.wait(timeout=helpers.scaled(300))  # a hang-guard only: the test releases it
        return commit(ctx, job, *rest)

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)  # 4 updates an epoch
    saving = checkpoint_every(ctx, every, tmp_path, async_save=True)
    step = saving(make_step(ctx, loss_fn))
    if end == "max_steps":
        step = max_steps(6)(step)
    monkeypatch.setattr(save, "write_and_commit", held)
    returned = []
    runner = threading.Thread(
        target=lambda: returned.append(saving.at_end(loop(run_epoch(ctx, step, loader), max_epochs=2)(state)))
    )
    runner.start()
    assert writing.wait(timeout=helpers.scaled(300))  # the event: the run-end save is being written
    runner.join(timeout=1.0)
    assert runner.is_alive() and not returned  # still waiting for the commit
    release.set()
    runner.join(timeout=helpers.scaled(300))
    final = returned[0]
    assert f"ckpt-{final.step:010d}" == latest_checkpoint(tmp_path).name  # committed when the loop returned
    ctx.close()
