"""Hostile checkpoints, built file by file: each is refused with a CheckpointError, opens nothing
outside its folder, and leaves the live model and optimizer as they were.

An attacker here can write the checkpoint folder, manifest included (so digests match what
they wrote): what stops them is the format, not the hashes.
"""

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    CheckpointError,
    Context,
    Stop,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    make_step,
    save_checkpoint,
    testing,
    verify_checkpoint,
)

import helpers

_OPENED: list[str] | None = None


def _audit(event, args):
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))
    if _OPENED is not None and event == "pickle.find_class":
        _OPENED.append(f"pickle:{args[0]}.{args[1]}")


sys.addaudithook(_audit)  # an audit hook cannot be removed: it records only inside _opened()


@contextlib.contextmanager
def _opened():
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


def _setup():
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = helpers.mlp()
    state = TrainState.create(
        ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), scheduler=None
    )
    return ctx, state


def _trained_checkpoint(tmp_path, **save):
    """A real checkpoint of a trained state, an outside file holding a secret, and the trained parameters."""
    ctx, state = _setup()
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(16), batch_size=4))
    step = make_step(ctx, helpers.ce_loss)
    for batch in dl:
        state = step(state, batch)
    save_checkpoint(ctx, tmp_path / "root", state, **save)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(631))
    return latest_checkpoint(tmp_path / "root"), secret, testing.parameters(state)


@pytest.fixture
def ckpt(tmp_path):
    """A real checkpoint (the gathered format) of a trained state, and an outside file holding a secret."""
    return _trained_checkpoint(tmp_path)[:2]


def _manifest(folder):
    return json.loads((folder / "MANIFEST.json").read_text())


_rewrite = helpers.rewrite_signed
_edit_json = helpers.edit_signed_json


def _load_refused(folder, secret, match):
    """Load into a fresh state: a CheckpointError, no file outside the folder opened, nothing changed."""
    ctx, state = _setup()
    before = testing.parameters(state)
    optimizer_before = json.dumps(repr(state.optimizer.state_dict()))
    with _opened() as opened, pytest.raises(CheckpointError, match=match) as raised:
        load_checkpoint(ctx, folder, state)
    outside = [p for p in opened if not Path(p).resolve().is_relative_to(folder.resolve())]
    assert [] == [p for p in outside if Path(p).resolve() == secret.resolve() or "secret" in p]
    assert "631" not in str(raised.value)  # nothing about the outside file is told
    testing.assert_params_equal(before, state)
    assert optimizer_before == json.dumps(repr(state.optimizer.state_dict()))
    return raised.value


# --- paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["../../secret.bin", "/etc/hostname", "sub/state.json", "state.json/..", "MANIFEST.json", "evil.py"]
)
def test_a_manifest_entry_of_another_kind(ckpt, name):
    """A manifest entry that is not a plain file of the format is refused."""
    folder, secret = ckpt
    doc = _manifest(folder)
    doc["files"][name] = {"size": 631, "sha256": "0" * 64}
    (folder / "MANIFEST.json").write_text(json.dumps(doc))

    _load_refused(folder, secret, r"is not a file of the checkpoint format")


@pytest.mark.parametrize("ranks", [0, 2, "1", True, 1.0])
def test_ranks_that_do_not_divide_the_processes(ckpt, ranks):
    """``data_ranks`` (how many shares of the data the saving processes read; fewer than the processes under tensor
    parallelism) decides how a load deals the data position out: it must be a positive int dividing ``world_size``."""
    folder, secret = ckpt
    doc = _manifest(folder)
    assert (doc["world_size"], doc["data_ranks"]) == (1, 1)
    doc["data_ranks"] = ranks
    (folder / "MANIFEST.json").write_text(json.dumps(doc))

    _load_refused(folder, secret, r"'data_ranks' must be a positive int that divides 'world_size' \(1\)")


@pytest.mark.parametrize("name", ["model.safetensors", "state.json", "rank-0.safetensors"])
def test_a_symlink_to_an_outside_file_is_refused(ckpt, name):
    """A file that is a symlink to an outside file is refused not followed."""
    folder, secret = ckpt
    (folder / name).unlink()
    os.symlink(secret, folder / name)
    doc = _manifest(folder)
    doc["files"][name] = {"size": 631, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    (folder / "MANIFEST.json").write_text(json.dumps(doc))

    _load_refused(folder, secret, rf"file {name} is a symbolic link")


def test_a_symlinked_manifest_or_folder(ckpt, tmp_path):
    """A manifest that is a symlink or a checkpoint folder that is one is refused."""
    folder, secret = ckpt
    linked = tmp_path / "root" / "ckpt-9999999999"
    os.symlink(folder, linked)
    assert latest_checkpoint(tmp_path / "root") == folder  # a linked folder is not a checkpoint
    _load_refused(linked, secret, "not a checkpoint folder")

    (folder / "MANIFEST.json").rename(tmp_path / "manifest.json")
    os.symlink(tmp_path / "manifest.json", folder / "MANIFEST.json")
    _load_refused(folder, secret, "MANIFEST.json is not a regular file")


# --- what the files say ----------------------------------------------------------------------


def test_a_crafted_dtype_name_is_refused(ckpt):
    folder, secret = ckpt

    def plant(doc):
        doc["optimizer"]["__dict__"].append([{"__dtype__": "seed"}, 1])

    _edit_json(folder, "state.json", plant)
    _load_refused(folder, secret, "unknown dtype 'seed'")


@pytest.mark.parametrize(
    "field,value",
    [
        ("step", float("nan")),
        ("epoch", float("inf")),
        ("micro_step", -1),
        ("batch_in_epoch", "3"),
        ("stop", "no"),
        ("stop", {"__record__": "Stop", "fields": {"reason": "x", "finished": "yes"}}),
        ("end_of_epoch", 1),
        ("step", True),
    ],
)
def test_counters_must_be_what_they_are(ckpt, field, value):
    folder, secret = ckpt

    def plant(doc):
        doc["state"][field] = value

    _edit_json(folder, "state.json", plant)
    _load_refused(folder, secret, rf"({field}|counter)")


@pytest.mark.parametrize("finished", [True, False])
def test_a_checkpoint_with_the_older_stop_fields_loads_its_finished_stop(ckpt, finished):
    """Before the stop was one value, state.json held should_stop, finished, stop_reason and final_stop: a finished run's stop
    is carried on from them, as it is from a Stop; another stop is not."""
    folder, secret = ckpt

    def plant(doc):
        doc["state"].pop("stop")
        doc["state"].update(should_stop=True, finished=finished, stop_reason="early_stop:loss", final_stop=False)

    _edit_json(folder, "state.json", plant)
    ctx, state = _setup()
    loaded = load_checkpoint(ctx, folder, state)
    assert loaded.stop == (Stop("early_stop:loss", finished=True) if finished else None)


def test_older_stop_fields_of_the_wrong_kind_are_refused(ckpt):
    folder, secret = ckpt

    def plant(doc):
        doc["state"].pop("stop")
        doc["state"].update(should_stop="yes", stop_reason=3)

    _edit_json(folder, "state.json", plant)
    _load_refused(folder, secret, "stop fields")


@pytest.mark.parametrize(
    "plant,match",
    [
        (
            lambda doc: doc["state"]["extras"]["__dict__"].append(["x", {"__record__": "Unknown", "fields": {}}]),
            "unknown record type",
        ),
        (lambda doc: doc["state"].__setitem__("loss_sum", {"__tensor__": "no.such.key"}), "no.such.key"),
        (lambda doc: doc["state"].__setitem__("history", [[1, 2, "loss"]]), "cannot read"),
        (lambda doc: doc["state"].__setitem__("history", [[1, 2, "loss", "high"]]), "history record"),
        (lambda doc: doc.__setitem__("accelerate", {"step": -5, "gradient_accumulation_steps": 1}), "accelerate.step"),
        (lambda doc: doc["state"].__setitem__("extras", [1, 2]), "extras"),
    ],
)
def test_a_bad_value_anywhere_is_refused_before_anything_changes(ckpt, plant, match):
    folder, secret = ckpt
    _edit_json(folder, "state.json", plant)
    _load_refused(folder, secret, match)


@pytest.mark.parametrize(
    "value,match",
    [
        (-1, "running.started_at"),
        ("2", "running.started_at"),
        (True, "running.started_at"),
        (5, "the running sums start after batch 5, past the epoch's batch 4"),
    ],
)
def test_running_sums_outside_the_epoch(ckpt, value, match):
    """A process's running sums say after which batch of the epoch they start (an epoch resumed on another number of
    processes restarts them): a count no further than the epoch's position (4 batches here), or the load is refused."""
    folder, secret = ckpt
    _edit_json(folder, "rank-0.json", lambda meta: meta["running"].__setitem__("started_at", value))
    _load_refused(folder, secret, match)


def test_a_manifest_that_lists_no_files_verifies_nothing_and_is_refused(ckpt):
    folder, secret = ckpt
    doc = _manifest(folder)
    doc["files"] = {}
    (folder / "MANIFEST.json").write_text(json.dumps(doc))

    _load_refused(folder, secret, r"does not list model.safetensors.*incomplete")


def test_a_manifest_that_omits_a_rank_file_is_refused(ckpt):
    folder, secret = ckpt
    doc = _manifest(folder)
    del doc["files"]["rank-0.json"]
    (folder / "MANIFEST.json").write_text(json.dumps(doc))

    _load_refused(folder, secret, r"does not list rank-0.json")


def test_an_oversized_manifest_and_json_file_are_refused_unread(ckpt):
    folder, secret = ckpt
    big = _manifest(folder)
    big["padding"] = "x" * (1 << 20)
    (folder / "MANIFEST.json").write_text(json.dumps(big))
    _load_refused(folder, secret, r"MANIFEST.json is damaged: \d+ bytes, more than a manifest can be")

    big.pop("padding")
    (folder / "MANIFEST.json").write_text(json.dumps(big))
    _rewrite(folder, "rank-0.json", b'"' + b"x" * (64 << 20) + b'"')
    _load_refused(folder, secret, r"rank-0.json has \d+ bytes, more than the \d+ a trainfold checkpoint writes")


@pytest.mark.parametrize("where", ["MANIFEST.json", "state.json"])
def test_deep_nesting_is_a_checkpoint_error_not_a_recursion_error(ckpt, where):
    folder, secret = ckpt
    deep = b"[" * 100_000 + b"]" * 100_000
    if where == "MANIFEST.json":
        (folder / where).write_bytes(deep)
        _load_refused(folder, secret, "MANIFEST.json is damaged")
    else:
        _rewrite(folder, where, deep)
        _load_refused(folder, secret, "nested too deeply")


def test_a_record_nested_deeply_inside_a_valid_file_is_a_checkpoint_error(ckpt):
    folder, secret = ckpt
    value = {"__tuple__": []}
    for _ in range(100):  # shallow enough for JSON, deeper than any value trainfold writes
        value = {"__tuple__": [value]}

    def plant(doc):
        doc["state"]["extras"]["__dict__"].append(["deep", value])

    _edit_json(folder, "state.json", plant)
    _load_refused(folder, secret, "nested more than 64 levels deep")


# --- the good checkpoint still loads ------------------------------------------------------------


def test_the_untouched_checkpoint_loads_and_opens_only_its_own_files(ckpt):
    folder, _ = ckpt
    ctx, state = _setup()

    with _opened() as opened:
        resumed = load_checkpoint(ctx, folder, state)

    assert 4 == resumed.step
    files = {Path(p).name for p in opened if Path(p).resolve().is_relative_to(folder.resolve())}
    assert {
        "MANIFEST.json",
        "state.json",
        "state.safetensors",
        "model.safetensors",
        "rank-0.json",
        "rank-0.safetensors",
    } == files


def _setup_with_scheduler():
    ctx, state = _setup()
    model = helpers.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return ctx, TrainState.create(ctx, model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2))


@pytest.mark.parametrize(
    "plant,match",
    [
        (lambda doc: doc["scheduler"]["__dict__"].append(["step", 5]), r"scheduler state has keys .*'step'"),
        (
            lambda doc: [kv.__setitem__(1, "soon") for kv in doc["scheduler"]["__dict__"] if kv[0] == "last_epoch"],
            "'last_epoch' is a str",
        ),
        (
            lambda doc: [
                kv.__setitem__(1, "fast")
                for g in doc["optimizer"]["__dict__"]
                if g[0] == "param_groups"
                for group in g[1]
                for kv in group["__dict__"]
                if kv[0] == "lr"
            ],
            "parameter group 'lr' is a str",
        ),
    ],
)
def test_a_scheduler_or_optimizer_state_of_another_shape_is_refused(tmp_path, plant, match):
    """load_state_dict takes any keys (a scheduler's update their __dict__: 'step' would replace the method)."""
    ctx, state = _setup_with_scheduler()
    save_checkpoint(ctx, tmp_path, state)
    folder = latest_checkpoint(tmp_path)
    _edit_json(folder, "state.json", plant)

    ctx, state = _setup_with_scheduler()
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ctx, folder, state)
    assert callable(state.scheduler.scheduler.step) and 0 == state.scheduler.scheduler.last_epoch


# --- sharded checkpoints (torch.distributed.checkpoint's pieces, trainfold's files) ----------


@pytest.fixture
def sharded(tmp_path):
    """A real sharded checkpoint (format 2) of a trained state, an outside file holding a secret, the trained parameters."""
    return _trained_checkpoint(tmp_path, sharded=True)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_sharded_checkpoint_is_read_without_unpickling_anything(sharded, tmp_path, monkeypatch):
    """DCP's own format keeps its metadata in a pickle (.metadata) and tensors in torch.save files: trainfold's
    sharded format keeps JSON and safetensors only. Planted DCP files are never opened, nothing is unpickled."""
    import pickle

    folder, _, trained = sharded
    (folder / ".metadata").write_bytes(pickle.dumps(_Boom()))
    (folder / "__0_0.distcp").write_bytes(pickle.dumps(_Boom()))
    monkeypatch.chdir(tmp_path)
    ctx, state = _setup()

    with _opened() as events:
        loaded = load_checkpoint(ctx, folder, state)

    testing.assert_params_equal(trained, loaded)
    assert [] == [e for e in events if e.startswith("pickle:")]
    assert [] == [e for e in events if e.endswith((".metadata", ".distcp"))]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "shard-0.distcp", "shard-01.safetensors"])
def test_a_sharded_manifest_listing_a_file_of_another_format_is_refused(sharded, name):
    folder, secret, _ = sharded
    doc = _manifest(folder)
    doc["files"][name] = {"size": 631, "sha256": "0" * 64}
    (folder / "MANIFEST.json").write_text(json.dumps(doc))

    _load_refused(folder, secret, r"is not a file of the checkpoint format")


def test_a_missing_shard_is_refused_naming_it(sharded):
    folder, secret, _ = sharded
    (folder / "shard-0.safetensors").unlink()

    _load_refused(folder, secret, r"file shard-0.safetensors is missing")


def test_a_shard_left_out_of_the_manifest_is_an_incomplete_checkpoint(sharded):
    folder, secret, _ = sharded
    doc = _manifest(folder)
    del doc["files"]["shard-0.safetensors"]
    (folder / "MANIFEST.json").write_text(json.dumps(doc))

    _load_refused(folder, secret, r"does not list shard-0.safetensors.*incomplete")


def _first_tensor(doc, prefix="model."):
    return next(k for k in doc["tensors"] if k.startswith(prefix))


def _outside(doc):
    doc["storage"][0][2] = "../secret.bin"


def _uncovered(doc):
    entry = doc["tensors"][_first_tensor(doc)]
    entry["chunks"][0][1][0] -= 1


def _overlapping(doc):
    entry = doc["tensors"][_first_tensor(doc)]
    entry["chunks"].append(entry["chunks"][0])


def _unknown_dtype(doc):
    doc["tensors"][_first_tensor(doc)]["dtype"] = "F128"


def _pickled_value(doc):
    doc["tensors"][_first_tensor(doc)] = {"__reduce__": "os.system"}


@pytest.mark.parametrize(
    "forge,match",
    [
        (_outside, r"stored in '../secret.bin', not a shard file of this checkpoint"),
        (_uncovered, r"the pieces of .* cover \d+ of the \d+ places along its dimension 0"),
        (_overlapping, r"declared in 2 pieces, more than the 1 processes that wrote it"),
        (_unknown_dtype, r"KeyError: 'F128'"),
        (_pickled_value, r"tensors.json does not describe the checkpoint's shards"),
    ],
)
def test_metadata_that_does_not_describe_its_shards_is_refused(sharded, forge, match):
    """tensors.json rewritten and re-signed: every value is checked before a piece is read."""
    folder, secret, _ = sharded

    _edit_json(folder, "tensors.json", forge)

    _load_refused(folder, secret, rf"tensors.json does not describe the checkpoint's shards.*{match}|{match}")


def test_a_tensor_of_another_shape_in_the_metadata_is_another_model(sharded):
    folder, secret, _ = sharded

    def grow(doc):
        name = _first_tensor(doc)
        entry = doc["tensors"][name]
        entry["size"][0] += 1
        entry["chunks"][0][1][0] += 1

    _edit_json(folder, "tensors.json", grow)

    _load_refused(folder, secret, r"is from another model: parameter '0.weight' has shape \(17, 8\) in the checkpoint")


def test_a_shard_without_its_piece(sharded):
    """The metadata says a piece is in shard-0.safetensors under a key the file does not have."""
    folder, secret, _ = sharded
    _edit_json(folder, "tensors.json", lambda doc: doc["storage"][0].__setitem__(3, "nothing@0,0"))

    _load_refused(folder, secret, r"file shard-0.safetensors does not hold the piece of")


# --- pieces, shapes and positions that cost or contradict --------------------------------------------


def _pieces(doc, n):
    """The first tensor (16 x 8) declared as ``n`` pieces along its first dimension... or as n one-element pieces."""
    name = _first_tensor(doc)
    doc["tensors"][name]["chunks"] = [[[i // 8, i % 8], [1, 1]] for i in range(n)]
    doc["storage"] += [[name, [i // 8, i % 8], "shard-0.safetensors", f"{name}@{i}"] for i in range(n)]


def test_a_tensor_in_thousands_of_pieces(sharded):
    """4,000 one-element pieces took 65 s to refuse (a pairwise overlap test); a million fit in a 16 MiB tensors.json."""
    folder, secret, _ = sharded
    _edit_json(folder, "tensors.json", lambda doc: _pieces(doc, 4000))

    _load_refused(
        folder, secret, r"'model.0.weight' is declared in 4000 pieces, more than the 1 processes that wrote it"
    )


def _grid(rows, cols, step_r, step_c):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [
        ChunkStorageMetadata(
            offsets=torch.Size([r, c]), sizes=torch.Size([min(step_r, rows - r), min(step_c, cols - c)])
        )
        for r in range(0, rows, step_r)
        for c in range(0, cols, step_c)
    ]


def test_the_tiling_check_takes_a_large_grid_and_finds_each_fault_in_it():
    """A 2-D mesh's pieces (a grid, the layout DTensor writes): 40,000 pieces checked in one pass, not 8*10^8 pairs."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from trainfold._src.checkpoint.formats.dcp_metadata import check_tiling

    chunks = _grid(400, 300, 2, 3)
    check_tiling("w", [400, 300], chunks)  # a quadratic check would not end within the suite's time

    shifted = chunks[:-1] + [ChunkStorageMetadata(offsets=torch.Size([398, 296]), sizes=torch.Size([2, 3]))]
    with pytest.raises(ValueError, match="do not tile it"):
        check_tiling("w", [400, 300], shifted)  # overlaps its neighbour, leaves a gap
    with pytest.raises(ValueError, match="cover 399 of the 400 places"):
        check_tiling("w", [400, 300], _grid(399, 300, 2, 3))
    with pytest.raises(ValueError, match="overlap"):
        check_tiling("w", [400, 300], chunks + chunks[:1])
    with pytest.raises(
        ValueError, match="do not tile it: 2 pieces for a grid of 4"
    ):  # a diagonal: each axis covered, two cells empty
        check_tiling(
            "w",
            [2, 2],
            [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 1])),
                ChunkStorageMetadata(torch.Size([1, 1]), torch.Size([1, 1])),
            ],
        )
    with pytest.raises(ValueError, match="do not tile it"):  # an L of two pieces
        check_tiling(
            "w",
            [2, 2],
            [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 2])),
                ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([1, 1])),
            ],
        )


@pytest.mark.parametrize("size", [[2**40, 2**40], [10**12], [2**63]])
def test_declared_sizes_no_tensor_can_hold_are_a_checkpoint_error(sharded, size):
    """torch.empty raised RuntimeError for them, outside the all-or-nothing check."""
    folder, secret, _ = sharded

    def huge(doc):
        entry = doc["tensors"]["optim.state.0.weight.momentum_buffer"]
        entry["size"], entry["chunks"] = size, [[[0] * len(size), size]]
        for piece in doc["storage"]:
            if piece[0] == "optim.state.0.weight.momentum_buffer":
                piece[1] = [0] * len(size)

    _edit_json(folder, "tensors.json", huge)

    _load_refused(folder, secret, r"elements, more than any tensor can hold|below 2\*\*62|has shape \(")


def test_an_optimizer_moment_of_another_shape(sharded):
    """momentum of a [16, 8] weight stored as [128] (metadata and piece agreeing): it was loaded, and the next step failed."""
    folder, secret, _ = sharded

    def flatten(doc):
        entry = doc["tensors"]["optim.state.0.weight.momentum_buffer"]
        entry["size"], entry["chunks"] = [128], [[[0], [128]]]
        for piece in doc["storage"]:
            if piece[0] == "optim.state.0.weight.momentum_buffer":
                piece[1] = [0]

    _edit_json(folder, "tensors.json", flatten)

    _load_refused(
        folder,
        secret,
        r"optimizer state 'state.0.weight.momentum_buffer' has shape \(128,\), which no optimizer keeps "
        r"for the parameter '0.weight' of shape \(16, 8\)",
    )


def test_a_position_past_the_end_of_the_epoch_is_refused_with_both_numbers(tmp_path):
    """batch_in_epoch 10^6 in a checkpoint of a 4-batch epoch was accepted: the epoch then ended at once."""
    from trainfold import max_steps, run_epoch

    ctx, state = _setup()
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(16), batch_size=4, shuffle=True)
    )
    save_checkpoint(ctx, tmp_path, run_epoch(ctx, max_steps(2)(make_step(ctx, helpers.ce_loss)), dl, state))
    folder = latest_checkpoint(tmp_path)
    _edit_json(folder, "state.json", lambda doc: doc["state"].__setitem__("batch_in_epoch", 10**6))

    ctx, fresh = _setup()
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(16), batch_size=4, shuffle=True)
    )
    resumed = load_checkpoint(ctx, folder, fresh)
    with pytest.raises(
        ValueError, match=r"stopped at batch 1000000 of its epoch, but this loader has 4 batches per epoch"
    ):
        run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, resumed)


# --- what was verified is what is used ---------------------------------------------------------


def test_a_file_rewritten_after_it_was_read(ckpt):
    """The storage's read is a copy: the bytes hashed are the bytes decoded, whatever happens to the file after.

    A private map of the file (what trainfold read through before) shows a rewrite in place made after the hash was
    taken (a weight of 1234.5 reached the model), and dies of SIGBUS when the file is truncated under it.
    """
    from trainfold._src.checkpoint.storage import checkpoint_at

    folder, _ = ckpt
    path = folder / "model.safetensors"
    original = path.read_bytes()
    buf = checkpoint_at(folder).read("model.safetensors", len(original))

    with open(path, "r+b") as f:  # overwritten in place, same size
        f.write(bytes(255 - b for b in original))
    assert original == bytes(buf)
    os.truncate(path, 0)  # truncated under the reader
    assert original == bytes(buf)


def test_a_file_removed_while_read(ckpt):
    """A reader racing keep_last: the documented CheckpointError, never FileNotFoundError or a signal."""
    from trainfold._src.checkpoint.storage import checkpoint_at

    folder, secret = ckpt
    size = (folder / "model.safetensors").stat().st_size
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors (is missing|was removed)"):
        checkpoint_at(folder).read("model.safetensors", size)
    with pytest.raises(CheckpointError, match="model.safetensors was removed while the checkpoint was read"):
        list(checkpoint_at(folder).chunks("model.safetensors"))
    (folder / "state.safetensors").write_bytes((folder / "state.safetensors").read_bytes()[:-8])
    _load_refused(folder, secret, "is missing|has .* bytes, the manifest says")


def _forge_piece(folder, change):
    """Replace the first model tensor's piece in shard-0.safetensors by ``change(piece)`` and re-sign the file."""
    from safetensors.torch import load_file, save_file

    pieces = load_file(folder / "shard-0.safetensors")
    key = next(k for k, v in pieces.items() if k.startswith("model.") and v.dim() == 2)
    pieces[key] = change(pieces[key]).contiguous()
    save_file(pieces, folder / "scratch.safetensors")
    _rewrite(folder, "shard-0.safetensors", (folder / "scratch.safetensors").read_bytes())
    (folder / "scratch.safetensors").unlink()


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda t: t[: t.shape[0] // 2],
            r"\(a torch.float32 piece of shape \(8, 8\); declared: torch.float32 of shape \(16, 8\)\)",
        ),
        (
            lambda t: t.half(),
            r"\(a torch.float16 piece of shape \(16, 8\); declared: torch.float32 of shape \(16, 8\)\)",
        ),
    ],
)
def test_a_piece_of_another_shape_or_dtype(sharded, tmp_path, capsys, change, match):
    """Export reads what a load reads, through the same check: it wrote a piece holding half the declared rows into the
    first half and left the rest uninitialised (values of 1e37), and converted a float16 piece silently, exiting 0."""
    from trainfold import checkpoint_weights, cli

    folder, secret, _ = sharded
    _forge_piece(folder, change)

    _load_refused(folder, secret, "file shard-0.safetensors does not hold the piece of .*" + match)
    with pytest.raises(CheckpointError, match=match):
        checkpoint_weights(folder)
    assert 2 == cli.main(["export", str(folder), str(tmp_path / "out.safetensors")])
    assert "does not hold the piece" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


def test_a_billion_processes_are_refused_at_once(ckpt):
    """1 KB that declares world_size 10^9: refused by what the folder lists, in bounded time and memory."""
    import resource
    import time

    folder, secret = ckpt
    doc = _manifest(folder)
    doc["world_size"] = doc["data_ranks"] = 10**9
    (folder / "MANIFEST.json").write_text(json.dumps(doc))

    before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.process_time()
    _load_refused(folder, secret, "does not list rank-1.json, a file every checkpoint of 1000000000 process")
    with pytest.raises(CheckpointError, match="a file every checkpoint of 1000000000 process"):
        verify_checkpoint(folder)
    assert time.process_time() - started < 5  # a list of 10^9 names takes minutes and tens of GB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


@pytest.mark.parametrize("where", ["frozen_param_fragments", "module"])
def test_deepspeed_values_that_are_no_tensors_are_refused(where):
    """DeepSpeed engine files that parse (plain values pass the restricted unpickler) but hold a string where a weight
    belongs are refused naming the value, never handed to an export or a diff as a weight."""
    from trainfold._src.checkpoint.formats import engine_files

    model = {
        "module": {"b": torch.zeros(2)},
        "buffer_names": ["b"],
        "param_shapes": [{"w": [2]}],
        "frozen_param_fragments": {},
    }
    model[where]["odd"] = "not a tensor"
    if where == "module":
        model["buffer_names"].append("odd")
    parsed = {
        "zero_pp_rank_0_mp_rank_00_model_states.pt": model,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": {
            "optimizer_state_dict": {"zero_stage": 2, "single_partition_of_fp32_groups": [torch.zeros(2)]}
        },
    }

    with pytest.raises(ValueError, match=r"holds 'odd' as a str, not a tensor"):
        engine_files.merged_weights(parsed)


def test_a_stream_source_that_is_no_mapping_is_refused(tmp_path):
    """A rank file's recorded stream source must be a mapping (what source_identity records): a forged list is refused at
    the load, before anything changes."""
    from trainfold import max_steps, run_epoch

    ctx, state = _setup()
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(16), batch_size=4, shuffle=True)
    )
    save_checkpoint(ctx, tmp_path, run_epoch(ctx, max_steps(2)(make_step(ctx, helpers.ce_loss)), dl, state))
    folder = latest_checkpoint(tmp_path)
    _edit_json(folder, "rank-0.json", lambda doc: doc.__setitem__("source", ["part-0.jsonl"]))

    ctx, fresh = _setup()
    with pytest.raises(CheckpointError, match=r"the stream's source is .*not a mapping"):
        load_checkpoint(ctx, folder, fresh)
