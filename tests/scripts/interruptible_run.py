"""A run that Ctrl-C stops at a step boundary with a final checkpoint; run again, it resumes.

python interruptible_run.py ROOT OUT [--disk-full-after-first-save]
"""

import resource
import signal
import sys
import time

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    load_checkpoint,
    loop,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
)


def main():
    root, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))

    if "--disk-full-after-first-save" in sys.argv:
        save_checkpoint(ctx, root, state)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
        state = run_epoch(ctx, make_step(ctx, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])), dl, state)
        try:
            save_checkpoint(ctx, root, state)
        except OSError as exc:
            print("save failed:", type(exc).__name__, flush=True)
            sys.exit(3)
        sys.exit(0)

    if latest_checkpoint(root) is not None:
        state = load_checkpoint(ctx, root, state)
    inner = make_step(ctx, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))

    def slow(s, b):
        time.sleep(0.02)
        return inner(s, b)

    saving = checkpoint_every(ctx, 1000, root)  # no periodic save: only the final one on a stop, and the end
    step = saving(slow)
    print("ready", flush=True)
    state = saving.at_end(loop(run_epoch(ctx, step, dl), max_epochs=4)(state))
    if state.stop is not None and state.stop.reason.startswith("signal"):
        print("interrupted at update", state.step, flush=True)
        sys.exit(130)
    save_file(testing.parameters(state), out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
