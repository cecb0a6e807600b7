"""Loading from several roots, the fast tier first: ``load_checkpoint(ctx, [memory, durable], state)`` loads the newest
complete checkpoint of either, by the position each records; a damaged one is passed over for the next newest of any
root; a memory root left by another run is passed over for the durable root's run."""

import warnings

import pytest

from trainfold import (
    CheckpointError,
    latest_checkpoint,
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
