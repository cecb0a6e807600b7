"""PEFT models: LoRA adapters checkpointed alone, resumed bit for bit, exported as PEFT loads them and merged with their base.

Needs peft and transformers (installed beside DeepSpeed: `make test-deepspeed` runs this file); skipped where they are not.
"""

import json

import pytest
import torch
from accelerate import Accelerator

import helpers

from trainfold import (
    CheckpointError,
    Context,
    TrainState,
    checkpoint_every,
    cli,
    export_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
)

peft = pytest.importorskip("peft")
# transformers 5 deprecates what peft 0.21 still calls
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
transformers = pytest.importorskip("transformers")


def _mlp_base(seed=0):
    """The issue's base: 0.4M parameters in three Linear layers."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 600), torch.nn.ReLU(), torch.nn.Linear(600, 600), torch.nn.ReLU(), torch.nn.Linear(600, 3)
    )


def _lora_mlp(seed=0, targets=("0", "2"), modules_to_save=("4",)):
    model = peft.get_peft_model(
        _mlp_base(seed),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), modules_to_save=list(modules_to_save)),
    )
    torch.manual_seed(1)
    with torch.no_grad():  # LoRA's B starts at zero: give it values, so that a merge changes something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _setup(model):
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    state = TrainState.create(
        ctx, model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    )
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(helpers.classification_data(96), batch_size=8, shuffle=True)
    )
    return ctx, state, dl


def _train(ctx, state, dl, wrap=lambda step: step, epochs=2):
    return helpers.train(ctx, state, dl, wrap, epochs=epochs)


def test_a_peft_checkpoint_is_small_and_exact(tmp_path, isolated):
    """A PEFT LoRA model's checkpoint is under a tenth of a full one and resumes bit for bit."""
    expected = _train(*_setup(_lora_mlp()))
    ctx, state, dl = _setup(_lora_mlp())
    state = _train(ctx, state, dl, checkpoint_every(ctx, 10, tmp_path / "root"))
    testing.assert_params_equal(expected, state)
    save_checkpoint(ctx, tmp_path / "full", state, save_frozen=True)
    ctx.close()
    newest = latest_checkpoint(tmp_path / "root")
    assert helpers.checkpoint_bytes(newest) <= 0.10 * helpers.checkpoint_bytes(latest_checkpoint(tmp_path / "full"))
    doc = json.loads((newest / "state.json").read_text())
    assert {"adapter": "default"} == {k: doc["peft"][k] for k in ("adapter",)} and 4 == doc["peft"]["config"]["r"]
    assert ["0", "2"] == doc["peft"]["config"]["target_modules"]

    first = list_checkpoints(tmp_path / "root")[0]  # update 10, in the first epoch
    ctx, fresh, dl = _setup(_lora_mlp())
    resumed = _train(ctx, load_checkpoint(ctx, first, fresh), dl)
    testing.assert_params_equal(expected, resumed)


def test_a_resume_with_other_adapters_is_refused_before_anything_changes(tmp_path, isolated):
    ctx, state, dl = _setup(_lora_mlp())
    save_checkpoint(ctx, tmp_path, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
    ctx.close()
    ctx, other, _ = _setup(_lora_mlp(targets=("0", "4"), modules_to_save=()))
    before = {n: t.clone() for n, t in other.model.state_dict().items()}
    with pytest.raises(
        CheckpointError,
        match=r"'base_model\.model\.2\.base_layer\.bias' is frozen in the checkpoint's model and not a "
        r"parameter of this one. Resume with the model as it was saved: the same base and adapters",
    ):
        load_checkpoint(ctx, tmp_path, other)
    assert all(torch.equal(before[n], t) for n, t in other.model.state_dict().items())


def _gpt2_base(folder):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    return model


def _lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


@pytest.fixture
def trained_gpt2(tmp_path, isolated):
    """A tiny GPT-2 (built locally, its lm_head tied to its embedding) under LoRA on its attention's Conv1D layers
    (fan_in_fan_out), trained 6 updates and checkpointed; its base saved with save_pretrained beside it."""
    base = _gpt2_base(tmp_path / "base")
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    )
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    state = TrainState.create(
        ctx, model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    )
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(
            torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(1)), batch_size=8
        )
    )
    state = run_epoch(ctx, make_step(ctx, _lm_loss), dl, state)
    save_checkpoint(ctx, tmp_path / "root", state)
    ctx.close()
    model.eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return tmp_path, model, ids, logits


def test_exported_adapters_are_peft_s(trained_gpt2, capsys):
    """Exported adapters are what PEFT saves and load with PEFT to the same logits."""
    tmp, model, ids, logits = trained_gpt2
    assert 0 == cli.main(["export", str(tmp / "root"), str(tmp / "adapters")])
    assert "PeftModel.from_pretrained(base_model, OUT) loads them" in capsys.readouterr().out

    from safetensors.torch import load_file

    written = load_file(str(tmp / "adapters" / "adapter_model.safetensors"))
    own = peft.get_peft_model_state_dict(model)
    assert own.keys() == written.keys() and all(torch.equal(own[k], written[k]) for k in own)

    fresh = transformers.GPT2LMHeadModel.from_pretrained(tmp / "base")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp / "adapters").eval()
    with torch.no_grad():
        assert torch.equal(logits, loaded(input_ids=ids).logits)


def test_adapters_export_to_a_file_name(trained_gpt2, capsys):
    """PEFT adapters export as a folder (weights and config): a target named like a file is refused, nothing written."""
    tmp, *_ = trained_gpt2
    assert 2 == cli.main(["export", str(tmp / "root"), str(tmp / "adapters.safetensors")])
    assert "name a folder" in capsys.readouterr().err
    assert not (tmp / "adapters.safetensors").exists()


def test_merged_with_its_base_the_model_gives_the_adapter_models_logits(trained_gpt2, capsys):
    tmp, model, ids, logits = trained_gpt2
    assert 0 == cli.main(
        [
            "export",
            str(tmp / "root"),
            str(tmp / "merged"),
            "--base",
            str(tmp / "base"),
            "--transformers",
            str(tmp / "base"),
        ]
    )
    capsys.readouterr()
    merged = transformers.GPT2LMHeadModel.from_pretrained(tmp / "merged").eval()
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5)
    peft_merged = model.merge_and_unload().state_dict()  # peft's own merge: the same weights, to rounding
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(tensor, peft_merged[name], rtol=1e-6, atol=1e-6)


def test_a_merge_onto_another_base_is_refused_naming_the_tensor(trained_gpt2, tmp_path_factory):
    tmp, *_ = trained_gpt2
    other = tmp_path_factory.mktemp("other")
    torch.manual_seed(5)
    transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(tmp / "base")).save_pretrained(other)
    with pytest.raises(
        CheckpointError, match=r"has other values than the frozen 'base_model\.model\.transformer\.wte\.weight'"
    ):
        export_checkpoint(tmp / "root", tmp / "merged.safetensors", base=other)
    assert not (tmp / "merged.safetensors").exists()


@pytest.mark.parametrize(
    "config",
    [
        {"modules_to_save": ["4"]},
        {"use_rslora": True},
        {"bias": "all"},
        {"bias": "lora_only"},
    ],
    ids=["modules_to_save", "rslora", "bias-all", "bias-lora-only"],
)
def test_merged_export_of_lora_variants(config, tmp_path, isolated):
    """A merged export (--base) equals PEFT's own merge_and_unload() for each LoRA variant a user configures: a module
    to save (its trained copy, not the untrained original), rsLoRA's scale (alpha / sqrt(r)), trained biases."""
    from safetensors.torch import save_file

    from trainfold import export_checkpoint
    from trainfold._src.checkpoint.safetensors import parse

    base = _mlp_base()
    save_file({n: t.contiguous() for n, t in base.state_dict().items()}, str(tmp_path / "base.safetensors"))
    model = peft.get_peft_model(_mlp_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], **config))
    ctx, state, dl = _setup(model)
    state = save_checkpoint(ctx, tmp_path / "root", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
    ctx.close()

    export_checkpoint(tmp_path / "root", tmp_path / "merged.safetensors", base=tmp_path / "base.safetensors")
    merged = parse(bytearray((tmp_path / "merged.safetensors").read_bytes()))
    expected = model.merge_and_unload().state_dict()

    assert sorted(expected) == sorted(merged)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
