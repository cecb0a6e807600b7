"""Two nodes on one machine: two ``torchrun --nnodes 2`` launchers (c10d rendezvous on 127.0.0.1), each in its own
working directory, as two hosts would run them; the checkpoint root is the one thing they share.

c10d gives global ranks in the order the workers join, not by ``--node_rank``: global rank 0 (the main process,
which writes a checkpoint's shared files, holds the root's lock, logs and prints) may be on either node.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import helpers

from trainfold import list_checkpoints, testing, verify_checkpoint

pytestmark = (
    pytest.mark.multiprocess
)  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one

SCRIPT = Path(__file__).resolve().parent / "scripts" / "signal_run.py"
sys.path.insert(0, str(SCRIPT.parent))
import signal_run  # noqa: E402  (its main(argv), run by testing.run_distributed)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _one_node(nproc, root, out, *extra):
    """The job on one node's ``nproc`` processes, in processes of ``testing.run_distributed`` (the reference needs no
    launcher of its own; the two nodes' jobs are real torchrun launches)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        testing.run_distributed(signal_run.main, [str(root), str(out), *extra], nprocs=nproc, timeout=600)
    return load_file(str(out))


def _start_two_nodes(tmp, nproc, root, out, *extra):
    """Both nodes' launchers, started apart; their output goes to ``tmp/node<k>.log``."""
    port = testing.free_port()
    nodes = []
    for k in (0, 1):
        cwd = tmp / f"node{k}"
        cwd.mkdir(exist_ok=True)
        log = open(tmp / f"node{k}.log", "w")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(k),
            "--nproc_per_node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"two-nodes-{port}",
            str(SCRIPT),
            str(root),
            str(out),
            *extra,
        ]
        nodes.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=cwd), log))
    return nodes


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _output(tmp):
    return "".join((tmp / f"node{k}.log").read_text() for k in (0, 1))


def _wait(nodes, tmp, timeout=helpers.scaled(600), signalled=None):
    """Wait for both launchers; each must exit 0 but ``signalled`` (torchrun re-raises a signal it forwarded: status 1)."""
    try:
        for proc, _ in nodes:
            proc.wait(timeout=timeout)
    finally:
        for proc, log in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    assert all(proc.returncode == 0 for k, (proc, _) in enumerate(nodes) if k != signalled), _output(tmp)[-4000:]
    return _output(tmp)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The same job on one launcher, for each world size: what two nodes must equal."""
    tmp = tmp_path_factory.mktemp("one-node")
    return {
        world: _one_node(world, tmp / f"ckpt-{world}", tmp / f"one-{world}.st", "--step-s", "0") for world in (2, 4)
    }


@pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2"])
def test_two_nodes_train_as_one_node_does_and_write_only_the_shared_root(tmp_path, one_node, nproc):
    """Bit for bit the parameters of the same job on one launcher with as many processes; the end of the run is
    checkpointed once, by every process into the shared root (global rank 0 the shared files, each rank its own);
    nothing lands in either node's working directory."""
    root = tmp_path / "ckpt"
    output = _wait(_start_two_nodes(tmp_path, nproc, root, tmp_path / "two.st", "--step-s", "0"), tmp_path)

    assert "done" in output
    testing.assert_params_equal(one_node[2 * nproc], load_file(str(tmp_path / "two.st")))
    manifest = verify_checkpoint(list_checkpoints(root)[-1])
    assert manifest["world_size"] == 2 * nproc
    assert {f"rank-{r}.json" for r in range(2 * nproc)} <= set(manifest["files"])
    assert [] == os.listdir(tmp_path / "node0") == os.listdir(tmp_path / "node1")
    assert 1 == output.count("done")  # printed by the main process only, on whichever node it is


@pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2"])
def test_sigterm_to_one_node_stops_both(tmp_path, one_node, nproc):
    """SIGTERM to one node's torchrun only (it forwards it to its workers): the other node's workers stop at the same
    update by the stop agreement, one final checkpoint is committed, and both nodes started again end as the job on one
    launcher does: bit for bit on 2 processes; on 4 within 1e-7 (1.5e-8 off), as plain PyTorch DDP on 4 gloo processes
    continued in a new DistributedDataParallel wrapper is (1.49e-8, measured without trainfold: the new wrapper's buckets
    sum the 4 processes' gradients in another order; a sum of 2 does not depend on the order)."""
    root = tmp_path / "ckpt"
    nodes = _start_two_nodes(tmp_path, nproc, root, tmp_path / "never.st", "--step-s", "0.05")
    deadline = time.monotonic() + helpers.scaled(600)  # waits for events; this only bounds a hang
    while _output(tmp_path).count("update") < 4:
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in nodes), _output(tmp_path)[-3000:]
        time.sleep(0.05)
    workers = [int(line.split()[2]) for line in _output(tmp_path).splitlines() if line.startswith("ready")]
    sent = time.monotonic()
    nodes[1][0].send_signal(signal.SIGTERM)
    while any(_alive(pid) for pid in workers):  # every worker, on both nodes, ends: the event
        assert time.monotonic() - sent < helpers.scaled(120), _output(tmp_path)[-3000:]
        time.sleep(0.05)
    stopped_in = time.monotonic() - sent
    # The signalled launcher exits at once (status 1: torchrun re-raises the signal it forwarded); the other one waits
    # in torchrun's exit barrier for it (up to 300 s, torchrun's own), where a scheduler ends the job: so does the test.
    for proc, log in nodes:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
    output = _output(tmp_path)

    assert stopped_in < helpers.scaled(30), output[-3000:]  # within the grace before SIGKILL, on a quiet machine
    stopped = int(output.split("stopped", 1)[1].split()[0])
    assert [f"ckpt-{stopped:010d}"] == [p.name for p in list_checkpoints(root)], output[-3000:]

    for k in (0, 1):
        (tmp_path / f"node{k}.log").unlink()
    output = _wait(_start_two_nodes(tmp_path, nproc, root, tmp_path / "resumed.st"), tmp_path)
    assert "done" in output
    expected, resumed = one_node[2 * nproc], load_file(str(tmp_path / "resumed.st"))
    if nproc == 1:
        testing.assert_params_equal(expected, resumed)
    else:
        for name, value in expected.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-7)


@pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2"])
def test_uneven_data_is_refused_on_both_nodes(tmp_path, nproc):
    """Rank 0 has one batch more than the others (121 batches over 2 or 4 processes, even_batches=False): every process
    on both nodes refuses the epoch at its start with the same message, and both launchers end; nothing is trained or saved."""
    output = _wait(_start_two_nodes(tmp_path, nproc, tmp_path / "ckpt", tmp_path / "never.st", "--uneven"), tmp_path)

    refusals = [line for line in output.splitlines() if line.startswith("refused")]
    assert sorted(int(line.split()[1]) for line in refusals) == list(range(2 * nproc)), output[-3000:]
    counts = f"rank 0: {121 // (2 * nproc) + 1}, rank 1: {121 // (2 * nproc)}"
    assert all("different numbers of batches this epoch" in line and counts in line for line in refusals), refusals
    assert "update" not in output and list_checkpoints(tmp_path / "ckpt") == []
