"""plot_history: the training and evaluation curves of a run as a PNG (needs matplotlib)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from trainfold._src.core.state import TrainState


def plot_history(state: TrainState, path: str | os.PathLike[str]) -> Path:
    """Draw every metric in ``state.history`` against the epoch and save a PNG at ``path``.

    Metrics that differ only by prefix (``train_loss``, ``eval_loss``) share one
    panel. Needs matplotlib (``pip install trainfold[plot]``); uses the Agg
    backend, so it works without a display.

    Args:
        state: the state whose history to plot.
        path: the image file to write (its suffix picks the format: ``.png``, ``.svg``...).

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'trainfold[plot]'``).
        ValueError: the history is empty.

    Examples:
        >>> import os, tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
        >>> plot_history(state, os.path.join(tempfile.mkdtemp(), "curves.png")).suffix
        '.png'
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plot_history needs matplotlib: pip install 'trainfold[plot]'") from exc
    series = state.history.to_dict()
    if not series:
        raise ValueError("plot_history: the history is empty; run an epoch or an evaluation first.")
    panels: dict[str, list[str]] = defaultdict(list)
    for name in series:
        panels[name.split("_", 1)[1] if "_" in name else name].append(name)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    for ax, (title, names) in zip(axes[0], panels.items()):
        for name in names:
            epochs = [e for e, _, _ in series[name]]
            ax.plot(epochs, [v for _, _, v in series[name]], marker="o", markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
