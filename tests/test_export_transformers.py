"""`trainfold export PATH OUT --transformers CONFIG_DIR`: a checkpoint as a save_pretrained folder that from_pretrained loads.

Needs transformers (installed beside DeepSpeed: `make test-deepspeed` runs this file); skipped where it is not.
"""

import json
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator

import helpers

from trainfold import (
    CheckpointError,
    Context,
    TrainState,
    export_checkpoint,
    make_step,
    max_steps,
    run_epoch,
    save_checkpoint,
)

transformers = pytest.importorskip("transformers")


def _gpt2(n_embd=16):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=n_embd, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


@pytest.fixture
def trained(tmp_path, isolated):
    """A tiny GPT-2 (lm_head tied to the embedding) trained 3 updates with a composed step and checkpointed; the folder it
    started from (save_pretrained's: config, its untrained weights, a tokenizer-like file) beside it."""
    model = _gpt2()
    model.save_pretrained(tmp_path / "config")
    (tmp_path / "config" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))
    ctx = Context(accelerator=Accelerator(cpu=True))
    loader = torch.utils.data.DataLoader(
        torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(1)), batch_size=4
    )
    (loader,) = ctx.prepare_loaders(loader)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    state = run_epoch(ctx, max_steps(3)(make_step(ctx, _lm_loss)), loader)(state)
    save_checkpoint(ctx, tmp_path / "root", state)
    return tmp_path, {n: t.detach().clone() for n, t in state.model.state_dict().items()}


def test_export_loads_with_from_pretrained(trained):
    """A checkpoint exports as a folder from pretrained loads with its ties."""
    tmp, want = trained

    out = export_checkpoint(tmp / "root", tmp / "hf", transformers_config=tmp / "config")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)

    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(".hf")]  # the staging folder was renamed into place


def test_another_models_config_is_refused(trained):
    """A config of another model is refused naming the shapes and nothing is written."""
    tmp, _ = trained
    _gpt2(n_embd=32).save_pretrained(tmp / "other")

    with pytest.raises(
        CheckpointError, match=r"do not fit .*other's model \(GPT2LMHeadModel\).* in the checkpoint and .* in the model"
    ):
        export_checkpoint(tmp / "root", tmp / "hf", transformers_config=tmp / "other")
    assert not (tmp / "hf").exists()
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(".hf")]


@pytest.mark.parametrize("architectures", [["pipeline"], [7], ["PretrainedConfig"], "GPT2LMHeadModel"])
def test_architectures_that_name_no_model(trained, architectures):
    """config.json's "architectures" must name a transformers model class: a function, a number, a config class or a
    bare string is refused with the fix, nothing written."""
    tmp, _ = trained
    config = json.loads((tmp / "config" / "config.json").read_text())
    (tmp / "odd").mkdir()
    (tmp / "odd" / "config.json").write_text(json.dumps({**config, "architectures": architectures}))

    with pytest.raises(CheckpointError, match=r"names no model class transformers has .*set \"architectures\""):
        export_checkpoint(tmp / "root", tmp / "hf", transformers_config=tmp / "odd")
    assert not (tmp / "hf").exists()


def test_the_command_writes_the_folder(trained):
    """The command writes the folder and refuses a folder without config in one line."""
    tmp, _ = trained
    run = lambda *argv: subprocess.run(
        [sys.executable, "-m", "trainfold", "export", *argv],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(300),
    )

    done = run(str(tmp / "root"), str(tmp / "hf"), "--transformers", str(tmp / "config"), "--json")
    again = run(str(tmp / "root"), str(tmp / "hf"), "--transformers", str(tmp / "config"))
    (tmp / "empty").mkdir()
    bare = run(str(tmp / "root"), str(tmp / "hf2"), "--transformers", str(tmp / "empty"))

    assert 0 == done.returncode, done.stderr
    assert json.loads(done.stdout)["tensors"] >= 1
    assert (2, 1) == (again.returncode, len(again.stderr.strip().splitlines()))
    assert "exists" in again.stderr
    assert 2 == bare.returncode and "has no config.json" in bare.stderr and "Traceback" not in bare.stderr


def test_weights_the_configs_model_lacks_are_refused_by_name_never_dropped(tmp_path, isolated):
    """An RLHF-style model: GPT-2 plus a value head. Exported as the config's GPT2LMHeadModel, the head would be lost
    silently: refused, naming it, nothing written."""
    lm = _gpt2()
    lm.save_pretrained(tmp_path / "config")

    class WithValueHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer, self.lm_head = lm.transformer, lm.lm_head  # GPT2LMHeadModel's names
            self.value_head = torch.nn.Linear(16, 1)

    model = WithValueHead()
    ctx = Context(accelerator=Accelerator(cpu=True))
    save_checkpoint(
        ctx,
        tmp_path / "root",
        TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
    )
    ctx.close()

    with pytest.raises(CheckpointError, match=r"do not fit .*: unexpected \['value_head.bias', 'value_head.weight'\]"):
        export_checkpoint(tmp_path / "root", tmp_path / "hf", transformers_config=tmp_path / "config")
    assert not (tmp_path / "hf").exists()
