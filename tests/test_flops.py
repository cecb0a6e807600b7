"""The FLOPs ``log_every(watch=True)`` counts at the first step agree with 6 * N * tokens, the figure papers state MFU by,
on a small GPT-2 built locally (transformers: run by ``make test-deepspeed``, where it is installed)."""

import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, log_every, make_step, run_epoch, testing

transformers = pytest.importorskip("transformers")


def test_the_counted_flops_of_a_small_gpt2_agree_with_six_n_per_token():
    """2 blocks of width 128, a vocabulary of 256 tied to the output, sequences of 16: per token, forward and backward
    count 2,555,904 FLOPs against 6 N = 2,577,408 (N without the position embeddings, which no matmul uses), within 1%:
    the attention's matmuls the formula leaves out, less the embedding lookup's, which is no matmul."""
    testing.reset_accelerate_state()
    config = transformers.GPT2Config(
        n_embd=128,
        n_layer=2,
        n_head=2,
        vocab_size=256,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = transformers.GPT2LMHeadModel(config)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(torch.randint(0, 256, (32, 16)), batch_size=8))
    step = log_every(ctx, 4, watch=True)(make_step(ctx, lambda m, ids: m(input_ids=ids, labels=ids).loss))
    report = run_epoch(ctx, step, dl, state).extras["log_every"].values
    ctx.close()

    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    per_token = report["flops"] / (report["samples"] * 16)
    assert 32 == report["samples"]
    assert per_token == pytest.approx(6 * n, rel=0.01)
