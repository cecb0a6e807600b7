"""Host memory at a save and a load, measured as the operating system counts it: the process's peak resident memory
(``VmHWM``, reset before the operation through ``/proc/self/clear_refs``) over its resident memory before. A blocking
save writes from the live tensors (no copy of the state); a load stages every file once, verified, before the live
model changes (the state once: what all-or-nothing costs, no second copy), and the staged buffers become the model's
tensors; background saves, one after another, leave the resident memory flat."""

import ctypes
import ctypes.util
import gc

import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    load_checkpoint,
    make_step,
    save_checkpoint,
    testing,
)

MiB = 1 << 20


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def _resident_in_use():
    """The resident memory once the C allocator has handed its free pages back (glibc's ``malloc_trim``): what the
    process holds, not what the allocator keeps free for later (its arenas, one a thread, grow and shrink with the
    machine's load)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    return _status("VmRSS")


def _reset_peak():
    """Reset the peak resident memory to the current one (Linux 4.0 and later), or skip where the system cannot.

    The garbage of what ran before (an earlier test's state in a reference cycle) is collected first: collected after
    the reset, it stayed in the peak and was counted as the operation's growth (100 MiB and more, in a full run)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"the peak resident memory cannot be reset here ({exc})")
    return _status("VmRSS")


def _grown_by(operation):
    """How far the peak resident memory rose above the resident memory while ``operation()`` ran, in bytes."""
    before = _reset_peak()
    operation()
    return _status("VmHWM") - before


def _state(ctx, width=1024, layers=8):
    """``layers`` x Linear(width, width) with AdamW's state after one update: 3 x 4 MiB a layer at the default width."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    state = make_step(ctx, lambda m, b: m(b).pow(2).mean())(state, torch.randn(4, width))
    values = sum(p.numel() for p in model.parameters())
    return state, 3 * 4 * values, 4 * width * width  # the state's bytes, the largest tensor's


@pytest.fixture
def ctx():
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True), signals=())
    yield ctx
    ctx.close()
    testing.reset_accelerate_state()


def test_a_blocking_save_does_not_copy_the_state(ctx, tmp_path):
    """A 96 MiB state saved (and fsynced) grows the process by less than max(64 MiB, twice its largest tensor)."""
    state, state_bytes, largest = _state(ctx)
    save_checkpoint(ctx, tmp_path, state)  # (the first save's one-time work: the root's lock, imports)

    grown = _grown_by(
        lambda: save_checkpoint(ctx, tmp_path, make_step(ctx, lambda m, b: m(b).sum())(state, torch.ones(1, 1024)))
    )

    assert state_bytes > 90 * MiB and grown < max(64 * MiB, 2 * largest), grown / MiB


def test_a_load_into_a_live_model_stages_the_state_once(ctx, tmp_path):
    """A load reads every file, verified, before it changes the live model: it grows the process by the state once at
    most (plus what decoding the small files takes), not twice."""
    state, state_bytes, _ = _state(ctx)
    save_checkpoint(ctx, tmp_path, state)
    load_checkpoint(ctx, tmp_path, state)  # (the first load's one-time work)

    grown = _grown_by(lambda: load_checkpoint(ctx, tmp_path, state))

    assert grown < state_bytes + 16 * MiB, (grown / MiB, state_bytes / MiB)


def test_a_load_into_a_model_with_no_values_yet_adds_the_state_alone(ctx, tmp_path):
    """A model built on the meta device and given memory by ``to_empty`` holds no values: the verified buffers become
    its tensors, so a load grows the process by the state alone (copied in, the weights would be resident twice: 108
    MiB more here) and the memory ``to_empty`` gave is handed back untouched. Each weight is 36 MiB, above the C
    allocator's largest threshold for mapping a block of its own: ``to_empty``'s memory is fresh pages, not pages an
    earlier tensor left resident."""

    def model():
        return torch.nn.Sequential(*[torch.nn.Linear(3072, 3072, bias=False) for _ in range(3)])

    torch.manual_seed(0)
    live = model()
    state = TrainState.create(ctx, model=live, optimizer=torch.optim.SGD(live.parameters(), lr=0.1))
    state_bytes = sum(p.nbytes for p in live.parameters())
    save_checkpoint(ctx, tmp_path, state)
    load_checkpoint(ctx, tmp_path, state)  # (the first load's one-time work)
    with torch.device("meta"):
        empty = model()
    empty.to_empty(device="cpu")
    fresh = TrainState.create(ctx, model=empty, optimizer=torch.optim.SGD(empty.parameters(), lr=0.1))

    out = []
    grown = _grown_by(lambda: out.append(load_checkpoint(ctx, tmp_path, fresh)))

    assert grown < state_bytes + 16 * MiB, (grown / MiB, state_bytes / MiB)
    testing.assert_params_equal(state, out[0])


def _hundred_background_saves(root, keep_last=2):
    """100 background saves of a 6 MiB state after 100 to warm up (the allocator's arenas, the saver thread's, grow to
    their steady size over the first tens): the resident memory in use before and after, in bytes. Counted with what
    the allocator holds free, the 100 saves grew two sharded processes of 426 MiB by 5.6 MiB on a busy machine; in use,
    they grow by 0.1 to 0.6 MiB of 355."""
    ctx = Context(accelerator=Accelerator(cpu=True), signals=())
    state, _, _ = _state(ctx, width=256, layers=8)
    step = make_step(ctx, lambda m, b: m(b).pow(2).mean())
    x = torch.randn(4, 256)
    for i in range(200):
        state = step(state, x)
        save_checkpoint(ctx, root, state, async_save=True, keep_last=keep_last)
        if i == 99:
            ctx.wait_for_checkpoints()
            before = _resident_in_use()
    ctx.wait_for_checkpoints()
    after = _resident_in_use()
    ctx.close()
    return before, after


def test_a_hundred_background_saves_leave_memory_flat(tmp_path):
    """No copy, thread or buffer of a background save outlives it: after 100 more, the resident memory is within 1%."""
    testing.reset_accelerate_state()
    try:
        before, after = _hundred_background_saves(str(tmp_path))
    finally:
        testing.reset_accelerate_state()

    assert after <= 1.01 * before, (before / MiB, after / MiB)


@pytest.mark.multiprocess
def test_a_hundred_sharded_background_saves_leave_memory_flat(tmp_path):
    """The same on two processes, sharded (DCP's planning and a gloo group of the saves' own, on the saver thread)."""
    for before, after in testing.run_distributed(_hundred_background_saves, str(tmp_path), nprocs=2, timeout=600):
        assert after <= 1.01 * before, (before / MiB, after / MiB)


def test_a_background_save_counts_the_copy_it_would_make(ctx):
    """What a background save copies, counted before it copies: the weights and AdamW's two moments (and its step
    counters), each storage once."""
    from trainfold._src.checkpoint.staging_budget import bytes_to_copy

    state, state_bytes, _ = _state(ctx, width=256, layers=4)

    assert state_bytes <= bytes_to_copy(ctx, state) <= state_bytes + 4 * 8 * 2  # + AdamW's 0-d step of each tensor


def test_a_background_save_within_its_staging_budget_runs_in_the_background(ctx, tmp_path, caplog):
    state, state_bytes, _ = _state(ctx)
    save_checkpoint(ctx, tmp_path, state)

    with caplog.at_level("WARNING", logger="trainfold"):
        save_checkpoint(ctx, tmp_path, state, async_save=True, staging_budget=state_bytes + MiB, keep_last=1)
        in_flight = ctx.runtime.saver.in_flight  # 96 MiB to write and fsync: still being written
        ctx.wait_for_checkpoints()

    assert in_flight and not [r for r in caplog.records if "staging_budget" in r.getMessage()]


def test_a_background_save_over_its_staging_budget_is_written_before_it_returns_with_no_copy(ctx, tmp_path, caplog):
    """A 96 MiB state with a 32 MiB budget: saved as a blocking save (committed at return), growing the process by less
    than max(64 MiB, twice its largest tensor); said once."""

    state, state_bytes, largest = _state(ctx)
    save_checkpoint(ctx, tmp_path, state)
    step = make_step(ctx, lambda m, b: m(b).sum())

    state = step(state, torch.ones(1, 1024))
    with caplog.at_level("WARNING", logger="trainfold"):
        grown = _grown_by(lambda: save_checkpoint(ctx, tmp_path, state, async_save=True, staging_budget=32 * MiB))
        assert latest_checkpoint(tmp_path).name == f"ckpt-{state.step:010d}"  # committed before it returned
        state = step(state, torch.ones(1, 1024))
        save_checkpoint(ctx, tmp_path, state, async_save=True, staging_budget=32 * MiB)

    assert grown < max(64 * MiB, 2 * largest), grown / MiB
    said = [r.getMessage() for r in caplog.records if "staging_budget" in r.getMessage()]
    assert len(said) == 1 and f"{(state_bytes - 32 * MiB) / MiB:.0f}." in said[0], said


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda ctx, root, state: save_checkpoint(ctx, root, state, staging_budget=MiB), "pass async_save=True"),
        (lambda ctx, root, state: save_checkpoint(ctx, root, state, async_save=True, staging_budget=0), "positive int"),
        (lambda ctx, root, state: checkpoint_every(ctx, 2, root, staging_budget=MiB), "pass async_save=True"),
    ],
    ids=["blocking save", "zero", "checkpoint_every"],
)
def test_a_staging_budget_is_refused_where_it_bounds_nothing(ctx, tmp_path, call, match):
    state, _, _ = _state(ctx, width=16, layers=1)
    with pytest.raises(ValueError, match=match):
        call(ctx, str(tmp_path), state)
    assert not list(tmp_path.iterdir())


def _budget_of_its_own(root):
    """Process 0 gives a budget that fits its state, process 1 one that does not: both save blocking, alike."""

    ctx = Context(accelerator=Accelerator(cpu=True), signals=())
    state, state_bytes, _ = _state(ctx, width=256, layers=2)
    budget = 2 * state_bytes if ctx.accelerator.process_index == 0 else state_bytes // 2
    save_checkpoint(ctx, root, state, async_save=True, staging_budget=budget)
    committed = latest_checkpoint(root).name
    ctx.close()
    return committed


@pytest.mark.multiprocess
def test_processes_with_budgets_of_their_own_agree_to_save_blocking(tmp_path):
    assert testing.run_distributed(_budget_of_its_own, str(tmp_path), nprocs=2, timeout=120) == ["ckpt-0000000001"] * 2


def _sharded_load(root, engine):
    """A sharded checkpoint of 8 x Linear(1024, 1024) + AdamW loaded twice into the live model on this process: the
    first load's growth of resident memory (what stays, beside the live state), then the second's peak, and the
    state this process holds, in bytes; and the checkpoint's files with their sizes."""
    import helpers

    ctx = Context(accelerator=helpers.fsdp2_accelerator() if engine == "fsdp2" else Accelerator(cpu=True), signals=())
    state, _, _ = _state(ctx)
    held = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for t in [*state.model.state_dict().values(), *_optimizer_tensors(state)]
    )
    save_checkpoint(ctx, root, state, sharded=True)
    before = _resident_in_use()
    load_checkpoint(ctx, root, state)
    stays = _resident_in_use() - before
    peak = _grown_by(lambda: load_checkpoint(ctx, root, state))
    ctx.close()
    files = {p.name: p.stat().st_size for p in latest_checkpoint(root).iterdir()}
    return stays, peak, held, files


def _optimizer_tensors(state):
    return [v for s in state.optimizer.optimizer.state.values() for v in s.values() if v.dim()]


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_sharded_load_stages_the_state_once_and_keeps_nothing(tmp_path, engine):
    """On the topology that saved, every piece a process reads is the whole of one of its tensors: the verified
    buffers become the loaded tensors (no second copy, which made a load grow by twice the state), and the model's
    part of them is handed back once copied into the live model (the optimizer's, its state now, stays)."""
    for stays, peak, held, files in testing.run_distributed(
        _sharded_load, str(tmp_path), engine, nprocs=2, timeout=300
    ):
        assert peak < held + 16 * MiB and stays < 16 * MiB, (peak / MiB, stays / MiB, held / MiB)
    if engine == "fsdp2":  # each process's shards apart from its share of what all hold whole (AdamW's steps)
        assert files["shard-0.safetensors"] > 40 * MiB and files["shard-1.safetensors"] > 40 * MiB
        assert 0 < files["whole-0.safetensors"] < 4096 and 0 < files["whole-1.safetensors"] < 4096, files
    else:
        assert not [name for name in files if name.startswith("whole-")], files


def test_a_save_to_and_a_load_from_a_bucket_hold_no_copy_of_the_parts(ctx):
    """On S3 (moto's server on 127.0.0.1), a 96 MiB state: an upload sends each part from the tensors' memory and a
    load streams each range into its place, so the save grows the process by less than max(64 MiB, twice its largest
    tensor) and the load by the state once (every part in flight was a copy: 96 MiB more, each way)."""
    import helpers

    state, state_bytes, largest = _state(ctx)
    with helpers.moto_server() as server:
        root, options = server.bucket("memory") + "/run", server.options()
        save_checkpoint(ctx, root, state, storage_options=options)
        load_checkpoint(ctx, root, state, storage_options=options)  # (the first load's and save's one-time work)

        saved = _grown_by(lambda: save_checkpoint(ctx, root, state, storage_options=options))
        loaded = _grown_by(lambda: load_checkpoint(ctx, root, state, storage_options=options))

    assert saved < max(64 * MiB, 2 * largest), saved / MiB
    assert loaded < state_bytes + 16 * MiB, (loaded / MiB, state_bytes / MiB)
