"""The same trainfold loop under Accelerate's debug_launcher and notebook_launcher (2 CPU processes)."""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, debug_launcher, notebook_launcher

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import helpers  # noqa: E402

from trainfold import Context, TrainState, evaluate, make_step, run_epoch  # noqa: E402


def train():
    with Context(accelerator=Accelerator(cpu=True)) as ctx:
        torch.manual_seed(0)
        model = helpers.mlp()
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(40), batch_size=4))
        state = evaluate(ctx, helpers.ce_loss, dl, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state))
        if ctx.accelerator.process_index == 0:
            print(
                f"processes {ctx.accelerator.num_processes} steps {state.step} eval_loss {state.metrics['eval_loss']:.6f}",
                flush=True,
            )


if __name__ == "__main__":
    if sys.argv[1] == "debug":
        debug_launcher(train, num_processes=2)
    else:
        notebook_launcher(train, num_processes=2, use_port=sys.argv[2])
