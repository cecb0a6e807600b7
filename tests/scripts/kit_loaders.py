"""Loaders put through ``testing.check_resume`` by test_resume_kit.py: factories of a ``LoaderRequest``, at module
level so that the kit's processes import them. Each epoch is 96 samples with ids 0..95, in batches of 4: whole
global batches on 1, 2 and 3 processes."""

import torch

SAMPLES, BATCH = 96, 4


class Numbers(torch.utils.data.Dataset):
    """Map-style: sample i is {"id": i}."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"id": torch.tensor(i)}


def map_style(request):
    """A shuffled map-style loader (Accelerate deals its sampler's order)."""
    return torch.utils.data.DataLoader(Numbers(), batch_size=BATCH, shuffle=True, num_workers=request.num_workers)


def _datasets_stream(buffer_size: int | None):
    from datasets import Dataset

    ds = Dataset.from_dict({"id": list(range(SAMPLES))}).to_iterable_dataset(num_shards=6)
    if buffer_size is not None:
        ds = ds.shuffle(seed=7, buffer_size=buffer_size)
    return ds.with_format("torch")


def datasets_stream(request):
    """A `datasets` stream of 6 shards, shards shuffled."""
    return torch.utils.data.DataLoader(_datasets_stream(1), batch_size=BATCH, num_workers=request.num_workers)


def datasets_buffer(request):
    """A `datasets` stream with a shuffle buffer of 16."""
    return torch.utils.data.DataLoader(_datasets_stream(16), batch_size=BATCH, num_workers=request.num_workers)


class Plain(torch.utils.data.IterableDataset):
    """A stream that cannot say where it is: a seeded order per epoch, read again on a resume."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            order = order[worker.id :: worker.num_workers]
        for i in order:
            yield {"id": torch.tensor(i)}


def plain_stream(request):
    return torch.utils.data.DataLoader(Plain(), batch_size=BATCH, num_workers=request.num_workers)


class Stateful(Plain):
    """A stream that says where it is (``state_dict``/``load_state_dict``): resumed in O(1)."""

    #: where a loaded state makes the next epoch start, past the position it says (a broken stream's is not 0)
    skew = 0

    def __init__(self) -> None:
        super().__init__()
        self.position = self.start = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.start = state["epoch"], state["position"] + self.skew

    def __iter__(self):
        start, self.start = self.start, 0
        for self.position, sample in enumerate(list(super().__iter__())[start:], start + 1):
            yield sample


class SkipsOne(Stateful):
    skew = 1  # a resumed epoch leaves out the sample after the position


class RepeatsOne(Stateful):
    skew = -1  # a resumed epoch trains the sample at the position again


def stateful_stream(request):
    return torch.utils.data.DataLoader(Stateful(), batch_size=BATCH, num_workers=request.num_workers)


def skips_one(request):
    return torch.utils.data.DataLoader(SkipsOne(), batch_size=BATCH, num_workers=request.num_workers)


def repeats_one(request):
    return torch.utils.data.DataLoader(RepeatsOne(), batch_size=BATCH, num_workers=request.num_workers)
