"""Token-count-correct accumulation: k micro-batches of different lengths equal one big batch."""

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from trainfold import Context, TrainState, make_step, run_epoch, testing

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


def _token_batches():
    seqs = _sequences()
    return [_pad(seqs[:3], 6), _pad(seqs[3:5], 5), _pad(seqs[5:], 3)]


def _per_token_loss(model, batches):
    """All token losses over all real tokens of ``batches``, by hand (what exp() of makes the perplexity)."""
    with torch.no_grad():
        total = sum(summed_loss(model, b)[0].double() for b in batches)
        tokens = sum(int((b[1] != -100).sum()) for b in batches)
    return (total / tokens).item()


def test_train_loss_is_weighted_by_tokens():
    """The recorded train_loss (and log_every's) is all token losses over all tokens of the epoch."""
    from trainfold import log_every, run_epoch

    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = _lm()
    state = TrainState.create(
        ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0)
    )  # lr 0: fixed weights
    batches = _token_batches()
    expected = _per_token_loss(model, batches)
    per_batch_means = sum(_per_token_loss(model, [b]) for b in batches) / len(batches)
    assert abs(expected - per_batch_means) > 1e-3  # the two differ here: the batches have 12, 6 and 2 tokens

    state = run_epoch(
        ctx, log_every(ctx, 3)(make_step(ctx, summed_loss, normalize="tokens")), ctx.own_shards(batches)[0], state
    )

    assert state.history["train_loss"][-1] == pytest.approx(expected, rel=1e-6)
    assert state.extras["log_every"].values["loss"] == pytest.approx(expected, rel=1e-6)
    assert "loss@weight" not in state.metrics and "train_loss@weight" not in state.metrics


def test_evaluate_weights_by_tokens():
    """Evaluate in token mode weights by tokens and counts every token once."""
    from trainfold import evaluate

    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = _lm()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _pad(_sequences(), 6)
    (loader,) = ctx.prepare_loaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3))

    state = evaluate(ctx, summed_loss, loader, state, normalize="tokens")

    assert state.metrics["eval_loss"] == pytest.approx(_per_token_loss(model, [(x, y)]), rel=1e-6)
    with pytest.raises(ValueError, match="needs loss_fn to return"):
        evaluate(ctx, mean_loss, loader, state, normalize="tokens")
    with pytest.raises(ValueError, match="normalize must be 'mean' or 'tokens'"):
        evaluate(ctx, summed_loss, loader, state, normalize="sum")


def test_the_token_count_is_the_losss_weight_not_a_metric():
    """Token mode sent 'tokens' to the history and the trackers as if it were a metric (train_tokens 6.5)."""
    from trainfold import evaluate

    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = _lm()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    batches = ctx.own_shards(_token_batches())[0]
    state = evaluate(
        ctx,
        summed_loss,
        batches,
        run_epoch(ctx, make_step(ctx, summed_loss, normalize="tokens"), batches, state),
        normalize="tokens",
    )

    assert {"train_loss", "eval_loss"} == set(state.metrics)


def test_nan_guard_masks_a_skipped_batchs_tokens():
    """Under nan_guard a non-finite batch adds neither its loss nor its tokens: train_loss is the per-token loss of the
    finite batches alone (weights fixed, lr 0)."""
    from trainfold import nan_guard

    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = _lm()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    batches = _token_batches()
    seen = []

    def poisoned(model, batch):
        loss, aux = summed_loss(model, batch)
        seen.append(1)
        return (loss * float("nan") if len(seen) == 2 else loss), aux

    state = run_epoch(
        ctx, make_step(ctx, poisoned, normalize="tokens", stages=[nan_guard(3)]), ctx.own_shards(batches)[0], state
    )

    finite = [batches[0], batches[2]]
    assert state.history["train_loss"][-1] == pytest.approx(_per_token_loss(model, finite), rel=1e-6)
    assert _per_token_loss(model, finite) != pytest.approx(_per_token_loss(model, batches), rel=1e-3)


def test_tokens_mode_logs_the_loss_per_token():
    """normalize="tokens": loss_fn returns a summed loss and its token count; the logged loss is the per-token mean."""
    ctx, state, loader, _ = testing.tiny_setup()

    def summed(model, batch):
        x, _ = batch
        tokens = torch.tensor(float(len(x) * 3))
        return model(x).sum() * 0 + 2.5 * tokens, {"tokens": tokens}  # 2.5 per token, whatever the batch

    state = run_epoch(ctx, make_step(ctx, summed, normalize="tokens"), loader, state)

    assert 2.5 == pytest.approx(state.history.latest("train_loss"))
