"""Checkpoints on a real S3-protocol server (moto's, on 127.0.0.1) under faults: two processes, kills, a server that stops.

Every test here spawns processes (the server, torchrun jobs) and waits for events, with a hard timeout.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import helpers
import pytest
import s3fs
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from trainfold import (
    CheckpointError,
    Context,
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    testing,
    verify_checkpoint,
)

pytestmark = (
    pytest.mark.multiprocess
)  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one

SCRIPT = Path(__file__).resolve().parent / "scripts" / "resumable_run.py"
sys.path.insert(0, str(SCRIPT.parent))
import resumable_run  # noqa: E402  (its main(argv), run by testing.run_distributed)


@pytest.fixture(scope="module")
def server():
    with helpers.moto_server() as s:
        yield s


def _env(server):
    # a killed job leaves its lock behind for one lease: 3 s here (times the machine's load: a live owner renews every
    # third of it, and a busy machine must not see its lease run out), so that each restart waits that long, not 30 s
    return {
        **os.environ,
        **server.env(),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TRAINFOLD_LOCK_LEASE_S": _lease(),
    }


def _lease() -> str:
    return f"{min(helpers.scaled(3), 600):.1f}"


def _torchrun(root, out, *extra):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(testing.free_port()),
        str(SCRIPT),
        root,
        str(out),
        *extra,
    ]


def _to_end(server, root, out, *extra):
    """The job to its end on 2 processes of ``testing.run_distributed`` (forked with torch and Accelerate imported: the
    killed jobs are real torchrun launches, a run that only trains to the end need not be), in the job's environment."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _env(server).items():
            mp.setenv(name, value)
        testing.run_distributed(resumable_run.main, [root, str(out), *extra], nprocs=2, timeout=600)
    return load_file(str(out))


def _newest(server, root):
    return latest_checkpoint(root, storage_options=server.options())


def _killed(server, root, out, delay, *extra):
    """Start the 2-process job, SIGKILL the launcher and both workers ``delay`` s after it committed a new checkpoint."""
    return helpers.kill_after_a_new_checkpoint(
        _torchrun(root, out, *extra), _env(server), lambda: _newest(server, root), delay
    )


def test_s3_kills_during_uploads(server, tmp_path):
    """torchrun, 2 CPU processes (DDP), a sharded checkpoint after every update uploaded in the background, the root an
    s3:// URL configured only by the environment: killed (launcher and workers, SIGKILL) at random moments, restarted
    each time, it ends bit for bit as a clean run, and every checkpoint it left verifies."""
    bucket = server.bucket("kills")
    expected = _to_end(server, f"{bucket}/clean", tmp_path / "clean.safetensors", "--async-saves")
    assert (
        2 == verify_checkpoint(_newest(server, f"{bucket}/clean"), storage_options=server.options())["format"]
    )  # sharded
    testing.assert_params_equal(
        expected, _loaded_on_one_process(server, f"{bucket}/clean")
    )  # elastic: 2 processes' shards, 1 process

    rng = random.Random(7)
    root = f"{bucket}/killed"
    kills = sum(
        _killed(server, root, tmp_path / "killed.safetensors", rng.uniform(0.05, 0.6), "--async-saves", "--slow-saves")
        == -signal.SIGKILL
        for _ in range(3)
    )
    progress = verify_checkpoint(_newest(server, root), storage_options=server.options())["step"]
    for ckpt in list_checkpoints(root, storage_options=server.options()):
        verify_checkpoint(
            ckpt, storage_options=server.options()
        )  # no kill left a committed checkpoint that does not verify
    resumed = _to_end(server, root, tmp_path / "killed.safetensors", "--async-saves")

    assert kills >= 2
    assert 0 < progress < verify_checkpoint(_newest(server, root), storage_options=server.options())["step"]
    testing.assert_params_equal(expected, resumed)


def _loaded_on_one_process(server, root):
    """The newest checkpoint under ``root`` loaded by this one process into resumable_run.py's model (resharded from 2)."""
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 3))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    loaded = load_checkpoint(ctx, root, state, storage_options=server.options())
    ctx.close()
    return testing.parameters(loaded)


def test_a_silent_server_fails_the_save_in_time(tmp_path, monkeypatch):
    """The server freezes (SIGSTOP) while a background save uploads: the save fails with an OSError within the bounded
    time of its requests (the job does not hang), nothing is committed, and the previous checkpoint stays the newest."""
    from trainfold._src.checkpoint.storage import requests

    cut = round(
        helpers.scaled(3)
    )  # 120 s by default: the bound, not its value, is tested (a busy machine's moto is slow)
    monkeypatch.setattr(requests, "REQUEST_TIMEOUT_S", float(cut))
    with helpers.moto_server() as server:
        root = server.bucket("frozen") + "/run"
        options = server.options()
        testing.reset_accelerate_state()
        torch.manual_seed(0)
        ctx = Context(accelerator=Accelerator(cpu=True))
        model = torch.nn.Linear(4096, 2048)  # 32 MiB of weights: several parts, uploaded while the server stops
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        first = save_checkpoint(ctx, root, state, storage_options=options)
        kept = testing.parameters(first)
        with torch.no_grad():
            model.weight.add_(1.0)
        save_checkpoint(ctx, root, attrs.evolve(first, step=1), storage_options=options, async_save=True)
        watcher = s3fs.S3FileSystem(**server.options(), use_listings_cache=False)
        deadline = time.monotonic() + helpers.scaled(120)
        while not watcher.exists(f"{root.removeprefix('s3://')}/ckpt-0000000001") and time.monotonic() < deadline:
            time.sleep(0.005)  # the event: the save's first object is there
        server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(OSError, match=f"did not answer within {cut} s.*nothing was committed"):
                ctx.wait_for_checkpoints()
            waited = time.monotonic() - started
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert waited < 20 * cut  # a few requests, each cut at 3 s (on a quiet machine)

        assert [f"{root}/ckpt-0000000000"] == list_checkpoints(root, storage_options=server.options())
        testing.reset_accelerate_state()
        ctx2 = Context(accelerator=Accelerator(cpu=True))
        fresh_model = torch.nn.Linear(4096, 2048)
        fresh = TrainState.create(ctx2, model=fresh_model, optimizer=torch.optim.SGD(fresh_model.parameters(), lr=0.1))
        testing.assert_params_equal(kept, load_checkpoint(ctx2, root, fresh, storage_options=server.options()))
        ctx2.close()
        ctx.close()


def _memory_root_on_two_processes():
    ctx, state, *_ = testing.tiny_setup(seed=0)
    try:
        save_checkpoint(ctx, "memory://one-process/run", state)
        return "saved"
    except ValueError as exc:
        return str(exc)
    finally:
        ctx.close()


def test_memory_root_of_several_processes():
    """memory:// is one process's memory: every process refuses it at once (none is left waiting in a collective)."""
    answers = testing.run_distributed(_memory_root_on_two_processes, nprocs=2, timeout=600)
    assert 2 == len(answers) and all("is one process's memory, and this run has 2 processes" in a for a in answers)


def _save_to_a_missing_bucket(options):
    ctx, state, *_ = testing.tiny_setup(seed=0)
    try:
        save_checkpoint(ctx, "s3://no-such-bucket/run", state, storage_options=options)
        return "saved"
    except (OSError, CheckpointError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        ctx.close()


def test_a_missing_bucket_fails_the_first_save_on_every_process_together(server):
    """Bad input found at the first save (the main process takes the lock there) is agreed: both processes raise, none waits."""
    answers = testing.run_distributed(_save_to_a_missing_bucket, server.options(), nprocs=2, timeout=600)
    assert answers[0].startswith("OSError") and "no-such-bucket" in answers[0] and "does not exist" in answers[0]
    assert answers[1].startswith("CheckpointError") and "failed on another process" in answers[1]


def test_read_only_credentials_are_refused(tmp_path):
    """moto enforcing IAM (after the set-up's requests): a user whose policy allows reading only saves nothing, and says why."""
    import boto3

    with helpers.moto_server(
        env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"}
    ) as server:  # the 4 set-up requests below are not checked
        admin = {
            "endpoint_url": server.endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        }
        boto3.client("s3", **admin).create_bucket(Bucket="read-only")
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")
        iam.put_user_policy(
            UserName="reader",
            PolicyName="read",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    # AWS checks s3:ListBucket for a listing, moto 5.2.6 the operation's own name
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Action": ["s3:GetObject", "s3:ListBucket", "s3:ListObjectsV2"],
                            "Resource": "*",
                        }
                    ],
                }
            ),
        )
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        reader = {"endpoint_url": server.endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        ctx, state, *_ = testing.tiny_setup(seed=0)
        with pytest.raises(OSError, match=r"locking s3://read-only/run failed \(Access Denied\).*may write there"):
            save_checkpoint(ctx, "s3://read-only/run", state, storage_options=reader)
        assert [] == list_checkpoints("s3://read-only/run", storage_options=reader)
        ctx.close()


# --- a stalled owner: the lease fences the commit -------------------------------------------------

STALLED = Path(__file__).resolve().parent / "scripts" / "stalled_writer.py"


def _stalled_writer(root, options, updates, stop, marker):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRAINFOLD_LOCK_LEASE_S": _lease()}
    return subprocess.Popen(
        [sys.executable, str(STALLED), root, json.dumps(options), str(updates), stop, str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _kill_left(*procs):
    """Kill the jobs a failed test left running (stopped or not) and wait for them."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=helpers.scaled(30))


def _until_stopped(proc, marker, what):
    """Wait for the event: the job created its marker and the kernel shows it stopped (state T); a hang-guard only."""
    deadline = time.monotonic() + helpers.scaled(300)
    while time.monotonic() < deadline and proc.poll() is None:
        if marker.exists() and Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.05)
    raise AssertionError(
        f"{what} did not stop itself (exit {proc.poll()}): {proc.stdout.read() if proc.poll() is not None else ''}"
    )


@pytest.mark.parametrize("store", ["s3", "az"])
def test_an_owner_past_its_lease_commits_nothing(store, server, tmp_path):
    """Issue 52's probe, with real SIGSTOPs: the owner stops inside its save of ckpt-8 for longer than its lease; a
    requeued copy takes the lock over (after one lease), continues from ckpt-4 and stops with ckpt-6 uploaded but not
    committed; the owner is continued. Before, it committed ckpt-8 under the other job's lock and its clean-up deleted
    ckpt-6's objects, which the copy then committed over nothing ("file model.safetensors is missing"). Now its commit
    is refused by the lease (a conditional write on the lock it no longer holds) and it removes nothing."""
    with helpers.azurite_server(tmp_path / "azurite") if store == "az" else _as_context(server) as service:
        root = (service.container("stalled") if store == "az" else service.bucket(f"stalled-{os.getpid()}")) + "/run"
        options = service.options()
        owner = _stalled_writer(root, options, 4, "write:ckpt-0000000008", tmp_path / "owner-stopped")
        copy = None
        try:
            _until_stopped(owner, tmp_path / "owner-stopped", "the owner")
            copy = _stalled_writer(root, options, 2, "commit:ckpt-0000000006", tmp_path / "copy-stopped")
            _until_stopped(copy, tmp_path / "copy-stopped", "the requeued copy")

            owner.send_signal(signal.SIGCONT)
            said, _ = owner.communicate(timeout=helpers.scaled(300))
            assert 3 == owner.returncode, said
            assert (
                "refused" in said
                and "ckpt-0000000008 was not committed: this job no longer holds the root's lock" in said
            )
            assert [f"{root}/ckpt-0000000004"] == list_checkpoints(root, storage_options=options)

            copy.send_signal(signal.SIGCONT)
            said, _ = copy.communicate(timeout=helpers.scaled(300))
            assert 0 == copy.returncode, said
            assert "committed ckpt-0000000006\ncommitted ckpt-0000000008" in said
        finally:
            _kill_left(owner, copy)
        checkpoints = list_checkpoints(root, storage_options=options)
        assert [f"{root}/ckpt-000000000{n}" for n in (4, 6, 8)] == checkpoints
        for checkpoint in checkpoints:  # every file there, every digest right: nothing removed under the copy
            verify_checkpoint(checkpoint, storage_options=options)


def test_a_fenced_commit_is_finished_by_the_next(server, tmp_path):
    """The owner stops after its fence (the lock holds its commit of ckpt-8) and before writing the manifest. The job
    that takes the lock over finishes that commit: the files were all written before the fence. The owner, continued,
    finds its own manifest there and reports the commit; the copy's later saves go on (ckpt-8 saved again by it)."""
    root, options = server.bucket(f"fenced-{os.getpid()}") + "/run", server.options()
    owner = _stalled_writer(root, options, 4, "manifest:ckpt-0000000008", tmp_path / "owner-stopped")
    copy = None
    try:
        _until_stopped(owner, tmp_path / "owner-stopped", "the owner")
        assert [f"{root}/ckpt-0000000004"] == list_checkpoints(root, storage_options=options)
        copy = _stalled_writer(root, options, 2, "commit:ckpt-0000000006", tmp_path / "copy-stopped")
        _until_stopped(copy, tmp_path / "copy-stopped", "the requeued copy")
        assert [f"{root}/ckpt-0000000004", f"{root}/ckpt-0000000008"] == list_checkpoints(root, storage_options=options)
        verify_checkpoint(f"{root}/ckpt-0000000008", storage_options=options)

        owner.send_signal(signal.SIGCONT)
        said, _ = owner.communicate(timeout=helpers.scaled(300))
        assert 0 == owner.returncode and "committed ckpt-0000000008" in said, said
        copy.send_signal(signal.SIGCONT)
        said, _ = copy.communicate(timeout=helpers.scaled(300))
        assert 0 == copy.returncode and "committed ckpt-0000000006\ncommitted ckpt-0000000008" in said, said
    finally:
        _kill_left(owner, copy)
    checkpoints = list_checkpoints(root, storage_options=options)
    assert [f"{root}/ckpt-000000000{n}" for n in (4, 6, 8)] == checkpoints
    for checkpoint in checkpoints:
        verify_checkpoint(checkpoint, storage_options=options)


class _as_context:
    """The module's S3 server as a context manager, beside Azurite's."""

    def __init__(self, server):
        self.server = server

    def __enter__(self):
        return self.server

    def __exit__(self, *exc):
        return False


def test_a_background_save_returns_while_the_store_does_not_answer(monkeypatch):
    """A background save to a root this run holds the lock of sends no request before it returns (confirming the lock
    and creating the checkpoint are the saver thread's): with the server frozen (SIGSTOP), the call returns at once, and
    once the server answers again the checkpoint is committed. Before, its requests kept the caller waiting, on a real
    store a round trip each."""
    from trainfold._src.checkpoint.storage import requests

    monkeypatch.setattr(requests, "REQUEST_TIMEOUT_S", helpers.scaled(60))
    with helpers.moto_server() as server:
        root, options = server.bucket("unanswered") + "/run", server.options()
        ctx, state, *_ = testing.tiny_setup(seed=0)
        save_checkpoint(ctx, root, state, storage_options=options)  # the root's lock is this run's
        server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            save_checkpoint(ctx, root, attrs.evolve(state, step=1), storage_options=options, async_save=True)
            returned = time.monotonic() - started
        finally:
            server.proc.send_signal(signal.SIGCONT)
        ctx.wait_for_checkpoints()
        ctx.close()

        assert returned < helpers.scaled(10)  # a request would have waited for the server, up to its 60 s bound
        assert [p.rsplit("/", 1)[-1] for p in list_checkpoints(root, storage_options=options)] == [
            "ckpt-0000000000",
            "ckpt-0000000001",
        ]
