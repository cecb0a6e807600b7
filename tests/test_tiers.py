"""Loading from several roots, the fast tier first: ``load_checkpoint(ctx, [memory, durable], state)`` loads the newest
complete checkpoint of either, by the position each records; a damaged one is passed over for the next newest of any
root; a memory root left by another run is passed over for the durable root's run."""

import warnings

import helpers
import pytest

from trainfold import (
    CheckpointError,
    checkpoint_every,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
)


def _trained(epochs, seed=0):
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=seed)
    step = make_step(ctx, loss_fn)
    for _ in range(epochs):
        state = run_epoch(ctx, step, loader, state)
    return ctx, state, step, loader


def _fresh():
    ctx, state, _, _ = testing.tiny_setup(seed=0)
    return ctx, state


def test_the_newest_checkpoint_of_either_root_is_loaded(tmp_path):
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    ctx, state, step, loader = _trained(1)
    save_checkpoint(ctx, durable, state)  # update 4
    state = run_epoch(ctx, step, loader, state)
    save_checkpoint(ctx, memory, state)  # update 8: newer, in the memory tier
    ctx.close()

    ctx, fresh = _fresh()
    assert 8 == load_checkpoint(ctx, [memory, durable], fresh).step
    ctx.close()
    ctx, fresh = _fresh()
    assert 8 == load_checkpoint(ctx, (durable, memory), fresh).step  # the order of the roots does not choose
    ctx.close()


def test_at_the_same_position_the_first_root_is_loaded(tmp_path, caplog):
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    ctx, state, _, _ = _trained(1)
    save_checkpoint(ctx, memory, state)
    save_checkpoint(ctx, durable, state)
    ctx.close()

    ctx, fresh = _fresh()
    with caplog.at_level("INFO", logger="trainfold"):
        assert 4 == load_checkpoint(ctx, [memory, durable], fresh).step
    ctx.close()
    assert f"resumed from {memory / 'ckpt-0000000004'} at update 4" in caplog.text


def test_a_memory_root_of_another_run_is_passed_over(tmp_path):
    """A memory root an earlier job left, with a newer checkpoint of its own run: the durable root's run is this one."""
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    ctx, other, _, _ = _trained(3, seed=1)
    save_checkpoint(ctx, memory, other)  # update 12, another run
    ctx.close()
    ctx, state, _, _ = _trained(1)
    save_checkpoint(ctx, durable, state)  # update 4, this run
    ctx.close()

    ctx, fresh = _fresh()
    with pytest.warns(UserWarning, match=rf"{memory} is passed over: its checkpoints of run {other.run_id} are not"):
        loaded = load_checkpoint(ctx, [memory, durable], fresh)
    ctx.close()
    assert (4, state.run_id) == (loaded.step, loaded.run_id)


def test_a_damaged_newest_checkpoint_falls_back_to_the_next_newest_of_any_root(tmp_path):
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    ctx, state, step, loader = _trained(1)
    save_checkpoint(ctx, durable, state)  # update 4
    state = run_epoch(ctx, step, loader, state)
    save_checkpoint(ctx, memory, state)  # update 8, then damaged
    ctx.close()
    weights = latest_checkpoint(memory) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    ctx, fresh = _fresh()
    with pytest.warns(UserWarning, match=r"does not match its digest.*Loading .*durable.*ckpt-0000000004"):
        assert 4 == load_checkpoint(ctx, [memory, durable], fresh).step
    ctx.close()


def test_roots_without_a_checkpoint(tmp_path):
    """Nothing saved yet in either: the state back with ``missing_ok``, else an error naming both roots."""
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    ctx, fresh = _fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_checkpoint(ctx, [memory, durable], fresh, missing_ok=True) is fresh
    with pytest.raises(CheckpointError, match=rf"no complete checkpoint under {memory} or {durable}"):
        load_checkpoint(ctx, [memory, durable], fresh)
    with pytest.raises(ValueError, match="an empty list of roots"):
        load_checkpoint(ctx, [], fresh)
    ctx.close()


@pytest.fixture
def full_memory(tmp_path):
    """A tmpfs of 512 KiB (a memory tier, for real), filled but for 4 KiB: no checkpoint fits."""
    for folder in helpers.small_disk(tmp_path / "shm", "512k"):
        filler = folder / "filler"
        with open(filler, "wb") as f:
            try:
                f.write(b"\0" * (512 << 10))
            except OSError:
                pass  # full
        filler.write_bytes(b"\0" * ((512 - 4) << 10))
        yield folder


def test_a_full_memory_tier_is_logged_and_training_goes_on(full_memory, tmp_path, caplog):
    """A best-effort tier whose every save fails for want of space: each failure is logged, nothing is committed or
    left behind there, training and the durable tier go on; once there is room, the tier saves again."""
    memory, durable = full_memory / "run", tmp_path / "durable"
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    fast = checkpoint_every(ctx, 1, memory, keep_last=2, best_effort=True)
    slow = checkpoint_every(ctx, 4, durable)
    step = slow(fast(make_step(ctx, loss_fn)))

    with caplog.at_level("ERROR", logger="trainfold"):
        state = run_epoch(ctx, step, loader, state)
    failed = [r.message for r in caplog.records if "best_effort=True" in r.message]
    assert 4 == state.step and 4 == len(failed) and "No space left on device" in failed[0]
    assert ["ckpt-0000000004"] == [p.name for p in list_checkpoints(durable)]
    assert [] == list_checkpoints(memory) and [] == [p.name for p in memory.iterdir() if p.name.startswith(".tmp")]

    (full_memory / "filler").unlink()  # room again: the next update's save is committed
    state = run_epoch(ctx, step, loader, state)
    ctx.close()
    assert ["ckpt-0000000007", "ckpt-0000000008"] == [p.name for p in list_checkpoints(memory)]


def test_a_best_effort_tier_saves_blocking(tmp_path):
    ctx, _, _, _ = testing.tiny_setup(seed=0)
    with pytest.raises(ValueError, match="best_effort=True saves blocking"):
        checkpoint_every(ctx, 1, tmp_path, best_effort=True, async_save=True)
    ctx.close()


def _load_from_own_memory(folder):
    """Each process's memory tier is its own folder (a node's own /dev/shm); the durable root is shared."""
    ctx, fresh = _fresh()
    rank = ctx.accelerator.process_index
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loaded = load_checkpoint(ctx, [f"{folder}/memory-{rank}", f"{folder}/durable"], fresh)
    ctx.close()
    return loaded.step, [str(w.message) for w in said if "passed over" in str(w.message)]


@pytest.mark.multiprocess
def test_a_memory_tier_not_alike_on_every_process_is_passed_over(tmp_path):
    """Restarted on other nodes, the processes do not see the same memory tier (process 0's holds update 8, process
    1's nothing): it is passed over on both with a warning naming what each saw, and both load the durable root's."""
    ctx, state, step, loader = _trained(1)
    save_checkpoint(ctx, tmp_path / "durable", state)  # update 4
    state = run_epoch(ctx, step, loader, state)
    save_checkpoint(ctx, tmp_path / "memory-0", state)  # update 8, on process 0's node only
    ctx.close()

    for step_loaded, passed_over in testing.run_distributed(_load_from_own_memory, str(tmp_path), nprocs=2):
        assert 4 == step_loaded
        assert len(passed_over) == 1 and "process 0 ckpt-0000000008, process 1 none" in passed_over[0], passed_over


def _save_to_own_folder(folder):
    """Each process saves to "the same root", which is a folder of its own (a node's own /dev/shm on several nodes)."""
    ctx, state, _, _ = testing.tiny_setup(seed=0)
    rank = ctx.accelerator.process_index
    try:
        save_checkpoint(ctx, f"{folder}/node-{rank}", state)
    except (OSError, CheckpointError) as exc:
        return type(exc).__name__, str(exc)
    finally:
        ctx.close()
    return None


@pytest.mark.multiprocess
def test_a_root_that_is_a_folder_of_each_node_is_refused_at_the_first_save(tmp_path):
    """Process 1 does not find the staging folder the main process made: it says the root is not shared, the main
    process that another failed, and nothing is committed (a memory tier on several nodes is such a root)."""
    (kind_0, said_0), (kind_1, said_1) = testing.run_distributed(_save_to_own_folder, str(tmp_path), nprocs=2)

    assert kind_1 == "FileNotFoundError" and "the root is not shared by every process" in said_1, said_1
    assert kind_0 == "CheckpointError" and "failed on another process" in said_0, said_0
    assert [] == list_checkpoints(tmp_path / "node-0")


@pytest.mark.parametrize("best_effort", [True, False])
def test_a_best_effort_tier_does_not_warn_of_an_unsaved_end(tmp_path, caplog, best_effort):
    """Closing the Context warns that the run's last updates are in no checkpoint of a root, unless that root is a
    best-effort tier (a memory tier's end is not what it is for: the durable root's at_end saves it)."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    step = checkpoint_every(ctx, 3, tmp_path / "memory", keep_last=2, best_effort=best_effort)(make_step(ctx, loss_fn))
    run_epoch(ctx, step, loader, state)  # 4 updates: the 4th is in no checkpoint there
    with caplog.at_level("WARNING", logger="trainfold"):
        ctx.close()
    assert ("are not in a checkpoint" in caplog.text) is not best_effort
