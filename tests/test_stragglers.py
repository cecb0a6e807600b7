"""The watch names the process that holds the others up, and why, from its one reduction: each process's data wait,
compute (up to its last gradient, before the gradients' all-reduce evens out every process's step time) and collective
wait ride in the report's all-reduce, one slot per process. A busy wait in one process's backward is named a compute
straggler, a loader stall on another an input straggler, each within 20 updates; with no injection nothing is named."""

import os
import subprocess
import sys
import time

import pytest
import torch
from accelerate import Accelerator
from hypothesis import given
from hypothesis import strategies as st

from trainfold import Context, TrainState, Watch, log_every, make_step, run_epoch, save_checkpoint, testing
from trainfold._src.compose.stragglers import Named, per_process, slots


class _Busy(torch.autograd.Function):
    """The identity, whose backward busy-waits ``seconds`` (compute, not a sleep) where told to."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        end = time.perf_counter() + ctx.seconds
        while time.perf_counter() < end:
            pass
        return grad, None


class _Model(torch.nn.Module):
    """The tiny MLP of the benchmarks, with a busy wait between its layers that a test turns on for one update."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(32, 64), torch.nn.Linear(64, 10)
        self.busy_s = 0.0

    def forward(self, x):
        hidden = torch.relu(self.first(x))
        if self.busy_s:
            hidden = _Busy.apply(hidden, self.busy_s)
        return self.second(hidden)


class _Stalling(torch.utils.data.Dataset):
    """Random samples; the sample ``stall_at`` takes 150 ms more to load."""

    def __init__(self, n, stall_at=None):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        self.stall_at = stall_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.stall_at:
            time.sleep(0.15)
        return self.x[i], self.y[i]


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _run(updates, busy_at=None, busy_rank=None, stall_at=None, stall_rank=None, every=5, root=None):
    """``updates`` updates of batch 8 on every process, reporting every ``every``; the process ``busy_rank`` busy-waits
    200 ms in the backward of update ``busy_at``, the process ``stall_rank`` waits 150 ms for the batch of update
    ``stall_at``. Each report's per-process values, in order, and the epoch's record."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True), signals=())
    model = _Model()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    world = (
        ctx.accelerator.num_processes
    )  # (the prepared loader deals batches in turn: this process's k-th is k*world+rank)
    stall = ((stall_at - 1) * world + rank) * 8 if rank == stall_rank else None  # the first sample of its batch
    data = _Stalling(8 * updates * world, stall)
    (loader,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=8))
    logged = log_every(ctx, every, watch=True)(make_step(ctx, _loss))
    reports = []

    def step(state, batch):
        state.model.module.busy_s = 0.2 if rank == busy_rank and state.step + 1 == busy_at else 0.0
        new = logged(state, batch)
        if new.step % every == 0:
            values = new.extras["log_every"].values
            reports.append((new.step, {k: v for k, v in values.items() if "_s_" in k or k.startswith("straggler")}))
        return new

    state = run_epoch(ctx, step, loader, state)
    record = {r.name: r.value for r in state.history if r.name.startswith(("train_straggler", "train_stragglers"))}
    if root is not None:
        save_checkpoint(ctx, root, state)
    ctx.close()
    return reports, record


def _named(reports):
    """Each report's stragglers: [(update, kind, process)]."""
    return [
        (update, kind, int(values[f"straggler_{kind}"]))
        for update, values in reports
        for kind in ("input", "compute")
        if f"straggler_{kind}" in values
    ]


@pytest.mark.multiprocess
def test_a_compute_and_an_input_straggler_are_named_by_process_and_kind(tmp_path):
    """Three processes: process 2 busy-waits 200 ms in the backward of update 8, process 1 waits 150 ms for the batch of
    update 28. The report after each (updates 10 and 30) names that process, of its kind, and no other, on every
    process alike; the epoch's record counts each, and ``trainfold inspect`` shows the counts."""
    runs = testing.run_distributed(
        _run, 40, busy_at=8, busy_rank=2, stall_at=28, stall_rank=1, root=str(tmp_path), nprocs=3, timeout=300
    )
    (reports, record), *others = runs

    assert all(other == (reports, record) for other in others)  # one reduction: every process has the same report
    named = _named(reports)
    assert [("compute", 2)] == [(kind, p) for update, kind, p in named if update == 10]
    assert [("input", 1)] == [(kind, p) for update, kind, p in named if update == 30]
    values = dict(reports)
    assert values[10]["compute_s_max_process"] == 2.0 and values[10]["compute_s_max"] > 0.2 / 5
    assert values[10]["collective_s_median"] > 0.1 / 5  # the others waited for it in the all-reduce
    assert values[30]["data_s_max_process"] == 1.0 and values[30]["data_s_max"] > 0.15 / 5
    for kind in ("input", "compute"):  # the reports that named one, counted in the epoch's record
        assert record[f"train_stragglers_{kind}"] == sum(k == kind for _, k, _ in named)
    assert 2.0 == record["train_straggler_compute_process"] and 1.0 == record["train_straggler_input_process"]
    text = f"input {int(record['train_stragglers_input'])} (process 1), compute {int(record['train_stragglers_compute'])} (process 2)"

    shown = subprocess.run(
        [sys.executable, "-m", "trainfold", "inspect", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert 0 == shown.returncode, shown.stderr
    assert f"stragglers by epoch: 1: {text}" in shown.stdout


@pytest.mark.multiprocess
def test_no_straggler_is_named_when_there_is_none():
    """Two processes of the tiny MLP, 200 updates, no injection: no report names a process."""
    (reports, record), _ = testing.run_distributed(_run, 200, every=10, nprocs=2, timeout=300)

    assert 20 == len(reports) and [] == _named(reports)
    assert 0.0 == record["train_stragglers_input"] == record["train_stragglers_compute"]


def _epoch_syncs_and_weights(stragglers):
    """An epoch of the tiny setup on this process's share, reported every 5 updates: its host syncs and its weights."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=160)
    step = log_every(ctx, 5, watch=Watch(stragglers=stragglers))(make_step(ctx, loss_fn))
    state = run_epoch(ctx, step, loader, state)  # (the first step's FLOPs counted, the hooks learnt)
    with testing.count_host_syncs() as counted:
        state = run_epoch(ctx, step, loader, state)
    named = any(k.startswith("compute_s") for k in state.extras["log_every"].values)
    weights = [p.detach().clone() for p in state.model.parameters()]
    ctx.close()
    return counted.total, named, weights


@pytest.mark.multiprocess
def test_per_process_figures_add_no_sync_and_change_nothing():
    """On two processes, an epoch with per-process figures makes as many host syncs as one without (the figures ride
    in the report's all-reduce), and trains the same weights bit for bit (the gradient hook only reads the clock).
    Each in processes of its own (a second process group in the same processes once met the first's teardown on one
    rank: a connection reset)."""
    with_figures = testing.run_distributed(_epoch_syncs_and_weights, 0.25, nprocs=2, timeout=300)
    without = testing.run_distributed(_epoch_syncs_and_weights, None, nprocs=2, timeout=300)
    for on, off in zip(with_figures, without):
        (on_syncs, on_figures, on_weights), (off_syncs, off_figures, off_weights) = on, off
        assert on_figures and not off_figures
        assert on_syncs == off_syncs
        assert all(torch.equal(a, b) for a, b in zip(on_weights, off_weights))


def test_one_process_reports_no_per_process_figures():
    """On one process there is nobody to compare with: a watched report carries no per-process figures."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = run_epoch(ctx, log_every(ctx, 2, watch=True)(make_step(ctx, loss_fn)), loader, state)

    assert not any("_s_" in k or k.startswith("straggler") for k in state.extras["log_every"].values)
    assert not any(r.name.startswith("train_straggler") for r in state.history)


@given(
    st.integers(2, 64).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(st.floats(0, 10), min_size=3 * n, max_size=3 * n))
    )
)
def test_slots_summed_over_processes_hold_each_processs_figures(case):
    """Each process writes its figures into its own slots; the sum of every process's vector holds them all, in order."""
    processes, figures = case
    per = [figures[r::processes] for r in range(processes)]  # process r's (data, compute, collective)
    summed = sum(slots(r, processes, per[r]) for r in range(processes)).tolist()

    assert summed == figures


def test_a_straggler_is_named_beyond_a_share_of_an_update_and_the_floor():
    """Named when its excess over the median is more than both the share of an update's time and the floor."""
    data, compute, collective = [0.0, 0.0, 0.0], [0.1, 0.1, 0.16], [0.06, 0.06, 0.0]  # 0.16 s per update

    assert 2.0 == per_process(data + compute + collective, 3, 1, 0.16, 0.25, 0.01)["straggler_compute"]  # 0.06 > 0.04
    assert "straggler_compute" not in per_process(data + compute + collective, 3, 1, 0.16, 0.5, 0.01)  # 0.06 < 0.08
    assert "straggler_compute" not in per_process(data + compute + collective, 3, 1, 0.16, 0.25, 0.1)  # < the floor
    named = Named()
    named.note(per_process(data + compute + collective, 3, 1, 0.16, 0.25, 0.01))
    assert {"stragglers_input": 0.0, "stragglers_compute": 1.0, "straggler_compute_process": 2.0} == named.take()
    assert {"stragglers_input": 0.0, "stragglers_compute": 0.0} == named.take()  # a new epoch starts from zero


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stragglers": 0}, "stragglers=0"),
        ({"stragglers": "high"}, "stragglers='high'"),
        ({"straggler_min_s": -1}, "straggler_min_s=-1"),
    ],
)
def test_a_wrong_straggler_setting_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Watch(**kwargs)


def test_the_gradient_hooks_observe_and_change_nothing():
    """Watching per process hooks the parameters' gradients: the weights after an epoch are the same bit for bit."""
    from trainfold._src.core.clock import Compute

    def epoch(watched):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        if watched:
            ctx.runtime.clock.compute = Compute()  # what a watch on several processes sets
        state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
        return [p.detach().clone() for p in state.model.parameters()], ctx.runtime.clock.compute

    plain, _ = epoch(False)
    watched, compute = epoch(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert 1 == len(compute.handles) and compute.seconds > 0  # one hook kept: the last gradient's


def test_each_straggler_of_a_report_is_named_on_the_logger(caplog):
    """The report's warning names the process, its kind and both figures; a report that names nobody logs nothing."""
    from trainfold._src.compose.stragglers import say

    figures = per_process([0.0, 0.0, 0.3] + [0.1] * 3 + [0.3, 0.3, 0.0], 3, 1, 0.4, 0.25, 0.01)
    with caplog.at_level("WARNING", logger="trainfold"):
        say(figures, 40, 0.25)
        say(per_process([0.0] * 3 + [0.1] * 3 + [0.0] * 3, 3, 1, 0.1, 0.25, 0.01), 50, 0.25)
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "update 40: process 2 holds the others up (input): it waited for its data 0.3 s per update, the median process 0 s"
    )
