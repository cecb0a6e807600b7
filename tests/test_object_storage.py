"""Checkpoints on object storage, against a real S3-protocol server on 127.0.0.1 (moto's server mode) and memory://.

Every promise of a local root holds without rename: the manifest, written last, is
the commit; an unfinished save is never listed and is cleaned at the next commit;
load verifies every object as it reads it; one writer per root, by a lock object
created only if absent and held by a lease.
"""

import json
import os
import subprocess
import sys
import time
import zlib

import attrs
import helpers
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainfold import (
    CheckpointError,
    checkpoint_every,
    evaluate,
    fit,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    make_step,
    restore_best,
    run_epoch,
    save_best,
    save_checkpoint,
    testing,
    verify_checkpoint,
)


@pytest.fixture(scope="module")
def server():
    with helpers.moto_server() as s:
        yield s


@pytest.fixture
def s3(server, request):
    """A fresh bucket for the test; yields (root URL, storage_options, an s3fs filesystem on the server)."""
    import s3fs

    slug = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"t-{slug}-{zlib.crc32(request.node.nodeid.encode()):08x}"  # unique per test and parameter, at most 63 characters
    bucket = server.bucket(name)
    return f"{bucket}/run", server.options(), s3fs.S3FileSystem(**server.options(), use_listings_cache=False)


_setup = helpers.noisy_setup


def _train(ctx, state, dl, wrap=lambda s: s, epochs=3):
    """``wrap``: a step transformer; a checkpoint_every saves the loop's end too (its at_end)."""
    end = getattr(wrap, "at_end", lambda s: s)
    return end(helpers.train(ctx, state, dl, wrap, epochs=epochs, clip_grad_norm=1.0))


# --- one process: resume bit for bit -------------------------------------------------------------


def test_s3_resumes_from_every_checkpoint(s3):
    """A run checkpointed on S3 resumes bit for bit from every checkpoint."""
    root, options, _ = s3
    expected = _train(*_setup())
    ctx, state, dl = _setup()
    with_saves = _train(ctx, state, dl, checkpoint_every(ctx, 1, root, storage_options=options))
    testing.assert_params_equal(expected, with_saves)
    checkpoints = list_checkpoints(root, storage_options=options)
    assert 6 <= len(checkpoints) and all(isinstance(c, str) and c.startswith(f"{root}/ckpt-") for c in checkpoints)

    for ckpt in checkpoints[::2]:
        ctx, state, dl = _setup(seed=123)  # other initial weights: everything must come from the checkpoint
        resumed = _train(ctx, load_checkpoint(ctx, ckpt, state, storage_options=options), dl)
        testing.assert_params_equal(expected, resumed)
        assert expected.history == resumed.history


def test_an_s3_root_is_written_to_the_bucket(s3, tmp_path, monkeypatch):
    """The bug this storage fixes: an s3:// root was taken as a path, and every checkpoint landed in ./s3:/..."""
    root, options, fs = s3
    monkeypatch.chdir(tmp_path)
    ctx, state, dl = _setup(ga=1)
    save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state), storage_options=options)

    assert [] == os.listdir(tmp_path)
    objects = sorted(p.rsplit("/", 1)[-1] for p in fs.find(root.removeprefix("s3://")))
    assert {"MANIFEST.json", "model.safetensors", "state.json", ".trainfold.lock"} <= set(objects)
    assert verify_checkpoint(latest_checkpoint(root, storage_options=options), storage_options=options)["step"] == 6


def test_fsspecs_own_configuration(server, tmp_path):
    """FSSPEC_S3_ENDPOINT_URL and the AWS_* credentials, as a job launched with them reads them (a fresh process)."""
    root = server.bucket("env-config") + "/run"
    code = (
        "import torch\n"
        "from trainfold import testing, save_checkpoint, latest_checkpoint, load_checkpoint\n"
        "ctx, state, *_ = testing.tiny_setup(seed=0)\n"
        f"save_checkpoint(ctx, {root!r}, state)\n"
        f"print(load_checkpoint(ctx, {root!r}, state).step, latest_checkpoint({root!r}))\n"
        "ctx.close()\n"
    )
    env = {**os.environ, **server.env()}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=helpers.scaled(600), env=env, cwd=tmp_path
    )
    assert 0 == result.returncode, result.stderr[-3000:]
    assert f"0 {root}/ckpt-0000000000" == result.stdout.strip()


def test_the_cli_on_s3(s3, tmp_path):
    """`trainfold ls | verify | inspect | export | diff` take a store's URL, configured as fsspec is (the environment)."""
    root, options, _ = s3
    ctx, state, dl = _setup(ga=1)
    state = run_epoch(
        ctx, checkpoint_every(ctx, 2, root, storage_options=options)(make_step(ctx, helpers.ce_loss)), dl, state
    )
    ctx.close()
    env = {**os.environ, **s3_env(options)}

    def cli(*argv):
        return subprocess.run(
            [sys.executable, "-m", "trainfold", *argv],
            capture_output=True,
            text=True,
            timeout=helpers.scaled(600),
            env=env,
            cwd=tmp_path,
        )

    listed, verified, inspected = cli("ls", root, "--json"), cli("verify", root), cli("inspect", root, "--json")
    exported = cli("export", root, str(tmp_path / "model.safetensors"))
    diffed = cli("diff", root, str(tmp_path / "model.safetensors"))
    missing = cli("ls", "s3://no-such-bucket-here/run")

    entries = json.loads(listed.stdout)["checkpoints"]
    newest = latest_checkpoint(root, storage_options=options)
    assert [e["name"] for e in entries if e["latest"]] == [newest.rsplit("/", 1)[-1]] and all(
        e["complete"] for e in entries
    )
    assert 0 == verified.returncode and ": OK" in verified.stdout, verified.stderr[-2000:]
    assert json.loads(inspected.stdout)["checkpoint"] == newest
    assert 0 == exported.returncode and 0 == diffed.returncode and "bit for bit" in diffed.stdout, (
        exported.stderr + diffed.stderr
    )
    assert (
        2 == missing.returncode and 1 == len(missing.stderr.strip().splitlines()) and "Traceback" not in missing.stderr
    )
    assert "the bucket (or container) 'no-such-bucket-here' does not exist" in missing.stderr


def s3_env(options):
    """fsspec's and botocore's own configuration for the server of ``options``: what a command launched with it reads."""
    return {
        "FSSPEC_S3_ENDPOINT_URL": options["endpoint_url"],
        "AWS_ACCESS_KEY_ID": options["key"],
        "AWS_SECRET_ACCESS_KEY": options["secret"],
        "AWS_DEFAULT_REGION": "us-east-1",
    }


# --- the manifest is the commit ------------------------------------------------------------------


def test_an_unfinished_save_is_never_listed(s3):
    """Objects without a manifest: a save that died (its job killed) or one another job is writing. The job holding the
    lock removes none after its commits (they might be a job's that took its lock over while it stalled); the next job
    to take the lock removes them, since no other job can be writing then."""
    root, options, fs = s3
    ctx, state, dl = _setup(ga=1)
    state = save_checkpoint(
        ctx, root, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state), storage_options=options
    )
    where = root.removeprefix("s3://")
    fs.pipe_file(f"{where}/ckpt-0000000099/model.safetensors", b"half an upload")  # a save killed before its manifest

    assert [f"{root}/ckpt-0000000006"] == list_checkpoints(root, storage_options=options)
    assert 6 == load_checkpoint(ctx, root, state, storage_options=options).step
    state = save_checkpoint(
        ctx, root, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state), storage_options=options
    )
    assert fs.exists(f"{where}/ckpt-0000000099")  # not this job's to remove while it holds the lock
    ctx.close()

    ctx, fresh, dl = _setup(ga=1)  # the next job
    save_checkpoint(ctx, root, load_checkpoint(ctx, root, fresh, storage_options=options), storage_options=options)
    assert not fs.exists(f"{where}/ckpt-0000000099")
    assert [f"{root}/ckpt-0000000006", f"{root}/ckpt-0000000012"] == list_checkpoints(root, storage_options=options)
    ctx.close()


def test_keep_last_on_s3():
    """`keep_last` deletes after the commit and never the newest finite checkpoint."""
    root = "memory://keep-last/run"
    ctx, state, dl = _setup(ga=1)
    step = make_step(ctx, helpers.ce_loss)
    for _ in range(3):
        state = save_checkpoint(ctx, root, run_epoch(ctx, step, dl, state), keep_last=2)
    assert ["ckpt-0000000012", "ckpt-0000000018"] == [c.rsplit("/", 1)[-1] for c in list_checkpoints(root)]
    with torch.no_grad():
        state.model[0].weight.fill_(float("nan"))  # the run diverged: two checkpoints of NaN weights follow
    for _ in range(2):
        state = save_checkpoint(ctx, root, attrs.evolve(state, step=state.step + 1), keep_last=2)
    names = [c.rsplit("/", 1)[-1] for c in list_checkpoints(root)]
    assert ["ckpt-0000000018", "ckpt-0000000019", "ckpt-0000000020"] == names  # the last finite one is kept
    ctx.close()


def test_a_save_of_a_position_saved_before_replaces_it(s3):
    root, options, fs = s3
    ctx, state, dl = _setup(ga=1)
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    save_checkpoint(ctx, root, state, storage_options=options)
    with torch.no_grad():
        state.model[0].weight.add_(1.0)
    save_checkpoint(ctx, root, state, storage_options=options)
    ctx2, fresh, _ = _setup(ga=1, seed=9)
    loaded = load_checkpoint(ctx2, root, fresh, storage_options=options)
    testing.assert_params_equal(state, loaded)
    assert 1 == len(list_checkpoints(root, storage_options=options))


# --- hostile objects, as for a local folder ------------------------------------------------------


def _committed(s3):
    root, options, fs = s3
    ctx, state, dl = _setup(ga=1)
    save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state), storage_options=options)
    ctx.close()
    ckpt = latest_checkpoint(root, storage_options=options)
    return ckpt, ckpt.removeprefix("s3://")


@pytest.mark.parametrize("damage", ["missing", "truncated", "altered", "oversized"])
def test_every_damage_to_every_object(s3, damage):
    """Every kind of damage to every object is refused and nothing changes."""
    root, options, fs = s3
    ckpt, where = _committed(s3)
    for name in ("model.safetensors", "state.json", "state.safetensors", "rank-0.json", "rank-0.safetensors"):
        good = fs.cat_file(f"{where}/{name}")
        if damage == "missing":
            fs.rm(f"{where}/{name}")
        else:
            data = {
                "truncated": good[:-7],
                "oversized": good + b"\0" * 4096,
                "altered": good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 1]) + good[len(good) // 2 + 1 :],
            }[damage]
            fs.pipe_file(f"{where}/{name}", data)
        ctx, state, _ = _setup(ga=1, seed=5)
        before = testing.parameters(state)
        with pytest.raises(CheckpointError, match=rf"file {name} (is missing|has \d+ bytes|does not match)"):
            load_checkpoint(ctx, ckpt, state, storage_options=options)
        with pytest.raises(CheckpointError, match=rf"file {name}"):
            verify_checkpoint(ckpt, storage_options=options)
        testing.assert_params_equal(before, state)
        ctx.close()
        fs.pipe_file(f"{where}/{name}", good)


def test_an_extra_object_is_never_read_and_a_forged_manifest_is_refused(s3):
    root, options, fs = s3
    ckpt, where = _committed(s3)
    fs.pipe_file(f"{where}/evil.pt", b"not a pickle anyone opens")
    ctx, state, _ = _setup(ga=1, seed=5)
    assert 6 == load_checkpoint(ctx, ckpt, state, storage_options=options).step  # unlisted: never read

    manifest = json.loads(fs.cat_file(f"{where}/MANIFEST.json"))
    for forged in (
        {**manifest, "files": {**manifest["files"], "../escape.json": manifest["files"]["state.json"]}},
        {**manifest, "files": {k: v for k, v in manifest["files"].items() if k != "rank-0.json"}},
        {**manifest, "format": 99},
    ):
        fs.pipe_file(f"{where}/MANIFEST.json", json.dumps(forged).encode())
        with pytest.raises(CheckpointError, match="refused|incomplete|format 99"):
            load_checkpoint(ctx, ckpt, state, storage_options=options)
    fs.pipe_file(f"{where}/MANIFEST.json", b"{" * 2_000_000)  # read no further than one byte past the limit
    with pytest.raises(CheckpointError, match="more than 1048576 bytes, more than a manifest can be; refused"):
        load_checkpoint(ctx, ckpt, state, storage_options=options)
    ctx.close()


# --- one writer ----------------------------------------------------------------------------------


def test_a_second_job_is_refused(s3):
    """A second job on the same root is refused naming the owner until the first ends."""
    root, options, _ = s3
    ctx, state, *_ = testing.tiny_setup(seed=0)
    save_checkpoint(ctx, root, state, storage_options=options)

    answer = helpers.second_job(root, options)
    assert answer.startswith("refused") and f"pid {os.getpid()}" in answer and "another job" in answer
    ctx.close()  # the lock object is removed: the next job takes it
    assert "saved" == helpers.second_job(root, options)


def test_an_expired_lease_is_taken_over(s3, monkeypatch):
    """An expired lease is taken over and its stale owner cannot renew it."""
    from trainfold._src.checkpoint.storage import lease

    root, options, fs = s3
    where = root.removeprefix("s3://")
    fs.pipe_file(
        f"{where}/.trainfold.lock",
        json.dumps(
            {"host": "gone", "pid": 1, "run_id": "dead", "token": "x", "expires": time.time() - 1, "lease_s": 1}
        ).encode(),
    )
    ctx, state, dl = _setup(ga=1)
    save_checkpoint(ctx, root, state, storage_options=options)  # a dead job's lease: taken over
    owner = json.loads(fs.cat_file(f"{where}/.trainfold.lock"))
    assert owner["pid"] == os.getpid() and owner["expires"] > time.time()

    # another job takes the lock over (as if this one had stalled past its lease): this one's next save refuses
    fs.pipe_file(
        f"{where}/.trainfold.lock",
        json.dumps({**owner, "pid": 2, "token": "thief", "expires": time.time() + 600}).encode(),
    )
    with pytest.raises(CheckpointError, match="no longer holds the root's lock.*pid 2"):
        save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state), storage_options=options)
    assert (
        json.loads(fs.cat_file(f"{where}/.trainfold.lock"))["token"] == "thief"
    )  # the stale owner wrote nothing over it
    ctx.close()
    assert root not in lease._HELD


def test_a_renewal_changes_the_lock_with_the_clock_frozen(monkeypatch):
    """Each renewal writes other bytes (a count), so a job watching the lock sees a live owner renew even when the
    owner's wall clock stands still (its expiry time the same at every renewal)."""
    import fsspec

    from trainfold._src.checkpoint.storage import conditional, lease

    fs = fsspec.filesystem("memory")
    monkeypatch.setattr(lease.time, "time", lambda: 1_000_000.0)
    lock = lease.LeaseLock(fs, "/frozen-clock/.trainfold.lock", "memory://frozen-clock", "run")
    lock.take()
    lock._stop.set()  # renewed by hand below, not by its thread
    tags = [conditional.tag(fs, lock.path)]
    for _ in range(3):
        lock.renew()
        tags.append(conditional.tag(fs, lock.path))
    lost = lock.lost
    lock.release_now()

    assert lost is None
    assert 4 == len(set(tags))


def test_a_superseded_owner_leaves_the_new_lock():
    """An owner whose lock another job took over (its lease ran out while it stalled) removes nothing when it closes:
    the new owner's lock stays."""
    import fsspec

    from trainfold._src.checkpoint.storage import lease

    fs = fsspec.filesystem("memory")
    path = "/superseded/.trainfold.lock"
    old = lease.LeaseLock(fs, path, "memory://superseded", "run-a")
    old.take()
    old._stop.set()  # stalled: no more renewals
    fs.pipe_file(
        path, json.dumps({"run_id": "run-b", "token": "new", "expires": time.time() + 600}).encode()
    )  # taken over

    old.release_now()

    assert "new" == json.loads(fs.cat_file(path))["token"]


def test_an_object_removed_while_read_in_parts_is_a_checkpoint_error(s3, monkeypatch):
    """A reader racing keep_last on a store: an object removed between two of its ranged reads is a CheckpointError that
    says it was removed, never a bare FileNotFoundError."""
    from trainfold._src.checkpoint.storage import checkpoint_at, remote

    root, options, fs = s3
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    save_checkpoint(ctx, root, state, storage_options=options)
    ctx.close()
    [ckpt] = list_checkpoints(root, storage_options=options)
    monkeypatch.setattr(remote, "READ_PART", 16)  # several parts for a small object
    parts = checkpoint_at(ckpt, options).chunks("state.json")
    next(parts)
    fs.rm(ckpt.removeprefix("s3://") + "/state.json")

    with pytest.raises(CheckpointError, match=r"file state\.json was removed while the checkpoint was read"):
        list(parts)


_HOLDING_COPY = """
import json, sys
from trainfold import load_checkpoint, save_checkpoint, testing
ctx, state, *_ = testing.tiny_setup(seed=0)
options = json.loads(sys.argv[2])
save_checkpoint(ctx, sys.argv[1], load_checkpoint(ctx, sys.argv[1], state, storage_options=options), storage_options=options)
print("saved", flush=True)
sys.stdin.read()  # holds the lock (renewing it) until the test closes stdin
ctx.close()
"""


def test_an_owner_that_stopped_renewing(s3, monkeypatch):
    """Issue 52's second probe: the owner's renewal thread stops while its training thread works on (the stand-in for
    a lease clock that froze). A requeued copy takes the lock after one lease and saves; the owner learns it at its
    next save, which commits nothing and removes nothing, and every checkpoint there verifies."""
    from trainfold._src.checkpoint.storage import lease

    monkeypatch.setenv("TRAINFOLD_LOCK_LEASE_S", "2")  # inherited by the second job
    root, options, _ = s3
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state), storage_options=options)
    lease._HELD[root][0]._stop.set()  # no more renewals; the job itself goes on

    copy = subprocess.Popen(
        [sys.executable, "-c", _HOLDING_COPY, root, json.dumps(options)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "saved" == copy.stdout.readline().strip()  # the event: it took the lock over and saved; it holds it
        with pytest.raises(CheckpointError, match="no longer holds the root's lock.*another job took it over"):
            save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state), storage_options=options)
    finally:
        copy.communicate("", timeout=helpers.scaled(120))  # stdin closed: the copy ends and gives the lock up
    ctx.close()
    checkpoints = list_checkpoints(root, storage_options=options)
    assert [f"{root}/ckpt-0000000004"] == checkpoints  # the copy saved the same position again, whole
    verify_checkpoint(checkpoints[0], storage_options=options)


def test_a_lock_removed_under_a_live_job(s3, caplog):
    """No job took it (a clean-up script removed the lock object): the job goes on saving, as on a local root."""
    root, options, fs = s3
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = save_checkpoint(ctx, root, state, storage_options=options)
    fs.rm(f"{root.removeprefix('s3://')}/.trainfold.lock")

    save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state), storage_options=options)
    assert "was removed while this job held it, and no other job had taken it; taking it again" in caplog.text
    assert [] == [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("trainfold")
    ]  # the logger's name says it
    assert json.loads(fs.cat_file(f"{root.removeprefix('s3://')}/.trainfold.lock"))["pid"] == os.getpid()
    assert helpers.second_job(root, options).startswith("refused")  # still the root's one writer
    ctx.close()


# --- bad input -----------------------------------------------------------------------------------


def test_an_unknown_protocol_is_refused_when_the_checkpointing_is_set_up():
    ctx, state, dl = _setup(ga=1)
    with pytest.raises(ValueError, match="'s4' is not a protocol fsspec knows"):
        checkpoint_every(ctx, 2, "s4://bucket/run")
    with pytest.raises(ValueError, match="storage_options are for a root on object storage"):
        checkpoint_every(ctx, 2, "local-folder", storage_options={"key": "x"})
    ctx.close()


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "100000"])
def test_a_senseless_lease_is_refused(monkeypatch, value):
    """A lease that is not a sensible number of seconds is refused naming the variable."""
    monkeypatch.setenv("TRAINFOLD_LOCK_LEASE_S", value)
    ctx, state, dl = _setup(ga=1)
    with pytest.raises(ValueError, match=rf"TRAINFOLD_LOCK_LEASE_S='{value}': .* above 0 and at most 600"):
        save_checkpoint(ctx, f"memory://lease-{abs(hash(value))}/run", state)
    ctx.close()


def test_a_missing_bucket_is_named(s3):
    """A bucket that does not exist is named at the first save and nothing is lost."""
    _, options, _ = s3
    ctx, state, dl = _setup(ga=1)
    with pytest.raises(OSError, match="no-such-bucket"):
        save_checkpoint(ctx, "s3://no-such-bucket/run", state, storage_options=options)
    ctx.close()


def test_a_typo_d_bucket_is_refused_when_the_checkpointing_is_composed(s3):
    """issue 46: checkpoint_every accepted s3://lmrnus/run, and the first save failed n updates later."""
    _, options, _ = s3
    ctx, state, dl = _setup(ga=1)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint_every: s3://lmrnus/run cannot hold checkpoints: the bucket \(or container\) "
        r"'lmrnus' does not exist on this store: check its name",
    ):
        checkpoint_every(ctx, 2, "s3://lmrnus/run", storage_options=options)
    ctx.close()  # (trainfold ls of such a root: the command-line test above)


def test_a_local_root_under_a_file(tmp_path):
    """A local root under a file is refused when the checkpointing is composed."""
    (tmp_path / "a-file").write_text("")
    ctx, state, dl = _setup(ga=1)
    with pytest.raises(CheckpointError, match=r"cannot hold checkpoints: .*a-file is a file, not a folder"):
        checkpoint_every(ctx, 2, tmp_path / "a-file" / "run")
    ctx.close()


def test_missing_credentials_are_an_error_that_names_the_fix(server, tmp_path):
    code = (
        "from trainfold import testing, save_checkpoint\n"
        "ctx, state, *_ = testing.tiny_setup(seed=0)\n"
        f"save_checkpoint(ctx, 's3://creds/run', state, storage_options={{'endpoint_url': {server.endpoint!r}}})\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=helpers.scaled(600), env=env
    )
    assert 0 != result.returncode
    assert "credentials" in result.stderr.splitlines()[-1].lower()


def test_without_fsspec_a_url_root_names_the_extra_to_install():
    code = (
        "import sys; sys.modules['fsspec'] = None\n"
        "from trainfold import testing, checkpoint_every\n"
        "ctx, *_ = testing.tiny_setup(seed=0)\n"
        "try:\n    checkpoint_every(ctx, 1, 's3://bucket/run')\nexcept ImportError as exc:\n    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=helpers.scaled(600))
    assert "pip install 'trainfold[s3]'" in result.stdout, result.stderr[-2000:]


# --- what else takes a root ----------------------------------------------------------------------


def test_fit_resumes_from_an_s3_checkpoint_dir(s3):
    root, options, _ = s3
    ctx, state, dl = _setup(ga=1)
    first = fit(
        ctx,
        helpers.ce_loss,
        dl,
        state,
        max_epochs=2,
        checkpoint_dir=root,
        storage_options=options,
        progress=False,
        echo=False,
    )
    ctx2, fresh, dl2 = _setup(ga=1, seed=4)
    more = fit(
        ctx2,
        helpers.ce_loss,
        dl2,
        fresh,
        max_epochs=3,
        checkpoint_dir=root,
        storage_options=options,
        progress=False,
        echo=False,
    )
    assert (2, 3) == (first.epoch, more.epoch)
    assert 3 == len(list_checkpoints(root, storage_options=options))


def test_save_best_and_restore_best_take_an_s3_path(s3):
    root, options, _ = s3
    ctx, state, dl = _setup(ga=1)
    path = f"{root}/best.safetensors"
    best = save_best(ctx, path, "eval_loss", evaluate(ctx, helpers.ce_loss, dl, state), storage_options=options)
    weights = testing.parameters(best)
    later = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, best)
    testing.assert_params_equal(weights, restore_best(ctx, path, later, storage_options=options))
    with pytest.raises(FileNotFoundError, match="no weights at"):
        restore_best(ctx, f"{root}/none.safetensors", later, storage_options=options)


def test_a_background_save_uploads_while_training_goes_on_and_commits(s3):
    root, options, _ = s3
    expected = _train(*_setup(ga=1))
    ctx, state, dl = _setup(ga=1)
    trained = _train(ctx, state, dl, checkpoint_every(ctx, 2, root, async_save=True, storage_options=options))
    ctx.wait_for_checkpoints()
    testing.assert_params_equal(expected, trained)
    ctx2, fresh, _ = _setup(ga=1, seed=8)
    testing.assert_params_equal(trained, load_checkpoint(ctx2, root, fresh, storage_options=options))


@given(sizes=st.lists(st.integers(0, 40), max_size=8), part=st.integers(1, 16))
def test_upload_parts_hold_every_byte(sizes, part):
    """S3's multipart rule: every part but the last exactly ``part`` bytes, none empty unless the file is (an empty
    last part after an exact multiple would be refused); joined, the parts are the file."""
    from trainfold._src.checkpoint.storage.upload import _parts

    chunks = [bytes(range(i, i + n)) for i, n in enumerate(sizes)]
    parts = [b"".join(pieces) for pieces in _parts(chunks, part)]
    assert b"".join(parts) == b"".join(chunks)
    assert all(len(p) == part for p in parts[:-1]) and 0 < len(parts[-1]) <= part if sum(sizes) else parts == [b""]


@given(
    sizes=st.lists(st.integers(0, 40), max_size=8),
    reads=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 50)), max_size=10),
)
def test_a_part_body_reads_its_pieces_as_one_file(sizes, reads):
    """What an upload sends from the tensors' memory without a copy: the pieces read as one seekable file, from any
    position (a retry seeks back), in any sizes."""
    from trainfold._src.checkpoint.storage.upload import PartBody

    pieces = [memoryview(bytes(range(i, i + n))) for i, n in enumerate(sizes)]
    whole = b"".join(pieces)
    body = PartBody(pieces)
    assert len(body) == len(whole) and body.read() == whole and body.read(1) == b""
    for at, n in reads:
        assert (
            body.seek(at) == at
            and body.read(n) == whole[at : at + n]
            and body.tell() == min(at + n, max(at, len(whole)))
        )


# --- requests: each is a round trip to the store -------------------------------------------------


def test_saves_and_a_load_make_only_the_requests_the_commit_protocol_needs(tmp_path, monkeypatch):
    """Counted at the server: a request to a real store is a round trip (tens of milliseconds on S3), paid at every save.

    A save: the lock (created only if absent and read for its ETag, then one listing for what dead saves left; renewed
    at the next save), one listing and each checkpoint's manifest read once (the run check), one listing to see that
    the position was not saved before, the files, the lock rewritten with the commit in it (the fence: only while this
    job holds the lease), the manifest; with ``keep_last``, the lease confirmed (one more conditional write), one more
    listing and manifests, and an old checkpoint removed manifest first, then its objects. A load: the root (not a
    checkpoint), its listing and manifests, then each file in one read (its size checked by that read).
    """
    monkeypatch.setenv("TRAINFOLD_LOCK_LEASE_S", "600")  # the lease is renewed every 200 s: not within this test
    with helpers.moto_server(log=tmp_path / "requests.log") as server:
        root, options = server.bucket("requests") + "/run", server.options()
        ctx, state, dl = _setup(ga=1)
        step = make_step(ctx, helpers.ce_loss)
        files = 5  # one process: model, state, its JSON and the rank's two files
        requests = helpers.RequestLog(tmp_path / "requests.log")

        state = run_epoch(ctx, step, dl, state)
        save_checkpoint(ctx, root, state, storage_options=options)
        first = requests.since()
        state = run_epoch(ctx, step, dl, state)
        save_checkpoint(ctx, root, state, storage_options=options, keep_last=1)
        second = requests.since()
        load_checkpoint(ctx, root, state, storage_options=options)
        load = requests.since()
        ctx.close()

    assert first == ["PUT", "HEAD", "LIST", "LIST", "LIST"] + ["PUT"] * files + ["PUT", "PUT"]
    assert second == (
        ["PUT", "LIST", "GET", "LIST"]
        + ["PUT"] * files
        + ["PUT", "PUT"]
        + ["PUT", "LIST", "GET", "GET", "DELETE", "LIST", "DELETE"]
    )
    assert load == ["GET", "LIST", "GET"] + ["GET"] * files


def test_a_large_file_is_uploaded_in_parts(s3, monkeypatch):
    """The multipart path in-process (every file of the other tests is under the 16 MiB part): 5 MiB parts (S3's
    smallest but the last) of a 12 MB model.safetensors, sent from the tensors' memory. Parts numbered from 0 broke
    every such file on S3. Read back in ranges of 3 MiB and a byte, each streamed into its place."""
    from accelerate import Accelerator

    from trainfold import Context, TrainState
    from trainfold._src.checkpoint.storage import remote, upload

    monkeypatch.setattr(upload, "WRITE_PART", 5 << 20)
    monkeypatch.setattr(remote, "READ_PART", (3 << 20) + 1)
    root, options, fs = s3

    def setup(seed):
        testing.reset_accelerate_state()
        torch.manual_seed(seed)
        ctx = Context(accelerator=Accelerator(cpu=True))
        model = torch.nn.Linear(1000, 3000)
        return ctx, TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    ctx, state = setup(0)
    save_checkpoint(ctx, root, state, storage_options=options)
    ctx.close()
    info = fs.info(f"{root.removeprefix('s3://')}/ckpt-0000000000/model.safetensors")
    assert 12_000_000 < info["size"] and info["ETag"].strip('"').endswith("-3")  # S3's ETag of a 3-part upload

    ctx, fresh = setup(1)
    testing.assert_params_equal(state, load_checkpoint(ctx, root, fresh, storage_options=options))
    ctx.close()
