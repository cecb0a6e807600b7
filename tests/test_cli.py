"""The checkpoint command line: `python -m trainfold ls | verify | inspect`, on checkpoints of each format."""

import json
import subprocess
import sys

import pytest

import helpers

from trainfold import cli, latest_checkpoint, make_step, max_steps, run_epoch, save_checkpoint, testing


@pytest.fixture
def root(tmp_path):
    """A root with a gathered checkpoint between epochs, a sharded one mid-epoch (stopped by a budget), and debris."""
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = save_checkpoint(ctx, tmp_path, run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
    save_checkpoint(ctx, tmp_path, run_epoch(ctx, max_steps(6)(make_step(ctx, loss_fn)), loader, state), sharded=True)
    (tmp_path / ".tmp-ckpt-0000000009").mkdir()
    return tmp_path


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_each_checkpoint(root, capsys):
    """`trainfold ls` lists each checkpoint with its position format and the newest marked."""
    code, out, _ = _run(capsys, "ls", str(root), "--json")
    doc = json.loads(out)

    assert 0 == code
    first, second, debris = doc["checkpoints"]
    assert ("ckpt-0000000004", 4, 1, 0, "gathered", 1, True, False) == (
        first["name"],
        first["update"],
        first["epoch"],
        first["batch_in_epoch"],
        first["format"],
        first["processes"],
        first["finite"],
        first["latest"],
    )
    assert ("ckpt-0000000006", 6, 1, 2, 4, "sharded", True) == (
        second["name"],
        second["update"],
        second["epoch"],
        second["batch_in_epoch"],
        second["epoch_length"],
        second["format"],
        second["latest"],
    )
    assert second["bytes"] > 0
    assert (".tmp-ckpt-0000000009", False) == (debris["name"], debris["complete"])
    code, text, _ = _run(capsys, "ls", str(root))
    assert "* ckpt-0000000006" in text and "epoch 2 batch 2/4 " in text and "debris of an unfinished save" in text


def test_verify_says_ok_or_names_the_damaged_file_with_exit_status_1(root, capsys):
    folder = latest_checkpoint(root)
    assert 0 == _run(capsys, "verify", str(folder))[0]

    shard = folder / "shard-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "verify", str(root), "--json")  # a root: its newest checkpoint

    assert 1 == code
    doc = json.loads(out)
    assert not doc["ok"] and "shard-0.safetensors does not match its digest" in doc["error"]


def test_ls_verify_marks_a_damaged_checkpoint(root, capsys):
    """`trainfold ls --verify` marks a damaged checkpoint and says which one a load resumes from with exit status 1."""
    code, out, _ = _run(capsys, "ls", str(root), "--verify")
    assert 0 == code and 2 == out.count("  verified") and "* the newest, what load_checkpoint" in out

    shard = latest_checkpoint(root) / "shard-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "ls", str(root), "--verify")

    assert 1 == code
    newest = next(line for line in out.splitlines() if "ckpt-0000000006" in line)
    assert "DAMAGED: " in newest and "shard-0.safetensors does not match its digest" in newest
    assert (
        "* the newest, damaged: load_checkpoint(ctx, root, state) resumes from ckpt-0000000004, the newest that verifies"
        in out
    )
    code, out, _ = _run(capsys, "ls", str(root), "--verify", "--json")
    assert 1 == code and [True, False] == [e["ok"] for e in json.loads(out)["checkpoints"] if e["complete"]]


def test_ls_unverified_claims_no_resume(root, capsys):
    """Without --verify, ls has not read the newest checkpoint's files: it says the newest is what a load resumes from
    only if it verifies (a damaged one is passed over), and how to check."""
    shard = latest_checkpoint(root) / "shard-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))

    code, out, _ = _run(capsys, "ls", str(root))

    assert 0 == code
    assert "what load_checkpoint(ctx, root, state) resumes from\n" not in out + "\n"
    assert (
        "* the newest: load_checkpoint(ctx, root, state) resumes from it if it verifies, else from the newest that "
        "does (trainfold ls --verify checks each)"
    ) in out


@pytest.mark.parametrize("field, value", [("epoch", "3"), ("world_size", True), ("world_size", [2]), ("epoch", -1)])
def test_ls_manifest_of_wrong_types(root, capsys, field, value):
    """A manifest whose counters are not counts (forged, or written by something else) is listed with those marked
    unknown, in one line each: ls reads a root to say what is there, and one odd manifest must not hide the others."""
    newest = latest_checkpoint(root)
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    manifest[field] = value
    (newest / "MANIFEST.json").write_text(json.dumps(manifest))

    code, out, err = _run(capsys, "ls", str(root))

    assert 0 == code, err
    assert "ckpt-0000000004" in out and "Traceback" not in out + err
    line = next(line for line in out.splitlines() if newest.name in line)
    assert "?" in line


def test_inspect_shows_counters_stop_records_settings_and_versions(root, capsys):
    code, out, _ = _run(capsys, "inspect", str(root), "--json")
    doc = json.loads(out)

    assert 0 == code
    assert (6, 1, 2, 6) == (doc["update"], doc["epoch"], doc["batch_in_epoch"], doc["micro_step"])
    assert {"should_stop": True, "finished": False, "reason": "max_steps"} == doc["stop"]
    assert [("train_loss", 1, 4)] == [(r["name"], r["epoch"], r["update"]) for r in doc["last_records"]]
    assert (1, "no", "sharded") == (doc["gradient_accumulation_steps"], doc["mixed_precision"], doc["format"])
    assert doc["trainfold_version"] and doc["torch_version"] and doc["run_id"]
    assert "stop: stopped (max_steps)" in _run(capsys, "inspect", str(root))[1]


@pytest.mark.parametrize("command", ["ls", "verify", "inspect"])
def test_a_path_that_is_no_checkpoint_is_one_line_and_exit_status_2(command, tmp_path, capsys):
    target = tmp_path / "nothing" if command != "inspect" else tmp_path
    code, out, err = _run(capsys, command, str(target))

    assert 2 == code and "" == out
    assert 1 == len(err.strip().splitlines()) and err.startswith(f"trainfold {command}: ") and "Traceback" not in err


def test_inspect_of_a_damaged_state_refuses_with_status_2(root, capsys):
    folder = latest_checkpoint(root)
    (folder / "state.json").write_text("{}")
    code, _, err = _run(capsys, "inspect", str(folder))
    assert 2 == code and "state.json" in err and "trainfold verify" in err


@pytest.mark.multiprocess
def test_python_dash_m_trainfold_runs_the_same_command_line(root):
    done = subprocess.run(
        [sys.executable, "-m", "trainfold", "ls", str(root)],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(600),
    )
    assert 0 == done.returncode, done.stderr
    assert "* ckpt-0000000006" in done.stdout


# --- export and diff ---------------------------------------------------------------------------------


def test_export_writes_the_models_weights_of_each_format_bit_for_bit(tmp_path, capsys):
    from trainfold import checkpoint_weights, export_checkpoint
    from trainfold._src.base.io import read_into
    from trainfold._src.checkpoint.safetensors import parse

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
    save_checkpoint(ctx, tmp_path / "gathered", state)
    save_checkpoint(ctx, tmp_path / "sharded", state, sharded=True)
    expected = testing.parameters(state)

    for fmt in ("gathered", "sharded"):
        testing.assert_params_equal(expected, checkpoint_weights(tmp_path / fmt))
        code, out, _ = _run(capsys, "export", str(tmp_path / fmt), str(tmp_path / f"{fmt}.safetensors"))
        assert 0 == code and "wrote" in out
        written = tmp_path / f"{fmt}.safetensors"
        testing.assert_params_equal(expected, dict(parse(read_into(written, written.stat().st_size))))
    with pytest.raises(FileExistsError, match="exists: export writes a new file"):
        export_checkpoint(tmp_path / "gathered", tmp_path / "gathered.safetensors")
    code, _, err = _run(capsys, "export", str(tmp_path / "gathered"), str(tmp_path / "gathered.safetensors"))
    assert 2 == code and "exists" in err


def _fsdp2_saved(root):
    import helpers
    import test_sharded as ts

    ctx, state, dl = ts._setup("fsdp2")
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    save_checkpoint(ctx, root, state)
    full = ts._full_params(state)
    ctx.close()
    return full


@pytest.mark.multiprocess
def test_export_puts_together_the_pieces_of_an_fsdp2_checkpoint_offline(tmp_path):
    """2 processes under FSDP2 write each their rows of every weight; export assembles them, with no process group."""
    from trainfold import checkpoint_weights

    full, _ = testing.run_distributed(_fsdp2_saved, str(tmp_path), nprocs=2)

    testing.assert_params_equal(full, checkpoint_weights(tmp_path))

    # written before manifests recorded data_ranks: one data-parallel rank per process, as such checkpoints had
    ckpt = latest_checkpoint(tmp_path)
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    assert 2 == manifest.pop("data_ranks")
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    doc = json.loads(
        subprocess.run(
            [sys.executable, "-m", "trainfold", "inspect", str(ckpt), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert (2, 2) == (doc["processes"], doc["data_ranks"])
    testing.assert_params_equal(full, checkpoint_weights(tmp_path))


def test_diff_says_equal_or_which_tensors_differ_and_by_how_much(tmp_path, capsys):
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    save_checkpoint(ctx, tmp_path / "before", state)
    save_checkpoint(ctx, tmp_path / "copy", state)
    trained = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
    save_checkpoint(ctx, tmp_path / "after", trained)
    cli.main(["export", str(tmp_path / "before"), str(tmp_path / "before.safetensors")])
    capsys.readouterr()

    assert (0, "equal: 2 tensors, bit for bit\n") == _run(
        capsys, "diff", str(tmp_path / "before"), str(tmp_path / "before.safetensors")
    )[:2]
    code, out, _ = _run(capsys, "diff", str(tmp_path / "before"), str(tmp_path / "after"), "--json")
    doc = json.loads(out)
    assert 1 == code and not doc["equal"]
    deltas = {r["name"]: r["max_abs_diff"] for r in doc["different"]}
    assert {"bias", "weight"} == set(deltas) and all(d > 0 for d in deltas.values())
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    code, _, err = _run(capsys, "diff", str(tmp_path / "junk.safetensors"), str(tmp_path / "copy"))
    assert 2 == code and "is not a safetensors file" in err


def test_export_without_transformers_names_install(root, tmp_path, capsys):
    """The optional dependency missing: exit status 2, one line naming the fix, nothing written (where transformers is
    installed, tests/test_export_transformers.py runs the export itself)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("transformers is installed here")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')

    code, out, err = _run(capsys, "export", str(root), str(tmp_path / "hf"), "--transformers", str(tmp_path / "base"))

    assert (2, "") == (code, out)
    assert 1 == len(err.strip().splitlines()) and "pip install transformers" in err
    assert not (tmp_path / "hf").exists()


# --- export writes only where it says, and leaves nothing behind -------------------------------


def _big_checkpoint(folder, features=4096, outputs=4096):
    """A checkpoint whose model.safetensors is ``features * outputs * 4`` bytes (64 MB by default)."""
    import torch
    from accelerate import Accelerator

    from trainfold import Context, TrainState

    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(features, outputs, bias=False)
    save_checkpoint(
        ctx, folder, TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    )
    ctx.close()
    return latest_checkpoint(folder)


def test_export_never_writes_through_a_link_planted_at_a_temporary_name(root, tmp_path, capsys):
    """The old temporary name (``.<out>.tmp``) planted as a link to a victim file: the victim is untouched, the export
    written under a fresh name of its own and renamed into place, and nothing else is left in the folder."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out_dir / ".model.safetensors.tmp").symlink_to(victim)

    assert 0 == _run(capsys, "export", str(root), str(out_dir / "model.safetensors"))[0]
    assert "precious" == victim.read_text()
    assert [".model.safetensors.tmp", "model.safetensors"] == sorted(p.name for p in out_dir.iterdir())


def test_write_durably_refuses_a_name_that_is_a_link(tmp_path):
    from trainfold._src.base.io import write_durably

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "name").symlink_to(victim)
    with pytest.raises(OSError):
        write_durably(tmp_path / "name", [b"weights"])
    assert "precious" == victim.read_text()


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_a_signal_the_moment_a_temporary_name_exists_leaves_nothing(folder, tmp_path):
    """The signal is raised at the first Python event after the temporary file (an export) or folder (a
    ``save_pretrained`` export) appears on disk, as a Ctrl-C landing there would: it is removed on the way out.
    (``tempfile.mkstemp`` made the file and returned its name after: a signal between the two left it.)"""
    from trainfold._src.base.io import atomic_write, staged_beside

    def write() -> None:
        if folder:
            with staged_beside(tmp_path / "hf", folder=True) as staging:
                (staging / "config.json").write_text("{}")
        else:
            atomic_write(tmp_path / "model.safetensors", lambda tmp: tmp.write_bytes(b"weights"))

    landed = []

    def signal_once_it_exists(frame, event, arg):
        if not landed and any(tmp_path.iterdir()):
            landed.append(frame.f_code.co_name)
            raise KeyboardInterrupt
        return signal_once_it_exists

    sys.settrace(signal_once_it_exists)
    try:
        with pytest.raises(KeyboardInterrupt):
            write()
    finally:
        sys.settrace(None)
    assert landed and [] == list(tmp_path.iterdir())


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys):
    import helpers

    ckpt = _big_checkpoint(tmp_path / "root", 512, 1024)  # 2 MB of weights
    for disk in helpers.small_disk(tmp_path / "disk", "1m"):
        code, out, err = _run(capsys, "export", str(ckpt), str(disk / "model.safetensors"))
        assert 2 == code and "No space left on device" in err and 1 == len(err.strip().splitlines())
        assert [] == list(disk.iterdir())


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_an_export_stopped_by_a_signal_while_it_writes_leaves_nothing(signum, tmp_path):
    """The signal lands once the temporary file exists (the event waited for): the process ends, the file is removed."""
    import signal
    import time

    ckpt = _big_checkpoint(tmp_path / "root", 8192, 4096)  # 128 MB: the write takes long enough to be caught in it
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainfold", "export", str(ckpt), str(out_dir / "model.safetensors")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + helpers.scaled(300)  # a hang-guard, not a wait
    while not any(out_dir.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert proc.poll() is None, f"the export ended before the signal could land in its write: {proc.communicate()}"
    proc.send_signal(getattr(signal, signum))
    proc.communicate(timeout=helpers.scaled(120))
    assert 0 != proc.returncode
    assert [] == list(out_dir.iterdir())


def test_export_never_offers_to_run_a_model_folders_code(root, tmp_path, capsys):
    """A config with an ``auto_map`` names a class whose code is in the folder: refused by name before transformers
    is asked anything (it would prompt for trust_remote_code, and "y" ran the folder's code)."""
    config = tmp_path / "evil"
    config.mkdir()
    (config / "config.json").write_text(
        json.dumps(
            {"architectures": ["EvilModel"], "auto_map": {"AutoModel": "modeling_evil.EvilModel"}, "model_type": "evil"}
        )
    )
    (config / "modeling_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")

    code, out, err = _run(capsys, "export", str(root), str(tmp_path / "hf"), "--transformers", str(config))
    assert 2 == code and "has an auto_map" in err and "never runs a folder's code" in err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "hf").exists()


# --- errors, not tracebacks; JSON that is JSON ---------------------------------------------------


def _with_history(ckpt, records):
    """``ckpt``'s state.json with its history replaced, re-signed in the manifest (a forger who can write the folder)."""
    import hashlib

    doc = json.loads((ckpt / "state.json").read_text())
    doc["state"]["history"] = records
    data = json.dumps(doc, allow_nan=True).encode()
    (ckpt / "state.json").write_bytes(data)
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    manifest["files"]["state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    return ckpt


@pytest.mark.parametrize(
    "records",
    [
        [[1, 4, "train_loss", {"a": 1}]],
        [[1, 4, "train_loss", "abc"]],
        ["x"],
        [[1, 4]],
        {"a": 1},
        [["1", 4, "train_loss", 2.0]],
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_of_misshapen_history_records(root, capsys, records, as_json):
    """`trainfold inspect` of history records of the wrong shape is one line and exit status 2."""
    ckpt = _with_history(list((p for p in root.iterdir() if p.name == "ckpt-0000000004"))[0], records)
    code, out, err = _run(capsys, "inspect", str(ckpt), *(["--json"] if as_json else []))
    assert 2 == code and "" == out
    assert 1 == len(err.strip().splitlines()) and "state.json is damaged: " in err and "history" in err


def test_inspect_json_of_a_diverged_run(root, capsys):
    """`trainfold inspect --json` of a diverged run is json with its non-finite values as strings."""
    ckpt = _with_history(
        root / "ckpt-0000000004", [[1, 4, "train_loss", float("nan")], [1, 4, "grad_norm", float("inf")]]
    )
    code, out, _ = _run(capsys, "inspect", str(ckpt), "--json")

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    doc = json.loads(out, parse_constant=refuse)
    assert 0 == code and ["nan", "inf"] == [r["value"] for r in doc["last_records"]]


def test_inspect_lists_the_last_eight_records_newest_last(tmp_path, capsys):
    from trainfold import loop

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = save_checkpoint(ctx, tmp_path, loop(run_epoch(ctx, make_step(ctx, loss_fn), loader), max_epochs=12)(state))
    ctx.close()
    code, out, _ = _run(capsys, "inspect", str(tmp_path), "--json")
    records = json.loads(out)["last_records"]
    assert 0 == code and list(range(5, 13)) == [r["epoch"] for r in records]
    assert [v for _, _, v in state.history.to_dict()["train_loss"][-8:]] == [r["value"] for r in records]


@pytest.mark.parametrize("shape", [[2**63, 1], [2**62, 4], [-1, 4]])
def test_a_dimension_out_of_range_is_one_line(tmp_path, capsys, shape):
    """A safetensors header with a dimension out of range is one line and exit status 2."""
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}).encode()
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    code, out, err = _run(capsys, "diff", str(tmp_path / "huge.safetensors"), str(tmp_path / "huge.safetensors"))
    assert 2 == code and 1 == len(err.strip().splitlines()) and "is not a safetensors file" in err


def test_diff_of_files_whose_tensors_are_not_the_same_set_is_never_equal(tmp_path, capsys):
    """A tensor only in B (or only in A) is a difference: exit status 1, the names said; none in common says so."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2), "value_head": torch.zeros(3)}, tmp_path / "b.safetensors")
    save_file({"other": torch.ones(2)}, tmp_path / "c.safetensors")
    a, b, c = (str(tmp_path / f"{n}.safetensors") for n in "abc")

    assert (1, "0 of 1 tensors differ:\n  only in b: value_head\n") == _run(capsys, "diff", a, b)[:2]
    assert (1, "0 of 1 tensors differ:\n  only in a: value_head\n") == _run(capsys, "diff", b, a)[:2]
    code, out, _ = _run(capsys, "diff", a, c)
    assert 1 == code and f"no tensor in common: {a} has w; {c} has other\n" == out


def test_a_model_folder_of_links(root, tmp_path, capsys):
    """A Hugging Face cache snapshot's files are links to its blobs: the config is read through them (it is the user's
    folder, not a checkpoint's), so an auto_map there is refused as such, not as a folder without a config."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    (blobs / "abc123").write_text(
        json.dumps({"architectures": ["EvilModel"], "auto_map": {"AutoModel": "m.EvilModel"}})
    )
    (snapshot / "config.json").symlink_to(blobs / "abc123")

    code, _, err = _run(capsys, "export", str(root), str(tmp_path / "hf"), "--transformers", str(snapshot))
    assert 2 == code and "has an auto_map" in err


def test_help_and_a_usage_error_answer_without_importing_torch():
    """``import trainfold`` loads its public names on first use, and the command line imports the library only once its
    arguments are good: ``--help`` and a usage error cost a Python start, not torch's import (seconds of CPU)."""
    import subprocess
    import sys

    probe = (
        "import sys, trainfold, trainfold.cli\n"
        "for argv in (['--help'], ['ls']):\n"
        "    try:\n"
        "        trainfold.cli.main(argv)\n"
        "    except SystemExit as exc:\n"
        "        print('exit', exc.code)\n"
        "print(sorted(m for m in ('torch', 'accelerate', 'trainfold._src') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=helpers.scaled(120), check=True
    ).stdout

    assert out.splitlines()[-3:] == ["exit 0", "exit 2", "[]"]


@pytest.mark.parametrize("argv", [["ls", "--verify"], ["verify"], ["inspect"], ["inspect", "--json"]])
def test_ls_verify_inspect_without_torch(root, argv):
    """They read manifests and JSON files, verified: torch's import (seconds of CPU, tens on a busy machine) is not
    theirs to pay. Each answers as it should, of the root with a gathered and a sharded checkpoint."""
    probe = (
        "import sys, trainfold.cli\n"
        "code = trainfold.cli.main(sys.argv[1:])\n"
        "print(code, sorted(m for m in ('torch', 'accelerate', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *argv, str(root)],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(120),
        check=True,
    ).stdout

    assert out.splitlines()[-1] == "0 []"
    assert ("ckpt-0000000006" in out) and ("verified" in out if argv[0] == "ls" else True)


def test_the_public_names_load_on_first_use_and_are_the_modules_own():
    import trainfold
    from trainfold._src.core.step import make_step

    assert trainfold.make_step is make_step and "make_step" in dir(trainfold)
    with pytest.raises(AttributeError, match="no attribute 'make_stpe'"):
        trainfold.make_stpe


def test_inspect_reads_an_older_stop(root, capsys):
    """Before the stop was one value, state.json held should_stop, finished and stop_reason: inspect reads those too."""
    import hashlib

    ckpt = latest_checkpoint(root)
    doc = json.loads((ckpt / "state.json").read_text())
    doc["state"].pop("stop")
    doc["state"].update(should_stop=True, finished=True, stop_reason="early_stop:eval_loss", final_stop=False)
    data = json.dumps(doc).encode()
    (ckpt / "state.json").write_bytes(data)
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    manifest["files"]["state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))

    code, out, _ = _run(capsys, "inspect", str(ckpt), "--json")

    assert (0, {"should_stop": True, "finished": True, "reason": "early_stop:eval_loss"}) == (
        code,
        json.loads(out)["stop"],
    )


def test_inspect_shows_the_last_report_of_a_watched_run(tmp_path, capsys):
    """log_every(..., watch=True)'s last report rides in the checkpoint (state.extras): inspect shows its rates, time
    shares and memory, and --json gives its values; a run without log_every shows no such line."""
    from trainfold import log_every

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    save_checkpoint(
        ctx, tmp_path / "watched", run_epoch(ctx, log_every(ctx, 2, watch=True)(make_step(ctx, loss_fn)), loader, state)
    )
    ctx.close()
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    save_checkpoint(ctx, tmp_path / "plain", run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
    ctx.close()

    code, out, _ = _run(capsys, "inspect", str(tmp_path / "watched"))
    line = next(x for x in out.splitlines() if "last report" in x)
    assert 0 == code and line.startswith("  last report (update 4): samples_per_s ")
    assert "time_data " in line and "%" in line and "memory_rss_gb " in line
    report = json.loads(_run(capsys, "inspect", str(tmp_path / "watched"), "--json")[1])["last_report"]
    assert 4 == report["update"] and 8.0 == report["values"]["samples"]
    plain = _run(capsys, "inspect", str(tmp_path / "plain"))[1]
    assert "last report" not in plain and "throughput" not in plain


def test_inspect_lists_the_throughput_of_each_watched_epoch(tmp_path, capsys):
    """A watched run's epoch records hold its time and samples per second: inspect lists them by epoch (--json: all of
    them, each with its update), as the history holds them (an unwatched run lists none: the test above)."""
    from trainfold import log_every, loop

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = loop(run_epoch(ctx, log_every(ctx, 2, watch=True)(make_step(ctx, loss_fn)), loader), max_epochs=2)(state)
    save_checkpoint(ctx, tmp_path / "watched", state)
    ctx.close()

    code, out, _ = _run(capsys, "inspect", str(tmp_path / "watched"))
    line = next(x for x in out.splitlines() if "throughput by epoch" in x)
    rows = json.loads(_run(capsys, "inspect", str(tmp_path / "watched"), "--json")[1])["throughput"]
    assert 0 == code and [1, 2] == [r["epoch"] for r in rows] and [4, 8] == [r["update"] for r in rows]
    assert [state.history["train_samples_per_s"][i] for i in (0, 1)] == [r["samples_per_s"] for r in rows]
    assert [state.history["train_memory_rss_gb"][i] for i in (0, 1)] == [r["memory_rss_gb"] for r in rows]
    assert (
        line.startswith("  throughput by epoch: 1: ") and " samples/s" in line and "; 2: " in line and " GB rss" in line
    )
