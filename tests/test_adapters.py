"""Adapter checkpoints: a model with frozen parameters saves what trains, records its base by fingerprint, and resumes
only onto that base, bit for bit."""

import json

import helpers
import pytest
import torch

from trainfold import (
    CheckpointError,
    checkpoint_every,
    export_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    loop,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
)

EPOCHS = 3  # 8 batches an epoch


def _train(ctx, state, dl, wrap=lambda step: step):
    return helpers.train(ctx, state, dl, wrap, epochs=EPOCHS)


def _frozen(state):
    return {n: p.detach().clone() for n, p in state.model.named_parameters() if not p.requires_grad}


def _state_json(ckpt):
    return json.loads((ckpt / "state.json").read_text())


def test_an_adapter_checkpoint_holds_what_trains_and_the_bases_fingerprint(tmp_path):
    ctx, state, dl = helpers.adapter_setup()
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    adapters = save_checkpoint(ctx, tmp_path / "adapters", state)
    full = save_checkpoint(ctx, tmp_path / "full", state, save_frozen=True)
    del adapters, full

    ckpt, whole = latest_checkpoint(tmp_path / "adapters"), latest_checkpoint(tmp_path / "full")
    model = state.model
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    buffers = [n for n, _ in model.named_buffers()]
    header = json.loads(
        (ckpt / "model.safetensors").read_bytes()[
            8 : 8 + int.from_bytes((ckpt / "model.safetensors").read_bytes()[:8], "little")
        ]
    )
    assert sorted(trainable + buffers) == sorted(
        k for k in header if k != "__metadata__"
    )  # the batch-norm statistics too

    recorded = _state_json(ckpt)["frozen"]
    assert frozen == [entry["name"] for entry in recorded]
    weight = dict(model.named_parameters())["2.base.weight"]
    entry = next(e for e in recorded if e["name"] == "2.base.weight")
    assert {"shape": [640, 640], "dtype": "float32"} == {"shape": entry["shape"], "dtype": entry["dtype"]}
    from trainfold._src.checkpoint import digest, safetensors

    assert digest.of(safetensors.raw(weight)) == entry["xxh3_128"]
    assert "frozen" not in _state_json(whole)

    size, full_size = helpers.checkpoint_bytes(ckpt), helpers.checkpoint_bytes(whole)
    assert size <= 0.10 * full_size, (size, full_size)  # 2.4% of the parameters train: 7% of a full checkpoint's bytes


def test_adapter_resume_from_any_update(tmp_path):
    """An adapter run resumed from any update ends bit for bit as the uninterrupted run."""
    expected = _train(*helpers.adapter_setup())
    ctx, state, dl = helpers.adapter_setup()
    saved = _train(ctx, state, dl, checkpoint_every(ctx, 5, tmp_path))
    testing.assert_params_equal(expected, saved)
    checkpoints = list_checkpoints(tmp_path)
    assert [f"ckpt-{n:010d}" for n in (5, 10, 15, 20)] == [c.name for c in checkpoints]

    for ckpt in checkpoints:
        ctx, state, dl = helpers.adapter_setup(adapter_seed=7)  # other adapters: they must come from the checkpoint
        base = _frozen(state)
        resumed = _train(ctx, load_checkpoint(ctx, ckpt, state), dl)
        testing.assert_params_equal(expected, resumed)
        assert all(
            torch.equal(base[n], p) for n, p in resumed.model.named_parameters() if n in base
        )  # the base untouched
        assert torch.equal(expected.model[3].running_mean, resumed.model[3].running_mean)
        assert expected.history == resumed.history


def _one_adapter_checkpoint(tmp_path):
    ctx, state, dl = helpers.adapter_setup()
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    save_checkpoint(ctx, tmp_path, state)
    ctx.close()
    return latest_checkpoint(tmp_path)


def _load_refused(ctx, ckpt, state, match):
    before = {n: t.clone() for n, t in state.model.state_dict().items()}
    moments = {k: v.clone() for k, v in state.optimizer.state_dict()["state"].items()}
    with pytest.raises(CheckpointError, match=match) as refused:
        load_checkpoint(ctx, ckpt, state)
    assert all(torch.equal(before[n], t) for n, t in state.model.state_dict().items()), (
        "a refused load changed the model"
    )
    assert moments == state.optimizer.state_dict()["state"]
    return str(refused.value)


def test_another_base_is_refused_naming_a_tensor(tmp_path):
    """Another base is refused naming the first frozen tensor that differs."""
    ckpt = _one_adapter_checkpoint(tmp_path)
    ctx, state, _ = helpers.adapter_setup(base_seed=3)
    message = _load_refused(
        ctx, ckpt, state, r"trained on another base: the frozen parameter '0.base.weight' \(float32, shape \(640, 8\)\)"
    )
    assert "Load the base the run started from" in message


def test_a_base_changed_in_place_by_one_ulp_is_refused(tmp_path):
    ckpt = _one_adapter_checkpoint(tmp_path)
    ctx, state, _ = helpers.adapter_setup()
    with torch.no_grad():
        w = state.model[5].base.weight
        w[2, 7] = torch.nextafter(w[2, 7], torch.tensor(float("inf")))
    _load_refused(ctx, ckpt, state, r"the frozen parameter '5.base.weight'")


def test_a_base_changed_in_a_run_is_hashed_again(tmp_path):
    """The digest is remembered with the tensor's version counter: a change in place between two saves is seen."""
    ctx, state, dl = helpers.adapter_setup()
    step = make_step(ctx, helpers.ce_loss)
    state = save_checkpoint(ctx, tmp_path, run_epoch(ctx, step, dl, state))
    first = {e["name"]: e["xxh3_128"] for e in _state_json(latest_checkpoint(tmp_path))["frozen"]}
    with torch.no_grad():
        state.model[2].base.bias.add_(1.0)
    save_checkpoint(ctx, tmp_path, run_epoch(ctx, step, dl, state))
    second = {e["name"]: e["xxh3_128"] for e in _state_json(latest_checkpoint(tmp_path))["frozen"]}
    assert {"2.base.bias"} == {n for n in first if first[n] != second[n]}


@pytest.mark.parametrize("write", ["data", "numpy"])
def test_a_base_changed_around_autograd_is_seen(write, tmp_path):
    """Writes that bump no version counter (through ``p.data``, as PEFT's unmerge does, or a numpy view) are seen too:
    the run's own checkpoint is refused on the changed base, and the next save records the base as it is."""
    ctx, state, dl = helpers.adapter_setup()
    step = make_step(ctx, helpers.ce_loss)
    state = save_checkpoint(ctx, tmp_path, run_epoch(ctx, step, dl, state))
    saved = latest_checkpoint(tmp_path)
    weight = state.model[5].base.weight
    if write == "data":
        weight.data[2, 7] += 1.0
    else:
        weight.detach().numpy()[2, 7] += 1.0

    with pytest.raises(CheckpointError, match=r"the frozen parameter '5.base.weight'"):
        load_checkpoint(ctx, saved, state)
    save_checkpoint(ctx, tmp_path, run_epoch(ctx, step, dl, state))
    from trainfold._src.checkpoint import digest, safetensors

    newest = {e["name"]: e["xxh3_128"] for e in _state_json(latest_checkpoint(tmp_path))["frozen"]}
    assert digest.of(safetensors.raw(weight.detach())) == newest["5.base.weight"]


def test_a_base_converted_by_to_during_a_run_is_hashed_again(tmp_path):
    """A module's .to() keeps the Parameter and swaps its data (a new version counter at 0): the digest is taken again."""
    ctx, state, dl = helpers.adapter_setup()
    state = save_checkpoint(ctx, tmp_path / "a", state)
    state.model[0].base.to(torch.float64)
    save_checkpoint(ctx, tmp_path / "b", state)
    ctx.close()
    first, second = ({e["name"]: e for e in _state_json(latest_checkpoint(tmp_path / r))["frozen"]} for r in ("a", "b"))
    assert (
        "float64" == second["0.base.weight"]["dtype"]
        and first["0.base.weight"]["xxh3_128"] != second["0.base.weight"]["xxh3_128"]
    )
    from trainfold._src.checkpoint import digest, safetensors

    assert digest.of(safetensors.raw(state.model[0].base.weight)) == second["0.base.weight"]["xxh3_128"]


def test_a_base_on_the_meta_device_is_refused_at_load(tmp_path):
    """A base moved to the meta device is refused at the load before anything changes."""
    ckpt = _one_adapter_checkpoint(tmp_path)
    ctx, state, _ = helpers.adapter_setup()
    state.model[5].base.to("meta")
    with pytest.raises(ValueError, match=r"the frozen parameter '5.base.weight' is on the meta device"):
        load_checkpoint(ctx, ckpt, state)
    assert 0 == state.step and not state.optimizer.state_dict()["state"]


def test_a_base_in_another_dtype_is_refused_naming_both(tmp_path):
    ckpt = _one_adapter_checkpoint(tmp_path)
    ctx, state, _ = helpers.adapter_setup()
    state.model[0].base.to(torch.float64)
    _load_refused(ctx, ckpt, state, r"'0.base.weight' is float32 of shape \(640, 8\); in this model it is float64")


def test_a_parameter_frozen_on_one_side_only_is_refused_with_how_to_resume(tmp_path):
    ckpt = _one_adapter_checkpoint(tmp_path)
    ctx, state, _ = helpers.adapter_setup()
    state.model[5].base.bias.requires_grad_(True)
    message = _load_refused(ctx, ckpt, state, r"'5.base.bias' is frozen when it was saved and trainable in this model")
    assert "frozen as it was (a run that unfreezes parameters resumes" in message


def test_a_run_that_unfreezes_a_layer_resumes_from_before_and_after_it(tmp_path):
    """Unfreezing mid-run: a checkpoint after it holds the unfrozen layer (trainable then); one before it records it."""

    def build(unfrozen):
        ctx, state, dl = helpers.adapter_setup()
        if unfrozen:
            state.model[5].base.requires_grad_(True)
            state.optimizer.add_param_group({"params": list(state.model[5].base.parameters()), "lr": 1e-3})
        return ctx, state, dl

    ctx, state, dl = build(False)
    state = save_checkpoint(ctx, tmp_path / "before", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
    state.model[5].base.requires_grad_(True)
    state.optimizer.add_param_group({"params": list(state.model[5].base.parameters()), "lr": 1e-3})
    after = save_checkpoint(ctx, tmp_path / "after", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
    ctx.close()
    assert "5.base.weight" not in {e["name"] for e in _state_json(latest_checkpoint(tmp_path / "after"))["frozen"]}

    ctx, fresh, dl = build(True)
    resumed = load_checkpoint(ctx, tmp_path / "after", fresh)
    testing.assert_params_equal(after, resumed)
    ctx.close()
    ctx, fresh, dl = build(False)
    assert 8 == load_checkpoint(ctx, tmp_path / "before", fresh).step
    ctx.close()
    ctx, frozen_again, _ = build(
        False
    )  # the checkpoint after the unfreezing, onto the model before it: refused by name
    _load_refused(
        ctx, tmp_path / "after", frozen_again, r"'5.base.bias' is frozen in this model and not in the checkpoint's"
    )


@pytest.mark.parametrize("forge", ["digest", "shape", "missing field", "not a list", "twice"])
def test_a_forged_fingerprint_is_refused(forge, tmp_path):
    """A damaged or forged fingerprint is refused before anything changes."""
    ckpt = _one_adapter_checkpoint(tmp_path)

    def change(doc):
        entries = doc["frozen"]
        if forge == "digest":  # a well-formed digest of other bytes: the base no longer matches
            entries[0]["xxh3_128"] = "0" * 32
        elif forge == "shape":
            entries[0]["shape"] = [-1, 8]
        elif forge == "missing field":
            del entries[1]["dtype"]
        elif forge == "not a list":
            doc["frozen"] = {"0.base.weight": entries[0]}
        else:
            entries.append(dict(entries[0]))

    helpers.edit_signed_json(ckpt, "state.json", change)
    ctx, state, _ = helpers.adapter_setup()
    _load_refused(
        ctx, ckpt, state, "trained on another base" if forge == "digest" else "a value this trainfold cannot read"
    )


def test_a_base_on_the_meta_device_cannot_be_fingerprinted_and_says_how(tmp_path):
    ctx, state, dl = helpers.adapter_setup()
    state.model[2].base.to("meta")
    with pytest.raises(
        ValueError, match=r"the frozen parameter '2.base.weight' is on the meta device: its weights were never loaded"
    ):
        save_checkpoint(ctx, tmp_path, state)
    assert latest_checkpoint(tmp_path) is None


def test_a_full_checkpoint_of_an_adapter_model_loads_onto_any_base(tmp_path):
    """``save_frozen=True`` holds the frozen parameters: a load puts them back and checks nothing of the base."""
    ctx, state, dl = helpers.adapter_setup()
    state = save_checkpoint(ctx, tmp_path, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state), save_frozen=True)
    ctx.close()
    ctx, other, _ = helpers.adapter_setup(base_seed=3)
    testing.assert_params_equal(state, load_checkpoint(ctx, tmp_path, other))


def test_checkpoint_every_takes_save_frozen_and_refuses_a_non_bool(tmp_path):
    ctx, state, dl = helpers.adapter_setup()
    with pytest.raises(TypeError, match="save_frozen must be True or False"):
        checkpoint_every(ctx, 4, tmp_path, save_frozen="yes")
    run_epoch(ctx, checkpoint_every(ctx, 4, tmp_path, save_frozen=True)(make_step(ctx, helpers.ce_loss)), dl, state)
    assert "frozen" not in _state_json(latest_checkpoint(tmp_path))


def _adapter_run(engine, root, *, stop_after=None, resume=False, epochs=2, load_from=None):
    """An adapter run on this process (one of several, or alone), saving every 2 updates; its parameters whole at the
    start and at the end (FSDP2's shards gathered), by name. ``load_from``: the checkpoint to resume from (else ``root``'s newest)."""
    import warnings

    from accelerate import Accelerator

    from trainfold import max_steps

    acc = helpers.fsdp2_accelerator() if engine == "fsdp2" else Accelerator(cpu=True)
    ctx, state, dl = helpers.adapter_setup(accelerator=acc, adapter_seed=7 if resume else 1)
    if resume:
        with warnings.catch_warnings():  # on another number of processes: the epoch's running train sums restart empty
            warnings.filterwarnings("ignore", message=".*running train sums")
            state = load_checkpoint(ctx, load_from or root, state)
    at_start = _whole(state)
    step = make_step(ctx, helpers.ce_loss)
    if stop_after is not None:
        step = max_steps(stop_after)(step)
    with warnings.catch_warnings():  # on another number of processes: the global batch changed
        warnings.filterwarnings("ignore", message=".*global batch")
        state = loop(run_epoch(ctx, checkpoint_every(ctx, 2, root)(step), dl), max_epochs=epochs)(state)
    at_end = _whole(state)
    ctx.close()
    return at_start, at_end, state.step


def _whole(state):
    model = state.accelerator.unwrap_model(state.model)
    return {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for n, t in model.state_dict().items()
    }


def _on(nprocs, *args, **kwargs):
    return helpers.on_processes(nprocs, _adapter_run, *args, **kwargs)


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_process_adapter_resume(engine, tmp_path):
    """Two processes save sharded adapter checkpoints (each its own pieces of the adapters); a run stopped after 3 updates
    and resumed on two ends with the uninterrupted run's parameters, bit for bit, every adapter tensor counted; the
    same checkpoint resumes on one process with the adapters and the base exactly as they stopped (2 -> 1)."""
    (_, expected, steps), _ = _on(2, engine, str(tmp_path / "whole"))
    (_, stopped, at), _ = _on(2, engine, str(tmp_path / "run"), stop_after=3)
    assert (8, 3) == (steps, at)  # 4 updates an epoch (64 samples, 2 processes of batches of 8): stopped mid-epoch

    ckpt = latest_checkpoint(tmp_path / "run")
    saved = json.loads((ckpt / "tensors.json").read_text())
    trainable = {f"{i}.{ab}" for i in (0, 2, 5) for ab in ("a", "b")}
    model_tensors = {k.removeprefix("model.") for k in saved["tensors"] if k.startswith("model.")}
    assert trainable | {"3.running_mean", "3.running_var", "3.num_batches_tracked"} == model_tensors  # no frozen piece
    assert {f"{i}.base.{wb}" for i in (0, 2, 5) for wb in ("weight", "bias")} | {"3.weight", "3.bias"} == {
        e["name"] for e in _state_json(ckpt)["frozen"]
    }

    (started, resumed, _), _ = _on(2, engine, str(tmp_path / "run"), resume=True)
    assert ckpt != latest_checkpoint(tmp_path / "run")
    for name in stopped:
        assert torch.equal(stopped[name], started[name]), name
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name

    ((alone, _, _),) = _on(
        1, "ddp", str(tmp_path / "alone"), resume=True, epochs=1, load_from=str(ckpt)
    )  # the epoch's rest, alone
    for name in stopped:
        if not name.startswith("3.running") and name != "3.num_batches_tracked":
            assert torch.equal(stopped[name], alone[name]), name


def test_inspect_shows_counts_and_the_base_digest(tmp_path, capsys):
    """`trainfold inspect` shows trainable and frozen counts and one digest of the base."""
    from trainfold import cli

    ckpt = _one_adapter_checkpoint(tmp_path / "a")
    ctx, state, dl = helpers.adapter_setup(adapter_seed=5)  # the same base, other adapters: the same base digest
    save_checkpoint(ctx, tmp_path / "b", state)
    ctx.close()
    docs = []
    for where in (ckpt, tmp_path / "b"):
        assert 0 == cli.main(["inspect", str(where), "--json"])
        docs.append(json.loads(capsys.readouterr().out))
    model = helpers.lora_mlp()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert {"trainable": trainable, "frozen": frozen} == docs[0]["parameters"] == {"trainable": 10284, "frozen": 419203}
    assert {"tensors": 8, "values": frozen} == {k: docs[0]["frozen"][k] for k in ("tensors", "values")}
    assert docs[0]["frozen"]["base"] == docs[1]["frozen"]["base"]

    assert 0 == cli.main(["inspect", str(ckpt)])
    text = capsys.readouterr().out
    assert "parameters: 10,284 trainable, 419,203 frozen" in text
    assert (
        f"adapter checkpoint: 8 frozen tensor(s) (419,203 values) not held, recorded by fingerprint; base {docs[0]['frozen']['base']}"
        in text
    )


def test_inspect_tied_frozen_weight(tmp_path, capsys):
    """A frozen weight tied under two names (an LM head tied to its embedding) is one parameter, recorded by fingerprint
    under each name: inspect says so where its two counts differ."""
    from accelerate import Accelerator

    from trainfold import Context, TrainState, cli

    testing.reset_accelerate_state()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2), torch.nn.Linear(4, 4, bias=False)
    )
    model[2].weight = model[0].weight  # tied
    model[0].weight.requires_grad_(False)
    ctx = Context(accelerator=Accelerator(cpu=True))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model[1].parameters(), lr=0.1))
    save_checkpoint(ctx, tmp_path, state)
    ctx.close()

    assert 0 == cli.main(["inspect", str(tmp_path)])
    text = capsys.readouterr().out

    assert "parameters: 10 trainable, 16 frozen" in text
    assert (
        "2 frozen tensor(s) (32 values, one fingerprint per name: a weight tied under several names counts under each)"
        in text
    )


def test_inspect_of_a_whole_checkpoint(tmp_path, capsys):
    """`trainfold inspect` of a checkpoint that holds every parameter says no adapters."""
    from trainfold import cli

    ctx, state, dl = helpers.adapter_setup()
    save_checkpoint(ctx, tmp_path, state, save_frozen=True)
    ctx.close()
    assert 0 == cli.main(["inspect", str(tmp_path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["frozen"] is None and 419203 == doc["parameters"]["frozen"]


def _base_file(tmp_path, state, names_of=lambda n: n):
    """The frozen tensors of ``state``'s model as one safetensors file (what a pretrained base's file holds)."""
    from safetensors.torch import save_file

    path = tmp_path / "base.safetensors"
    save_file(
        {names_of(n): p.detach().contiguous() for n, p in state.model.named_parameters() if not p.requires_grad},
        str(path),
    )
    return path


def test_export_writes_the_adapters_alone(tmp_path, capsys):
    """Export of an adapter checkpoint writes the adapters alone and says so."""
    from trainfold import cli
    from trainfold._src.checkpoint.safetensors import parse

    ctx, state, dl = helpers.adapter_setup()
    state = save_checkpoint(ctx, tmp_path / "root", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
    ctx.close()
    assert 0 == cli.main(["export", str(tmp_path / "root"), str(tmp_path / "adapters.safetensors")])
    out = capsys.readouterr().out
    assert "the adapters alone" in out and "--base BASE writes the whole model" in out
    written = parse(bytearray((tmp_path / "adapters.safetensors").read_bytes()))
    expected = {
        n: t
        for n, t in state.model.state_dict().items()
        if n not in {m for m, p in state.model.named_parameters() if not p.requires_grad}
    }
    assert expected.keys() == written.keys() and all(torch.equal(expected[n], written[n]) for n in expected)


@pytest.mark.parametrize("names", ["the model's", "the backbone's own"])
def test_export_with_the_base_writes_the_whole_model_bit_for_bit(names, tmp_path, capsys):
    """The base's tensors are found by name, or else by their values (a backbone saved under its own names)."""
    from trainfold import cli
    from trainfold._src.checkpoint.safetensors import parse

    ctx, state, dl = helpers.adapter_setup()
    base = _base_file(
        tmp_path, state, (lambda n: n) if names == "the model's" else (lambda n: n.replace(".base.", "."))
    )
    state = save_checkpoint(ctx, tmp_path / "root", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
    ctx.close()
    assert 0 == cli.main(["export", str(tmp_path / "root"), str(tmp_path / "model.safetensors"), "--base", str(base)])
    assert "the adapters alone" not in capsys.readouterr().out
    written = parse(bytearray((tmp_path / "model.safetensors").read_bytes()))
    live = state.model.state_dict()
    assert live.keys() == written.keys() and all(torch.equal(live[n], written[n]) for n in live)


def test_export_refuses_a_wrong_base(tmp_path, capsys):
    """Export with another base or a base for a whole checkpoint is refused and writes nothing."""
    from trainfold import cli

    ctx, state, dl = helpers.adapter_setup()
    save_checkpoint(ctx, tmp_path / "root", state)
    save_checkpoint(ctx, tmp_path / "whole", state, save_frozen=True)
    ctx.close()
    ctx, other, _ = helpers.adapter_setup(base_seed=3)
    ctx.close()
    other_base = _base_file(tmp_path, other)

    assert 2 == cli.main(
        ["export", str(tmp_path / "root"), str(tmp_path / "out.safetensors"), "--base", str(other_base)]
    )
    assert (
        "has other values than the frozen '0.base.weight' the run trained on: another base" in capsys.readouterr().err
    )
    assert 2 == cli.main(
        ["export", str(tmp_path / "whole"), str(tmp_path / "out.safetensors"), "--base", str(other_base)]
    )
    assert "holds every parameter of its model: a base is for an adapter checkpoint" in capsys.readouterr().err
    assert 2 == cli.main(["export", str(tmp_path / "root"), str(tmp_path / "out"), "--transformers", str(tmp_path)])
    assert "is an adapter checkpoint: it holds what trained, not its base" in capsys.readouterr().err
    assert 2 == cli.main(
        ["export", str(tmp_path / "root"), str(tmp_path / "out.safetensors"), "--base", str(tmp_path / "nothing")]
    )
    assert "no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "out").exists()


def test_export_base_through_links(tmp_path):
    """A base in a Hugging Face hub cache's layout: the snapshot folder's files are symbolic links into blobs/. The
    export follows the links the user's base is made of and writes the whole model."""
    from trainfold import cli
    from trainfold._src.checkpoint.safetensors import parse

    ctx, state, dl = helpers.adapter_setup()
    blob = _base_file(tmp_path, state).rename(tmp_path / "blob-0123abcd")
    snapshot = tmp_path / "snapshots" / "main"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(f"../../{blob.name}")
    state = save_checkpoint(ctx, tmp_path / "root", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
    ctx.close()

    assert 0 == cli.main(
        ["export", str(tmp_path / "root"), str(tmp_path / "model.safetensors"), "--base", str(snapshot)]
    )
    written = parse(bytearray((tmp_path / "model.safetensors").read_bytes()))
    live = state.model.state_dict()
    assert live.keys() == written.keys() and all(torch.equal(live[n], written[n]) for n in live)


def test_export_base_refuses_a_fifo(tmp_path, capsys):
    """A FIFO named like a weights file in the base folder is refused at once (an open would wait for a writer)."""
    import os
    import threading

    from trainfold import cli

    ctx, state, dl = helpers.adapter_setup()
    base = tmp_path / "base"
    base.mkdir()
    _base_file(tmp_path, state).rename(base / "model.safetensors")
    os.mkfifo(base / "extra.safetensors")
    save_checkpoint(ctx, tmp_path / "root", state)
    ctx.close()
    codes = []
    command = threading.Thread(
        target=lambda: codes.append(
            cli.main(["export", str(tmp_path / "root"), str(tmp_path / "out.safetensors"), "--base", str(base)])
        ),
        daemon=True,
    )
    command.start()
    command.join(timeout=helpers.scaled(60))
    if command.is_alive():  # blocked in the open: let it go before failing
        os.close(os.open(base / "extra.safetensors", os.O_WRONLY | os.O_NONBLOCK))
        command.join(timeout=helpers.scaled(60))
        pytest.fail("export blocked on a FIFO in the base folder")

    assert [2] == codes
    assert "extra.safetensors is not a regular file" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


_PEAK = """
import sys
from trainfold import cli

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":")) * 1024

cli.main(["export", sys.argv[1], sys.argv[2], "--base", sys.argv[4]])  # every module the export imports, imported
open("/proc/self/clear_refs", "w").write("5")  # the peak so far forgotten
before = status("VmRSS")
code = cli.main(["export", sys.argv[1], sys.argv[2], "--base", sys.argv[3]])
print(code, status("VmHWM") - before)
"""


@pytest.mark.multiprocess
def test_export_base_header_in_bounded_memory(tmp_path):
    """A base file whose header names 100,000 empty tensors (8 MB of header) is refused for lacking the frozen one,
    holding a small entry per tensor, not a tensor: under 14 bytes of memory per byte of header (22 when every
    tensor was made)."""
    import struct
    import subprocess
    import sys

    ctx, state, _ = helpers.adapter_setup()
    save_checkpoint(ctx, tmp_path / "root", state)
    ctx.close()
    for count, name in ((100_000, "base.safetensors"), (1, "one.safetensors")):
        header = json.dumps(
            {f"layer.{i}.weight": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
        ).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(header)) + header)
    base = tmp_path / "base.safetensors"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _PEAK,
            str(tmp_path / "root"),
            str(tmp_path / "out.safetensors"),
            str(base),
            str(tmp_path / "one.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(120),
    )

    code, peak = (int(word) for word in run.stdout.split())
    assert code == 2 and "has no tensor '0.base.weight', and none with the values of the frozen" in run.stderr
    assert peak < 14 * base.stat().st_size, f"{peak / base.stat().st_size:.1f} bytes of memory per byte of header"
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_follows_the_umask(umask, tmp_path):
    """An export is as readable as any file its user writes (save_pretrained's 0644 under umask 022), not private."""
    import os

    ctx, state, dl = helpers.adapter_setup()
    save_checkpoint(ctx, tmp_path / "root", state)
    ctx.close()
    old = os.umask(umask)
    try:
        export_checkpoint(tmp_path / "root", tmp_path / "adapters.safetensors")
    finally:
        os.umask(old)

    assert 0o666 & ~umask == (tmp_path / "adapters.safetensors").stat().st_mode & 0o777


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "background"])
def test_ema_of_an_adapter_model_shares_the_base(async_save, tmp_path):
    """ema() holds the model's frozen parameters themselves (the base is not held twice, nor averaged); an adapter
    checkpoint writes the average's trainable part only, and a resume gets the base from the model, bit for bit."""
    from trainfold import ema, ema_model

    def steps(ctx):
        return ema(0.9)(make_step(ctx, helpers.ce_loss))

    ctx, state, dl = helpers.adapter_setup()
    full = run_epoch(ctx, steps(ctx), dl, state)
    average = ema_model(full)
    frozen = {n: p for n, p in full.model.named_parameters() if not p.requires_grad}
    assert all(dict(average.named_parameters())[n] is p for n, p in frozen.items())  # shared, not copied
    save_checkpoint(ctx, tmp_path / "adapters", full, async_save=async_save)
    save_checkpoint(ctx, tmp_path / "full", full, save_frozen=True)
    ctx.wait_for_checkpoints()
    ctx.close()
    ckpt = latest_checkpoint(tmp_path / "adapters")
    assert helpers.checkpoint_bytes(ckpt) <= 0.10 * helpers.checkpoint_bytes(latest_checkpoint(tmp_path / "full"))

    ctx, fresh, dl = helpers.adapter_setup(adapter_seed=7)
    resumed = load_checkpoint(ctx, ckpt, fresh)
    got = ema_model(resumed)
    for n, p in average.named_parameters():
        assert torch.equal(p, dict(got.named_parameters())[n]), n
    assert all(dict(got.named_parameters())[n] is p for n, p in resumed.model.named_parameters() if not p.requires_grad)
    testing.assert_params_equal(full, resumed)


def _ema_resume(root):
    """On this process (one of two): an EMA run of a plain model and of an adapter model, each saved and loaded into a
    fresh state; whether each loaded average equals the saved one, and shares the adapter model's frozen base."""
    from accelerate import Accelerator

    from trainfold import Context, TrainState, ema, ema_model

    out, contexts = [], []
    accelerator = Accelerator(cpu=True)
    for kind in ("plain", "adapters"):
        if kind == "plain":
            ctx = Context(accelerator=accelerator)
            torch.manual_seed(0)
            model = helpers.mlp()
            state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(32), batch_size=4))
        else:
            ctx, state, dl = helpers.adapter_setup(accelerator=accelerator)
        state = run_epoch(ctx, ema(0.9)(make_step(ctx, helpers.ce_loss)), dl, state)
        save_checkpoint(ctx, f"{root}/{kind}", state)
        if kind == "plain":
            torch.manual_seed(1)
            model = helpers.mlp()
            fresh = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        else:
            fresh = helpers.adapter_setup(accelerator=accelerator, adapter_seed=7)[1]
        loaded = load_checkpoint(ctx, f"{root}/{kind}", fresh)
        saved, got = dict(ema_model(state).named_parameters()), dict(ema_model(loaded).named_parameters())
        model = ctx.accelerator.unwrap_model(loaded.model)
        out.append(
            (
                all(torch.equal(saved[n], got[n]) for n in saved),
                all(got[n] is p for n, p in model.named_parameters() if not p.requires_grad),
            )
        )
        contexts.append(ctx)
    for ctx in contexts:
        ctx.close()
    return out


@pytest.mark.multiprocess
def test_an_ema_run_on_two_processes_resumes_its_average(tmp_path):
    """The average is a copy of the user's module, not of DDP's wrapper: a load rebuilt it from the wrapper and refused
    every EMA checkpoint of a run on several processes ("Missing key(s) ... module.0.weight")."""
    for rank in helpers.on_processes(2, _ema_resume, str(tmp_path)):
        assert [(True, True), (True, True)] == rank
