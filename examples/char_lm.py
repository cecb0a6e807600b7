"""A small character-level transformer trained on the Python standard library's own source.

bf16 autocast, token-count-correct gradient accumulation (the sequences have different lengths),
a warmup-cosine schedule, checkpoints every 50 updates with resume, and a sample of generated
text at the end. The text ships with every Python installation: nothing is downloaded.

    python examples/char_lm.py               # 150 updates, a few minutes on 2 CPU cores
    python examples/char_lm.py --smoke       # a few updates (what CI runs)
    # interrupt it (Ctrl-C, kill) and run it again: it resumes from examples/out/char_lm/
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader
from toolz import compose

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    load_checkpoint,
    log_every,
    loop,
    lr_schedule,
    make_step,
    max_steps,
    run_epoch,
    warmup_cosine,
)

SEQ = 64


def stdlib_text(limit: int) -> str:
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    chunks, size = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        chunks.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(chunks)[:limit]


class Lines(torch.utils.data.Dataset):
    """Runs of whole source lines, up to SEQ + 1 characters: sequences of many lengths."""

    def __init__(self, text: str, vocab: dict[str, int]):
        self.items: list[torch.Tensor] = []
        current = ""
        for line in text.splitlines(keepends=True):
            if len(current) + len(line) > SEQ + 1 and len(current) > 1:
                self.items.append(torch.tensor([vocab[c] for c in current]))
                current = ""
            current = (current + line)[: SEQ + 1]
        self.items = [t for t in self.items if len(t) > 1]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def collate(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), length, dtype=torch.long)
    y = torch.full((len(seqs), length), -100)
    for i, s in enumerate(seqs):
        x[i, : len(s) - 1], y[i, : len(s) - 1] = s[:-1], s[1:]
    return x, y


class CharTransformer(torch.nn.Module):
    def __init__(self, vocab: int, d: int = 96, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(SEQ, d)
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.pos(torch.arange(t, device=x.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def loss_fn(model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed loss over real characters and their count: normalize='tokens' divides by the group's total."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum")
    return loss, {"tokens": (y != -100).sum()}


@torch.no_grad()
def sample(model: torch.nn.Module, vocab: dict[str, int], prompt: str, n: int, temperature: float = 0.8) -> str:
    chars = {i: c for c, i in vocab.items()}
    ids = torch.tensor([[vocab.get(c, 0) for c in prompt]], device=next(model.parameters()).device)
    model.eval()
    for _ in range(n):
        logits = model(ids[:, -SEQ:])[:, -1].float() / temperature
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], dim=1)
    model.train()
    return "".join(chars[int(i)] for i in ids[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--updates", type=int, default=150)
    parser.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    args = parser.parse_args()
    updates = 4 if args.smoke else args.updates
    root = Path(__file__).resolve().parent / "out" / ("char_lm_smoke" if args.smoke else "char_lm")
    if args.fresh or args.smoke:
        shutil.rmtree(root, ignore_errors=True)

    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4))
    text = stdlib_text(40_000 if args.smoke else 400_000)
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    data = Lines(text, vocab)
    model = CharTransformer(len(vocab))
    state = TrainState.create(
        ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    )
    (train_dl,) = ctx.prepare_loaders(DataLoader(data, batch_size=16, shuffle=True, collate_fn=collate))
    state = load_checkpoint(ctx, root, state, missing_ok=True)  # resumes by itself, wherever a save completed
    if state.step:
        ctx.accelerator.print(f"resumed at update {state.step}")

    saving = checkpoint_every(
        ctx, 2 if args.smoke else 50, root, keep_last=2
    )  # and at a stop; saving.at_end saves the end
    step = compose(
        max_steps(updates),
        log_every(ctx, 2 if args.smoke else 25),
        saving,
        lr_schedule(warmup_cosine(3e-3, warmup_steps=min(30, updates // 4), total_steps=updates, end_lr=3e-4)),
    )(make_step(ctx, loss_fn, clip_grad_norm=1.0, normalize="tokens"))

    def report(s: TrainState) -> TrainState:
        if s.interrupted or s.ended_mid_epoch:  # Ctrl-C or max_steps stopped it mid-epoch: no epoch ended to report
            ctx.accelerator.print(f"stopped at update {s.step} in epoch {s.epoch + 1} ({s.stop.reason})")
            return s
        loss = s.metrics["train_loss"]
        ctx.accelerator.print(
            f"epoch {s.epoch}  update {s.step}  train_loss {loss:.3f} nats/char ({loss / math.log(2):.2f} bits)"
        )
        return s

    state = compose(saving.at_end, loop(compose(report, run_epoch(ctx, step, train_dl))))(state)
    ctx.accelerator.print(f"{len(data)} sequences, {len(vocab)} characters, {state.step} updates. A sample:\n")
    ctx.accelerator.print(sample(ctx.accelerator.unwrap_model(state.model), vocab, "def ", 20 if args.smoke else 300))
    ctx.close()


if __name__ == "__main__":
    main()
