"""What an unlucky operator does to checkpoints: odd names, two copies of a job, a full disk,
debris of crashes, batches of every container type, save-best on several processes."""

import collections
import functools
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    CheckpointError,
    Context,
    DamagedCheckpoint,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    loop,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
    verify_checkpoint,
)

import helpers

ROOT = Path(__file__).resolve().parents[1]


_setup = functools.partial(helpers.setup, n=24)


# --- names and order -------------------------------------------------------------------------


def test_checkpoints_are_named_by_update(tmp_path):
    """Under accumulation 2, update 3 is ckpt-0000000003 (not the micro-batch count 6); mid-group saves stay apart."""
    ctx, state, dl = _setup(ga=2)
    step = make_step(ctx, helpers.ce_loss)
    for i, batch in enumerate(dl):
        state = step(state, batch)
        if i in (4, 5):  # after the 5th micro-batch (mid-group) and the 6th (update 3)
            save_checkpoint(ctx, tmp_path, state)

    assert ["ckpt-0000000002-5", "ckpt-0000000003"] == [p.name for p in list_checkpoints(tmp_path)]


def test_order_comes_from_the_position_inside_not_the_name(tmp_path):
    """A copy kept as ckpt-best, or an old checkpoint copied under a high number, is not the newest."""
    ctx, state, dl = _setup()
    step = checkpoint_every(ctx, 2, tmp_path)(make_step(ctx, helpers.ce_loss))
    early = None
    for batch in dl:
        state = step(state, batch)
        if state.step == 2:
            early = latest_checkpoint(tmp_path)
            shutil.copytree(early, tmp_path / "ckpt-best")
            shutil.copytree(early, tmp_path / "ckpt-9999999999")

    assert "ckpt-0000000006" == latest_checkpoint(tmp_path).name
    assert 6 == load_checkpoint(ctx, tmp_path, state).step  # resume does not rewind to update 2

    save_checkpoint(ctx, tmp_path, state, keep_last=1)  # keeps the newest, not the high-numbered copy
    assert ["ckpt-0000000006"] == [p.name for p in list_checkpoints(tmp_path)]
    assert (tmp_path / "ckpt-best").is_dir()  # not a name trainfold writes: never counted, never pruned


# --- two writers ------------------------------------------------------------------------------


_HOLDER = textwrap.dedent("""
    import sys, time, torch
    from accelerate import Accelerator
    from trainfold import Context, TrainState, save_checkpoint
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(2, 1)
    save_checkpoint(ctx, sys.argv[1], TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    print("saved", flush=True)
    time.sleep(120)
""")


@pytest.mark.multiprocess
def test_a_second_writer_is_refused_and_a_dead_writers_lock_is_taken_over(tmp_path):
    root = tmp_path / "ckpts"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert "saved" == holder.stdout.readline().strip()
        testing.reset_accelerate_state()
        ctx = Context(accelerator=Accelerator(cpu=True))
        model = torch.nn.Linear(2, 1)
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

        with pytest.raises(
            CheckpointError, match=rf"being written by another process \(host .*, pid {holder.pid}, run"
        ):
            save_checkpoint(ctx, root, state)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=helpers.scaled(30))
        holder.stdout.close()

    save_checkpoint(ctx, root, load_checkpoint(ctx, root, state))  # the dead writer's lock is taken over
    assert 1 == len(list_checkpoints(root))


_PROBE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from trainfold import CheckpointError
    from trainfold._src.checkpoint.storage import lock as _lock
    try:
        _lock.acquire(Path(sys.argv[1]), "second-copy")
        print("taken")
    except CheckpointError as exc:
        print("refused", exc)
""")


def _second_copy(root):
    """What a requeued copy of the job finds: 'taken' or 'refused <why>'."""
    return subprocess.run(
        [sys.executable, "-c", _PROBE, str(root)], capture_output=True, text=True, timeout=helpers.scaled(600)
    ).stdout.strip()


def _state_for(ctx):
    model = torch.nn.Linear(2, 1)
    return TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.multiprocess
def test_closing_one_of_two_contexts_that_write_a_root_keeps_it_locked(tmp_path):
    """POSIX locks drop when any descriptor of the file is closed: a second Context (with_accumulation, a host's next
    trial, a resume) that closed released the first one's lock, and a requeued copy saved beside the live run."""
    root = tmp_path / "ckpts"
    ctx = Context(accelerator=Accelerator(cpu=True))
    state = save_checkpoint(ctx, root, _state_for(ctx))
    other = ctx.with_accumulation(2)  # the same Accelerator, a second Context writing the same run's root
    save_checkpoint(other, root, attrs.evolve(state, step=1))

    other.close()
    assert _second_copy(root).startswith("refused")  # the first Context still writes there
    ctx.close()
    assert "taken" == _second_copy(root)  # the last user gave it up


@pytest.mark.multiprocess
def test_one_folder_reached_by_two_paths_is_one_root_with_one_lock(tmp_path):
    """Keyed by the folder, not the spelling: through a symbolic link (or ``..``) a second Context of this process
    shares the lock, and closing it keeps the folder locked (a second descriptor of the lock file, closed, had dropped
    the process's lock, and a requeued copy then saved beside the live run)."""
    root, link = tmp_path / "ckpts", tmp_path / "link"
    root.mkdir()
    link.symlink_to(root)
    ctx = Context(accelerator=Accelerator(cpu=True))
    state = save_checkpoint(ctx, root, _state_for(ctx))
    other = ctx.with_accumulation(2)
    save_checkpoint(other, link, attrs.evolve(state, step=1))
    save_checkpoint(other, tmp_path / "link" / ".." / "ckpts", attrs.evolve(state, step=2))

    other.close()
    assert _second_copy(link).startswith("refused")  # the first Context still writes there
    ctx.close()
    assert "taken" == _second_copy(link)


@pytest.mark.multiprocess
def test_a_root_deleted_under_a_live_run_is_made_again_and_stays_locked(tmp_path):
    root = tmp_path / "ckpts"
    ctx, state, dl = _setup()
    save_checkpoint(ctx, root, state)
    shutil.rmtree(root)  # a clean-up script

    save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))

    assert 1 == len(list_checkpoints(root))
    verify_checkpoint(latest_checkpoint(root))
    assert _second_copy(root).startswith("refused")
    other = ctx.with_accumulation(2)  # the folder made again is found as the same hold: one descriptor
    save_checkpoint(other, root, attrs.evolve(state, step=99))
    other.close()
    assert _second_copy(root).startswith("refused")
    ctx.close()


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_lock_path_that_is_not_a_file_is_refused_by_name(kind, tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    if kind == "directory":
        (root / ".trainfold.lock").mkdir()
    else:
        (root / ".trainfold.lock").symlink_to(tmp_path / "elsewhere")
    ctx, state, _ = _setup()

    with pytest.raises(
        CheckpointError,
        match=rf"\.trainfold\.lock is not a regular file \(a {'directory' if kind == 'directory' else 'symbolic link'}\).*Remove it",
    ) as raised:
        save_checkpoint(ctx, root, state)
    assert "Free space" not in str(raised.value)
    assert not (tmp_path / "elsewhere").exists()


# --- a damaged newest checkpoint ---------------------------------------------------------------------


def _three_checkpoints(root):
    """A run saving at updates 2, 4 and 6; their names."""
    ctx, state, dl = _setup()
    run_epoch(ctx, checkpoint_every(ctx, 2, root)(make_step(ctx, helpers.ce_loss)), dl, state)
    ctx.close()
    return [p.name for p in list_checkpoints(root)]


def _flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # a weight's bit, flipped on disk: the manifest's digest no longer matches
    path.write_bytes(bytes(data))


def test_a_damaged_newest_falls_back_with_a_warning(tmp_path):
    """A root whose newest checkpoint is damaged loads the one before it with a warning naming the damage."""
    names = _three_checkpoints(tmp_path)
    assert ["ckpt-0000000002", "ckpt-0000000004", "ckpt-0000000006"] == names
    _flip_a_bit(tmp_path / names[-1] / "model.safetensors")
    ctx, state, _ = _setup()
    expected = load_checkpoint(ctx, tmp_path / names[-2], state)
    ctx.close()

    ctx, state, _ = _setup()
    with pytest.warns(
        UserWarning,
        match=r"ckpt-0000000006: file model.safetensors does not match its digest.*Loading "
        r".*ckpt-0000000004, the newest checkpoint before it, instead",
    ):
        resumed = load_checkpoint(ctx, tmp_path, state)
    ctx.close()
    assert 4 == resumed.step
    testing.assert_params_equal(expected, resumed)


def test_a_damaged_checkpoint_named_itself_is_refused_not_replaced(tmp_path):
    names = _three_checkpoints(tmp_path)
    (tmp_path / names[-1] / "rank-0.json").unlink()
    ctx, state, _ = _setup()
    with pytest.raises(DamagedCheckpoint, match="file rank-0.json is missing"):
        load_checkpoint(ctx, tmp_path / names[-1], state)
    ctx.close()


def test_a_root_whose_every_checkpoint_is_damaged_is_refused_saying_so(tmp_path):
    for name in _three_checkpoints(tmp_path):
        _flip_a_bit(tmp_path / name / "model.safetensors")
    ctx, state, _ = _setup()
    with (
        pytest.warns(UserWarning),
        pytest.raises(DamagedCheckpoint, match="ckpt-0000000002.*No checkpoint under the root loads"),
    ):
        load_checkpoint(ctx, tmp_path, state)
    ctx.close()


def test_a_misfit_checkpoint_has_no_fallback(tmp_path):
    """Only damage falls back: another model is the user's mistake, which an older checkpoint would hide."""
    _three_checkpoints(tmp_path)
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    other = torch.nn.Linear(3, 3)
    state = TrainState.create(ctx, model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match="ckpt-0000000006") as refused:
            load_checkpoint(ctx, tmp_path, state)
    ctx.close()
    assert not isinstance(refused.value, DamagedCheckpoint)


# --- a full disk, and debris ---------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    yield from helpers.small_disk(tmp_path / "disk", "4m")


def test_a_full_disk_at_the_manifest(small_disk):
    """ENOSPC while writing MANIFEST.json: the same message and clean-up as for the data files."""
    ctx, state, dl = _setup()
    root = small_disk / "ckpts"
    save_checkpoint(ctx, root, state)
    first = latest_checkpoint(root)
    pages = sum(-(-p.stat().st_size // 4096) for p in first.iterdir() if p.name != "MANIFEST.json")
    vfs = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(
        b"\0" * (vfs.f_bavail * vfs.f_frsize - pages * 4096)
    )  # room for the data files only

    with pytest.raises(
        OSError, match=r"committing ckpt-0000000000 failed \(.*No space left on device.*\); nothing was committed"
    ):
        save_checkpoint(ctx, root, state)

    assert [] == [p.name for p in root.iterdir() if p.name.startswith(".tmp")]
    assert [first] == list_checkpoints(root)
    verify_checkpoint(first)


def test_a_commit_cleans_the_debris_of_crashed_saves(tmp_path):
    ctx, state, dl = _setup()
    for debris in (".tmp-ckpt-0000000003", ".del-ckpt-0000000001", ".old-ckpt-0000000002-7"):
        (tmp_path / debris).mkdir(parents=True)
        (tmp_path / debris / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".tmp-other").mkdir()  # not a name trainfold writes: left alone

    save_checkpoint(ctx, tmp_path, state)

    assert [".tmp-other", ".trainfold.lock"] == sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


# --- batches of every container type, across a mid-epoch resume ---------------------------------


Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Example:
    x: torch.Tensor
    y: torch.Tensor


class Encoding(collections.UserDict):
    """Like transformers' BatchEncoding: a Mapping subclass with attribute access."""

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


def _collate(kind):
    def collate(samples):
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        if kind == "namedtuple":
            return Pair(x, y)
        if kind == "dataclass":
            return Example(x, y)
        if kind == "mapping":
            return Encoding({"x": x, "y": y})
        return (x, y.numpy())  # a numpy leaf

    return collate


def _loss(kind):
    def loss_fn(model, batch):
        if kind == "namedtuple":
            assert isinstance(batch, Pair)
            x, y = batch.x, batch.y
        elif kind == "dataclass":
            assert isinstance(batch, Example)
            x, y = batch.x, batch.y
        elif kind == "mapping":
            assert isinstance(batch, Encoding)
            x, y = batch.x, batch.y
        else:
            assert isinstance(batch[1], np.ndarray)
            x, y = batch[0], torch.from_numpy(batch[1])
        return helpers.ce_loss(model, (x, y))

    return loss_fn


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass", "mapping", "numpy"])
def test_read_ahead_batch_keeps_its_container(tmp_path, kind):
    """Saved after every batch and resumed from each save: every resumed run sees its own batch types and ends exact."""
    ctx, state, dl = _setup(collate_fn=_collate(kind))
    step = checkpoint_every(ctx, 1, tmp_path)(make_step(ctx, _loss(kind)))
    whole = run_epoch(ctx, step, dl, state)
    resumes = [p for p in list_checkpoints(tmp_path) if 0 < load_checkpoint(ctx, p, state).batch_in_epoch][:2]

    for ckpt in resumes:
        ctx, state, dl = _setup(collate_fn=_collate(kind))
        resumed = run_epoch(ctx, make_step(ctx, _loss(kind)), dl, load_checkpoint(ctx, ckpt, state))
        testing.assert_params_equal(whole, resumed)


def test_a_batch_a_checkpoint_cannot_hold_is_refused_at_the_first_step(tmp_path):
    class Opaque:
        pass

    ctx, state, dl = _setup(
        collate_fn=lambda samples: (
            torch.stack([s[0] for s in samples]),
            torch.stack([s[1] for s in samples]),
            Opaque(),
        )
    )
    step = checkpoint_every(ctx, 100, tmp_path)(make_step(ctx, lambda m, b: helpers.ce_loss(m, b[:2])))

    with pytest.raises(
        TypeError, match=r"checkpoint_every: the loader's batches cannot be checkpointed mid-epoch: .*it is a Opaque"
    ):
        run_epoch(ctx, step, dl, state)
    assert not tmp_path.exists() or [] == list(tmp_path.iterdir())


def test_an_unprepared_loader_is_refused(tmp_path):
    """An unprepared loader with `checkpoint_every` is refused at the first step."""
    ctx, state, _ = _setup()
    raw = torch.utils.data.DataLoader(helpers.classification_data(8), batch_size=4)
    step = checkpoint_every(ctx, 100, tmp_path)(make_step(ctx, helpers.ce_loss))

    with pytest.raises(TypeError, match="checkpoint_every: the epoch runs over a loader that was not prepared"):
        run_epoch(ctx, step, raw, state)
    assert not (tmp_path / ".tmp-ckpt-0000000000").exists()


def test_dispatched_map_dataset_is_refused(tmp_path):
    """A checkpoint inside such an epoch could not continue it: said at the first step, with the setting to change."""
    from accelerate import DataLoaderConfiguration

    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True)))
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(8), batch_size=4))
    step = checkpoint_every(ctx, 100, tmp_path)(make_step(ctx, helpers.ce_loss))

    with pytest.raises(
        TypeError,
        match=r"checkpoint_every: Accelerate dispatches this loader's batches from process 0 "
        r"\(dispatch_batches=True\) over a map-style dataset.*Leave dispatch_batches unset",
    ):
        run_epoch(ctx, step, dl, state)
    ctx.close()


# --- save-best on several processes ----------------------------------------------------------------


def _best_on_this_rank(folder):
    from trainfold import evaluate, restore_best, save_best

    ctx = Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(0)
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(16), batch_size=4))
    path = os.path.join(folder, "best.safetensors")
    best = save_best(ctx, path, "eval_loss", evaluate(ctx, helpers.ce_loss, dl, state))
    weights = [p.detach().clone() for p in best.model.parameters()]
    later = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, best)
    back = restore_best(ctx, path, later)
    same = all(torch.equal(a, b) for a, b in zip(weights, back.model.parameters()))
    ctx.close()
    return same, str(ctx.accelerator.device)


@pytest.mark.multiprocess
def test_save_best_and_restore_best_on_two_processes(tmp_path):
    ranks = testing.run_distributed(_best_on_this_rank, str(tmp_path), nprocs=2, timeout=600)

    assert [True, True] == [same for same, _ in ranks]


def test_an_empty_root_is_refused(tmp_path, monkeypatch):
    """An empty root is refused instead of writing into the working directory."""
    ctx, state, _ = _setup()
    monkeypatch.chdir(tmp_path)

    with pytest.raises(ValueError, match=r"save_checkpoint needs a folder for its checkpoints \(got ''\)"):
        save_checkpoint(ctx, "", state)
    assert [] == list(tmp_path.iterdir())


def test_verify_checkpoint_streams_every_file_and_names_the_altered_one(tmp_path):
    ctx, state, _ = _setup()
    save_checkpoint(ctx, tmp_path, state)
    ckpt = latest_checkpoint(tmp_path)
    assert "ckpt-0000000000" == ckpt.name and verify_checkpoint(ckpt)["world_size"] == 1

    data = bytearray((ckpt / "state.safetensors").read_bytes())
    data[-1] ^= 0x01
    (ckpt / "state.safetensors").write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=r"file state.safetensors does not match its digest \(xxh3_128\)"):
        verify_checkpoint(ckpt)


def test_every_file_is_fsynced_before_the_commit(tmp_path, monkeypatch):
    """A spy on os.fsync and os.replace during a save: each file the manifest lists, the manifest and the staging folder
    reach the disk before the folder is renamed into place (after a power cut, a committed name holds whole files)."""
    import json

    events = []
    fsync, replace = os.fsync, os.replace

    def spying_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def spying_replace(src, dst, **kwargs):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        return replace(src, dst, **kwargs)

    ctx, state, dl = _setup()
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    monkeypatch.setattr(os, "fsync", spying_fsync)
    monkeypatch.setattr(os, "replace", spying_replace)
    save_checkpoint(ctx, tmp_path, state)
    monkeypatch.undo()
    ctx.close()

    ckpt = latest_checkpoint(tmp_path)
    commit = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(ckpt))
    staging = events[commit][1]
    synced = {e[1] for e in events[:commit] if e[0] == "fsync"}
    files = [*json.loads((ckpt / "MANIFEST.json").read_text())["files"], "MANIFEST.json"]
    assert [] == [name for name in files if os.path.join(staging, name) not in synced]
    assert staging in synced  # the folder's entries too
    assert ("fsync", str(tmp_path)) in events[commit:]  # and the rename itself


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_a_bad_keep_last_is_refused_at_the_call(keep_last, tmp_path):
    """`checkpoint_every` refuses a bad `keep_last` when it is called not at the first save."""
    ctx, *_ = testing.tiny_setup(seed=0)
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        checkpoint_every(ctx, 2, tmp_path, keep_last=keep_last)


def test_checkpoint_every_in_the_order_before(tmp_path):
    """``checkpoint_every(ctx, root, n)``, the order before the period came first, saves as ``checkpoint_every(ctx, n,
    root)`` does, and the warning says how to write it."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)

    with pytest.warns(
        DeprecationWarning, match=r"is now checkpoint_every\(ctx, n, root\).*write checkpoint_every\(ctx, 3, '"
    ):
        saving = checkpoint_every(ctx, tmp_path / "before", 3)
    loop(run_epoch(ctx, saving(make_step(ctx, loss_fn)), loader), max_epochs=2)(state)
    now = checkpoint_every(ctx, 3, tmp_path / "now")
    loop(run_epoch(ctx, now(make_step(ctx, loss_fn)), loader), max_epochs=2)(state)

    assert (
        [p.name for p in list_checkpoints(tmp_path / "before")]
        == [p.name for p in list_checkpoints(tmp_path / "now")]
        == ["ckpt-0000000003", "ckpt-0000000006"]
    )
