"""A training run that resumes from its latest checkpoint: killed and restarted by test_kill_resume.py.

    python resumable_run.py ROOT OUT [--slow-saves] [--async-saves] [--lora]
    torchrun --nproc_per_node 2 resumable_run.py ROOT OUT --fsdp2 [--async-saves] [--lora]

``main(argv)`` runs it in a process of ``testing.run_distributed``. Prints "ready" once set up, saves a checkpoint
after every update, and writes its final parameters to OUT (safetensors) when it finishes. With --fsdp2 the
model is sharded by Accelerate's FSDP2 path on CPU processes (as the tests set it up).
With --lora the model is a frozen base with LoRA adapters (helpers.lora_mlp): its
checkpoints are adapter checkpoints, the base recorded by fingerprint.
"""

import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    load_checkpoint,
    loop,
    make_step,
    run_epoch,
)


class NoisyData(torch.utils.data.Dataset):
    def __init__(self, n=30):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def main(argv=None):
    """The run, with ``argv`` as the command line's arguments (``sys.argv[1:]`` where None): ``testing.run_distributed``
    calls it so in a test."""
    argv = sys.argv[1:] if argv is None else list(argv)
    root, out = argv[0], argv[1]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import helpers

    torch.manual_seed(0)
    if "--fsdp2" in argv:
        accelerator = helpers.fsdp2_accelerator(gradient_accumulation_steps=2)
    else:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    ctx = Context(accelerator=accelerator)
    if "--lora" in argv:
        model = helpers.lora_mlp(width=64)
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 3)
        )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(NoisyData(), batch_size=4, shuffle=True))
    state = load_checkpoint(ctx, root, state, missing_ok=True)
    saving = checkpoint_every(ctx, 1, root, keep_last=3, async_save="--async-saves" in argv)
    step = saving(make_step(ctx, loss_fn, clip_grad_norm=1.0))
    if "--slow-saves" in argv:  # widen the window in which a kill lands during a save
        inner, pause = step, 0.05 if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0.01

        def step(s, b):
            time.sleep(pause)
            return inner(s, b)

    os.write(
        1, f"ready {os.getpid()}\n".encode()
    )  # one system call: two workers share the pipe (print may write twice)
    with ctx:  # waits for the last background save and every process, then ends the run
        state = saving.at_end(loop(run_epoch(ctx, step, dl), max_epochs=6)(state))
        model = ctx.accelerator.unwrap_model(state.model)
        params = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
        }
        if ctx.is_main_process:
            save_file(params, out)
    print("done", state.step, flush=True)


if __name__ == "__main__":
    import resumable_run  # the module, not __main__: the classes a run pickles have one name however it started

    resumable_run.main()
