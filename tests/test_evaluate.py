"""evaluate and predict: exact means over every sample, order kept, training mode restored."""

import pytest
import torch
from accelerate import Accelerator
from toolz import pipe

from trainfold import Context, TrainState, evaluate, make_step, predict, run_epoch, testing

from helpers import ce_loss_with_accuracy, classification_data, mlp
import helpers


def _setup(n=50, batch_size=8):
    ctx = Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Dropout(0.5), mlp())
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = classification_data(n)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=batch_size))
    return ctx, state, dl, data


def _per_sample_reference(model, data):
    x, y = data.tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train()
    losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    return losses.double().mean().item(), (logits.argmax(-1) == y).double().mean().item()


@pytest.mark.parametrize("n,batch_size", [(50, 8), (48, 8), (7, 8), (1, 4)])
def test_evaluate_gives_the_exact_per_sample_mean(n, batch_size):
    """The recorded loss and accuracy equal the means over all samples, whatever the last batch."""
    ctx, state, dl, data = _setup(n, batch_size)

    new = evaluate(ctx, ce_loss_with_accuracy, dl, state)

    loss, accuracy = _per_sample_reference(state.model, data)
    assert new.metrics["eval_loss"] == pytest.approx(loss, rel=1e-6)
    assert new.metrics["eval_accuracy"] == pytest.approx(accuracy, rel=1e-6)


def test_evaluate_restores_training_mode_and_changes_nothing_else():
    ctx, state, dl, _ = _setup()
    before = testing.parameters(state)

    new = evaluate(ctx, ce_loss_with_accuracy, dl, state)

    assert state.model.training
    testing.assert_params_equal(before, state)
    assert (new.step, new.epoch, new.micro_step) == (state.step, state.epoch, state.micro_step)
    assert 0 == len(state.history)


def test_evaluate_restores_eval_mode_too():
    ctx, state, dl, _ = _setup()
    state.model.eval()

    evaluate(ctx, ce_loss_with_accuracy, dl, state)

    assert not state.model.training


def test_evaluate_with_a_prefix_and_another_model():
    """prefix names the records; model= evaluates another module (an EMA copy, say)."""
    ctx, state, dl, data = _setup()
    other = mlp()

    new = evaluate(ctx, ce_loss_with_accuracy, dl, state, prefix="val", model=other)

    assert new.metrics["val_loss"] == pytest.approx(_per_sample_reference(other, data)[0], rel=1e-6)


def test_evaluate_records_at_the_current_epoch_and_step():
    ctx, state, dl, _ = _setup()
    step = make_step(ctx, ce_loss_with_accuracy)

    new = pipe(state, run_epoch(ctx, step, dl), evaluate(ctx, ce_loss_with_accuracy, dl))

    records = {r.name: (r.epoch, r.step) for r in new.history}
    assert {"train_loss": (1, 7), "train_accuracy": (1, 7), "eval_loss": (1, 7), "eval_accuracy": (1, 7)} == records


def test_predict_returns_every_sample_in_order():
    ctx, state, dl, data = _setup()

    out = predict(ctx, lambda model, batch: model(batch[0]), dl, state)
    assert state.model.training

    state.model.eval()
    with torch.no_grad():
        expected = state.model(data.tensors[0])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # batched matmuls round differently


def test_predict_concatenates_structures():
    ctx, state, dl, data = _setup()

    out = predict(ctx, lambda model, batch: {"y": batch[1], "pair": (batch[1], batch[1] * 2)}, dl, state)

    y = data.tensors[1]
    assert torch.equal(out["y"], y) and torch.equal(out["pair"][1], y * 2)


def test_evaluate_sums_in_float64_so_the_mean_matches_an_exact_sum():
    """3,000 float32 batch losses spread over six orders of magnitude: the recorded mean is the exact
    (fsum) mean of the float32 values to float64 rounding, which float32 sums are not."""
    import math

    from accelerate import Accelerator

    from trainfold import Context, TrainState, evaluate

    g = torch.Generator().manual_seed(0)
    values = (torch.rand(3000, generator=g) * 10.0 ** torch.randint(-3, 3, (3000,), generator=g)).float()
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    batches = [(torch.tensor([i]), torch.zeros(1, 1)) for i in range(len(values))]

    got = evaluate(ctx, lambda m, b: values[b[0][0]] + 0 * m(b[1]).sum(), batches, state).metrics["eval_loss"]

    exact = math.fsum(values.tolist()) / len(values)
    assert abs(got - exact) <= 1e-12 * exact
    float32 = torch.zeros(())
    for chunk in values.split(64):  # what float32 sums folded every 64 batches give
        float32 = float32 + chunk.sum(dtype=torch.float32)
    assert abs(float(float32) / len(values) - exact) > 1e-9 * exact


# --- metrics that are not batch means (evaluate_metrics) -------------------------------------


def _f1_setup(n=50):
    from trainfold import Context, TrainState

    ctx = Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(0)
    model = mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = classification_data(n)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=8))
    return ctx, state, dl, data


def _macro_f1_on_this_rank(n):
    """torchmetrics' macro F1 through evaluate_metrics, and sklearn's on the whole dataset, on this process."""
    from sklearn.metrics import f1_score
    from torchmetrics.classification import MulticlassF1Score

    from trainfold import evaluate_metrics

    ctx, state, dl, data = _f1_setup(n)
    from torchmetrics.aggregation import SumMetric

    f1 = MulticlassF1Score(num_classes=3, average="macro")
    state = evaluate_metrics(ctx, {"f1": f1}, lambda m, b: (m(b[0]).argmax(-1), b[1]), dl, state)
    # a count is what double counting would show (an F1 of everything twice is the same F1)
    state = evaluate_metrics(ctx, {"samples": SumMetric()}, lambda m, b: torch.ones(len(b[1])), dl, state)
    x, y = data.tensors
    with torch.no_grad():
        expected = f1_score(y.numpy(), state.model(x).argmax(-1).numpy(), average="macro")
    ctx.close()
    return state.metrics["eval_f1"], float(expected), state.metrics["eval_samples"]


def test_evaluate_metrics_runs_a_torchmetrics_metric_and_records_it():
    testing.reset_accelerate_state()
    got, expected, samples = _macro_f1_on_this_rank(50)
    testing.reset_accelerate_state()

    assert got == pytest.approx(expected, rel=1e-6)
    assert 50 == samples


@pytest.mark.multiprocess
def test_evaluate_metrics_counts_every_sample_once_on_two_processes():
    """50 samples, 2 processes of batch 8: the last round is padded; the padding is dropped and nothing is counted twice."""
    for got, expected, samples in testing.run_distributed(_macro_f1_on_this_rank, 50, nprocs=2):
        assert got == pytest.approx(expected, rel=1e-6)
        assert 50 == samples  # not 56 (padding) nor 100 (synced again)


def test_evaluate_metrics_refuses_non_metrics():
    """`evaluate_metrics` refuses an object that is not a metric and a value that is not a number."""
    from trainfold import evaluate_metrics

    testing.reset_accelerate_state()
    ctx, state, dl, _ = _f1_setup()

    with pytest.raises(
        TypeError,
        match=r"metric 'f1' is a function, which has neither update, compute and reset \(torchmetrics\) nor add_batch and compute",
    ):
        evaluate_metrics(ctx, {"f1": lambda p, t: 0.0}, lambda m, b: (m(b[0]), b[1]), dl, state)

    from torchmetrics.classification import MulticlassF1Score

    per_class = MulticlassF1Score(num_classes=3, average=None)
    with pytest.raises(TypeError, match=r"metric 'f1' computed a tensor of shape \(3,\); the history holds numbers"):
        evaluate_metrics(ctx, {"f1": per_class}, lambda m, b: (m(b[0]).argmax(-1), b[1]), dl, state)
    testing.reset_accelerate_state()


# --- outputs and loaders that would not count every sample once ----------------------------------


class _TokenAccuracy:
    """Correct tokens over all tokens: flattens (batch, tokens) inside the metric."""

    def __init__(self):
        self.reset()

    def update(self, preds, target):
        self.right += int((preds == target).sum())
        self.total += target.numel()

    def compute(self):
        return self.right / self.total

    def reset(self):
        self.right, self.total = 0, 0


def _tokens_setup(n=29, tokens=64, batch_size=8):
    from trainfold import Context, TrainState

    ctx = Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(0)
    x, y = torch.randint(0, 5, (n, tokens)), torch.randint(0, 5, (n, tokens))
    model = torch.nn.Embedding(5, 5)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    )
    expected = int((model(x).argmax(-1) == y).sum()) / y.numel()
    return ctx, state, dl, expected


def test_evaluate_metrics_refuses_flattened_per_token_outputs():
    """(batch*tokens,) outputs had their last batch cut to its sample count (1856 entries to 29): a wrong accuracy."""
    from trainfold import evaluate_metrics

    ctx, state, dl, _ = _tokens_setup()
    flat = lambda m, b: (m(b[0]).argmax(-1).reshape(-1), b[1].reshape(-1))  # noqa: E731

    with pytest.raises(ValueError, match=r"tensor of shape \(512,\) for a batch of 8 samples.*first dimension"):
        evaluate_metrics(ctx, {"acc": _TokenAccuracy()}, flat, dl, state)


def test_evaluate_metrics_counts_every_token_of_per_sample_outputs():
    from trainfold import evaluate_metrics

    ctx, state, dl, expected = _tokens_setup()
    per_sample = lambda m, b: (m(b[0]).argmax(-1), b[1])  # noqa: E731

    state = evaluate_metrics(ctx, {"acc": _TokenAccuracy()}, per_sample, dl, state)

    assert pytest.approx(expected, abs=1e-12) == state.metrics["eval_acc"]


@pytest.mark.parametrize("which", ["evaluate", "evaluate_metrics", "predict"])
def test_a_loader_that_drops_samples_is_refused_where_every_sample_counts(which):
    """drop_last=True: 48 of 60 samples evaluated, with no word."""
    from trainfold import evaluate_metrics, predict

    ctx, state, _, loss_fn = testing.tiny_setup(seed=0)
    x = torch.randn(60, 1)
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=16, drop_last=True)
    )
    call = {
        "evaluate": lambda: evaluate(ctx, loss_fn, dl, state),
        "evaluate_metrics": lambda: evaluate_metrics(
            ctx, {"acc": _TokenAccuracy()}, lambda m, b: (m(b[0]), b[1]), dl, state
        ),
        "predict": lambda: predict(ctx, lambda m, b: m(b[0]), dl, state),
    }[which]
    with pytest.raises(ValueError, match=rf"{which}: the loader drops the last 12 of 60 samples.*drop_last=False"):
        call()


class _HfAccuracyF1:
    """What Hugging Face evaluate's metrics look like to a loop (evaluate.load('glue', 'mrpc')): add_batch with keywords,
    and a compute() that returns a dict of values and empties the metric. Made here: nothing can be downloaded."""

    def __init__(self):
        self.predictions, self.references, self.computes = [], [], 0

    def add_batch(self, *, predictions, references):
        self.predictions += predictions.tolist()
        self.references += references.tolist()

    def compute(self):
        pairs = list(zip(self.predictions, self.references))
        self.predictions, self.references, self.computes = [], [], self.computes + 1
        tp = sum(p == r == 1 for p, r in pairs)
        precision, recall = tp / max(1, sum(p == 1 for p, _ in pairs)), tp / max(1, sum(r == 1 for _, r in pairs))
        return {
            "accuracy": sum(p == r for p, r in pairs) / len(pairs),
            "f1": 2 * precision * recall / (precision + recall),
            "n": len(pairs),
        }


def test_evaluate_metrics_takes_hf_evaluate():
    """Accelerate's examples port as written: the metric's add_batch/compute, each key of its result a record."""
    from sklearn.metrics import accuracy_score, f1_score

    from trainfold import evaluate_metrics

    ctx, state, dl, data = _setup(n=50)
    metric = _HfAccuracyF1()
    preds = lambda m, b: ((m(b[0]).argmax(-1) == 1).long(), (b[1] == 1).long())  # noqa: E731 - a binary task, as MRPC

    state = evaluate_metrics(ctx, {"glue": metric}, preds, dl, state)

    x, y = data.tensors
    state.model.eval()  # as evaluate_metrics ran it (the model has dropout)
    with torch.no_grad():
        expected_p, expected_r = (state.model(x).argmax(-1) == 1).long().tolist(), (y == 1).long().tolist()
    assert pytest.approx(accuracy_score(expected_r, expected_p)) == state.metrics["eval_accuracy"]
    assert pytest.approx(f1_score(expected_r, expected_p)) == state.metrics["eval_f1"]
    assert (50.0, 1) == (state.metrics["eval_n"], metric.computes)  # every sample once, the padding dropped


def _mismatched_aux_on_this_rank():
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(8, 3)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(16), batch_size=4))
    name = f"metric_of_rank_{ctx.accelerator.process_index}"

    def loss_fn(model, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return loss, {name: loss.detach()}

    try:
        evaluate(ctx, loss_fn, dl, state)
    except RuntimeError as exc:
        return str(exc)
    finally:
        ctx.close()
    return None


@pytest.mark.multiprocess
def test_different_metric_names_fail():
    """Processes that report different metric names fail instead of mixing them."""
    for message in testing.run_distributed(_mismatched_aux_on_this_rank, nprocs=2, timeout=60):
        assert message and "not every process has the same names" in message
