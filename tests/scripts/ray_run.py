"""elastic_run.py's training, inside Ray Train's ``TorchTrainer``, on a local Ray cluster of CPU workers.

    python ray_run.py STORAGE OUT --workers N [--kill-at UPDATE] [--max-failures K] [--memory MEM --every K]

The training function is the guide's: the checkpoint root lies inside the run's storage path
(``<STORAGE>/run/trainfold``), every committed checkpoint is reported to Ray where it lies (no copy), and a worker
restarted by Ray resumes from the root. ``--kill-at N`` SIGKILLs the worker of rank 1 at update N of the first attempt
(a marker file in OUT says it happened), so that Ray's ``FailureConfig`` restarts the group. Prints "result <update>
<checkpoint path>" with the run's last reported checkpoint. ``--memory`` and ``--every`` are elastic_run.py's (a memory
tier saved every update; the root every K updates).
"""

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def train_func(config):
    import elastic_run
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    root = os.path.join(ray.train.get_context().get_storage().experiment_fs_path, "trainfold")
    rank = ray.train.get_context().get_world_rank()
    marker = os.path.join(config["out"], "killed")

    def on_update(state):
        if state.step == config["kill_at"] and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # a worker lost: Ray restarts the group

    def on_commit(state, path):
        ray.train.report(
            {"update": state.step},
            checkpoint=Checkpoint.from_directory(str(path)),
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,  # it is in the run's storage already: no copy
        )

    tiers = ["--memory", config["memory"], "--every", str(config["every"])] if config["memory"] else []
    argv = [root, config["out"], "--step-s", str(config["step_s"]), *tiers]
    elastic_run.main(argv, on_update=on_update, on_commit=on_commit)


def _worlds(out):
    """(update, world) of every micro-batch the workers recorded so far."""
    return [
        (int(line.split()[1]), int(line.split()[3]))
        for path in out.glob("records-*.txt")
        for line in path.read_text().splitlines()
    ]


def _grow_then_shrink(cluster, out):
    """A second node of one CPU joins once the job trains on one worker; it leaves once the job has made two updates on
    two (Ray's autoscaling coordinator sees a new node within about 20 s)."""
    while not _worlds(out):
        time.sleep(0.1)
    node = cluster.add_node(num_cpus=1)
    print("node added", flush=True)
    while len({u for u, w in _worlds(out) if w == 2}) < 3:
        time.sleep(0.1)
    cluster.remove_node(node)
    print("node removed", flush=True)


def main():
    import ray  # here: the test suite imports this module, where ray may not be
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("storage")
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--memory", default=None)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    if args.elastic:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        ray.init(address=cluster.address, log_to_driver=True)
        workers = (1, 2)
    else:
        ray.init(
            address="local", num_cpus=args.workers, include_dashboard=False, log_to_driver=True
        )  # a cluster of its own
        workers = args.workers
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "out": args.out,
            "kill_at": args.kill_at,
            "step_s": args.step_s,
            "memory": args.memory,
            "every": args.every,
        },
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(
            name="run",
            storage_path=args.storage,
            failure_config=FailureConfig(max_failures=args.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),  # trainfold's keep_last prunes, if asked
        ),
    )
    if args.elastic:  # the cluster changes from the main thread (Ray's nodes install signal handlers): fit in another
        results = []
        fitting = threading.Thread(target=lambda: results.append(trainer.fit()))
        fitting.start()
        _grow_then_shrink(cluster, Path(args.out))
        fitting.join()
        (result,) = results
    else:
        result = trainer.fit()
    print("result", result.metrics.get("update"), result.checkpoint.path if result.checkpoint else None, flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
