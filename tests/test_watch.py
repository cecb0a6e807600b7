"""Watching a run: ``log_every(ctx, n, watch=True)`` reports exact counts (samples, real tokens, FLOPs) and rates, the
shares of the wall time, and memory, from the report's one reduction: no sync of its own, nothing changed in training.

Token counts are checked against batches of known random padding, with accumulation 1 and 4, on 1 and 2 processes;
FLOPs against a hand count of a small MLP's matmuls.
"""

import contextlib
import time
import warnings

import attrs
import helpers
import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, Watch, checkpoint_every, log_every, loop, make_step, run_epoch, testing

BATCH, LENGTH, WIDTH = 4, 6, 3


class Padded(torch.utils.data.Dataset):
    """Sequences of LENGTH positions, each with a seeded random number of real tokens (at least one); the rest padding."""

    def __init__(self, n=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, LENGTH, WIDTH, generator=g)
        self.real = torch.randint(1, LENGTH + 1, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "mask": (torch.arange(LENGTH) < self.real[i]).float()}


def summed_loss(model, batch):
    per_token = (model(batch["x"]).squeeze(-1) - batch["x"].sum(-1)) ** 2
    return (per_token * batch["mask"]).sum(), {"tokens": batch["mask"].sum()}


def _reports(step, counted=None):
    """``step``, and the values of every report it makes, in order; with ``counted`` (a batch's count), also the counts
    of the batches between reports, counted here: ``reports[i]["counted"]``."""
    reports = []
    since = []

    def recorded(state, batch):
        new = step(state, batch)
        if counted is not None:
            since.append(counted(batch))
        report = new.extras.get("log_every")
        if new.step != state.step and report is not None and report.step == new.step:
            reports.append({**report.values, "counted": sum(since), "batches": len(since)})
            since.clear()
        return new

    return recorded, reports


def _token_run(accumulation, watch=True, epochs=2):
    """One process's run over Padded with token-normalised accumulation, a report at every update."""
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=accumulation))
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    dataset = Padded(seed=ctx.accelerator.process_index)  # each process its own padding
    (dl,) = ctx.own_shards(torch.utils.data.DataLoader(dataset, batch_size=BATCH))
    step, reports = _reports(
        log_every(ctx, 1, watch=watch)(make_step(ctx, summed_loss, normalize="tokens")),
        counted=lambda batch: int(batch["mask"].sum()),
    )
    state = loop(run_epoch(ctx, step, dl), max_epochs=epochs)(state)
    return ctx, state, reports, dataset


@pytest.mark.parametrize("accumulation", [1, 4])
def test_reports_count_tokens_and_samples(accumulation):
    """24 sequences of 6 positions, batches of 4 (6 an epoch), 1 to 6 real tokens each: every update's report holds the
    real tokens and the samples of the micro-batches since the last report, two epochs running; under accumulation 4
    an update's group spans the epoch's end (batches 5 and 6, then 1 and 2 of the next), and its tokens are all
    counted. The rates are those counts over the interval."""
    ctx, state, reports, dataset = _token_run(accumulation)
    ctx.close()

    assert 12 // accumulation == len(reports)
    assert all(r["time_update"] > 0 for r in reports)  # the update of a step with stages (normalize="tokens") is timed
    assert [r["counted"] for r in reports] == [r["tokens"] for r in reports]
    assert [BATCH * accumulation] * len(reports) == [r["samples"] for r in reports]
    assert int(dataset.real.sum()) * 2 == sum(r["tokens"] for r in reports)
    for r in reports:
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["interval_s"])
        assert r["updates_per_s"] == pytest.approx(1 / r["interval_s"])


def _two_process_tokens(accumulation):
    ctx, state, reports, _ = _token_run(accumulation)
    ctx.close()
    return [(r["tokens"], r["samples"], r["counted"], r["time_stop"]) for r in reports]


@pytest.mark.multiprocess
@pytest.mark.parametrize("accumulation", [1, 4])
def test_on_two_processes_a_report_counts_the_tokens_and_samples_of_both(accumulation):
    """Each process reads its own padding: every report, on both processes, holds the sum of both processes' counts
    (reduced in the report's one all-reduce)."""
    both = testing.run_distributed(_two_process_tokens, accumulation, nprocs=2)
    expected = [(float(a[2] + b[2]), float(2 * BATCH * accumulation)) for a, b in zip(*both)]

    assert 12 // accumulation == len(expected)
    assert [expected, expected] == [[r[:2] for r in reports] for reports in both]
    assert any(r[3] > 0 for reports in both for r in reports)  # the processes' stop agreement, timed where it runs
    assert sum(int(Padded(seed=rank).real.sum()) for rank in (0, 1)) * 2 == sum(t for t, _ in expected)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_each_epoch_records_its_samples_and_real_tokens_per_second(accumulation):
    """A watched run's epoch record holds its wall time and rates: every epoch reads the 24 sequences and their real
    tokens once (under accumulation 4 an update's group spans the epoch's end, and each epoch still counts its own
    batches). An unwatched run's records have none of them."""
    ctx, state, _, dataset = _token_run(accumulation)
    ctx.close()
    _, plain, _, _ = _token_run(accumulation, watch=False)
    history = state.history

    assert 2 == len(history["train_epoch_s"]) and all(s > 0 for s in history["train_epoch_s"])
    assert [24.0, 24.0] == [
        pytest.approx(r * s) for r, s in zip(history["train_samples_per_s"], history["train_epoch_s"])
    ]
    real = float(dataset.real.sum())
    assert [real, real] == [
        pytest.approx(r * s) for r, s in zip(history["train_tokens_per_s"], history["train_epoch_s"])
    ]
    assert history["train_loss"] == plain.history["train_loss"]
    assert not {"train_epoch_s", "train_samples_per_s", "train_tokens_per_s"} & set(plain.history.names)


def _peak_rss_gb():
    import resource
    import sys

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 1e9


def test_each_epoch_records_peak_memory():
    """The epoch's record holds the peak memory (on a CPU the process's peak resident memory so far, read at the epoch's
    end: between what it was before the run and after it, and never lower in a later epoch); with Watch(memory=False),
    none."""
    before = _peak_rss_gb()
    ctx, state, _, _ = _token_run(1)
    ctx.close()
    after = _peak_rss_gb()
    other, unwatched_memory, _, _ = _token_run(1, watch=Watch(memory=False))
    other.close()

    peaks = state.history["train_memory_rss_gb"]
    assert 2 == len(peaks) and before <= peaks[0] <= peaks[1] <= after
    assert (
        "train_memory_rss_gb" not in unwatched_memory.history.names
        and "train_samples_per_s" in unwatched_memory.history.names
    )


@helpers.needs_cuda
def test_cuda_peak_memory_of_every_interval():
    """A report reads CUDA's peak memory and resets it, at every update here; the epoch's record still holds the peak
    of the one batch that allocated 256 MB (each reading is folded into the epoch's peak too), and the reports after
    that batch's do not."""
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator())
    model = torch.nn.Linear(WIDTH, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(Padded(), batch_size=BATCH))
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        if calls[0] == 2:
            torch.empty(2**26, device=ctx.accelerator.device).fill_(1.0)  # 256 MB, freed at once
        return summed_loss(model, batch)

    step, reports = _reports(log_every(ctx, 1, watch=True)(make_step(ctx, loss_fn, normalize="tokens")))
    state = run_epoch(ctx, step, dl, state)
    ctx.close()

    assert reports[1]["memory_allocated_gb"] >= 0.268 and all(r["memory_allocated_gb"] < 0.1 for r in reports[2:])
    assert state.history["train_memory_allocated_gb"] == [pytest.approx(reports[1]["memory_allocated_gb"])]
    assert state.history["train_memory_reserved_gb"][0] >= 0.268


def _two_process_memory():
    before = _peak_rss_gb()
    ctx, state, _, _ = _token_run(1)
    ctx.close()
    return before, _peak_rss_gb(), state.history["train_memory_rss_gb"]


@pytest.mark.multiprocess
def test_peak_memory_on_two_processes():
    """Each process's peak rides in the epoch's one all-reduce: both record the same mean, which lies between the two
    processes' own peaks."""
    (before_0, after_0, peaks_0), (before_1, after_1, peaks_1) = testing.run_distributed(_two_process_memory, nprocs=2)

    assert peaks_0 == peaks_1 and 2 == len(peaks_0)
    assert all(min(before_0, before_1) <= p <= max(after_0, after_1) for p in peaks_0)


def _two_process_epochs():
    ctx, state, _, dataset = _token_run(4)
    ctx.close()
    history = state.history
    return float(dataset.real.sum()), [
        (r * s, t * s)
        for r, t, s in zip(history["train_samples_per_s"], history["train_tokens_per_s"], history["train_epoch_s"])
    ]


@pytest.mark.multiprocess
def test_on_two_processes_an_epoch_records_the_samples_and_tokens_of_both():
    """Each process reads its own 24 sequences with its own padding: each epoch's record, on both processes, counts 48
    samples and the real tokens of both (summed in the epoch's one all-reduce)."""
    (real_0, epochs_0), (real_1, epochs_1) = testing.run_distributed(_two_process_epochs, nprocs=2)

    for epochs in (epochs_0, epochs_1):
        assert [(48.0, real_0 + real_1)] * 2 == [(pytest.approx(s), pytest.approx(t)) for s, t in epochs]


def test_flops_per_sample_and_mfu():
    """Linear(8, 16), tanh, Linear(16, 1): per sample 2*8*16 + 2*16 forward, 2*16 + 2*16 backward through the second
    layer, 2*8*16 for the first layer's weight (its input needs no gradient): 608 FLOPs."""
    ctx, state, loader, _ = testing.tiny_setup(seed=0, n=40)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=8))
    mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    step, reports = _reports(log_every(ctx, 2, watch=Watch(peak_flops=1e9))(make_step(ctx, mse)))
    run_epoch(ctx, step, dl, state)

    assert [16, 16] == [r["samples"] for r in reports]
    assert [608 * 16] * 2 == [r["flops"] for r in reports]
    for r in reports:
        assert r["mfu"] == pytest.approx(r["flops"] / (r["interval_s"] * 1e9))
    ctx.close()


def test_flops_per_token_and_no_mfu_on_a_cpu():
    """A figure per token gives the flops and no peak on a CPU gives no MFU."""
    ctx, state, reports, dataset = _token_run(1, watch=Watch(flops_per_token=100.0), epochs=1)
    ctx.close()

    assert [100.0 * r["counted"] for r in reports] == [r["flops"] for r in reports]
    assert not any("mfu" in r for r in reports)


def test_flops_per_token_without_tokens_warns():
    """A figure per token with a loss that counts no tokens gives no FLOPs: said once, at the first report."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=32)
    step = log_every(ctx, 1, watch=Watch(flops_per_token=100.0))(make_step(ctx, loss_fn))

    with pytest.warns(UserWarning, match=r"flops_per_token.*counts no tokens.*normalize=\"tokens\"") as caught:
        state = run_epoch(ctx, step, loader, state)
    ctx.close()

    assert 1 == sum("flops_per_token" in str(w.message) for w in caught)
    assert state.step > 1
    assert "flops" not in state.extras["log_every"].values


def test_watching_changes_nothing_in_training_bit_for_bit():
    """The FLOPs are counted under a dispatch mode at the first step: the same kernels, the same numbers."""
    _, watched, _, _ = _token_run(4, watch=True)
    _, plain, _, _ = _token_run(4, watch=False)
    testing.assert_params_equal(plain, watched)
    assert watched.history["train_loss"] == plain.history["train_loss"]


def test_watching_adds_no_host_sync_to_an_epoch():
    """With reports far apart, an epoch of 40 batches syncs as often as one of 4, watched or not; with a report every 5
    updates, watching adds no sync to them: the counts ride in the report's own all-reduce."""

    def syncs(n_samples, watch, every):
        testing.reset_accelerate_state()
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=n_samples)
        step = log_every(ctx, every, watch=watch)(make_step(ctx, loss_fn))
        run_epoch(ctx, step, loader, state)  # the first step's FLOPs counted, the clock started
        with testing.count_host_syncs() as counted:
            run_epoch(ctx, step, loader, state)
        ctx.close()
        return counted.total

    assert syncs(16, True, 1000) == syncs(160, True, 1000) == syncs(160, False, 1000)
    assert syncs(160, True, 5) == syncs(160, False, 5)


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.full((8,), float(i)), torch.tensor(i % 2)


def test_the_time_shares_add_up_and_name_the_loader_and_the_checkpoints(tmp_path):
    """A loader that sleeps 4 ms a sample (16 ms a batch): each interval of 3 updates waits at least 2 batches' reading
    (the loader reads one ahead; the first batch is read before the first interval begins), whatever the machine's
    load; a checkpoint at every update shows; the shares add up to the whole interval; the process's peak memory is
    reported."""
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(Slow(), batch_size=4))
    step, reports = _reports(
        log_every(ctx, 3, watch=True)(checkpoint_every(ctx, 1, tmp_path)(make_step(ctx, helpers.ce_loss)))
    )
    run_epoch(ctx, step, dl, state)
    ctx.close()

    for r in reports:
        shares = {k: v for k, v in r.items() if k.startswith("time_")}
        assert {"time_data", "time_step", "time_update", "time_checkpoint", "time_stop"} == set(shares)
        assert sum(shares.values()) == pytest.approx(1.0)
        assert r["time_data"] * r["interval_s"] >= 2 * 0.016 * 0.99
        assert r["time_checkpoint"] > 0 and r["time_update"] > 0
        assert r["memory_rss_gb"] > 0.05


def test_watch_takes_a_bool_or_a_watch():
    ctx, *_ = testing.tiny_setup(seed=0)
    with pytest.raises(TypeError, match=r"watch=\.\.\.\) takes True, False or a trainfold.Watch, not str"):
        log_every(ctx, 2, watch="yes")
    ctx.close()


def test_a_resume_before_a_report_reports_it(tmp_path):
    """log_every outside checkpoint_every: the save at update 4 comes before the report at update 4, so the checkpoint's
    last report is update 2's. The resumed run's reports start from update 4's, as the uninterrupted run's do."""
    from trainfold import latest_checkpoint, load_checkpoint, max_steps

    def run(root, stop=None, resume=False):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=24)
        if resume:
            state = load_checkpoint(ctx, latest_checkpoint(root), state)
        inner = checkpoint_every(ctx, 2, root)(make_step(ctx, loss_fn))
        step, reports = _reports(log_every(ctx, 2)(max_steps(stop)(inner) if stop else inner))
        loop(run_epoch(ctx, step, loader), max_epochs=2)(state)
        ctx.close()
        return [r["loss"] for r in reports]

    clean = run(tmp_path / "clean")
    run(tmp_path / "stopped", stop=4)
    resumed = run(tmp_path / "stopped", resume=True)

    assert 6 == len(clean) and clean[2:] == resumed  # updates 6, 8, 10, 12


def test_the_progress_bar_shows_the_rates_of_the_last_report():
    import io

    from trainfold import progress_bar

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=32)
    out = io.StringIO()
    step = progress_bar(ctx, total=len(loader), force=True, file=out, mininterval=0)(
        log_every(ctx, 2, watch=True)(make_step(ctx, loss_fn))
    )
    run_epoch(ctx, step, loader, state)
    ctx.close()

    shown = out.getvalue()
    assert "samples_per_s=" in shown and "loss=" in shown and "8/8" in shown


def test_init_trackers_purges_tensorboard(tmp_path):
    """A resumed state at update 4: TensorBoard starts with purge_step 5 (what the run before logged after update 4 is
    dropped); a tracker that cannot cut its series is started as given, and a warning names it. A fresh state: no
    purge, no warning."""
    from trainfold import init_trackers

    mine = helpers.own_tracker()
    for step, warned in ((0, False), (4, True)):
        testing.reset_accelerate_state()
        accelerator = Accelerator(cpu=True, log_with=["tensorboard", mine], project_dir=str(tmp_path / str(step)))
        ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=accelerator)
        state = attrs.evolve(state, step=step)
        if warned:
            with pytest.warns(UserWarning, match=r"the run goes on from update 4, and mine cannot cut a series back"):
                init_trackers(ctx, "run", state)
        else:
            init_trackers(ctx, "run", state)
        board = next(t for t in ctx.accelerator.trackers if t.name == "tensorboard")
        assert ({"purge_step": 5} if warned else {}) == board.init_kwargs
        ctx.close()


@pytest.mark.parametrize("started_by", ["init_trackers", "accelerate"])
def test_trackers_started_before_the_load_warn(started_by, tmp_path):
    """Trackers started before load_checkpoint (trainfold's init_trackers given the fresh state, or Accelerate's own)
    start as a new run: a resumed run would log the updates after its checkpoint twice. The load says so and names
    the order that keeps each update once; trackers started after it are not warned about."""
    from trainfold import init_trackers, load_checkpoint, save_checkpoint

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    save_checkpoint(ctx, tmp_path / "root", run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
    ctx.close()
    testing.reset_accelerate_state()
    ctx, fresh, _, _ = testing.tiny_setup(
        seed=0, accelerator=Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    )
    if started_by == "init_trackers":
        init_trackers(ctx, "run", fresh)
    else:
        ctx.accelerator.init_trackers("run")

    with pytest.warns(
        UserWarning,
        match=r"the Accelerator's trackers \(tensorboard\) were started before this load.*"
        r"init_trackers\(ctx, project_name, state\) after load_checkpoint",
    ):
        load_checkpoint(ctx, tmp_path / "root", fresh)
    ctx.close()


@pytest.mark.parametrize("started_by", ["accelerate", "init_trackers"])
def test_trackers_started_after_the_load(started_by, tmp_path):
    """After the load: Accelerate's own init_trackers starts a new run (a resumed run's updates after its checkpoint
    would be logged twice), said at the first report; trainfold's init_trackers given the loaded state is not warned about."""
    from trainfold import init_trackers, load_checkpoint, log_every, save_checkpoint

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    save_checkpoint(ctx, tmp_path / "root", run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
    ctx.close()
    testing.reset_accelerate_state()
    ctx, fresh, loader, loss_fn = testing.tiny_setup(
        seed=0, accelerator=Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    )
    resumed = load_checkpoint(ctx, tmp_path / "root", fresh)
    step = log_every(ctx, 2)(make_step(ctx, loss_fn))
    if started_by == "accelerate":
        ctx.accelerator.init_trackers("run")
        with pytest.warns(
            UserWarning,
            match=r"the run resumed from update 4, and its trackers \(tensorboard\) were started by "
            r"accelerator.init_trackers.*init_trackers\(ctx, project_name, state\)",
        ):
            run_epoch(ctx, step, loader, resumed)
    else:
        init_trackers(ctx, "run", resumed)
        run_epoch(ctx, step, loader, resumed)  # (a warning would fail the test)
    ctx.close()


def test_a_resume_goes_on_with_mlflow(tmp_path, monkeypatch):
    """A first run logs updates 1-6 to MLflow, the epoch's record at update 6 too, and is cut off; resumed at update 3, it
    goes on with the MLflow run tagged with its run id, and MLflow is sent only what it lacks: updates 7 and 8, each key
    once. A tracker that keeps nothing of its own (``mine``) is sent everything, as before."""
    from mlflow.tracking import MlflowClient

    from trainfold import init_trackers
    from trainfold._src.compose.tracking import emit

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's file store: no server, no database
    run_id = None
    for first, updates in ((True, range(1, 7)), (False, range(4, 9))):
        testing.reset_accelerate_state()
        mine = helpers.own_tracker()
        ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with=["mlflow", mine]))
        state = attrs.evolve(state, run_id=run_id or state.run_id, step=0 if first else 3)
        run_id = state.run_id
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # mine cannot cut a series back: said
            init_trackers(ctx, "proj", state)
        for update in updates:
            emit(ctx, {"train/loss": update + (0.0 if first else 0.5)}, update)
            if update == 6:
                emit(ctx, {"train/loss_epoch": 10.0 + update}, update)
        assert [u for u, _ in mine.logged if u != 6] == [u for u in updates if u != 6]  # mine got every value
        assert not ctx.runtime.tracker_holds  # past what MLflow held: every value goes out again
        mlflow_run = next(t for t in ctx.accelerator.trackers if t.name == "mlflow").active_run.info.run_id
        ctx.accelerator.end_training()
        ctx.close()

    client = MlflowClient()
    assert [mlflow_run] == [
        r.info.run_id for r in client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    ]
    series = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run, key))
        for key in ("train/loss", "train/loss_epoch")
    }
    assert [(u, float(u)) for u in range(1, 7)] + [(7, 7.5), (8, 8.5)] == series["train/loss"]
    assert [(6, 16.0)] == series["train/loss_epoch"]


def test_an_epoch_record_is_not_logged_twice(tmp_path, monkeypatch):
    """A checkpoint saved in an epoch's last update (4) comes before the epoch's record at that update. The run before
    logged updates 1-5, the record at 4 too, and was cut off; resumed at 4, the run logs the record at 4 again, then 5
    and 6 (its values made different here, to tell them apart). TensorBoard (``purge_step`` 5 drops only what came after
    4) and MLflow each hold every point once, the record at 4 as the run before logged it. Found by the kill test: its
    kill once landed after such a record."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _, trackers = _cut_off_then_resumed(
        "proj", {"log_with": ["tensorboard", "mlflow"], "project_dir": str(tmp_path / "logs")}
    )
    mlflow_run = next(t for t in trackers[-1] if t.name == "mlflow").active_run.info.run_id

    board = EventAccumulator(str(tmp_path / "logs" / "proj"), size_guidance={"scalars": 0})
    board.Reload()
    client = MlflowClient()
    series = {
        "tensorboard": {
            tag: [(e.step, e.value) for e in board.Scalars(tag)] for tag in ("train/loss", "train/loss_epoch")
        },
        "mlflow": {
            key: sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run, key))
            for key in ("train/loss", "train/loss_epoch")
        },
    }
    # update 5: TensorBoard purged the first run's, MLflow kept it (it cannot delete; an exact resume logs the same)
    assert [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.5), (6, 6.5)] == series["tensorboard"]["train/loss"]
    assert [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.5)] == series["mlflow"]["train/loss"]
    assert [(4, 10.0)] == series["tensorboard"]["train/loss_epoch"] == series["mlflow"]["train/loss_epoch"]


def _cut_off_then_resumed(project, accelerator_kwargs, **init):
    """The run before logs updates 1-5, the epoch's record at 4 too, and is cut off; resumed at 4 with its run id, the run
    logs the record at 4 again, then 5 and 6 (values 0.5 higher, to tell them apart; no update at 4: log_every reported it
    before the checkpoint). Each run starts its trackers with init_trackers(ctx, project, state, **init); returns each
    run's trackers, as it ended."""
    from trainfold import init_trackers
    from trainfold._src.compose.tracking import emit

    run_id, trackers = None, []
    for first, updates in ((True, range(1, 6)), (False, range(4, 7))):
        testing.reset_accelerate_state()
        ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, **accelerator_kwargs))
        state = attrs.evolve(state, run_id=run_id or state.run_id, step=0 if first else 4)
        run_id = state.run_id
        init_trackers(ctx, project, state, **init)
        for update in updates:
            if first or update > 4:
                emit(ctx, {"train/loss": update + (0.0 if first else 0.5)}, update)
            if update == 4:
                emit(ctx, {"train/loss_epoch": 10.0 if first else 20.0}, update)
        trackers.append(list(ctx.accelerator.trackers))
        ctx.accelerator.end_training()
        ctx.close()
    return run_id, trackers


class _Killed(Exception):
    """What a kill does to a run, here: it stops inside a tracker's log."""


class _CutAt(helpers.OwnTracker):
    """A tracker of one's own that, given update ``at``, stops the run there: the trackers before it in ``log_with`` got
    that update, those after it did not, as when a kill lands while ``accelerator.log`` goes through them."""

    def __init__(self, at=None):
        super().__init__()
        self.at = at

    def log(self, values, step=None, **kwargs):
        if step == self.at:
            raise _Killed(step)
        super().log(values, step, **kwargs)


@pytest.mark.parametrize("saved_every, cut", [(2, 4), (3, 6)], ids=["inside-an-epoch", "at-an-epochs-end"])
@pytest.mark.parametrize("watch", [False, True], ids=["plain", "watched"])
def test_a_report_a_kill_kept_back_is_sent(tmp_path, monkeypatch, caplog, watch, saved_every, cut):
    """log_every(2) outside checkpoint_every: the report of the update ``cut`` is made after its checkpoint, so the
    resumed run goes on from the next update and the report at ``cut`` is never made again. The run before stopped while
    that report went through the trackers: TensorBoard got it, MLflow did not (the kill test found Trackio so, its writer
    thread behind). The resumed run makes that report again, from the checkpoint's sums (at an epoch's end, 6 of 6
    batches: from the sums the epoch closed with), and sends it to the trackers that lack it: each series holds every
    report once, with the uninterrupted run's values (the means of 2 updates, the learning rate, the epoch: to the last
    bit, watched or not). The logger does not print it again, and it has no rates (their interval was the run before's)."""
    import logging

    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainfold import init_trackers, latest_checkpoint, load_checkpoint

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's file store: no server, no database

    def run(name, cut=None, resume=False):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / name}/mlruns")
        testing.reset_accelerate_state()
        mine = helpers.own_tracker(_CutAt, cut)
        accelerator = Accelerator(cpu=True, log_with=["tensorboard", mine, "mlflow"], project_dir=str(tmp_path / name))
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=24, accelerator=accelerator)
        if resume:
            state = load_checkpoint(ctx, latest_checkpoint(tmp_path / name / "checkpoints"), state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # mine cannot cut a series back: said
            init_trackers(ctx, "proj", state)
        step = log_every(ctx, 2, watch=watch)(
            checkpoint_every(ctx, saved_every, tmp_path / name / "checkpoints")(make_step(ctx, loss_fn))
        )
        with pytest.raises(_Killed) if cut else contextlib.nullcontext():
            loop(run_epoch(ctx, step, loader), max_epochs=2)(state)
        ctx.accelerator.end_training()
        ctx.close()
        board = EventAccumulator(str(tmp_path / name / "proj"), size_guidance={"scalars": 0})
        board.Reload()
        client = MlflowClient()
        (mlflow_run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
        keys = ("train/loss", "train/lr", "epoch")
        rates.extend(m.step for m in client.get_metric_history(mlflow_run.info.run_id, "train/samples_per_s"))
        return (
            {
                key: sorted((e.step, e.value) for e in board.Scalars(key)) for key in keys
            },  # (two runs' files: read in either order)
            {
                key: sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, key))
                for key in keys
            },
        )

    rates = []
    clean = run("clean")
    board, mlflow = run("cut", cut=cut)
    assert (
        cut // 2 == len(board["train/loss"]) == len(mlflow["train/loss"]) + 1
    )  # the run before: TensorBoard got the cut report, MLflow not
    rates.clear()
    with caplog.at_level(logging.INFO, logger="trainfold"):
        board, mlflow = run("cut", resume=True)

    assert [2, 4, 6, 8, 10, 12] == [u for u, _ in clean[0]["train/loss"]]
    assert clean == (board, mlflow)
    printed = [m.split(":")[0] for m in caplog.messages if m.startswith("step ")]
    assert [f"step {u}" for u in range(cut + 2, 13, 2)] == printed
    assert sorted(rates) == ([u for u in range(2, 13, 2) if u != cut] if watch else [])


def test_a_resume_goes_on_with_dvclive(tmp_path, monkeypatch):
    """DVCLive started as Accelerate starts it (``Live(**init_kwargs)``) empties its folder: a resumed run erased the series
    of the run before. The run before logged updates 1-5, the epoch's record at 4 too, and was cut off; resumed at 4,
    the run goes on with DVCLive's files (``resume=True``) and is sent only what they lack: update 6, and not the
    record at 4 again. Each point once; those the run before logged, as it logged them (an exact resume logs the same)."""
    monkeypatch.chdir(tmp_path)  # (DVCLive reads git from where it runs: none here)
    folder = tmp_path / "dvclive"
    _cut_off_then_resumed("proj", {"log_with": "dvclive"}, init_kwargs={"dvclive": {"dir": str(folder)}})

    series = helpers.dvclive_series(folder)
    assert [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.5)] == series["train/loss"]
    assert [(4, 10.0)] == series["train/loss_epoch"]


@pytest.mark.parametrize(
    "damaged, content",
    [
        ("metrics.json", '{\n    "step": 5,\n    "tra'),
        ("metrics.json", ""),
        ("params.yaml", ""),
        ("params.yaml", "lr: [0.1\n"),
    ],
)
def test_a_cut_dvclive_file_is_set_aside(tmp_path, monkeypatch, damaged, content):
    """DVCLive rewrites its summary (``metrics.json``, at every step) and parameters (``params.yaml``, at every start)
    in place, so a kill can leave them cut short, and DVCLive going on with its folder fails on them (the kill test
    found the summary). init_trackers sets the file aside, says so, and the run goes on with the series (the ``.tsv``
    files are appended to, and whole); DVCLive writes the file anew."""
    from trainfold import init_trackers
    from trainfold._src.compose.tracking import emit

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "dvclive"
    (folder / "plots" / "metrics" / "train").mkdir(parents=True)
    (folder / "plots" / "metrics" / "train" / "loss.tsv").write_text("step\tloss\n4\t0.5\n5\t0.25\n")
    (folder / "metrics.json").write_text('{\n    "step": 5\n}\n')
    (folder / "params.yaml").write_text("lr: 0.1\n")
    (folder / damaged).write_text(content)
    ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with="dvclive"))

    with pytest.warns(UserWarning, match=rf"DVCLive's .* .*{damaged} is cut short .*set aside as .*{damaged}.damaged"):
        init_trackers(
            ctx, "proj", attrs.evolve(state, step=4), config={"lr": 0.1}, init_kwargs={"dvclive": {"dir": str(folder)}}
        )
    emit(ctx, {"train/loss": 0.125}, 6)
    ctx.accelerator.end_training()
    ctx.close()

    assert content == (folder / f"{damaged}.damaged").read_text()
    assert [(4, 0.5), (5, 0.25), (6, 0.125)] == helpers.dvclive_series(folder)["train/loss"]
    assert '"step": 6' in (folder / "metrics.json").read_text() and "lr: 0.1" in (folder / "params.yaml").read_text()


def test_an_unreadable_dvclive_file_is_named(tmp_path, monkeypatch):
    """A resumed run whose DVCLive folder holds a file it cannot read (a row not DVCLive's): init_trackers names the file
    and what may appear twice there, holds back what the other files hold, and the run goes on."""
    from trainfold import init_trackers

    monkeypatch.chdir(tmp_path)
    metrics = tmp_path / "dvclive" / "plots" / "metrics" / "train"
    metrics.mkdir(parents=True)
    (metrics / "loss.tsv").write_text("step\tloss\n1\t0.5\n5\t0.25\n")
    (metrics / "lr.tsv").write_text("step\tlr\n1\t0.1\nfive\t0.1\n")
    ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with="dvclive"))
    with pytest.warns(
        UserWarning,
        match=r"DVCLive's .*lr.tsv could not be read \(ValueError: .*five.*\), so what the run before logged to it at or after update 4",
    ):
        init_trackers(
            ctx, "proj", attrs.evolve(state, step=4), init_kwargs={"dvclive": {"dir": str(tmp_path / "dvclive")}}
        )
    assert {"dvclive": {"train/loss": 5}} == ctx.runtime.tracker_holds
    ctx.accelerator.end_training()
    ctx.close()


def test_a_resume_goes_on_with_trackio():
    """Trackio (its local store) keeps every row it is sent. The run before logged updates 1-5, the epoch's record at 4
    too, and was cut off; resumed at 4, the run goes on with the Trackio run whose config holds its run id, and is
    sent only what that run lacks: update 6, and not the record at 4 again. Each point once in one run; those the
    run before logged, as it logged them."""
    import uuid

    from trackio.sqlite_storage import SQLiteStorage

    project = f"proj-{uuid.uuid4().hex[:8]}"  # (the session's one store: a project of this test's own)
    run_id, trackers = _cut_off_then_resumed(project, {"log_with": "trackio"}, config={"lr": 0.1})
    names = [ended[0].run.name for ended in trackers]

    assert names[0] == names[1] and [names[0]] == SQLiteStorage.get_runs(project)
    rows = SQLiteStorage.get_logs(project, names[0])
    series = {
        key: [(row["step"], row[key]) for row in rows if key in row] for key in ("train/loss", "train/loss_epoch")
    }
    assert [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.5)] == series["train/loss"]
    assert [(4, 10.0)] == series["train/loss_epoch"]
    assert {"lr": 0.1, "trainfold.run_id": run_id}.items() <= SQLiteStorage.get_run_config(project, names[0]).items()


def test_a_resumed_run_given_its_trackio_runs_name_goes_on_with_that_run():
    """A name given in init_kwargs wins over the run id's mark: the resumed run goes on with the run of that name
    (resume="allow"; Trackio's own default would start a second run of the name), and is sent only what it lacks."""
    import uuid

    from trackio.sqlite_storage import SQLiteStorage

    project = f"proj-{uuid.uuid4().hex[:8]}"
    _, trackers = _cut_off_then_resumed(project, {"log_with": "trackio"}, init_kwargs={"trackio": {"name": "named"}})

    assert ["named", "named"] == [ended[0].run.name for ended in trackers]
    assert trackers[0][0].run.id == trackers[1][0].run.id and 1 == len(SQLiteStorage.get_run_records(project))
    rows = SQLiteStorage.get_logs(project, "named")
    assert [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.5)] == [
        (r["step"], r["train/loss"]) for r in rows if "train/loss" in r
    ]


def test_a_lost_trackio_run_starts_anew():
    """A resumed state whose run id no Trackio run of the project holds (another store, or a run killed before Trackio
    wrote anything): a warning names the project and the key, and the run starts a new Trackio run, marked with its id."""
    import uuid

    from trainfold import init_trackers

    project = f"proj-{uuid.uuid4().hex[:8]}"
    ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with="trackio"))
    state = attrs.evolve(state, step=3)
    with pytest.warns(
        UserWarning,
        match=rf"Trackio holds no run of project '{project}' whose config has trainfold.run_id={state.run_id}",
    ):
        init_trackers(ctx, project, state)
    run = ctx.accelerator.trackers[0].run
    assert state.run_id == run.config["trainfold.run_id"] and not ctx.runtime.tracker_holds
    ctx.accelerator.end_training()
    ctx.close()


def test_an_unreadable_trackio_store_is_named(monkeypatch):
    """A resumed run whose Trackio run its store's reader cannot read: init_trackers says what may then appear twice,
    and the run goes on logging everything."""
    from trackio.sqlite_storage import SQLiteStorage

    from trainfold import init_trackers

    def unreadable(*args, **kwargs):
        raise OSError("database disk image is malformed")

    monkeypatch.setattr(SQLiteStorage, "get_logs", unreadable)  # trackio's reader, not trainfold's code
    ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with="trackio"))
    with pytest.warns(
        UserWarning,
        match=r"Trackio's run '.*' of project 'proj-unread' could not be read \(OSError: database disk image",
    ):
        init_trackers(ctx, "proj-unread", attrs.evolve(state, step=4), init_kwargs={"trackio": {"name": "named"}})
    assert "named" == ctx.accelerator.trackers[0].run.name and not ctx.runtime.tracker_holds
    ctx.accelerator.end_training()
    ctx.close()


def test_unreadable_tensorboard_events_are_named(tmp_path, monkeypatch):
    """A resumed run whose TensorBoard events its reader cannot read (a folder it does not support, a damaged file):
    init_trackers says what may then appear twice, and the run goes on logging everything."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainfold import init_trackers

    def unreadable(self):
        raise OSError("no such filesystem")

    monkeypatch.setattr(EventAccumulator, "Reload", unreadable)  # tensorboard's reader, not trainfold's code
    ctx, state, _, _ = testing.tiny_setup(
        seed=0, accelerator=Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    )
    with pytest.warns(
        UserWarning,
        match=r"could not be read \(OSError: no such filesystem\), so what the run before logged at update 4",
    ):
        init_trackers(ctx, "proj", attrs.evolve(state, step=4))
    assert not ctx.runtime.tracker_holds
    ctx.close()


def test_a_lost_mlflow_run_starts_anew(tmp_path, monkeypatch):
    """A resumed state whose run id no MLflow run carries (another tracking store, say): a warning names the experiment
    and the tag, and the run logs into a new MLflow run, tagged with its id, holding nothing back."""
    from trainfold import init_trackers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    testing.reset_accelerate_state()
    ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with="mlflow"))
    state = attrs.evolve(state, step=3)

    with pytest.warns(
        UserWarning, match=rf"MLflow holds no run of experiment 'proj' tagged trainfold.run_id={state.run_id}"
    ):
        init_trackers(ctx, "proj", state)

    run = ctx.accelerator.trackers[0].active_run
    assert state.run_id == run.data.tags["trainfold.run_id"] and not ctx.runtime.tracker_holds
    ctx.accelerator.end_training()
    ctx.close()


def test_a_tracker_that_cannot_flush_is_named(tmp_path):
    """A checkpoint first has each tracker that writes behind (ClearML, Trackio) write what it was given. One whose own
    flush fails (here a stand-in named as Accelerate names ClearML's, its task's flush raising) is named in a warning,
    and the checkpoint is saved: a tracker's trouble does not cost the run its checkpoint."""
    from accelerate.tracking import GeneralTracker

    from trainfold import latest_checkpoint, save_checkpoint

    class Task:
        def flush(self, wait_for_uploads=False):
            raise OSError("No space left on device")

    class Broken(GeneralTracker):
        name, requires_logging_directory, main_process_only = "clearml", False, True

        def __init__(self):
            super().__init__()
            self.task = Task()

        @property
        def tracker(self):
            return self.task

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            pass

    ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with=[Broken()]))
    ctx.accelerator.init_trackers("proj")

    with pytest.warns(
        UserWarning,
        match=r"clearml could not be made to write what it was given before this checkpoint \(OSError: No space",
    ):
        save_checkpoint(ctx, tmp_path, state)
    assert latest_checkpoint(tmp_path) is not None
    ctx.close()


def test_a_watched_report_line_reads_at_a_glance(caplog):
    """The logger's line is for a person: no tracker prefixes, rates with units, the time split in percent adding up
    to about 100; the trackers and the state keep the full values."""
    import logging
    import re

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=32)
    with caplog.at_level(logging.INFO, logger="trainfold"):
        state = run_epoch(ctx, log_every(ctx, 4, watch=True)(make_step(ctx, loss_fn)), loader, state)
    ctx.close()

    line = caplog.records[-1].getMessage()
    assert line.startswith("step 8: epoch 1  loss ") and "train/" not in line
    assert re.search(r"  \|  [\d,]+ samples/s  [\d,]+ updates/s  [\d.]+ kFLOP/s  \|  time: step \d+%", line), line
    assert 95 <= sum(int(p) for p in re.findall(r"(\d+)%", line.split("time: ")[1].split("|")[0])) <= 105
    assert 0 < state.extras["log_every"].values["time_step"] < 1  # the state keeps the fraction
