"""Checkpoints on Azure Blob storage (az://), against Azurite, Microsoft's emulator, on 127.0.0.1 (installed by `make test`).

What test_object_storage.py checks on S3 that depends on the store: a run saved and resumed bit for bit, and one
writer per root by Azure's conditional writes (a lock blob created with If-None-Match: *, renewed with If-Match on its
ETag). The rest (the manifest as the commit, verification, the bounded requests) is the storage layer's, common to
both, and tested there.
"""

import json
import os
import time
import zlib

import helpers
import pytest

from trainfold import (
    CheckpointError,
    checkpoint_every,
    list_checkpoints,
    load_checkpoint,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
)


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    with helpers.azurite_server(tmp_path_factory.mktemp("azurite")) as server:
        yield server


@pytest.fixture
def az(azurite, request):
    """A fresh container for the test; yields (root URL, storage_options, an adlfs filesystem on the service)."""
    import adlfs

    name = f"t{zlib.crc32(request.node.nodeid.encode()):08x}"
    return f"{azurite.container(name)}/run", azurite.options(), adlfs.AzureBlobFileSystem(**azurite.options())


def _train(ctx, state, dl, wrap=lambda s: s, epochs=2):
    """``wrap``: a step transformer; a checkpoint_every saves the loop's end too (its at_end)."""
    end = getattr(wrap, "at_end", lambda s: s)
    return end(helpers.train(ctx, state, dl, wrap, epochs=epochs, clip_grad_norm=1.0))


def test_a_run_checkpointed_on_azure_resumes_bit_for_bit(az):
    """No warning either (the suite turns warnings into errors): Azure gets conditional writes, its lock keeps one writer."""
    root, options, _ = az
    expected = _train(*helpers.noisy_setup())
    ctx, state, dl = helpers.noisy_setup()
    with_saves = _train(ctx, state, dl, checkpoint_every(ctx, 2, root, storage_options=options))
    testing.assert_params_equal(expected, with_saves)
    ctx.close()
    checkpoints = list_checkpoints(root, storage_options=options)
    assert 2 <= len(checkpoints) and all(c.startswith(f"{root}/ckpt-") for c in checkpoints)

    ctx, state, dl = helpers.noisy_setup(seed=123)  # other initial weights: everything comes from the checkpoint
    resumed = _train(ctx, load_checkpoint(ctx, checkpoints[0], state, storage_options=options), dl)
    testing.assert_params_equal(expected, resumed)
    assert expected.history == resumed.history
    ctx.close()


def test_a_second_azure_job_is_refused(az):
    """A second job on the same Azure root is refused naming the owner until the first ends."""
    root, options, fs = az
    ctx, state, *_ = testing.tiny_setup(seed=0)
    save_checkpoint(ctx, root, state, storage_options=options)

    answer = helpers.second_job(root, options)
    assert answer.startswith("refused") and f"pid {os.getpid()}" in answer and "another job" in answer
    ctx.close()  # the lock blob is removed: the next job takes it
    assert not fs.exists(f"{root.removeprefix('az://')}/.trainfold.lock")
    assert "saved" == helpers.second_job(root, options)


def test_an_expired_azure_lease_is_taken_over(az):
    """An expired Azure lease is taken over and its stale owner cannot renew it."""
    root, options, fs = az
    where = root.removeprefix("az://")
    fs.pipe_file(
        f"{where}/.trainfold.lock",
        json.dumps(
            {"host": "gone", "pid": 1, "run_id": "dead", "token": "x", "expires": time.time() - 1, "lease_s": 1}
        ).encode(),
    )
    ctx, state, dl = helpers.noisy_setup(ga=1)
    save_checkpoint(
        ctx, root, state, storage_options=options
    )  # a dead job's lease: taken over, conditionally on its ETag
    owner = json.loads(fs.cat_file(f"{where}/.trainfold.lock"))
    assert owner["pid"] == os.getpid()

    # another job takes the lock over (as if this one had stalled past its lease): this one's renewal (If-Match on the
    # ETag it wrote) is refused by the service, and its next save raises instead of writing beside the new owner
    fs.pipe_file(
        f"{where}/.trainfold.lock",
        json.dumps({**owner, "pid": 2, "token": "thief", "expires": time.time() + 600}).encode(),
    )
    with pytest.raises(CheckpointError, match="no longer holds the root's lock.*pid 2"):
        save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state), storage_options=options)
    assert json.loads(fs.cat_file(f"{where}/.trainfold.lock"))["token"] == "thief"
    ctx.close()


def test_the_lock_blob_is_conditional(az):
    """The two conditional writes themselves, against the service: what makes two jobs one writer."""
    from trainfold._src.checkpoint.storage import conditional

    root, _, fs = az
    path = f"{root.removeprefix('az://')}/probe"
    conditional.create(fs, path, b"first")
    with pytest.raises(conditional.Lost):
        conditional.create(fs, path, b"second")
    tag = conditional.tag(fs, path)
    renewed = conditional.replace(fs, path, b"third", tag)
    with pytest.raises(conditional.Lost):
        conditional.replace(fs, path, b"fourth", tag)  # the ETag it had before: stale
    assert (b"third", renewed) == (fs.cat_file(path), conditional.tag(fs, path))

    # a watcher sees the owner's renewal even where adlfs holds a listing of the folder (it answers info from one)
    fs.ls(path.rsplit("/", 1)[0], detail=True)
    again = conditional.replace(fs, path, b"fifth", renewed)
    assert again != renewed and again == conditional.tag(fs, path)
    fs.rm(path)  # removed, not replaced by another version: told apart
    with pytest.raises(conditional.Gone):
        conditional.replace(fs, path, b"sixth", again)
