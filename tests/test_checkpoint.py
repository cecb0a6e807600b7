"""Checkpoints: resume from any position ends bit-identical; damage is refused; nothing runs on load."""

import json
import pickle
import shutil

import helpers
import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    CheckpointError,
    Context,
    TrainState,
    checkpoint_every,
    ema,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    log_every,
    loop,
    make_step,
    max_steps,
    nan_guard,
    run_epoch,
    save_checkpoint,
    testing,
    verify_checkpoint,
)


_setup = helpers.noisy_setup  # Accelerate's state reset, a dropout MLP, SGD momentum, StepLR, a shuffled noisy loader


EPOCHS = 3


def _train(ctx, state, dl, step_wrapper=lambda s: s):
    step = step_wrapper(ema(0.9)(make_step(ctx, helpers.ce_loss, clip_grad_norm=1.0)))
    return loop(run_epoch(ctx, step, dl), max_epochs=EPOCHS)(state)


def _save_every_batch(ctx, root):
    def wrap(step):
        def saving(state, batch):
            return save_checkpoint(ctx, root, step(state, batch))

        return saving

    return wrap


def test_resume_from_every_batch_position_is_bit_exact(tmp_path):
    """6 batches an epoch (the last short), accumulation 3: resume after any of the 18 batches."""
    expected = _train(*_setup())
    ctx, state, dl = _setup()
    with_saves = _train(ctx, state, dl, _save_every_batch(ctx, tmp_path))
    testing.assert_params_equal(expected, with_saves)  # saving changes nothing
    checkpoints = list_checkpoints(tmp_path)
    assert 18 == len(checkpoints)

    for ckpt in checkpoints:
        ctx, state, dl = _setup(seed=123)  # other initial weights: everything must come from the checkpoint
        resumed = _train(ctx, load_checkpoint(ctx, ckpt, state), dl)

        testing.assert_params_equal(expected, resumed)
        testing.assert_params_equal(
            testing.parameters(expected.extras["ema"].model), testing.parameters(resumed.extras["ema"].model)
        )
        assert expected.history == resumed.history, ckpt.name
        assert (expected.step, expected.micro_step, expected.epoch) == (resumed.step, resumed.micro_step, resumed.epoch)


def test_resume_keeps_transformer_states(tmp_path):
    ctx, state, dl = _setup(ga=1)
    step = checkpoint_every(ctx, 4, tmp_path)(log_every(ctx, 2)(make_step(ctx, helpers.ce_loss, stages=[nan_guard(3)])))
    state = run_epoch(ctx, step, dl, state)

    ctx, fresh, dl = _setup(ga=1)
    resumed = load_checkpoint(ctx, tmp_path, fresh)

    assert 4 == resumed.step
    assert {"nan_guard", "log_every"} <= set(resumed.extras)
    assert 0 == resumed.extras["nan_guard"].skipped
    assert resumed.extras["log_every"].step == 4


def test_resume_keeps_the_nan_guards_unread_flags(tmp_path):
    """Flags written on the device and not yet read survive a checkpoint: the resumed run reads them
    with the next ones and stops where the uninterrupted run stops (3 skipped in a row, read at the 6th update)."""
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = helpers.ce_loss(model, batch)
        return loss * float("nan") if calls["n"] in (2, 4, 5, 6) else loss

    def step(ctx):
        return make_step(ctx, loss_fn, stages=[nan_guard(3, check_every=3)])

    counts = lambda s: (s.step, s.should_stop, s.extras["nan_guard"].skipped, s.extras["nan_guard"].consecutive)
    ctx, state, dl = _setup(ga=1)
    uninterrupted = run_epoch(ctx, step(ctx), dl, state)
    assert (6, True, 4, 3) == counts(uninterrupted)

    calls["n"] = 0
    ctx, state, dl = _setup(ga=1)
    saved = run_epoch(ctx, step(ctx), dl, state, max_batches=4)
    assert 1 == saved.extras["nan_guard"].unread  # read at the 3rd update; the 4th's flag is on the device
    save_checkpoint(ctx, tmp_path, saved)
    ctx, fresh, dl = _setup(ga=1)
    resumed = load_checkpoint(ctx, tmp_path, fresh)
    assert 1 == resumed.extras["nan_guard"].unread
    assert (4, False, 2, 1) == counts(resumed)
    final = run_epoch(ctx, step(ctx), dl, resumed)

    assert counts(uninterrupted) == counts(final)
    testing.assert_params_equal(uninterrupted, final)


def test_checkpoint_every_and_keep_last(tmp_path):
    ctx, state, dl = _setup(ga=1)
    step = checkpoint_every(ctx, 2, tmp_path, keep_last=2)(make_step(ctx, helpers.ce_loss))

    loop(run_epoch(ctx, step, dl), max_epochs=2)(state)

    names = [p.name for p in list_checkpoints(tmp_path)]
    assert ["ckpt-0000000010", "ckpt-0000000012"] == names
    assert latest_checkpoint(tmp_path).name == "ckpt-0000000012"
    assert [".trainfold.lock"] == [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".")
    ]  # no debris, only the lock


def _one_checkpoint(tmp_path):
    ctx, state, dl = _setup(ga=1)
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    save_checkpoint(ctx, tmp_path, state)
    return latest_checkpoint(tmp_path)


def _files(ckpt):
    return sorted(p.name for p in ckpt.iterdir() if p.name != "MANIFEST.json")


@pytest.mark.parametrize("damage", ["missing", "truncated", "altered"])
def test_every_kind_of_damage_to_every_file_is_refused(tmp_path, damage):
    ckpt = _one_checkpoint(tmp_path / "good")
    for name in _files(ckpt):
        broken = tmp_path / f"{damage}-{name}"
        shutil.copytree(ckpt, broken)
        f = broken / name
        if damage == "missing":
            f.unlink()
        elif damage == "truncated":
            f.write_bytes(f.read_bytes()[:-7])
        else:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x01
            f.write_bytes(bytes(data))
        ctx, state, _ = _setup(ga=1)
        before = testing.parameters(state)

        with pytest.raises(CheckpointError, match=rf"file {name} (is missing|has \d+ bytes|does not match)"):
            load_checkpoint(ctx, broken, state)
        testing.assert_params_equal(before, state)  # nothing was touched


def test_a_damaged_manifest_and_a_folder_that_is_not_a_checkpoint(tmp_path):
    ckpt = _one_checkpoint(tmp_path / "root")
    (ckpt / "MANIFEST.json").write_text("{not json")
    ctx, state, _ = _setup(ga=1)

    with pytest.raises(CheckpointError, match="MANIFEST.json is damaged"):
        load_checkpoint(ctx, ckpt, state)
    with pytest.raises(CheckpointError, match="neither a trainfold checkpoint nor a folder of checkpoints"):
        load_checkpoint(ctx, tmp_path / "empty", state)
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="has no MANIFEST.json"):
        verify_checkpoint(tmp_path / "other")


def test_swapped_in_pickles_never_run(tmp_path):
    """Even with the manifest rewritten to match, a pickle in place of a file is never unpickled."""
    ckpt = _one_checkpoint(tmp_path / "root")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    for name in _files(ckpt):
        (ckpt / name).write_bytes(pickle.dumps(Evil()))
        import hashlib

        data = (ckpt / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    ctx, state, _ = _setup(ga=1)

    with pytest.raises(CheckpointError):
        load_checkpoint(ctx, ckpt, state)
    assert not marker.exists()


def test_a_checkpoint_of_another_model_names_the_parameter(tmp_path):
    ckpt = _one_checkpoint(tmp_path)
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2))

    with pytest.raises(
        CheckpointError, match=r"parameter '0.weight' has shape \(16, 8\) in the checkpoint and \(32, 8\)"
    ):
        load_checkpoint(ctx, ckpt, state)


def test_a_checkpoint_with_another_optimizer_layout_is_refused(tmp_path):
    ckpt = _one_checkpoint(tmp_path)
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = helpers.mlp(dropout=0.3)
    params = list(model.parameters())
    opt = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1, momentum=0.9)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2))

    with pytest.raises(CheckpointError, match=r"optimizer layout differs.*\[4\], this optimizer \[2, 2\]"):
        load_checkpoint(ctx, ckpt, state)


def test_a_checkpoint_with_other_accumulation_is_refused(tmp_path):
    ckpt = _one_checkpoint(tmp_path)
    ctx, state, _ = _setup(ga=2)

    with pytest.raises(CheckpointError, match="gradient_accumulation_steps=1, this run uses 2"):
        load_checkpoint(ctx, ckpt, state)


def test_a_root_with_only_an_unfinished_save(tmp_path):
    (tmp_path / ".tmp-ckpt-0000000004").mkdir()
    ctx, state, _ = _setup(ga=1)

    with pytest.raises(CheckpointError, match="only unfinished checkpoints"):
        load_checkpoint(ctx, tmp_path, state)


def test_missing_ok_starts_where_no_save_completed(tmp_path, caplog):
    """A script that resumes by itself: the same line starts a fresh run (no root, an empty one, one whose only save
    was cut short) and resumes one, and the log says which."""
    ctx, state, dl = _setup(ga=1)
    (tmp_path / "cut" / ".tmp-ckpt-0000000004").mkdir(parents=True)
    caplog.set_level("INFO", logger="trainfold")
    for root in (tmp_path / "absent", tmp_path / "cut"):
        assert load_checkpoint(ctx, root, state, missing_ok=True) is state
        assert f"no checkpoint under {root} yet: starting at update 0" in caplog.text
    trained = save_checkpoint(ctx, tmp_path / "run", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))

    resumed = load_checkpoint(ctx, tmp_path / "run", missing_ok=True)(state)  # curried: an epoch function too

    assert (resumed.step, resumed.epoch) == (trained.step, 1)
    assert (
        f"resumed from ckpt-{trained.step:010d} at update {trained.step} (epoch 1, batch 0) on 1 process" in caplog.text
    )
    with pytest.raises(CheckpointError, match="neither a trainfold checkpoint nor a folder"):
        load_checkpoint(ctx, tmp_path / "absent", state)  # without it, a root with no checkpoint is an error


def test_a_trainstate_subclass_through_a_checkpoint(tmp_path):
    """Snapshots and checkpoints share one description of a run's state: a subclass's fields are part of it."""
    import attrs

    @attrs.frozen
    class LabelledState(TrainState):
        label: str = "none"
        seen: int = 0

    ctx, base, dl = _setup(ga=1)
    state = attrs.evolve(
        LabelledState(base.model, base.optimizer, base.scheduler, base.accelerator, sums=base.sums),
        label="run-a",
        seen=3,
    )
    save_checkpoint(ctx, tmp_path, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))

    resumed = load_checkpoint(ctx, tmp_path, attrs.evolve(state, label="other", seen=0))

    assert (LabelledState, "run-a", 3, 1) == (type(resumed), resumed.label, resumed.seen, resumed.epoch)


def test_a_users_registered_record_in_extras_is_checkpointed(tmp_path):
    """A step transformer's own attrs record in state.extras round-trips once registered (no pickle)."""
    import attrs

    from trainfold import register_record

    @register_record(name="test_checkpoint.Seen")
    @attrs.frozen
    class Seen:
        batches: int
        last: torch.Tensor = attrs.field(eq=False)

    ctx, state, dl = _setup(ga=1)

    def counting(step):
        def counted(s, batch):
            new = step(s, batch)
            seen = new.extras.get("seen", Seen(0, torch.zeros(())))
            return new.with_extra("seen", Seen(seen.batches + 1, batch[1][:1].float()))

        return counted

    trained = run_epoch(ctx, counting(make_step(ctx, helpers.ce_loss)), dl, state)
    save_checkpoint(ctx, tmp_path, trained)
    resumed = load_checkpoint(ctx, tmp_path, state)

    assert isinstance(resumed.extras["seen"], Seen)
    assert 6 == resumed.extras["seen"].batches
    assert torch.equal(trained.extras["seen"].last, resumed.extras["seen"].last)


def test_an_unregistered_record_in_extras_is_refused_with_the_fix(tmp_path):
    import attrs

    @attrs.frozen
    class Unknown:
        n: int = 0

    ctx, state, _ = _setup(ga=1)
    with pytest.raises(TypeError, match=r"extras.*Unknown.*@trainfold.register_record"):
        save_checkpoint(ctx, tmp_path, state.with_extra("mine", Unknown()))


def test_register_record_refuses_what_it_cannot_keep_apart():
    import attrs

    from trainfold import register_record

    class Plain:
        pass

    @attrs.frozen
    class A:
        n: int = 0

    @attrs.frozen
    class B:
        n: int = 0

    with pytest.raises(TypeError, match="takes an attrs class"):
        register_record(Plain)
    register_record(name="test_checkpoint.Same")(A)
    with pytest.raises(
        ValueError, match="record name 'test_checkpoint.Same' is taken by .*A; register .*B under another name"
    ):
        register_record(name="test_checkpoint.Same")(B)


def test_a_dtype_name_is_looked_up_in_a_fixed_list_not_on_the_torch_module(tmp_path):
    """A crafted {"__dtype__": "seed"} once decoded to torch.seed; now only real dtypes decode."""
    from trainfold._src.checkpoint.codec import decode

    assert torch.bfloat16 is decode({"__dtype__": "bfloat16"}, {})
    for name in ("seed", "load", "__builtins__", ["float32"]):
        with pytest.raises(ValueError, match="unknown dtype"):
            decode({"__dtype__": name}, {})


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool],
)
def test_trainfolds_safetensors_files_are_the_librarys_both_ways(tmp_path, dtype):
    """The streaming writer and the one-buffer reader speak the safetensors library's format."""
    from safetensors.torch import load_file, save_file

    from trainfold._src.base.io import read_into
    from trainfold._src.checkpoint import safetensors as _safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": (torch.randn(3, 5, generator=g) * 10).to(dtype),
        "b": torch.ones((), dtype=dtype),
        "empty": torch.zeros(0, 2, dtype=dtype),
        "mixed": torch.arange(7, dtype=torch.int32),
        "wide": torch.randn(2, generator=g, dtype=torch.float64),
    }

    entry = _safetensors.write(tmp_path / "ours.safetensors", tensors)
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    theirs = _safetensors.parse(
        read_into(tmp_path / "theirs.safetensors", (tmp_path / "theirs.safetensors").stat().st_size)
    )
    ours = load_file(str(tmp_path / "ours.safetensors"))

    assert entry["size"] == (tmp_path / "ours.safetensors").stat().st_size
    for loaded in (ours, theirs):
        assert tensors.keys() == loaded.keys()
        for k, t in tensors.items():
            assert (t.dtype, t.shape) == (loaded[k].dtype, loaded[k].shape) and torch.equal(t, loaded[k])


@pytest.mark.parametrize(
    "header",
    [
        b"{",
        b"[1]",
        b'{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}',
        b'{"x": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 4]}}',
        b'{"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}',
        b'{"x": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}',
        b'{"x": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}}',
        b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [false, true]}}',
        b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}',
        b'{"x": {"dtype": "F32", "shape": [1]}}',
        b'{"x": ["F32", [1], [0, 4]]}',
        b'{"x": {"F32": 0, "12": 0, "08": 0}}',
        b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}',
        b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "y": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}',
    ],
)
def test_the_safetensors_reader_trusts_nothing_in_the_header(header):
    import struct

    from trainfold._src.checkpoint import safetensors as _safetensors

    buf = bytearray(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(_safetensors.FormatError):
        _safetensors.parse(buf)


def test_safetensors_any_key_order():
    """What the safetensors library reads, this reader reads: an entry's keys in any order, and tensors named
    ``dtype``, ``shape`` and ``data_offsets``."""
    import struct

    from safetensors.torch import load

    from trainfold._src.checkpoint import safetensors as _safetensors

    header = (
        b'{"dtype": {"data_offsets": [0, 4], "shape": [1], "dtype": "F32"}, "shape": {"shape": [1], "dtype": "I32", '
        b'"data_offsets": [4, 8]}, "data_offsets": {"dtype": "U8", "shape": [0], "data_offsets": [8, 8]}}'
    )
    header += b" " * (-len(header) % 8)
    data = struct.pack("<Q", len(header)) + header + struct.pack("<fi", 1.5, 7)

    for tensors in (_safetensors.parse(bytearray(data)), load(data)):
        assert {n: t.tolist() for n, t in tensors.items()} == {"dtype": [1.5], "shape": [7], "data_offsets": []}


# --- what a load puts into the model -------------------------------------------------------------


def _resumed_into(tmp_path, fresh_setup):
    """Train 3 epochs; train them again saving at every batch, load the 8th save into ``fresh_setup()``'s state and
    train on to 3: both runs, the loaded state, and where the fresh model's tensors lay before the load."""
    expected = _train(*_setup())
    ctx, state, dl = _setup()
    _train(ctx, state, dl, _save_every_batch(ctx, tmp_path))
    ctx, fresh, dl = fresh_setup()
    before = [p.data_ptr() for p in fresh.model.parameters()]
    loaded = load_checkpoint(ctx, list_checkpoints(tmp_path)[7], fresh)
    return expected, _train(ctx, loaded, dl), loaded, before


def test_a_load_makes_the_verified_bytes_the_models_tensors(tmp_path):
    """A model built on the meta device and given memory by ``to_empty`` holds no values: the load makes the verified
    file buffers its tensors, copying nothing (its own memory is never touched), and the parameters stay the objects
    the optimizer updates; the run goes on bit for bit."""
    expected, resumed, loaded, before = _resumed_into(tmp_path, lambda: _setup(seed=123, empty=True))

    params = list(loaded.model.parameters())
    assert not {p.data_ptr() for p in params} & set(before)
    assert [id(p) for p in loaded.optimizer.param_groups[0]["params"]] == [id(p) for p in params]
    testing.assert_params_equal(expected, resumed)
    assert expected.history == resumed.history


def test_a_model_with_a_load_hook_is_loaded_by_its_hook(tmp_path):
    """A ``load_state_dict`` pre-hook may change what a name loads: such a model's tensors are copied into, as torch
    loads them, and the hook runs."""
    seen = []

    def with_hook():
        ctx, state, dl = _setup(seed=123)
        state.model.register_load_state_dict_pre_hook(lambda module, sd, prefix, *_: seen.append(sorted(sd)))
        return ctx, state, dl

    expected, resumed, loaded, before = _resumed_into(tmp_path, with_hook)

    assert [p.data_ptr() for p in loaded.model.parameters()] == before and seen
    testing.assert_params_equal(expected, resumed)


def test_a_model_on_the_meta_device_is_refused_with_the_fix():
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    with torch.device("meta"):
        model = helpers.mlp()
    with pytest.raises(ValueError, match=r"'0.weight' is on the meta device.*model.to_empty\(device='cpu'\)"):
        TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.close()


# --- digests ---------------------------------------------------------------------------------------


def test_xxh3_digests_and_sha256_still_loads(tmp_path):
    """XXH3-128 (a fast digest: the manifest guards against damage, not forgery) for new checkpoints; a checkpoint
    whose manifest records SHA-256 (every checkpoint before 0.3) verifies and loads as before."""
    import hashlib
    import json

    import xxhash

    from trainfold import latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    trained = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
    save_checkpoint(ctx, tmp_path, trained)
    folder = latest_checkpoint(tmp_path)
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()} == entry
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # as 0.2 wrote it
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))

    verify_checkpoint(folder)
    ctx, fresh, _, _ = testing.tiny_setup(seed=1)
    testing.assert_params_equal(trained, load_checkpoint(ctx, folder, fresh))


@pytest.mark.parametrize(
    "entry",
    [
        {"size": 1},
        {"size": 1, "md5": "0" * 32},
        {"size": 1, "xxh3_128": "0" * 64},
        {"size": 1, "xxh3_128": "0" * 32, "sha256": "0" * 64},
    ],
)
def test_a_manifest_entry_without_exactly_one_known_digest_is_refused(entry, tmp_path):
    import json

    from trainfold import CheckpointError, latest_checkpoint, save_checkpoint, verify_checkpoint

    ctx, state, _, _ = testing.tiny_setup(seed=0)
    save_checkpoint(ctx, tmp_path, state)
    folder = latest_checkpoint(tmp_path)
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    manifest["files"]["state.json"] = entry
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))

    with pytest.raises(
        CheckpointError, match=r"the entry of state.json needs a size and one digest \(xxh3_128 or sha256\)"
    ):
        verify_checkpoint(folder)


def _rewritten_as_before(ckpt):
    """Every safetensors file of ``ckpt`` as trainfold wrote it before it aligned its tensors (largest elements first,
    the header padded to 8 bytes), and the manifest signed anew: tensors at the file offsets such a checkpoint has."""
    import hashlib
    import struct

    from trainfold._src.base.io import read_into
    from trainfold._src.checkpoint.safetensors import DTYPES, parse

    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    for name in manifest["files"]:
        if not name.endswith(".safetensors"):
            continue
        tensors = {k: v.clone() for k, v in parse(read_into(ckpt / name, manifest["files"][name]["size"])).items()}
        order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
        header, offset = {}, 0
        for n in order:
            header[n] = {
                "dtype": DTYPES[tensors[n].dtype],
                "shape": list(tensors[n].shape),
                "data_offsets": [offset, offset + tensors[n].nbytes],
            }
            offset += tensors[n].nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        data = (
            struct.pack("<Q", len(head))
            + head
            + b"".join(tensors[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n in order)
        )
        (ckpt / name).write_bytes(data)
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("sharded,written_by", [(False, "now"), (True, "now"), (False, "before"), (True, "before")])
def test_what_a_load_hands_to_the_run_is_aligned_as_torch_allocates(tmp_path, sharded, written_by):
    """A checkpoint's tensors are views into the file's buffer (read once, not copied), at the offsets the file gives
    them. What goes on living in the run (the batch the loader had read ahead, the optimizer's moments) must sit where
    torch would have allocated it, 64-byte aligned: CPU kernels sum in another order at another alignment, so a batch
    at offset 56 made a resumed run's gradients differ from the uninterrupted run's in the last bits (2-process DDP,
    tests/test_signals.py). Files trainfold writes now put most tensors there already; those it wrote before did not,
    and what the run keeps of them is copied there."""
    ctx, state, dl = _setup(ga=1)
    state = run_epoch(
        ctx, max_steps(3)(make_step(ctx, helpers.ce_loss)), dl, state
    )  # stopped mid-epoch: a batch read ahead
    save_checkpoint(ctx, tmp_path, state, sharded=sharded)
    if written_by == "before":
        _rewritten_as_before(latest_checkpoint(tmp_path))
    ctx.close()
    ctx, fresh, _ = _setup(ga=1, seed=123)
    loaded = load_checkpoint(ctx, tmp_path, fresh)

    has, batch = loaded.cursor.position.read_ahead
    moments = [
        v
        for per in loaded.optimizer.optimizer.state.values()
        for v in per.values()
        if isinstance(v, torch.Tensor) and v.ndim
    ]
    assert has and moments
    assert [t.data_ptr() % 64 for t in [*batch, *moments]] == [0] * (len(batch) + len(moments))
    ctx.close()


def test_written_tensors_are_aligned(tmp_path):
    """trainfold's safetensors writer starts the data at a 64-byte boundary and puts first the tensors whose sizes are
    multiples of 64: read back from the mapped file, each is a view at such a boundary (a verified load copies nothing
    it need not); the others are aligned to their element size; the safetensors library reads the file as written."""
    import os

    from safetensors.torch import load_file

    from trainfold._src.base.io import read_into
    from trainfold._src.checkpoint import safetensors as ours

    tensors = {
        "odd": torch.randn(3),
        "big": torch.randn(64, 64),
        "ids": torch.arange(5),
        "half": torch.randn(16).half(),
        "wide": torch.randn(10, 32),
        "byte": torch.ones(7, dtype=torch.uint8),
    }
    path = tmp_path / "t.safetensors"
    ours.write(path, tensors)
    buf = read_into(path, os.path.getsize(path))
    parsed = ours.parse(buf)

    assert {k: torch.equal(v, tensors[k]) for k, v in load_file(str(path)).items()} == dict.fromkeys(tensors, True)
    assert all(torch.equal(parsed[k], tensors[k]) for k in tensors)
    start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    for name in ("big", "wide", "half"):  # sizes 16384, 1280, 32... bytes: "half" is 32, not a multiple of 64
        t = parsed[name]
        inside = start <= t.data_ptr() < start + len(buf)
        assert inside, name  # a view into the file's buffer, not a copy
        assert (t.data_ptr() % 64 == 0) == (t.nbytes % 64 == 0), name
    assert all(parsed[k].data_ptr() % parsed[k].element_size() == 0 for k in parsed)


def test_a_resume_reads_one_consumed_batch_again(tmp_path):
    """Without workers, the consumed batches are passed over by the sampler's order: of them only one batch is loaded again
    (the template of the batches' container types), however far the epoch had gone; a stream reads them all again
    (tests/test_streams.py)."""

    class Counting(torch.utils.data.Dataset):
        def __init__(self):
            self.data, self.reads = helpers.classification_data(64), []

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            self.reads.append(i)
            return self.data[i]

    def setup():
        testing.reset_accelerate_state()
        torch.manual_seed(0)
        ctx = Context(accelerator=Accelerator(cpu=True))
        model = helpers.mlp()
        data = Counting()
        (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
        return ctx, TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)), dl, data

    ctx, state, dl, _ = setup()
    run_epoch(ctx, checkpoint_every(ctx, 10, tmp_path)(max_steps(10)(make_step(ctx, helpers.ce_loss))), dl, state)
    ctx.close()
    ctx, state, dl, data = setup()
    resumed = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, load_checkpoint(ctx, tmp_path, state))

    assert (1, 16) == (resumed.epoch, resumed.step)
    # one consumed batch again, then the 5 after the batch read ahead (which the checkpoint holds): 6 batches of 4
    assert 6 * 4 == len(data.reads)
    ctx.close()


_FRESH_LOAD = """
import sys

import torch
from accelerate import Accelerator

import trainfold as tf

torch.manual_seed(0)
ctx = tf.Context(accelerator=Accelerator(cpu=True))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
state = tf.TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
state = tf.load_checkpoint(ctx, sys.argv[1], state)  # before anything that would import log_every's module
print(sorted((name, type(value).__name__) for name, value in state.extras.items()))
"""


@pytest.mark.multiprocess
def test_load_before_building_the_step(tmp_path):
    """A script that loads its checkpoint right after ``import trainfold`` (before it builds the step that made the
    records) reads every record trainfold's own transformers and epoch functions keep."""
    import subprocess
    import sys

    from toolz import compose

    from trainfold import early_stop, stop_when

    ctx, state, dl = _setup(ga=1)
    step = compose(ema(0.9), log_every(ctx, 2), stop_when(ctx, lambda s: s.last_loss > 1e9, check_every=4))(
        make_step(ctx, helpers.ce_loss, stages=[nan_guard(3)])
    )
    trained = compose(early_stop("train_loss"), run_epoch(ctx, step, dl))(state)
    save_checkpoint(ctx, tmp_path, trained)
    saved = sorted((name, type(value).__name__) for name, value in trained.extras.items())
    assert {"EmaState", "LogState", "StopWhenState", "NanGuardState", "PatienceState"} <= {kind for _, kind in saved}

    run = subprocess.run(
        [sys.executable, "-c", _FRESH_LOAD, str(tmp_path)], capture_output=True, text=True, timeout=helpers.scaled(120)
    )

    assert 0 == run.returncode, run.stderr[-2000:]
    assert repr(saved) == run.stdout.strip()


def test_every_record_trainfold_registers_has_a_home():
    """Each record type trainfold's own modules register is in the table a load consults when its module is not
    imported yet, under the module that defines it: a load never meets its own library's record as unknown."""
    import importlib
    import pkgutil

    import trainfold
    from trainfold._src.base import records

    for module in pkgutil.walk_packages(trainfold.__path__, "trainfold."):
        if module.name != "trainfold.__main__":  # the command line, which runs on import
            importlib.import_module(module.name)
    own = {name: cls.__module__ for name, cls in records.RECORDS.items() if cls.__module__.startswith("trainfold.")}

    assert own == records.HOMES


def test_an_infinite_buffer_is_not_divergence(tmp_path, caplog):
    """A causal mask registered as a buffer holds -inf by design: checkpoints of a healthy run with it are finite
    (judged by what training changes), are not reported as diverged, and keep_last prunes them as usual."""
    ctx, state, dl = _setup(ga=1)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    assert torch.isinf(mask).any()
    state.model.register_buffer("mask", mask)
    step = checkpoint_every(ctx, 1, tmp_path, keep_last=2)(make_step(ctx, helpers.ce_loss))

    with caplog.at_level("ERROR", logger="trainfold"):
        run_epoch(ctx, step, dl, state)

    assert "non-finite" not in caplog.text
    assert ["ckpt-0000000005", "ckpt-0000000006"] == [p.name for p in list_checkpoints(tmp_path)]
    assert all(json.loads((p / "MANIFEST.json").read_text())["finite"] for p in list_checkpoints(tmp_path))


def test_nan_guard_checkpoint_after_a_fold(tmp_path):
    """A checkpoint taken right after the running sums folded (batch 64 of an epoch) under nan_guard, whose folded sums
    hold its "nonfinite" count beside the loss's aux names, resumes to the uninterrupted run's end."""
    from trainfold._src.base.running_sums import FOLD_EVERY

    def setup():
        testing.reset_accelerate_state()
        return testing.tiny_setup(seed=0, n=2 * (FOLD_EVERY + 6), batch_size=2)

    def step(ctx, loss_fn):
        return make_step(ctx, loss_fn, stages=[nan_guard(3)])

    ctx, state, loader, loss_fn = setup()
    expected = run_epoch(ctx, step(ctx, loss_fn), loader, state)
    ctx, state, loader, loss_fn = setup()
    run_epoch(
        ctx, checkpoint_every(ctx, FOLD_EVERY, tmp_path)(step(ctx, loss_fn)), loader, state, max_batches=FOLD_EVERY
    )
    assert [f"ckpt-{FOLD_EVERY:010d}"] == [p.name for p in list_checkpoints(tmp_path)]

    ctx, fresh, loader, loss_fn = setup()
    resumed = run_epoch(ctx, step(ctx, loss_fn), loader, load_checkpoint(ctx, tmp_path, fresh))

    testing.assert_params_equal(expected, resumed)
    assert expected.history == resumed.history


def test_at_end_composed_first_is_warned(tmp_path):
    """``compose(loop(...), saving.at_end)`` runs at_end on the untrained state, before the loop: the first step of the
    loop says so, naming the order to compose in."""
    from toolz import compose

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    saving = checkpoint_every(ctx, 3, tmp_path)
    wrong = compose(loop(run_epoch(ctx, saving(make_step(ctx, loss_fn)), loader), max_epochs=2), saving.at_end)

    with pytest.warns(
        UserWarning, match=r"at_end ran before its step trained anything.*compose\(saving\.at_end, loop\(\.\.\.\)\)"
    ):
        wrong(state)
    ctx.close()


def test_a_forgotten_at_end_is_said_at_close(tmp_path, caplog):
    """A run whose last updates checkpoint_every did not reach (no at_end after the loop) says at close how many
    updates a restart would train again; with at_end, nothing is said."""

    def run(with_end):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        saving = checkpoint_every(ctx, 3, tmp_path / str(with_end))
        train = loop(run_epoch(ctx, saving(make_step(ctx, loss_fn)), loader), max_epochs=2)  # 8 updates: saved at 3, 6
        (compose(saving.at_end, train) if with_end else train)(state)
        with caplog.at_level("WARNING", logger="trainfold"):
            ctx.close()

    from toolz import compose

    run(with_end=False)
    assert "the run's last 2 update(s), after update 6, are not in a checkpoint" in caplog.text
    assert "compose(saving.at_end, loop(...))" in caplog.text
    caplog.clear()
    run(with_end=True)
    assert "not in a checkpoint" not in caplog.text


@pytest.mark.parametrize(
    "saved_with,loaded_with,match",
    [
        (True, False, r"has a scheduler but the state has none"),
        (False, True, r"has no scheduler but the state has one"),
    ],
)
@pytest.mark.parametrize("built_on_both", [True, False])
def test_a_checkpoint_and_a_state_must_agree_on_having_a_scheduler(
    saved_with, loaded_with, match, built_on_both, tmp_path
):
    """A scheduler adds initial_lr to the optimizer's parameter groups: built on one side only (a scheduler added between
    runs), the groups differ too, and the scheduler, the cause, is what the error names."""

    def build(with_scheduler):
        testing.reset_accelerate_state()
        ctx = Context(accelerator=Accelerator(cpu=True))
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1) if built_on_both or with_scheduler else None
        return ctx, TrainState.create(ctx, model=model, optimizer=opt, scheduler=scheduler if with_scheduler else None)

    ctx, saved = build(saved_with)
    save_checkpoint(ctx, tmp_path, saved)
    ctx, state = build(loaded_with)

    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ctx, tmp_path, state)


@pytest.mark.parametrize("size", [1, 4096, 4097, 3 * 4096 + 5])
def test_a_file_read_in_parts_is_read_whole(size, tmp_path, monkeypatch):
    """A file larger than ``READ_PART`` is read in parts on two threads: every byte in its place, each part given to
    ``seen`` in order (a hasher's update: the digest is the whole file's), and a file that is not the size it was
    measured at is refused (parts of 4 KiB here, of 8 MiB in a run)."""
    import os

    import xxhash

    from trainfold._src.base import io

    monkeypatch.setattr(io, "READ_PART", 4096)
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    hasher, parts = xxhash.xxh3_128(), []

    def seen(part):
        hasher.update(part)
        parts.append(len(part))

    assert bytes(io.read_into(tmp_path / "f", size, seen)) == data
    assert hasher.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert parts == [min(4096, size - start) for start in range(0, size, 4096)]
    with pytest.raises(ValueError, match="another size"):
        io.read_into(tmp_path / "f", size + 1)
