"""SIGKILL a run over a stream at random moments and resume it each time: every sample is trained once, in the order
of an uninterrupted run, and the end is bit-identical (tests/scripts/stream_run.py). One process, loader workers, and
each way Accelerate hands a stream to two processes: each reads it and keeps its share (``IterableDatasetShard``), one
global batch split among them (``split_batches``), and process 0 reading and sending each its part (``dispatch_batches``).
A dispatched stream resumes on another number of processes (2 -> 1 -> 3); the others are refused there, by name."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
from safetensors.torch import load_file

from trainfold import CheckpointError, latest_checkpoint, testing, verify_checkpoint

pytestmark = pytest.mark.multiprocess  # spawns processes: run serially, not under pytest-xdist

SCRIPT = Path(__file__).resolve().parent / "scripts" / "stream_run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}
SAMPLES = 384  # stream_run.py's


def _cmd(root, out, processes, extra):
    if processes == 1:
        return [sys.executable, str(SCRIPT), str(root), str(out), *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
            str(testing.free_port()), str(SCRIPT), str(root), str(out), *extra]


def _to_end(root, out, processes, extra):
    result = subprocess.run(_cmd(root, out, processes, extra), capture_output=True, text=True, timeout=helpers.scaled(300), env=ENV)
    assert 0 == result.returncode, result.stderr[-3000:]
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
    (2, ("--source", "stateful", "--deal", "shard"), 1),
    (2, ("--source", "stateful", "--deal", "split"), 1),
    (2, ("--source", "stateful", "--deal", "dispatch"), 1),
    (2, ("--source", "plain", "--deal", "dispatch"), 1),  # no state: process 0 reads the consumed part again
]
IDS = ["1-own", "1-datasets-workers", "2-shard-datasets", "2-shard", "2-split", "2-dispatch", "2-dispatch-replay"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run of each kind, run once: ``uninterrupted(processes, extra)`` -> (its out folder, its parameters)."""
    runs = {}

    def run(processes, extra):
        source = extra[1]
        key = (processes, source if processes == 1 or source == "datasets-plain" else "stateful", extra[2:] if processes == 1 else ())
        if key not in runs:
            folder = tmp_path_factory.mktemp("uninterrupted")
            # two processes: dealt as shards (the other ways deal the same samples); "plain" is "stateful" without a state
            args = extra if processes == 1 else ("--source", key[1], "--deal", "shard")
            runs[key] = folder / "out", _to_end(folder / "root", folder / "out", processes, args)
        return runs[key]

    return run


def test_the_ways_accelerate_deals_a_stream_to_two_processes_train_each_on_the_same_samples(uninterrupted, tmp_path):
    """What lets the kill tests share one uninterrupted run: shards, one split batch, and dispatching from process 0."""
    shard_out, shard = uninterrupted(2, ("--source", "stateful", "--deal", "shard"))
    for deal in ("split", "dispatch"):
        params = _to_end(tmp_path / deal, tmp_path / f"{deal}-out", 2, ("--source", "stateful", "--deal", deal))
        testing.assert_params_equal(shard, params)
        assert [_trained(shard_out, r) for r in (0, 1)] == [_trained(tmp_path / f"{deal}-out", r) for r in (0, 1)]


@pytest.mark.parametrize("processes, extra, kills", CASES, ids=IDS)
def test_a_stream_killed_at_random_moments_and_resumed_trains_every_sample_once_to_the_same_parameters(processes, extra, kills, uninterrupted, tmp_path):
    clean, expected = uninterrupted(processes, extra)

    rng = random.Random(7)
    root, out = tmp_path / "killed-root", tmp_path / "killed"
    newest = lambda: latest_checkpoint(root) if root.exists() else None  # noqa: E731
    killed = sum(helpers.kill_after_a_new_checkpoint(_cmd(root, out, processes, (*extra, "--slow")), ENV, newest, rng.uniform(0.05, 0.3),
                                                     processes=processes) == -signal.SIGKILL for _ in range(kills))
    progress = verify_checkpoint(latest_checkpoint(root))["step"]
    resumed = _to_end(root, out, processes, extra)

    assert killed >= 1 and 0 < progress < 48  # killed part-way (48 updates in all)
    testing.assert_params_equal(expected, resumed)
    for rank in range(processes):
        assert _trained(clean, rank) == _trained(out, rank)  # the uninterrupted run's samples, in its order
    every = sorted(i for rank in range(processes) for i in _trained(out, rank))
    assert sorted(list(range(SAMPLES)) * 2) == every  # two epochs: every sample once in each


def _ids(out):
    """Every sample id trained by every process of a run (its out folder), in no particular order."""
    return [i for path in sorted(out.glob("trained-*.txt")) for line in path.read_text().splitlines()
            if not line.startswith("resumed") for i in map(int, line.split()[1:])]


@pytest.mark.parametrize("source", ["stateful", "datasets-plain"])
def test_a_dispatched_stream_resumes_on_one_process_then_on_three_and_trains_every_sample_once(source, tmp_path):
    """Process 0 reads the stream and dispatches it (``dispatch_batches``): its state is the whole stream's position. Saved
    by 2 processes in epoch 1 (update 5: 160 samples of 384), continued on 1 process into epoch 2 (update 22: 48
    samples into it), and on 3 processes to the end: each sample of each epoch is trained once, none twice, none lost.
    A user's stream with a state, and a ``datasets`` stream of 12 shards (its own state, num_workers=0)."""
    root = tmp_path / "root"
    extra = ("--source", source, "--deal", "dispatch")
    said = {}
    for processes, stop, out in ((2, 5, "two"), (1, 22, "one"), (3, None, "three")):
        cmd = _cmd(root, tmp_path / out, processes, (*extra, *(("--stop-after", str(stop)) if stop else ())))
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=helpers.scaled(300), env=ENV)
        assert 0 == result.returncode, result.stderr[-3000:]
        said[out] = result.stderr
        if stop:
            assert stop == verify_checkpoint(latest_checkpoint(root))["step"]
    assert "saved by 2 processes in the middle of epoch 1" in said["one"]  # its running train sums restart: said
    assert "saved by 1 processes in the middle of epoch 2" in said["three"]

    runs = [_ids(tmp_path / out) for out in ("two", "one", "three")]
    assert [160, 224 + 48, 336] == [len(ids) for ids in runs]  # 2 x 8 x 2 x 5; 1 x 8 x 2 x 17; 3 x 8 x 2 x 7
    assert sorted(list(range(SAMPLES)) * 2) == sorted(i for ids in runs for i in ids)


def _saves_inside_a_streamed_epoch(root, deal="shard", source="stateful"):
    """2 processes over a stream (each its share, or dispatched by process 0): stopped after 5 batches and saved there."""
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration

    from trainfold import Context, TrainState, make_step, run_epoch, save_checkpoint
    from test_streams import StatefulNumbers, _loss

    class Plain(StatefulNumbers):
        state_dict = load_state_dict = None

    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=deal == "dispatch")))
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(StatefulNumbers() if source == "stateful" else Plain(), batch_size=8))
    inner = make_step(ctx, _loss([]))

    def step(s, batch):
        s = inner(s, batch)
        return s.with_stop("test") if s.batch_in_epoch == 5 else s

    save_checkpoint(ctx, root, run_epoch(ctx, step, dl, state))
    ctx.close()


@pytest.mark.parametrize("deal, source, reason", [
    ("shard", "stateful", r"each process read the stream and its state says where that process's part stood"),
    ("dispatch", "plain", r"process 0 read it and dispatched it, but it cannot say where it stood \(no state_dict\(\)\)"),
])
def test_a_streamed_epoch_that_cannot_be_dealt_anew_is_refused_on_another_number_of_processes_before_anything_changes(deal, source, reason, tmp_path):
    """Each process saved where its own part of the stream stood (or process 0 read a stream with no state): on one
    process the epoch cannot go on exactly, and load_checkpoint says why and what resumes elastically; the model is
    untouched."""
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
    with pytest.raises(CheckpointError, match=r"saved by 2 processes in the middle of an epoch over a stream, and this run has 1 "
                                              rf"processes: {reason}.*Resume it on 2 processes"):
        load_checkpoint(ctx, tmp_path, state)
    ctx.close()
    testing.assert_params_equal(before, state)
