"""Token-count-correct accumulation: k micro-batches of different lengths equal one big batch."""

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from trainfold import Context, TrainState, make_step, testing

V, D = 11, 6


def _lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(V, D), torch.nn.Linear(D, V))


def _sequences():
    """Seven sequences of lengths 2..7, as (tokens, labels) with -100 padding."""
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, V, (n,), generator=g) for n in (7, 2, 5, 3, 6, 4, 2)]


def _pad(seqs, length):
    x = torch.zeros(len(seqs), length, dtype=torch.long)
    y = torch.full((len(seqs), length), -100)
    for i, s in enumerate(seqs):
        x[i, : len(s) - 1] = s[:-1]
        y[i, : len(s) - 1] = s[1:]
    return x, y


def summed_loss(model, batch):
    x, y = batch
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    return loss, {"tokens": (y != -100).sum()}


def mean_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)


def _train(ga, loss_fn, batches, **kw):
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=ga))
    model = _lm()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    step = make_step(ctx, loss_fn, **kw)
    return testing.run_steps(step, state, batches)


def test_token_normalized_accumulation_equals_one_big_batch():
    seqs = _sequences()
    micro = [_pad(seqs[:3], 6), _pad(seqs[3:5], 5), _pad(seqs[5:], 3)]  # different lengths and paddings

    big = _train(1, mean_loss, [_pad(seqs, 6)])
    tokens = _train(3, summed_loss, micro, normalize="tokens")
    naive = _train(3, mean_loss, micro)

    assert 1 == big.step == tokens.step == naive.step
    testing.assert_params_equal(big, tokens, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):  # the mean of per-batch means is not the same gradient
        testing.assert_params_equal(big, naive, rtol=1e-3, atol=1e-4)


def test_token_mode_resets_the_group_count_after_each_update():
    seqs = _sequences()
    micro = [_pad(seqs[:3], 6), _pad(seqs[3:5], 5), _pad(seqs[5:], 3)] * 2

    state = _train(3, summed_loss, micro, normalize="tokens")

    assert 2 == state.step and "tokens" not in state.extras


def test_token_mode_needs_the_token_count():
    with pytest.raises(ValueError, match=r"\{'tokens': n\}"):
        _train(1, mean_loss, [_pad(_sequences(), 6)], normalize="tokens")
    with pytest.raises(ValueError, match="normalize must be 'mean' or 'tokens'"):
        _train(1, mean_loss, [], normalize="sum")
