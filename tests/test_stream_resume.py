"""SIGKILL a run over a stream at random moments and resume it each time: every sample is trained once, in the order
of an uninterrupted run, and the end is bit-identical (tests/scripts/stream_run.py). One process, loader workers, and
each way Accelerate hands a stream to two processes: each reads it and keeps its share (``IterableDatasetShard``), one
global batch split among them (``split_batches``), and process 0 reading and sending each its part (``dispatch_batches``).
A dispatched stream resumes on another number of processes (2 -> 1 -> 3); the others are refused there, by name."""

import os
import random
import signal
import sys
from pathlib import Path

import helpers
import pytest
from safetensors.torch import load_file

from trainfold import CheckpointError, latest_checkpoint, testing, verify_checkpoint

pytestmark = (
    pytest.mark.multiprocess
)  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one

SCRIPT = Path(__file__).resolve().parent / "scripts" / "stream_run.py"
sys.path.insert(0, str(SCRIPT.parent))
import stream_run  # noqa: E402  (its train(argv), run by testing.run_distributed)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}
SAMPLES = 384  # stream_run.py's


def _cmd(root, out, processes, extra):
    if processes == 1:
        return [sys.executable, str(SCRIPT), str(root), str(out), *extra]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(testing.free_port()),
        str(SCRIPT),
        str(root),
        str(out),
        *extra,
    ]


def _run(root, out, processes, extra, monkeypatch):
    """stream_run.py's run on ``processes`` processes of ``testing.run_distributed`` (forked with torch, Accelerate and
    datasets imported: seconds less than torchrun's new interpreters); what the processes warned, in one text."""
    for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"):
        monkeypatch.setenv(name, ENV[name])
    said = testing.run_distributed(stream_run.train, [str(root), str(out), *extra], nprocs=processes, timeout=300)
    return "\n".join(message for messages in said for message in messages)


def _to_end(root, out, processes, extra, monkeypatch):
    _run(root, out, processes, extra, monkeypatch)
    return load_file(str(out / "params.safetensors"))


def _trained(out, rank):
    """The ids this rank trained, over every run, as they count: a run's batches from the update it resumed from replace
    what the runs before it trained from there on."""
    batches: list[tuple[int, list[int]]] = []
    for line in (out / f"trained-{rank}.txt").read_text().splitlines():
        words = line.split()
        if words[0] == "resumed":
            batches = [b for b in batches if b[0] < int(words[1])]
        else:
            batches.append((int(words[0]), [int(w) for w in words[1:]]))
    return [i for _, ids in batches for i in ids]


# The four ways of dealing the same stream to two processes train each process on the same samples (the first test
# proves it): they share one uninterrupted run. A kill per two-process job, two per one-process job.
CASES = [
    (1, ("--source", "stateful"), 2),
    (1, ("--source", "datasets-plain", "--workers", "2", "--stateful-loader"), 2),
    (2, ("--source", "datasets-plain", "--deal", "shard"), 1),
    (2, ("--source", "datasets-buffer", "--deal", "shard"), 1),
    (2, ("--source", "stateful", "--deal", "shard"), 1),
    (2, ("--source", "stateful", "--deal", "split"), 1),
    (2, ("--source", "stateful", "--deal", "dispatch"), 1),
    (2, ("--source", "plain", "--deal", "dispatch"), 1),  # no state: process 0 reads the consumed part again
]
IDS = [
    "1-own",
    "1-datasets-workers",
    "2-shard-datasets",
    "2-shard-datasets-buffer",
    "2-shard",
    "2-split",
    "2-dispatch",
    "2-dispatch-replay",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run of each kind, run once: ``uninterrupted(processes, extra)`` -> (its out folder, its parameters)."""
    runs = {}
    monkeypatch = pytest.MonkeyPatch()

    def run(processes, extra):
        source = extra[1]
        key = (
            processes,
            source if processes == 1 or source.startswith("datasets") else "stateful",
            extra[2:] if processes == 1 else (),
        )
        if key not in runs:
            folder = tmp_path_factory.mktemp("uninterrupted")
            # two processes: dealt as shards (the other ways deal the same samples); "plain" is "stateful" without a state
            args = extra if processes == 1 else ("--source", key[1], "--deal", "shard")
            runs[key] = folder / "out", _to_end(folder / "root", folder / "out", processes, args, monkeypatch)
        return runs[key]

    yield run
    monkeypatch.undo()


def test_each_way_to_deal_a_stream(uninterrupted, tmp_path, monkeypatch):
    """What lets the kill tests share one uninterrupted run: shards, one split batch, and dispatching from process 0."""
    shard_out, shard = uninterrupted(2, ("--source", "stateful", "--deal", "shard"))
    for deal in ("split", "dispatch"):
        params = _to_end(
            tmp_path / deal, tmp_path / f"{deal}-out", 2, ("--source", "stateful", "--deal", deal), monkeypatch
        )
        testing.assert_params_equal(shard, params)
        assert [_trained(shard_out, r) for r in (0, 1)] == [_trained(tmp_path / f"{deal}-out", r) for r in (0, 1)]


@pytest.mark.parametrize("processes, extra, kills", CASES, ids=IDS)
def test_stream_kill_and_resume(processes, extra, kills, uninterrupted, tmp_path, monkeypatch):
    """A stream killed at random moments and resumed trains every sample once to the same parameters."""
    clean, expected = uninterrupted(processes, extra)

    rng = random.Random(7)
    root, out = tmp_path / "killed-root", tmp_path / "killed"
    newest = lambda: latest_checkpoint(root) if root.exists() else None  # noqa: E731
    killed = sum(
        helpers.kill_after_a_new_checkpoint(
            _cmd(root, out, processes, (*extra, "--slow")), ENV, newest, rng.uniform(0.05, 0.3), processes=processes
        )
        == -signal.SIGKILL
        for _ in range(kills)
    )
    progress = verify_checkpoint(latest_checkpoint(root))["step"]
    resumed = _to_end(root, out, processes, extra, monkeypatch)  # the last resume: in processes of run_distributed

    assert killed >= 1 and 0 < progress < 48  # killed part-way (48 updates in all)
    testing.assert_params_equal(expected, resumed)
    for rank in range(processes):
        assert _trained(clean, rank) == _trained(out, rank)  # the uninterrupted run's samples, in its order
    every = sorted(i for rank in range(processes) for i in _trained(out, rank))
    assert sorted(list(range(SAMPLES)) * 2) == every  # two epochs: every sample once in each


def _ids(out):
    """Every sample id trained by every process of a run (its out folder), in no particular order."""
    return [
        i
        for path in sorted(out.glob("trained-*.txt"))
        for line in path.read_text().splitlines()
        if not line.startswith("resumed")
        for i in map(int, line.split()[1:])
    ]


@pytest.mark.parametrize(
    "source, deal, stops, counts",
    [
        ("stateful", "dispatch", (5, 22), [160, 224 + 48, 336]),  # 2 x 8 x 2 x 5; 1 x 8 x 2 x 17; 3 x 8 x 2 x 7
        ("datasets-plain", "dispatch", (5, 22), [160, 224 + 48, 336]),
        ("stateful", "shard", (5, 13), [160, 128, 96 + 384]),  # 2 x 8 x 2 x 5; 1 x 8 x 2 x 8; the rest of both epochs
        ("stateful", "split", (5, 13), [160, 128, 96 + 384]),
        ("datasets-plain", "shard", (5, 13), [160, 128, 96 + 384]),
        ("datasets-buffer", "shard", (5, 13), [160, 128, 96 + 384]),
        ("datasets-buffer", "dispatch", (5, 22), [160, 224 + 48, 336]),
        ("stateful", "dispatch>shard", (5, 13), [160, 128, 96 + 384]),
    ],
    ids=[
        "dispatch",
        "dispatch-datasets",
        "shares",
        "split",
        "datasets-shards",
        "datasets-buffer-shards",
        "dispatch-datasets-buffer",
        "dispatch-then-shares",
    ],
)
def test_a_stream_resumes_on_one_then_three(source, deal, stops, counts, tmp_path, monkeypatch):
    """Saved by 2 processes inside epoch 1 (update 5: 160 samples of 384), continued on 1 process and saved again, then
    on 3 processes to the end: each sample of each epoch is trained once, none twice, none lost.

    - Dispatched (process 0 reads the stream and sends each process its part): its state is the whole stream's; the
      1-process run goes into epoch 2 (update 22: 48 samples into it).
    - Each process reads its own share (Accelerate's ``IterableDatasetShard``: the whole stream read by every process;
      ``split_batches``; a ``datasets`` stream of 12 shards split by process, 6 each on 2, 4 each on 3): the rest of the
      epoch is dealt anew, the batches the processes had read ahead first. The 1-process run stops inside that epoch
      (update 13), so the 3-process run deals anew an epoch that was dealt anew already.
    - Dispatched by the 2 processes, then read in shares: the dispatched batch process 0 had read ahead comes first.
    A user's stream with a state, and a ``datasets`` stream (its own state, num_workers=0)."""
    root = tmp_path / "root"
    first, _, then = deal.partition(">")
    said = {}
    for processes, stop, out in ((2, stops[0], "two"), (1, stops[1], "one"), (3, None, "three")):
        extra = ("--source", source, "--deal", first if out == "two" else then or first)
        said[out] = _run(
            root, tmp_path / out, processes, (*extra, *(("--stop-after", str(stop)) if stop else ())), monkeypatch
        )
        if stop:
            assert stop == verify_checkpoint(latest_checkpoint(root))["step"]
    assert "saved by 2 processes in the middle of epoch 1" in said["one"]  # its running train sums restart: said
    assert "again" not in said["one"] + said["three"]  # each part continued from its state: nothing read again
    assert f"saved by 1 process in the middle of epoch {2 if stops[1] > 19 else 1}" in said["three"]

    runs = [_ids(tmp_path / out) for out in ("two", "one", "three")]
    assert counts == [len(ids) for ids in runs]
    assert sorted(list(range(SAMPLES)) * 2) == sorted(i for ids in runs for i in ids)


def _saves_inside_a_streamed_epoch(root, deal="shard", source="stateful"):
    """2 processes over a stream (each its share, or dispatched by process 0; prepared by ctx.prepare_loaders or by
    Accelerate directly): stopped after 5 batches and saved there."""
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration

    from trainfold import Context, TrainState, make_step, run_epoch, save_checkpoint
    from test_streams import StatefulNumbers, _loss

    class Plain(StatefulNumbers):
        state_dict = load_state_dict = None

    torch.manual_seed(0)
    config = DataLoaderConfiguration(
        dispatch_batches=deal == "dispatch", use_stateful_dataloader=source == "datasets-loader"
    )
    ctx = Context(accelerator=Accelerator(cpu=True, dataloader_config=config))
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    if source.startswith(
        "datasets"
    ):  # a datasets stream Accelerate splits by process (read by a StatefulDataLoader: its state the loader's)
        from datasets import Dataset

        data = Dataset.from_dict({"x": [[i / 512] for i in range(512)], "id": list(range(512))})
        dataset = data.to_iterable_dataset(num_shards=4).with_format("torch")
    else:
        dataset = StatefulNumbers() if source == "stateful" else Plain()
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    (dl,) = (ctx.accelerator.prepare(loader),) if deal == "prepared-elsewhere" else ctx.prepare_loaders(loader)
    inner = make_step(ctx, _loss([]))

    def step(s, batch):
        s = inner(s, batch)
        return s.with_stop("test") if s.batch_in_epoch == 5 else s

    save_checkpoint(ctx, root, run_epoch(ctx, step, dl, state))
    ctx.close()


@pytest.mark.parametrize(
    "deal, source, reason",
    [
        (
            "dispatch",
            "plain",
            r"process 0 read it and dispatched it, but it cannot say where it stood \(no state_dict\(\)\)",
        ),
        (
            "shard",
            "datasets-loader",
            r"each process's loader \(.*StatefulDataLoader, 0 worker\(s\)\) saved a state of its own.*num_workers=0",
        ),
        (
            "prepared-elsewhere",
            "datasets",
            r"each process read a part of the stream, and the checkpoint does not say how the stream was split.*ctx.prepare_loaders",
        ),
    ],
)
def test_an_undealable_stream_is_refused(deal, source, reason, tmp_path):
    """Process 0 read a stream with no state; a StatefulDataLoader saved a state of its own; a loader prepared by
    Accelerate directly split a datasets stream by process (how, the checkpoint cannot say): on one process the epoch
    cannot go on exactly, and load_checkpoint says why and what resumes elastically; the model is untouched."""
    import torch
    from accelerate import Accelerator

    from trainfold import Context, TrainState, load_checkpoint

    testing.run_distributed(_saves_inside_a_streamed_epoch, str(tmp_path), deal, source, nprocs=2)
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(1)
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    before = testing.parameters(state)
    with pytest.raises(
        CheckpointError,
        match=r"saved by 2 processes in the middle of an epoch over a stream, and this run has 1 "
        rf"process: {reason}.*Resume it on 2 processes",
    ):
        load_checkpoint(ctx, tmp_path, state)
    ctx.close()
    testing.assert_params_equal(before, state)


def test_a_redealt_epoch_continues_in_order(tmp_path):
    """2 processes, each its share of a user's stream (IterableDatasetShard), saved after 5 batches each: the first 80
    samples of the epoch's order. On 1 process the rest is dealt anew: the 16 samples the two processes had read ahead,
    then the stream from its state, so this process trains samples 80.. of the order. Stopped after 3 batches and saved
    inside that epoch, then resumed once more on 1 process: exactly samples 80..511 of the order, once each, in order,
    and the stream yields each of them once (nothing consumed read again). A loader that dispatches, or a stream of
    another kind, is refused at the epoch's start, before a batch is read."""
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration

    from test_streams import SAMPLES, StatefulNumbers, _loss
    from trainfold import Context, TrainState, load_checkpoint, make_step, run_epoch, save_checkpoint

    testing.run_distributed(_saves_inside_a_streamed_epoch, str(tmp_path / "two"), "shard", "stateful", nprocs=2)
    order = StatefulNumbers().order()

    def resume(root, dataset=None, dispatch=False):
        testing.reset_accelerate_state()
        ctx = Context(
            accelerator=Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        )
        torch.manual_seed(1)
        model = torch.nn.Linear(1, 1)
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        dataset = dataset if dataset is not None else StatefulNumbers()
        (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(dataset, batch_size=8))
        if root.name == "two":  # another number of processes: the epoch's running sums restart, said
            with pytest.warns(UserWarning, match="saved by 2 processes in the middle of epoch 1"):
                return ctx, load_checkpoint(ctx, root, state), dl, dataset
        return ctx, load_checkpoint(ctx, root, state), dl, dataset

    class Other(StatefulNumbers):
        pass

    for dataset, dispatch, refusal in (
        (
            None,
            True,
            r"dealt to its processes in shares, and this loader has process 0 read and "
            r"dispatch the stream.*dispatch_batches=False",
        ),
        (Other(), False, r"the state of a .*StatefulNumbers, and this loader's stream is a .*Other"),
    ):
        ctx, state, dl, dataset = resume(tmp_path / "two", dataset, dispatch)
        with pytest.raises(CheckpointError, match=refusal):
            run_epoch(ctx, make_step(ctx, _loss([])), dl, state)
        assert 0 == dataset.yielded.value
        ctx.close()

    trained = []
    ctx, state, dl, dataset = resume(tmp_path / "two")
    assert 5 == state.batch_in_epoch
    inner = make_step(ctx, _loss(trained))
    state = run_epoch(
        ctx, lambda s, b: (lambda t: t.with_stop("test") if t.batch_in_epoch == 8 else t)(inner(s, b)), dl, state
    )
    save_checkpoint(ctx, tmp_path / "one", state)
    ctx.close()
    read = dataset.yielded.value

    ctx, state, dl, dataset = resume(tmp_path / "one")
    state = run_epoch(ctx, make_step(ctx, _loss(trained)), dl, state)
    ctx.close()

    assert order[80:] == trained
    assert 1 == state.epoch
    assert SAMPLES - 96 == read + dataset.yielded.value  # the samples after the 16 read ahead, each read once


def _refusal(ctx, loader, state):
    """What run_epoch says when it refuses to continue ``state`` over ``loader`` (None: it did not), the Context closed."""
    from trainfold import make_step, run_epoch
    from test_streams import _loss

    try:
        run_epoch(ctx, make_step(ctx, _loss([])), loader, state)
    except CheckpointError as exc:
        return str(exc)
    finally:
        ctx.close()
    return None


def _continues_in_shares(root):
    """2 processes, the stream now dealt in shares: what run_epoch says of a checkpoint whose epoch was dispatched."""
    import torch
    from accelerate import Accelerator

    from trainfold import Context, TrainState, load_checkpoint
    from test_streams import StatefulNumbers

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    state = load_checkpoint(
        ctx, root, TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    )
    dataset = StatefulNumbers()
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(dataset, batch_size=8))
    return _refusal(ctx, dl, state), dataset.yielded.value


def test_a_dispatched_epoch_is_not_shared(tmp_path):
    """Each process's position says where its own way stood (process 0's is the whole stream's; the others read
    nothing): continued in shares, process 0's dispatched batch would be one process's batch and the others would
    start the stream again. Refused on every process before a batch is read, naming the setting."""
    testing.run_distributed(_saves_inside_a_streamed_epoch, str(tmp_path), "dispatch", "stateful", nprocs=2)
    said = testing.run_distributed(_continues_in_shares, str(tmp_path), nprocs=2)
    for message, read in said:
        assert 0 == read
        assert "was dispatched on its 2 processes, and this loader deals each process its share" in message
        assert "DataLoaderConfiguration(dispatch_batches=True), as it was saved" in message


def _resumes_prepared_by_accelerate(root):
    """2 processes, their loader prepared by Accelerate directly (a datasets stream it splits by process, the dataset
    given not kept): what run_epoch says of a 1-process checkpoint inside an epoch over that stream."""
    import warnings

    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from datasets import Dataset

    from trainfold import Context, TrainState, load_checkpoint

    ctx = Context(accelerator=Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False)))
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the epoch's running sums restart: said, and not what this test is about)
        state = load_checkpoint(ctx, root, state)
    data = Dataset.from_dict({"x": [[i / 512] for i in range(512)], "id": list(range(512))})
    dl = ctx.accelerator.prepare(
        torch.utils.data.DataLoader(data.to_iterable_dataset(num_shards=4).with_format("torch"), batch_size=8)
    )
    return _refusal(ctx, dl, state)


def test_a_stream_split_elsewhere_is_refused(tmp_path):
    """Saved by 1 process inside an epoch over a 4-shard datasets stream; resumed on 2 whose loader Accelerate prepared
    directly: the whole stream the rest is read from is not at hand (each process holds its own shards). Refused on
    both, naming ctx.prepare_loaders."""
    testing.reset_accelerate_state()
    _saves_inside_a_streamed_epoch(str(tmp_path), "shard", "datasets")
    said = testing.run_distributed(_resumes_prepared_by_accelerate, str(tmp_path), nprocs=2)
    for message in said:
        assert "goes on dealt anew to 2 processes, which needs the whole stream this loader reads a share of" in message
        assert "prepare the loader with ctx.prepare_loaders" in message
