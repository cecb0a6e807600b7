"""Streamed data (iterable datasets): a run interrupted inside an epoch continues where its checkpoint stands.

A stream has no sampler's order to skip through: the resumed epoch reads the consumed part again and drops
it, so every sample is trained on once and the parameters equal an uninterrupted run's bit for bit. The data
is generated here: a Hugging Face ``datasets`` stream over shards with a shuffle buffer, and a plain torch
``IterableDataset``.
"""

import warnings

import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, checkpoint_every, latest_checkpoint, load_checkpoint, loop, make_step, run_epoch, testing

SAMPLES, BATCH = 512, 16  # 32 batches an epoch


class Numbers(torch.utils.data.IterableDataset):
    """A user's own stream: the samples of a seeded permutation of its epoch, without a state of its own."""

    def __init__(self) -> None:
        self.epoch = 0
        self.yielded = 0  # samples read from the stream (in this process: num_workers=0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch))
        worker = torch.utils.data.get_worker_info()
        if worker is not None:  # each worker its share, as a sharded stream deals them
            order = order[worker.id::worker.num_workers]
        for i in order.tolist():
            self.yielded += 1
            yield {"x": torch.tensor([i / SAMPLES]), "id": torch.tensor(i)}


def _stream(kind: str):
    if kind == "datasets":
        from datasets import Dataset

        data = Dataset.from_dict({"x": [[i / SAMPLES] for i in range(SAMPLES)], "id": list(range(SAMPLES))}).with_format("torch")
        return data.to_iterable_dataset(num_shards=16).shuffle(seed=7, buffer_size=64)
    return Numbers()


def _setup(kind: str, workers: int):
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(_stream(kind), batch_size=BATCH, num_workers=workers))
    return ctx, state, dl


class Crash(Exception):
    """The process dies here (no run-end save follows, as after kill -9)."""


def _loss(trained, crash_after=None):
    def loss_fn(model, batch):
        if len(trained) == crash_after:
            raise Crash
        trained.extend(batch["id"].tolist())
        return ((model(batch["x"]) - batch["x"].sin()) ** 2).mean()

    return loss_fn


@pytest.mark.parametrize("kind, workers", [("datasets", 0), ("datasets", 2), ("own", 0), ("own", 2)])
def test_a_streamed_epoch_resumed_mid_epoch_trains_every_sample_once_and_equals_the_uninterrupted_run(kind, workers, tmp_path):
    """The issue's run: checkpoints every 10 updates, killed after update 23, resumed from update 20 (batch 20 of 32)."""
    ctx, state, dl = _setup(kind, workers)
    expected_ids: list[int] = []
    expected = loop(run_epoch(ctx, make_step(ctx, _loss(expected_ids)), dl), max_epochs=2)(state)
    ctx.close()

    ctx, state, dl = _setup(kind, workers)
    before: list[int] = []
    with pytest.raises(Crash):
        run_epoch(ctx, checkpoint_every(ctx, tmp_path, 10)(make_step(ctx, _loss(before, crash_after=23 * BATCH))), dl, state)
    ctx.close()
    assert tmp_path / "ckpt-0000000020" == latest_checkpoint(tmp_path)

    ctx, state, dl = _setup(kind, workers)
    after: list[int] = []
    with pytest.warns(UserWarning, match="stopped at batch 20 of epoch 0.*reading the epoch's first 21 batches again") as caught:
        resumed = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
        resumed = loop(run_epoch(ctx, make_step(ctx, _loss(after)), dl), max_epochs=2)(resumed)
    ctx.close()

    assert 1 == len(caught)  # once per run, not once per resumed epoch
    assert 2 * 32 == resumed.step  # never a second pass over the consumed part
    first_epoch = before[: 20 * BATCH] + after[: 12 * BATCH]
    assert sorted(first_epoch) == list(range(SAMPLES))  # every sample of the interrupted epoch once
    assert expected_ids == first_epoch + after[12 * BATCH:]  # in the uninterrupted run's order
    testing.assert_params_equal(expected, resumed)
    assert expected.history == resumed.history


def test_a_stream_saved_at_its_epochs_last_batch_resumes_without_reading_it_again_or_warning(tmp_path):
    """The save at update 32 comes before run_epoch closes the epoch: the resume closes it, reading nothing."""
    ctx, state, dl = _setup("own", 0)
    state = run_epoch(ctx, checkpoint_every(ctx, tmp_path, 32)(make_step(ctx, _loss([]))), dl, state)
    ctx.close()

    ctx, state, dl = _setup("own", 0)
    trained: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
        resumed = loop(run_epoch(ctx, make_step(ctx, _loss(trained)), dl), max_epochs=2)(resumed)
    ctx.close()
    assert (2, 64) == (resumed.epoch, resumed.step)
    assert SAMPLES == len(trained) == dl.base_dataloader.dataset.yielded  # epoch 1 alone, read once
