"""The engines that run jobs: a script that resumes by itself, relaunched by them with another world size.

Each launch here is a real one: torchrun agents on 127.0.0.1 (c10d rendezvous), the workers they start, the kills an
engine meets (an agent lost with its node, a launcher killed by hand).
"""

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import helpers

from trainfold import testing

pytestmark = pytest.mark.multiprocess  # spawns processes: the multi-process part (make test-multiprocess)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _gone(pid):
    """Whether ``pid`` has ended (a zombie has: nothing may reap an orphan in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if not _gone(pid)]


def test_workers_end_when_their_launcher_is_killed(tmp_path):
    """``kill -9`` of a torchrun job's process group misses its workers (torchrun starts each in a session of its own):
    they notice their launcher is gone within a second, say so and exit, instead of training on beside the job that
    is started again."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(testing.free_port()),
        str(SCRIPTS / "signal_run.py"),
        str(tmp_path / "ckpt"),
        str(tmp_path / "out.st"),
        "--step-s",
        "0.2",  # 24 s of training: far longer than the workers may outlive their launcher
    ]
    err = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV, start_new_session=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert all(line.startswith("ready") for line in lines), lines + [(tmp_path / "stderr.log").read_text()]
        pids = [int(line.split()[2]) for line in lines]
        while not proc.stdout.readline().startswith("update 2"):  # training, with one update to spare
            assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=helpers.scaled(30))
        left = _wait_gone(pids, helpers.scaled(10))
    finally:
        for pid in pids if "pids" in locals() else ():
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        err.close()
        proc.stdout.close()

    said = (tmp_path / "stderr.log").read_text()
    assert not left, f"workers {left} trained on without their launcher:\n{said[-3000:]}"
    # each exits by its own watch, or first by the failure of its peer's collectives once that peer exited
    assert said.count("the launcher that started this process") >= 1, said[-3000:]
    assert "exiting: an engine that starts the job again resumes it from its newest checkpoint" in said
    assert not (tmp_path / "out.st").exists()  # they stopped, not finished


ELASTIC = SCRIPTS / "elastic_run.py"
sys.path.insert(0, str(SCRIPTS))
import elastic_run  # noqa: E402  (its main(argv), run by testing.run_distributed for the replay)

#: what torch 2.13's elastic agents need to grow a job (the guide says why), and quick rendezvous rounds for a test
ELASTIC_ENV = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=300"


def _agent(tmp, k, port, root, out, backend="c10d"):
    """One torchrun elastic agent (a node of one process), in a working directory of its own, its output in a log.

    Node 0's agent is told its settings by flags; node 1's by the ``PET_*`` variables alone, as Kubeflow's torch
    runtime sets them in a pod (torchrun reads ``PET_<FLAG>`` for each flag it is not given)."""
    cwd = tmp / f"node{k}"
    cwd.mkdir(exist_ok=True)
    settings = {
        "nnodes": "1:2",
        "nproc_per_node": "1",
        "max_restarts": "3",
        "monitor_interval": "0.2",
        "rdzv_backend": backend,
        "rdzv_endpoint": f"127.0.0.1:{port}",
        "rdzv_id": f"elastic-{port}",
        "rdzv_conf": RDZV_CONF,
    }
    flags = [part for name, value in settings.items() for part in ("--" + name.replace("_", "-"), value)]
    pets = {f"PET_{name.upper()}": value for name, value in settings.items()}
    script = [str(ELASTIC), str(root), str(out), "--step-s", "0.1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *(flags if k == 0 else []), *script]
    env = {**ELASTIC_ENV, **(pets if k == 1 else {})}
    log = open(tmp / f"node{k}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    return proc, log


def _lines(tmp, k):
    path = tmp / f"node{k}.log"
    return path.read_text().splitlines() if path.exists() else []


def _wait_for(what, found, agents, tmp, timeout=helpers.scaled(240)):
    """Wait until ``found()`` is true, failing with the agents' output if one ended first or it took too long."""
    deadline = time.monotonic() + timeout
    while not found():
        ended = [k for k, (proc, _) in enumerate(agents) if proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            said = "\n".join(f"--- node {k}:\n" + "\n".join(_lines(tmp, k)[-60:]) for k in range(len(agents)))
            pytest.fail(f"waiting for {what}: {'agents ' + str(ended) + ' ended' if ended else 'timed out'}\n{said}")
        time.sleep(0.05)


def _starts(tmp, k):
    """The incarnations node ``k``'s worker took part in, in order: (world, update resumed from, rank, pid)."""
    return [tuple(int(w) for w in line.split()[1:5]) for line in _lines(tmp, k) if line.startswith("start ")]


def _updates(tmp, k):
    return [int(line.split()[1]) for line in _lines(tmp, k) if line.startswith("update ")]


def _lineage(out, starts):
    """Per epoch, the ids of the samples trained on by the updates that made it into the final state (an
    incarnation's updates after the checkpoint the next one resumed from were lost with it, and made again), and the
    incarnations those came from."""
    records = [line.split() for path in sorted(out.glob("records-*.txt")) for line in path.read_text().splitlines()]
    resumed = {pid: update for _, update, rank, pid in starts if rank == 0}
    order = list(resumed)
    kept: dict[int, list[int]] = {}
    by: dict[int, set[int]] = {}
    for incarnation, update, epoch, _world, *ids in records:
        at = order.index(int(incarnation))
        end = resumed[order[at + 1]] if at + 1 < len(order) else None
        if int(update) > resumed[int(incarnation)] and (end is None or int(update) <= end):
            kept.setdefault(int(epoch), []).extend(int(i) for i in ids)
            by.setdefault(int(epoch), set()).add(at)
    return kept, by


def _replay(tmp, root, out, segments):
    """Replay an engine's run from the same checkpoints: each ``(world, resumed from, until)`` segment starts on
    ``world`` processes from a copy of the run's checkpoint at update ``resumed from`` (none: from scratch) and ends at
    update ``until`` (None: the end). Each must end with the run's checkpoint at ``until`` (its model and optimizer,
    bit for bit), the last with the run's final parameters."""
    for n, (world, start, until) in enumerate(segments):
        here, outs = tmp / f"replay-{n}", tmp / f"replayed-{n}"
        outs.mkdir()
        if start:
            shutil.copytree(root / f"ckpt-{start:010d}", here / f"ckpt-{start:010d}")
        argv = [str(here), str(outs), *(["--until", str(until)] if until is not None else [])]
        testing.run_distributed(elastic_run.main, argv, nprocs=world, timeout=300)
        if until is None:
            testing.assert_params_equal(load_file(str(outs / "final.st")), load_file(str(out / "final.st")))
            continue
        ours, theirs = root / f"ckpt-{until:010d}", here / f"ckpt-{until:010d}"
        files = sorted(p.name for p in ours.glob("*.safetensors") if not p.name.startswith("rank-"))
        assert files and files == sorted(p.name for p in theirs.glob("*.safetensors") if not p.name.startswith("rank-"))
        for name in files:  # the model and optimizer (not the running sums, nor a process's own random states)
            expected, got = (
                {k: v for k, v in load_file(str(f / name)).items() if not k.startswith("running.")}
                for f in (theirs, ours)
            )
            testing.assert_params_equal(expected, got)


@contextlib.contextmanager
def _etcd(tmp):
    """An etcd server on 127.0.0.1 (Debian's etcd-server, with the v2 API torch's etcd rendezvous speaks); its port."""
    client, peer = testing.free_port(), testing.free_port()
    cmd = [
        shutil.which("etcd"),
        "--enable-v2",
        "--data-dir",
        str(tmp / "etcd"),
        "--listen-client-urls",
        f"http://127.0.0.1:{client}",
        "--advertise-client-urls",
        f"http://127.0.0.1:{client}",
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"default=http://127.0.0.1:{peer}",
    ]
    with open(tmp / "etcd.log", "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            helpers.wait_until_listening(server, client, "etcd")
            yield client
        finally:
            server.kill()
            server.wait()


def _etcd_missing():
    if shutil.which("etcd") is None:
        return "needs etcd (Debian's etcd-server)"
    if importlib.util.find_spec("etcd") is None:
        return "needs python-etcd (torch's etcd rendezvous client)"
    return None


def _incarnations(out):
    """(world, update resumed from, 0, incarnation) of each incarnation that trained, in order, from the records."""
    first: dict[int, tuple[int, int]] = {}
    for path in out.glob("records-*.txt"):
        for line in path.read_text().splitlines():
            incarnation, update, _, world = (int(w) for w in line.split()[:4])
            if incarnation not in first or update - 1 < first[incarnation][1]:
                first[incarnation] = (world, update - 1)
    return sorted(((w, u, 0, i) for i, (w, u) in first.items()), key=lambda s: s[1])


def _assert_every_sample_once(out, starts):
    """Every sample once in each of the four epochs that made it into the final state, where an epoch ran on one world
    size; where it was resumed on another, the rest was dealt as Accelerate deals a loader, its last round completed
    (if not whole) with samples from the rest's start: every sample, and fewer than 2 processes x 2 more."""
    kept, by = _lineage(out, starts)
    assert sorted(kept) == [0, 1, 2, 3]
    for epoch, ids in kept.items():
        if len(by[epoch]) == 1:
            assert sorted(ids) == list(range(24)), (epoch, sorted(ids))
        else:
            assert set(ids) == set(range(24)) and len(ids) - 24 < 2 * 2, (epoch, sorted(ids))


@pytest.mark.parametrize(
    "backend",
    [
        "c10d",
        pytest.param("etcd-v2", marks=pytest.mark.skipif(_etcd_missing() is not None, reason=str(_etcd_missing()))),
    ],
)
def test_torchrun_elastic_grows_and_shrinks_and_resumes_exactly(tmp_path, backend):
    """Two elastic agents on 127.0.0.1 (``--nnodes 1:2``, c10d; the second set up by ``PET_*`` variables): the job starts on one process, grows to two when the
    second agent joins (the first restarts its worker, whose stop saves), shrinks to one when that agent is SIGKILLed
    (its worker exits with it; the other's next collective fails and its agent restarts it) and finishes. Every sample
    is trained on once per epoch; the parameters equal, bit for bit, a replay of the same world sizes from the same
    checkpoints; the kill loses at most one checkpoint interval and the update in progress. (An epoch resumed on two
    processes may train a few samples twice: Accelerate completes a last round that is not whole.)"""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    with contextlib.ExitStack() as servers:
        port = servers.enter_context(_etcd(tmp_path)) if backend == "etcd-v2" else testing.free_port()
        _grow_and_shrink(tmp_path, root, out, port, backend)
    _check_elastic_run(tmp_path, root, out)


def _grow_and_shrink(tmp_path, root, out, port, backend):
    agents = [_agent(tmp_path, 0, port, root, out, backend)]
    everyone = list(agents)
    try:
        _wait_for("a checkpoint on one process", lambda: 4 in _updates(tmp_path, 0), agents, tmp_path)
        agents.append(_agent(tmp_path, 1, port, root, out, backend))
        everyone.append(agents[1])
        _wait_for("the job on two processes", lambda: any(s[0] == 2 for s in _starts(tmp_path, 0)), agents, tmp_path)
        grown = next(s[1] for s in _starts(tmp_path, 0) if s[0] == 2)
        _wait_for(
            "a checkpoint on two processes",
            lambda: any(u >= grown + 3 for u in _updates(tmp_path, 0) + _updates(tmp_path, 1)),
            agents,
            tmp_path,
        )
        os.kill(agents[1][0].pid, signal.SIGKILL)  # the node is lost: its agent first, its worker follows
        agents[1][0].wait()
        agents = agents[:1]
        agents[0][0].wait(timeout=helpers.scaled(300))
    finally:
        for proc, log in everyone:
            if proc.poll() is None:
                proc.kill()
            log.close()
    said = "\n".join(_lines(tmp_path, 0))
    assert agents[0][0].returncode == 0, said[-4000:]


def _check_elastic_run(tmp_path, root, out):
    said = "\n".join(_lines(tmp_path, 0))
    assert any(line.startswith("done ") for line in _lines(tmp_path, 0)), said[-4000:]

    starts = _starts(tmp_path, 0)
    assert [world for world, *_ in starts] == [1, 2, 1], starts
    (_, first, *_), (_, grown, *_), (_, shrunk, *_) = starts
    assert first == 0 and 4 <= grown < shrunk
    assert f"stopped {grown} signal SIGTERM" in said  # the agent's SIGTERM to grow: the stop was saved, nothing lost
    before_kill = max(
        int(line.split()[1])
        for path in out.glob("records-*.txt")
        for line in path.read_text().splitlines()
        if line.split()[3] == "2"
    )
    assert before_kill - shrunk <= 2 + 1  # one checkpoint interval, and the update in progress
    _assert_every_sample_once(out, starts)

    _replay(tmp_path, root, out, [(1, 0, grown), (2, grown, shrunk), (1, shrunk, None)])


#: the launch line of the guide "Running at scale" for SLURM, run by ``srun`` once per node (here: once per "node")
SLURM_LINE = (
    'torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 1 --rdzv-backend c10d '
    '--rdzv-endpoint "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):$PORT" --rdzv-id "$SLURM_JOB_ID" '
    "train.py"
)
FAKE_SCONTROL = """#!/bin/sh
case "$1 $2" in
  "show hostnames") echo 127.0.0.1 ;;
  requeue*) echo "$@" >> "$SCONTROL_LOG" ;;
  *) echo "fake scontrol: $*" >&2; exit 1 ;;
esac
"""


def _node(engine, tmp, name, k, nodes, port, root, out):
    """One node of a job as ``engine`` starts it, its output in ``tmp/<name>.log``.

    Kubernetes: a pod whose container runs a plain ``torchrun train.py``, told everything by Kubeflow's ``PET_*``
    variables. SLURM: the guide's launch line, in a shell with the ``SLURM_*`` variables of node ``k`` of the job and a
    fake ``scontrol`` on the path (it answers ``show hostnames`` and records a ``requeue``)."""
    script = [str(ELASTIC), str(root), str(out), "--step-s", "0.1"]
    if engine == "kubernetes":
        pets = {"NNODES": nodes, "NPROC_PER_NODE": 1, "NODE_RANK": k, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env = {**ENV, **{f"PET_{name}": str(value) for name, value in pets.items()}}
        cmd = [sys.executable, "-m", "torch.distributed.run", *script]
    else:
        bin_ = tmp / "bin"
        bin_.mkdir(exist_ok=True)
        (bin_ / "scontrol").write_text(FAKE_SCONTROL)
        (bin_ / "scontrol").chmod(0o755)
        (bin_ / "torchrun").write_text(f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n')
        (bin_ / "torchrun").chmod(0o755)
        slurm = {"JOB_ID": 4242, "NNODES": nodes, "NODEID": k, "JOB_NODELIST": "node[0-1]" if nodes > 1 else "node0"}
        env = {
            **ENV,
            **{f"SLURM_{name}": str(value) for name, value in slurm.items()},
            "PATH": f"{bin_}:{os.environ['PATH']}",
            "PORT": str(port),
            "SCONTROL_LOG": str(tmp / "scontrol.log"),
        }
        cmd = ["sh", "-c", "exec " + SLURM_LINE.replace("train.py", " ".join(script))]  # srun runs it: no shell stays
    cwd = tmp / f"{name}-cwd"
    cwd.mkdir(exist_ok=True)
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True), log


def test_the_guide_gives_the_launch_line_tested_here():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "scale.md").read_text()
    assert f"srun {SLURM_LINE}" in guide


def _said(tmp, name):
    path = tmp / f"{name}.log"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("engine", ["kubernetes", "slurm"])
def test_a_job_stopped_by_its_scheduler_goes_on_on_another_node_count(tmp_path, engine):
    """The job on two nodes is stopped as its scheduler stops it: Kubernetes SIGTERMs each pod's torchrun (within
    terminationGracePeriodSeconds, 30 s by default, before its SIGKILL); SLURM signals every process of the job at
    once (the time limit's ``--signal``). Every process stops at the same update, the final checkpoint is written
    and each node has ended within the grace period; under SLURM the stopped run requeues its job, once. Started
    again on one node, it resumes from that update (nothing lost), finishes (and requeues nothing), every sample once
    per epoch of one world size, with the parameters of a replay of the same world sizes from the same checkpoints,
    bit for bit."""
    root, out, port = tmp_path / "ckpt", tmp_path / "out", testing.free_port()
    out.mkdir()
    nodes = [_node(engine, tmp_path, f"node{k}", k, 2, port, root, out) for k in (0, 1)]
    try:
        _wait_for("the job training", lambda: 5 in _updates_of(tmp_path, "node0", "node1"), nodes, tmp_path)
        if engine == "kubernetes":
            targets = [proc.pid for proc, _ in nodes]  # the kubelet signals each container's first process
        else:
            targets = [int(pid) for _, _, pid in _workers(tmp_path, "node0", "node1")]
            targets += [proc.pid for proc, _ in nodes]
        signalled = time.monotonic()
        for pid in targets:
            os.kill(pid, signal.SIGTERM)
        for proc, _ in nodes:
            proc.wait(timeout=helpers.scaled(30))
        ended_in = time.monotonic() - signalled
    finally:
        for proc, log in nodes:
            if proc.poll() is None:
                proc.kill()
            log.close()
    said = "\n".join(_said(tmp_path, "node0") + _said(tmp_path, "node1"))
    stopped = {int(line.split()[1]) for line in said.splitlines() if line.startswith("stopped ")}
    assert len(stopped) == 1 and "signal SIGTERM" in said, said[-4000:]
    assert "ChildFailedError" not in said  # every worker exited 0 at the agreed stop (torchrun itself re-raises it)
    (stop,) = stopped
    assert ended_in < helpers.scaled(30)
    requeued = (tmp_path / "scontrol.log").read_text() if (tmp_path / "scontrol.log").exists() else ""
    assert requeued == ("requeue 4242\n" if engine == "slurm" else "")

    again = [_node(engine, tmp_path, "again", 0, 1, testing.free_port(), root, out)]
    try:
        again[0][0].wait(timeout=helpers.scaled(300))
    finally:
        again[0][0].kill()
        again[0][1].close()
    resumed = _said(tmp_path, "again")
    assert again[0][0].returncode == 0, "\n".join(resumed)[-4000:]
    assert [line for line in resumed if line.startswith("start ")][0].split()[1:3] == ["1", str(stop)]
    assert any(line.startswith("done ") for line in resumed)
    assert requeued == ((tmp_path / "scontrol.log").read_text() if requeued else "")  # a finished run: no requeue
    _assert_every_sample_once(out, _incarnations(out))

    _replay(tmp_path, root, out, [(2, 0, stop), (1, stop, None)])


def _updates_of(tmp, *names):
    return [int(line.split()[1]) for name in names for line in _said(tmp, name) if line.startswith("update ")]


def _workers(tmp, *names):
    """(world, rank, pid) of each worker started so far."""
    return [
        (line.split()[1], line.split()[3], line.split()[4])
        for name in names
        for line in _said(tmp, name)
        if line.startswith("start ")
    ]


RAY_SITE = Path(__file__).resolve().parents[1] / ".ray-site"
#: the Ray driver's processes (its workers inherit them): ray from its own folder, a local cluster that asks nothing
RAY_ENV = {
    **ENV,
    "PYTHONPATH": str(RAY_SITE),
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}
needs_ray = pytest.mark.skipif(
    not (RAY_SITE / ".trainfold-installed").exists(), reason="needs .ray-site (make .ray-site/.trainfold-installed)"
)


@needs_ray
def test_ray_train_restarts_a_lost_worker_and_it_resumes_exactly(tmp_path):
    """Ray Train's TorchTrainer on a local Ray cluster runs the same training, Accelerate inside the training function:
    the root lies inside the run's storage path and each committed checkpoint is reported where it lies (no copy, rank
    0's metrics). A worker SIGKILLed at update 7 makes Ray (FailureConfig) restart the group, which resumes from the
    root's newest checkpoint; the run ends with the parameters of the same training under testing.run_distributed,
    uninterrupted, bit for bit, and Ray's result names the root's last checkpoint."""
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    env = RAY_ENV
    cmd = [sys.executable, str(SCRIPTS / "ray_run.py"), str(storage), str(out), "--kill-at", "7", "--max-failures", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=helpers.scaled(400))
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-5000:]

    root = storage / "run" / "trainfold"
    assert (out / "killed").exists()
    assert "resumed from ckpt-0000000006 at update 6" in said  # the restarted group, from the root's newest
    assert f"result 24 {root / 'ckpt-0000000024'}" in said
    copies = [p for p in (storage / "run").rglob("*.safetensors") if root not in p.parents]
    assert not copies  # reported where it lies: Ray copied no checkpoint
    _assert_every_sample_once(out, _incarnations(out))
    reference = tmp_path / "reference"
    reference.mkdir()
    testing.run_distributed(elastic_run.main, [str(tmp_path / "uninterrupted"), str(reference)], nprocs=2, timeout=300)
    testing.assert_params_equal(load_file(str(reference / "final.st")), load_file(str(out / "final.st")))


@needs_ray
def test_ray_train_restarts_a_lost_worker_from_a_memory_tier(tmp_path):
    """The same training with a memory tier (a root in /dev/shm, saved every update) beside a root saved every 8: the
    worker SIGKILLed at update 7 makes Ray restart the group, which resumes from the memory tier's update 7 (the root
    has none yet), and ends with the parameters of the same training uninterrupted, bit for bit."""
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    memory = Path("/dev/shm") / f"trainfold-test-{os.getpid()}-{testing.free_port()}"
    cmd = [sys.executable, str(SCRIPTS / "ray_run.py"), str(storage), str(out), "--kill-at", "7", "--max-failures", "1"]
    try:
        done = subprocess.run(
            [*cmd, "--memory", str(memory), "--every", "8"],
            capture_output=True,
            text=True,
            env=RAY_ENV,
            timeout=helpers.scaled(400),
        )
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-5000:]

    assert (out / "killed").exists()
    assert f"resumed from {memory / 'ckpt-0000000007'} at update 7" in said  # the memory tier's, not the root's
    _assert_every_sample_once(out, _incarnations(out))
    reference = tmp_path / "reference"
    reference.mkdir()
    testing.run_distributed(
        elastic_run.main, [str(tmp_path / "uninterrupted"), str(reference), "--every", "8"], nprocs=2, timeout=300
    )
    testing.assert_params_equal(load_file(str(reference / "final.st")), load_file(str(out / "final.st")))


@needs_ray
def test_ray_train_grows_and_shrinks_the_group_and_it_resumes_exactly(tmp_path):
    """``ScalingConfig(num_workers=(1, 2))`` on a local Ray cluster (``ray.cluster_utils.Cluster``): one worker on the
    head's one CPU; a node of one CPU joins and Ray grows the group to two (it restarts the training function, which
    resumes from the root); the node leaves and the group goes on with one, resumed again. Every sample once per epoch
    of one world size; the parameters equal a replay of the same world sizes from the same checkpoints, bit for bit."""
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    env = {
        **RAY_ENV,
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
    }  # a group asked of a node that left: given up sooner
    cmd = [sys.executable, str(SCRIPTS / "ray_run.py"), str(storage), str(out), "--elastic", "--max-failures", "3"]
    done = subprocess.run(
        [*cmd, "--step-s", "0.3"], capture_output=True, text=True, env=env, timeout=helpers.scaled(500)
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-5000:]

    starts = _incarnations(out)
    assert [world for world, *_ in starts] == [1, 2, 1], (starts, said[-3000:])
    _assert_every_sample_once(out, starts)
    (_, _, *_), (_, grown, *_), (_, shrunk, *_) = starts
    _replay(tmp_path, storage / "run" / "trainfold", out, [(1, 0, grown), (2, grown, shrunk), (1, shrunk, None)])


def test_a_killed_worker_costs_one_update_with_a_memory_tier(tmp_path):
    """Two workers under ``torchrun --max-restarts 3`` save to a memory tier (a root in /dev/shm) every update and to
    the durable root every 8; SIGKILL to one worker at update 11: torchrun restarts both, which resume from the
    memory tier's newest checkpoint (at most one update lost, not the three since the durable root's update 8),
    train every sample once, and end with the parameters of an uninterrupted run, bit for bit."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    memory = Path("/dev/shm") / f"trainfold-test-{os.getpid()}-{testing.free_port()}"
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.2",
        str(ELASTIC),
        str(root),
        str(out),
        "--step-s",
        "0.05",
        "--every",
        "8",
        "--memory",
        str(memory),
    ]
    log = open(tmp_path / "node0.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ELASTIC_ENV, start_new_session=True)
    agents = [(proc, log)]
    try:
        _wait_for("update 11", lambda: 11 in _updates(tmp_path, 0), agents, tmp_path)
        ((_, _, _, victim),) = [s for s in _starts(tmp_path, 0) if s[2] == 1]
        killed_after = max(_updates(tmp_path, 0))
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=helpers.scaled(300))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(memory, ignore_errors=True)
    said = "\n".join(_lines(tmp_path, 0))
    assert proc.returncode == 0 and "done 24" in said, said[-4000:]

    starts = sorted({(w, u, r, p) for w, u, r, p in _starts(tmp_path, 0) if r == 0}, key=lambda s: s[1])
    assert [(2, 0), (2, starts[1][1])] == [(w, u) for w, u, *_ in starts], starts
    resumed = starts[1][1]
    assert 8 < resumed and killed_after - resumed <= 1, (killed_after, resumed)  # the memory tier's, not update 8
    _assert_every_sample_once(out, starts)
    clean, clean_out = tmp_path / "clean", tmp_path / "clean-out"
    clean_out.mkdir()
    testing.run_distributed(elastic_run.main, [str(clean), str(clean_out), "--every", "8"], nprocs=2, timeout=300)
    testing.assert_params_equal(load_file(str(clean_out / "final.st")), load_file(str(out / "final.st")))
