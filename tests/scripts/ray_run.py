"""elastic_run.py's training, inside Ray Train's ``TorchTrainer``, on a local Ray cluster of CPU workers.

    python ray_run.py STORAGE OUT --workers N [--kill-at UPDATE] [--max-failures K]

The training function is the guide's: the checkpoint root lies inside the run's storage path
(``<STORAGE>/run/trainfold``), every committed checkpoint is reported to Ray where it lies (no copy), and a worker
restarted by Ray resumes from the root. ``--kill-at N`` SIGKILLs the worker of rank 1 at update N of the first attempt
(a marker file in OUT says it happened), so that Ray's ``FailureConfig`` restarts the group. Prints "result <update>
<checkpoint path>" with the run's last reported checkpoint.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

import ray
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))


def train_func(config):
    import elastic_run
    import ray.train
    from ray.train import CheckpointUploadMode

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

    elastic_run.main([root, config["out"], "--step-s", "0.05"], on_update=on_update, on_commit=on_commit)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("storage")
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--max-failures", type=int, default=0)
    args = parser.parse_args()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"out": args.out, "kill_at": args.kill_at},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(
            name="run",
            storage_path=args.storage,
            failure_config=FailureConfig(max_failures=args.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),  # trainfold's keep_last prunes, if asked
        ),
    )
    result = trainer.fit()
    print("result", result.metrics.get("update"), result.checkpoint.path if result.checkpoint else None, flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
