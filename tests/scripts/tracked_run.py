"""A run that logs every update to TensorBoard, MLflow, DVCLive, ClearML (offline), Trackio and Aim and resumes from its
latest checkpoint: killed and restarted by test_tracking.py.

    python tracked_run.py ROOT LOGS [--slow]

Prints "ready <pid>" once set up and "logged <update>" once each update's report is written; saves a checkpoint every 3 updates; logs train/loss (and lr, epoch) at every update with
log_every and the epoch's records with log_epoch, to TensorBoard under LOGS, to an MLflow store in LOGS/mlruns (its
file store, which needs no server), to DVCLive's files in LOGS/dvclive and to an offline ClearML session under
LOGS/clearml (HOME is LOGS/home: ClearML keeps a file there), to Trackio's store in LOGS/trackio and to an Aim repository
in LOGS/.aim; starts its trackers with trainfold's init_trackers, which cuts TensorBoard's series back to the checkpoint a
resumed run goes on from, has MLflow's and Trackio's runs, DVCLive's files and ClearML's session go on without what they
hold, and Aim's run go on (a step logged again replaces what it held).
"""

import argparse
import contextlib
import os
import sys
import time

import torch
from accelerate import Accelerator

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    evaluate,
    init_trackers,
    latest_checkpoint,
    load_checkpoint,
    log_epoch,
    log_every,
    loop,
    make_step,
    run_epoch,
)
from toolz import compose


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("logs")
    parser.add_argument("--slow", action="store_true")
    args = parser.parse_args()

    args.root, args.logs = os.path.abspath(args.root), os.path.abspath(args.logs)
    os.makedirs(args.logs, exist_ok=True)
    os.chdir(args.logs)  # (DVCLive looks for a git repository where it runs: none there)
    os.environ.update(
        MLFLOW_TRACKING_URI=f"file:{args.logs}/mlruns",
        MLFLOW_ALLOW_FILE_STORE="true",
        CLEARML_OFFLINE_MODE="1",
        CLEARML_CACHE_DIR=f"{args.logs}/clearml",
        HOME=f"{args.logs}/home",
        TRACKIO_DIR=f"{args.logs}/trackio",
        ITERATIVE_DO_NOT_TRACK="1",  # DVCLive's usage report: no request to the network
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        GRADIO_ANALYTICS_ENABLED="False",
    )  # (read once, when trackio is imported: in init_trackers)
    os.makedirs(os.environ["HOME"], exist_ok=True)
    with open(
        os.path.join(os.environ["HOME"], "clearml.conf"), "w"
    ) as f:  # ClearML reports from a thread: from its forked process, closing took 11-90 s
        f.write("sdk { development { report_use_subprocess: false } }\n")
    torch.manual_seed(0)
    ctx = Context(
        accelerator=Accelerator(
            cpu=True, log_with=["tensorboard", "mlflow", "dvclive", "clearml", "trackio", "aim"], project_dir=args.logs
        )
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    (train, held_out) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(data, batch_size=8, shuffle=True), torch.utils.data.DataLoader(data, batch_size=32)
    )
    if latest_checkpoint(args.root) is not None:
        state = load_checkpoint(ctx, args.root, state)
    with contextlib.redirect_stdout(
        sys.stderr
    ):  # ClearML and Trackio say where they write: stdout is for "ready" first
        init_trackers(
            ctx,
            "run",
            state,
            init_kwargs={
                "dvclive": {"dir": os.path.join(args.logs, "dvclive")},
                "clearml": {"auto_connect_frameworks": False, "auto_resource_monitoring": False},
                "aim": {"capture_terminal_logs": False},
            },
        )  # (stdout is the test's)

    def loss_fn(model, batch):
        if args.slow:
            time.sleep(0.03)
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    saving = checkpoint_every(ctx, 3, args.root)
    logged = log_every(ctx, 1)(saving(make_step(ctx, loss_fn)))

    def step(state, batch):  # says when the trackers hold an update: the event the test's kill waits for
        state = logged(state, batch)
        os.write(1, f"logged {state.step}\n".encode())
        return state

    epoch = compose(log_epoch(ctx), evaluate(ctx, loss_fn, held_out), run_epoch(ctx, step, train))
    os.write(1, f"ready {os.getpid()}\n".encode())
    with ctx:
        state = saving.at_end(loop(epoch, max_epochs=3)(state))
    print("done", state.step, flush=True)


if __name__ == "__main__":
    main()
