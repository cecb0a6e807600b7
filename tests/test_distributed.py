"""Two gloo processes on CPU: the composed loop equals the canonical one, and evaluation is exact."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from trainfold import Context, TrainState, evaluate, loop, make_step, predict, run_epoch, testing

import helpers

pytestmark = (
    pytest.mark.multiprocess
)  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one

ROOT = Path(__file__).resolve().parent.parent


def _equivalence_on_this_rank(configs):
    """Per config: canonical params, trainfold params, and the recorded train losses."""
    out = []
    for cfg in configs:
        kw = dict(cpu=True, gradient_accumulation_steps=cfg.get("ga", 1))
        model, opt, sched, dl = helpers.build(0, dropout=0.2, shuffle=True, scheduler=True)
        torch.manual_seed(7)
        expected, _ = helpers.canonical_loop(
            Accelerator(**kw), model, opt, sched, dl, helpers.ce_loss, epochs=2, clip_norm=cfg.get("clip")
        )

        AcceleratorState._reset_state()  # keep the process group, forget the Accelerator settings
        GradientState._reset_state()
        model, opt, sched, dl = helpers.build(0, dropout=0.2, shuffle=True, scheduler=True)
        torch.manual_seed(7)
        ctx = Context(accelerator=Accelerator(**kw))
        state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
        (dl,) = ctx.prepare_loaders(dl)
        state = loop(run_epoch(ctx, make_step(ctx, helpers.ce_loss, clip_grad_norm=cfg.get("clip")), dl), max_epochs=2)(
            state
        )
        out.append((expected, testing.parameters(state), state.history["train_loss"], ctx.accelerator.num_processes))
        AcceleratorState._reset_state()
        GradientState._reset_state()
    return out


def test_composed_loop_equals_canonical_loop_on_two_processes():
    """With and without accumulation (and with clipping, dropout, shuffling, a scheduler): bit for bit, on both ranks."""
    configs = [{}, {"ga": 4, "clip": 0.5}]

    ranks = testing.run_distributed(_equivalence_on_this_rank, configs, nprocs=2)

    for per_config in zip(*ranks):
        (exp0, got0, losses0, world), (exp1, got1, losses1, _) = per_config
        assert 2 == world
        testing.assert_params_equal(exp0, got0)
        testing.assert_params_equal(exp1, got1)
        testing.assert_params_equal(got0, got1)  # DDP keeps the replicas identical
        assert losses0 == losses1  # recorded from values reduced over both ranks


def _evaluate_on_this_rank(n, batch_size):
    ctx = Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(0)
    model = helpers.mlp()
    data = helpers.classification_data(n)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=batch_size))
    new = evaluate(ctx, helpers.ce_loss_with_accuracy, dl, state)
    preds = predict(ctx, lambda m, b: m(b[0]), dl, state)
    labels = predict(ctx, lambda m, b: b[1], dl, state)
    with torch.no_grad():
        x, y = data.tensors
        logits = model(x)
        reference = (
            torch.nn.functional.cross_entropy(logits, y).item(),
            (logits.argmax(-1) == y).float().mean().item(),
        )
    ctx.close()
    return dict(new.metrics), reference, preds, labels, y, logits


@pytest.mark.parametrize("n,batch_size", [(50, 8), (7, 8), (48, 8)])
def test_evaluation_on_two_processes_counts_every_sample_once(n, batch_size):
    """Uneven datasets (padded last rounds) give the single-process means and every prediction once, in order."""
    ranks = testing.run_distributed(_evaluate_on_this_rank, n, batch_size, nprocs=2)

    for metrics, (loss, accuracy), preds, labels, y, logits in ranks:
        assert metrics["eval_loss"] == pytest.approx(loss, rel=1e-5)
        assert metrics["eval_accuracy"] == pytest.approx(accuracy, rel=1e-6)
        assert torch.equal(labels, y)
        torch.testing.assert_close(preds, logits, rtol=1e-5, atol=1e-6)


def _raise_on_rank_one():
    ctx = Context(accelerator=Accelerator(cpu=True))
    ctx_, state, loader, loss_fn = testing.tiny_setup(accelerator=ctx.accelerator)

    def loss(model, batch):
        if ctx.accelerator.process_index == 1 and state.micro_step == 0:
            raise ValueError("bad batch on rank one")
        return loss_fn(model, batch)

    with ctx_:
        run_epoch(ctx_, make_step(ctx_, loss), loader, state)


def test_an_error_on_one_rank_ends_the_run_with_that_error():
    with pytest.raises(RuntimeError, match="rank 1: ValueError: bad batch on rank one"):
        testing.run_distributed(_raise_on_rank_one, nprocs=2, timeout=60)


def _resume_by_itself_on_this_rank(root):
    from trainfold import CheckpointError, load_checkpoint, save_checkpoint

    ctx, state, dl = helpers.setup()
    fresh = load_checkpoint(ctx, f"{root}/shared", state, missing_ok=True)
    saved = save_checkpoint(ctx, f"{root}/shared", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, fresh))
    resumed = load_checkpoint(ctx, f"{root}/shared", state, missing_ok=True)
    mine = f"{root}/shared" if ctx.accelerator.process_index == 0 else f"{root}/local-{ctx.accelerator.process_index}"
    try:
        load_checkpoint(ctx, mine, state, missing_ok=True)
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    ctx.close()
    return fresh is state, saved.step, resumed.step, refused


def test_missing_ok_agrees_on_what_every_process_sees(tmp_path):
    """A shared root: a fresh start, then a resume, alike on both processes. A root that is a local folder on each
    node (here: another folder on process 1) is refused on both, naming what each saw, instead of one process
    loading while the other starts fresh."""
    ranks = testing.run_distributed(_resume_by_itself_on_this_rank, str(tmp_path), nprocs=2, timeout=120)

    for fresh, saved, resumed, refused in ranks:
        assert fresh and resumed == saved == 6
        assert "process 0 ckpt-0000000006, process 1 none" in refused
        assert "every node must see the same root" in refused


def test_digits_example_under_torchrun_on_two_cpu_processes():
    """The same script runs unchanged under torchrun and ends cleanly."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(testing.free_port()),
        str(ROOT / "examples" / "digits.py"),
        "--smoke",
        "--cpu",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=helpers.scaled(600), env=_env())

    assert 0 == result.returncode, result.stderr[-3000:]
    assert 1 == result.stdout.count("test accuracy")  # printed by the main process only
    assert "on 360 samples after 24 updates on 2 process(es)" in result.stdout


def test_digits_example_under_accelerate_launch_with_the_readme_config():
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--config_file",
        str(ROOT / "examples" / "launch" / "cpu_2proc.yaml"),
        "--main_process_port",
        str(testing.free_port()),
        str(ROOT / "examples" / "digits.py"),
        "--smoke",
        "--cpu",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=helpers.scaled(600), env=_env())

    assert 0 == result.returncode, result.stderr[-3000:]
    assert "on 360 samples after 24 updates on 2 process(es)" in result.stdout


@pytest.mark.parametrize("launcher", ["debug", "notebook"])
def test_the_same_loop_under_accelerates_python_launchers(launcher):
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "launchers.py"), launcher, str(testing.free_port())]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=helpers.scaled(600), env=_env())

    assert 0 == result.returncode, result.stderr[-3000:]
    assert "processes 2 steps 5 eval_loss" in result.stdout


def _early_stop_on_rank_one_data():
    from toolz import compose

    from trainfold import early_stop

    ctx = Context(accelerator=Accelerator(cpu=True))
    ctx_, state, loader, loss_fn = testing.tiny_setup(accelerator=ctx.accelerator)
    rank = ctx.accelerator.process_index

    def eval_fn(model, batch):
        # Only rank 1's data gets worse, from epoch 2 on.
        worse = torch.tensor(float(rank == 1 and state_box[0].epoch >= 2))
        return loss_fn(model, batch), {"bad": worse}

    state_box = [state]

    def remember(s):
        state_box[0] = s
        return s

    epoch = compose(
        early_stop("eval_bad", patience=1, mode="min"),
        evaluate(ctx, eval_fn, loader),
        remember,
        run_epoch(ctx, make_step(ctx, loss_fn), loader),
    )
    final = loop(epoch, max_epochs=10)(state)
    ctx.close()
    return final.epoch, final.should_stop, final.history["eval_bad"]


def test_an_early_stop_decided_on_one_ranks_data_stops_both_ranks():
    """Metrics are reduced over processes before any decision: both ranks stop after the same epoch."""
    (epoch0, stop0, bad0), (epoch1, stop1, bad1) = testing.run_distributed(
        _early_stop_on_rank_one_data, nprocs=2, timeout=60
    )

    assert (2, True) == (epoch0, stop0) == (epoch1, stop1)
    assert bad0 == bad1 == (0.0, 0.5)


def _env():
    import os

    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def _checkpoint_on_this_rank(root):
    from trainfold import checkpoint_every, list_checkpoints, load_checkpoint

    def setup(seed):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        torch.manual_seed(seed)
        ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
        model = helpers.mlp(dropout=0.3)
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        (dl,) = ctx.prepare_loaders(
            torch.utils.data.DataLoader(helpers.classification_data(44), batch_size=4, shuffle=True)
        )
        return ctx, state, dl

    def train(ctx, state, dl, wrap=lambda s: s):
        end = getattr(wrap, "at_end", lambda s: s)  # a checkpoint_every saves the loop's end too
        return end(loop(run_epoch(ctx, wrap(make_step(ctx, helpers.ce_loss)), dl), max_epochs=2)(state))

    uninterrupted = train(*setup(0))
    expected = (testing.parameters(uninterrupted), uninterrupted.history)
    ctx, state, dl = setup(0)
    train(ctx, state, dl, checkpoint_every(ctx, 1, root))
    ckpts = list_checkpoints(root)
    results = []
    for ckpt in (ckpts[1], ckpts[len(ckpts) // 2], ckpts[-1]):
        ctx, state, dl = setup(99)
        resumed = train(ctx, load_checkpoint(ctx, ckpt, state), dl)
        results.append((ckpt.name, testing.parameters(resumed), resumed.history))

    # A checkpoint between epochs (as fit writes them): the loader's synchronized generator is kept too.
    from trainfold import save_checkpoint

    ctx, state, dl = setup(0)
    state = save_checkpoint(ctx, f"{root}/boundary", run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
    ctx, fresh, dl = setup(99)
    resumed = train(ctx, load_checkpoint(ctx, f"{root}/boundary", fresh), dl)
    results.append(("boundary", testing.parameters(resumed), None))
    save_checkpoint(
        ctx, f"{root}/gathered", resumed, sharded=False
    )  # the gathered format: dealt out to replicas on resume
    return expected, results, [c.name for c in ckpts]


def test_checkpoints_on_two_processes_resume_exactly(tmp_path):
    """One writer for shared files, each rank its own random state and read-ahead batch; resume is bit-exact."""
    from trainfold import CheckpointError, latest_checkpoint, load_checkpoint, verify_checkpoint

    ranks = testing.run_distributed(_checkpoint_on_this_rank, str(tmp_path), nprocs=2)

    for (expected, history), results, names in ranks:
        assert 6 == len(names)  # 44 samples, 2 ranks x batch 4: 6 batches each, 3 updates an epoch
        for name, params, resumed_history in results:
            testing.assert_params_equal(expected, params)
            # the interrupted epoch's train_loss too: each rank resumes its own running sums, not rank 0's
            assert resumed_history in (None, history), name
    assert {f"rank-{r}.safetensors" for r in (0, 1)} <= {p.name for p in (tmp_path / names[0]).iterdir()}

    assert "model.safetensors" in verify_checkpoint(latest_checkpoint(tmp_path / "gathered"))["files"]
    # the gathered format holds the whole model and optimizer: it continues on one process too (a replica)
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    torch.manual_seed(5)
    model = helpers.mlp(dropout=0.3)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    resumed = load_checkpoint(ctx, tmp_path / "gathered", state)
    testing.assert_params_equal(ranks[0][1][-1][1], resumed)
    other_ctx, other_model_state, _, _ = testing.tiny_setup()
    with pytest.raises(CheckpointError, match=r"another model"):
        load_checkpoint(other_ctx, tmp_path / "gathered", other_model_state)


def _token_step_on_this_rank():
    import test_tokens as tt

    seqs = tt._sequences()
    mine = (
        [tt._pad(seqs[:2], 6), tt._pad(seqs[2:3], 4)]
        if int(__import__("os").environ["RANK"]) == 0
        else [tt._pad(seqs[3:6], 5), tt._pad(seqs[6:], 2)]
    )
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    model = tt._lm()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    state = testing.run_steps(make_step(ctx, tt.summed_loss, normalize="tokens"), state, mine)
    ctx.close()
    return state.step, testing.parameters(state)


def test_token_normalization_spans_every_process():
    """Two ranks, two micro-batches each, all of different lengths: the update equals one big batch of everything."""
    import test_tokens as tt

    ranks = testing.run_distributed(_token_step_on_this_rank, nprocs=2)
    big = tt._train(1, tt.mean_loss, [tt._pad(tt._sequences(), 6)])

    for step, params in ranks:
        assert 1 == step
        testing.assert_params_equal(big, params, rtol=1e-5, atol=1e-6)


def test_a_run_that_frees_its_ddp_model_after_closing_ends_every_time():
    """The model's reducer keeps the process group, so freeing it after ``ctx.close()`` destroys the group; at the wrong
    moment gloo's worker thread needed the GIL the destroying thread held, and the process hung for good (about one
    call in five, with the forkserver's preload). Fifteen short runs, each bounded: every one ends."""
    for _ in range(15):
        ranks = testing.run_distributed(_token_step_on_this_rank, nprocs=2, timeout=30)

        assert [1, 1] == [step for step, _ in ranks]


def _token_weighted_train_loss_on_this_rank():
    import test_tokens as tt

    seqs = tt._sequences()
    rank = int(__import__("os").environ["RANK"])
    mine = [tt._pad(seqs[:2], 6), tt._pad(seqs[2:3], 4)] if rank == 0 else [tt._pad(seqs[3:6], 5), tt._pad(seqs[6:], 2)]
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = tt._lm()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))  # fixed weights
    state = run_epoch(ctx, make_step(ctx, tt.summed_loss, normalize="tokens"), ctx.own_shards(mine)[0], state)
    ctx.close()
    return state.history["train_loss"][-1]


def test_token_weighted_train_loss_spans_every_process():
    """Rank 0 has 9 tokens, rank 1 11: the recorded loss is all 20 token losses over 20, not a mean of ranks' means."""
    import test_tokens as tt

    ranks = testing.run_distributed(_token_weighted_train_loss_on_this_rank, nprocs=2)
    seqs = tt._sequences()
    expected = tt._per_token_loss(
        tt._lm(), [tt._pad(seqs[:2], 6), tt._pad(seqs[2:3], 4), tt._pad(seqs[3:6], 5), tt._pad(seqs[6:], 2)]
    )

    assert ranks[0] == ranks[1] == pytest.approx(expected, rel=1e-6)


def _barrier_on_this_rank(root):
    import time

    with Context(accelerator=Accelerator(cpu=True)) as ctx:
        if ctx.is_main_process:
            time.sleep(1.0)  # rank 1 reaches the barrier long before rank 0 writes
            (Path(root) / "written-before-the-barrier").touch()
        ctx.wait_for_everyone()
        return (Path(root) / "written-before-the-barrier").exists()


def test_wait_for_everyone_holds_every_rank_until_all_arrive(tmp_path):
    """Context.wait_for_everyone is a real barrier across CPU processes (it bypasses Accelerate's, which
    asks for one GPU per process and fails on a machine with fewer GPUs than processes)."""
    assert [True, True] == testing.run_distributed(_barrier_on_this_rank, str(tmp_path), nprocs=2, timeout=60)


def _save_into_another_runs_root(folder):
    from trainfold import CheckpointError, save_checkpoint

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        save_checkpoint(ctx, folder, state)
        return "saved"
    except CheckpointError as exc:
        return "refused: " + str(exc)[:60]
    finally:
        ctx.close()


def test_a_refused_save_is_refused_on_every_rank_and_none_waits(tmp_path):
    """The main process finds another run's checkpoints; the other rank learns it instead of waiting forever."""
    from trainfold import save_checkpoint

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(2, 1)
    save_checkpoint(
        ctx, tmp_path, TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    )
    ctx.close()  # this process's lock goes: only the other run's checkpoint stays

    ranks = testing.run_distributed(_save_into_another_runs_root, str(tmp_path), nprocs=2, timeout=60)

    assert all(r.startswith("refused") for r in ranks), ranks


def _end_training_inside_the_with_block():
    with Context(accelerator=Accelerator(cpu=True)) as ctx:
        ctx.wait_for_everyone()
        ctx.accelerator.end_training()  # the usual Accelerate ending
    return "ok"


def test_end_training_inside_with_context_is_harmless():
    """Before, __exit__'s barrier crashed every process: 'Default process group has not been initialized'."""
    assert ["ok", "ok"] == testing.run_distributed(_end_training_inside_the_with_block, nprocs=2, timeout=60)


def _unprepared_on_this_rank(kind):
    ctx = Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(0)
    model = helpers.mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = helpers.classification_data(16)
    if kind == "distributed_sampler":  # shards itself: taken as it is
        sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
        dl = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    else:
        dl = torch.utils.data.DataLoader(data, batch_size=4)
        if kind == "marked":
            (dl,) = ctx.own_shards(dl)
    outcomes = []
    for call in (
        lambda: run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state),
        lambda: evaluate(ctx, helpers.ce_loss, dl, state),
        lambda: predict(ctx, lambda m, b: m(b[0]), dl, state),
    ):
        try:
            call()
            outcomes.append("ran")
        except ValueError as exc:
            outcomes.append(str(exc))
    ctx.close()
    return outcomes


def test_an_unprepared_loader_on_two_processes():
    """Each rank would read the whole dataset (twice the updates per epoch, every sample twice): refused before any batch."""
    for outcomes in testing.run_distributed(_unprepared_on_this_rank, "plain", nprocs=2, timeout=60):
        for where, message in zip(("run_epoch", "evaluate", "predict"), outcomes):
            assert message.startswith(
                f"{where}: the loader was not prepared, so each of the 2 processes would read the whole dataset"
            )
            assert "ctx.prepare_loaders(loader)" in message and "ctx.own_shards(loader)" in message


@pytest.mark.parametrize("kind", ["marked", "distributed_sampler"])
def test_a_loader_that_shards_itself_is_taken_on_two_processes(kind):
    for outcomes in testing.run_distributed(_unprepared_on_this_rank, kind, nprocs=2, timeout=60):
        assert ["ran", "ran", "ran"] == outcomes


def _environment_and_threads():
    import os

    import fsspec.config

    return (
        os.environ.get("TRAINFOLD_PROBE"),
        "TRAINFOLD_GONE" in os.environ,
        torch.get_num_threads(),
        fsspec.config.conf.get("s3", {}).get("endpoint_url"),
    )


def test_processes_start_with_the_callers_environ(monkeypatch):
    """The processes come from a server started at the first call; what the caller's environment says at a later call
    (a variable set, one removed, the thread count, an fsspec setting, which fsspec reads when it is imported: the
    server imported it, under datasets) is what each process has, as a spawned interpreter would."""
    monkeypatch.setenv("TRAINFOLD_GONE", "1")
    testing.run_distributed(_environment_and_threads, nprocs=2)  # the server has started, with TRAINFOLD_GONE set
    monkeypatch.setenv("TRAINFOLD_PROBE", "set after the server started")
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("TRAINFOLD_GONE")
    for threads in (1, 2):
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))

        got = testing.run_distributed(_environment_and_threads, nprocs=2)

        assert got == [("set after the server started", False, threads, "http://127.0.0.1:9")] * 2


def _read_by_loader_workers():
    import torch

    data = torch.utils.data.TensorDataset(torch.arange(12.0))
    return sorted(
        float(x) for (batch,) in torch.utils.data.DataLoader(data, batch_size=4, num_workers=2) for x in batch
    )


def test_a_process_may_read_its_data_with_loader_workers():
    """A DataLoader with num_workers > 0 starts processes of its own, which a daemonic process may not."""
    assert [[float(i) for i in range(12)]] * 2 == testing.run_distributed(_read_by_loader_workers, nprocs=2)


def _sleep_after_noting_the_pid(folder):
    import os
    import time

    Path(folder, f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(600)


def test_an_interrupted_call_leaves_no_process_behind(tmp_path):
    """Ctrl-C in the caller while the ranks run: the call stops them and the caller exits (non-daemonic processes would
    otherwise be waited for at exit)."""
    import os
    import signal
    import time

    # Ctrl-C reaches the caller whatever this process inherited (a background job starts with SIGINT ignored); the caller
    # leads a process group of its own, with the forkserver and the ranks in it, so that a failure kills them all
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
        "sys.path.insert(0, sys.argv[2]); from trainfold import testing; import test_distributed as t\n"
        "testing.run_distributed(t._sleep_after_noting_the_pid, sys.argv[1], nprocs=2, timeout=600)"
    )
    caller = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path), str(Path(__file__).parent)],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + helpers.scaled(120)
    while len(list(tmp_path.glob("pid-*"))) < 2 and caller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    caller.send_signal(signal.SIGINT)
    try:
        _, err = caller.communicate(timeout=helpers.scaled(60))
    finally:  # a failure leaves nothing running: the caller's group (the forkserver, the ranks) killed
        try:
            os.killpg(caller.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        caller.communicate(timeout=helpers.scaled(60))

    assert 2 == len(pids)
    assert "KeyboardInterrupt" in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (killed and reaped by the call)


def _imported_at_start():
    import sys

    return sorted(
        name
        for name in ("torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo", "datasets")
        if name in sys.modules
    )


def test_processes_start_with_lazy_imports_done():
    """FSDP2, distributed checkpointing, dynamo (an optimizer's constructor) and datasets (Accelerate's prepare_data_loader)
    cost a fresh process ~4 s of CPU to import; forked from the server, a process has them before its function runs."""
    got = testing.run_distributed(_imported_at_start, nprocs=2)

    assert got == [["datasets", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp"]] * 2


def _a_sub_group_formed_after_rank_zero_returned():
    import time

    acc = Accelerator(cpu=True)
    if acc.process_index == 0:
        return None
    time.sleep(1.0)  # rank 0's function has long returned; its process holds the group's TCP store
    group = torch.distributed.new_group([1, 2], use_local_synchronization=True)  # only the members: through the store
    total = torch.ones(1)
    torch.distributed.all_reduce(total, group=group)
    return total.item()


def test_no_process_leaves_while_the_others_still_need_the_group_s_store():
    """A mesh's sub-groups are set up through rank 0's TCP store; a rank that returned first (a refusal before any
    collective) must not take the store with it: nobody leaves before every rank has its result (without that wait,
    the other ranks fail with 'Broken pipe')."""
    assert testing.run_distributed(_a_sub_group_formed_after_rank_zero_returned, nprocs=3) == [None, 2.0, 2.0]


def _sleeps(seconds):
    import time

    time.sleep(seconds)
    return seconds


def test_run_distributed_stretches_its_time_limit_by_the_machines_load(monkeypatch):
    """A limit is a hang-guard: on a machine at load 5 per core, 1 s after the start is 5 s, and a run of 2 s
    finishes; on a quiet machine the same run is stopped at 1 s, with the limit it had in the error."""
    from trainfold._src.distributed import launch

    monkeypatch.setattr(launch, "load_factor", lambda: 5.0)
    assert [2.0] == testing.run_distributed(_sleeps, 2.0, nprocs=1, timeout=1)
    monkeypatch.setattr(launch, "load_factor", lambda: 1.0)
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 1s of starting"):
        testing.run_distributed(_sleeps, 30.0, nprocs=1, timeout=1)


@pytest.mark.parametrize(
    "load, cores, factor", [((8.0, 1.0, 1.0), {0, 1}, 4.0), ((1.5, 9.0, 9.0), {0, 1}, 1.0), (OSError, {0}, 1.0)]
)
def test_the_load_factor(monkeypatch, load, cores, factor):
    """The load factor is the one minute load per core and never below one."""
    import os

    from trainfold._src.distributed import launch

    def getloadavg():
        if load is OSError:
            raise OSError("no load average here")
        return load

    monkeypatch.setattr(os, "getloadavg", getloadavg)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores, raising=False)
    assert factor == launch.load_factor()
