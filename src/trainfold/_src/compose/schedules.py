"""Learning-rate schedules as pure functions of ``state.step`` (optimizer updates).

``state.step`` counts updates and is the same on every process, so a schedule
means the same thing on 1 or 64 processes and with any accumulation — unlike a
torch scheduler prepared by Accelerate, which is stepped ``num_processes``
times per update. Apply one with :func:`~trainfold.lr_schedule`.
"""

from __future__ import annotations

import math

import attrs


def _finite_lr(name: str, lr: float) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(
            f"{name} must be a finite, non-negative learning rate (got {lr!r}): a NaN or infinite one trains silently to NaN."
        )


def _check(peak_lr: float, warmup_steps: int, total_steps: int) -> None:
    _finite_lr("peak_lr", peak_lr)
    if not peak_lr > 0:
        raise ValueError(f"peak_lr must be positive (got {peak_lr!r}).")
    if not (
        isinstance(warmup_steps, int)
        and isinstance(total_steps, int)
        and 0 <= warmup_steps <= total_steps
        and total_steps > 0
    ):
        raise ValueError(
            f"need 0 <= warmup_steps <= total_steps and total_steps > 0 (got warmup_steps={warmup_steps!r}, "
            f"total_steps={total_steps!r}); count them in optimizer updates."
        )


@attrs.frozen
class constant:
    """``lr(step) = lr``.

    Examples:
        >>> constant(0.1)(1000)
        0.1
    """

    lr: float

    def __attrs_post_init__(self) -> None:
        _finite_lr("lr", self.lr)

    def __call__(self, step: int) -> float:
        return self.lr


@attrs.frozen
class _Warmup:
    """Linear warmup from 0 to ``peak_lr`` over ``warmup_steps``, then ``_decay`` down to ``end_lr`` at ``total_steps``."""

    peak_lr: float
    warmup_steps: int
    total_steps: int
    end_lr: float = 0.0

    def __attrs_post_init__(self) -> None:
        _check(self.peak_lr, self.warmup_steps, self.total_steps)
        _finite_lr("end_lr", self.end_lr)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        decay = self.total_steps - self.warmup_steps
        frac = min(1.0, (step - self.warmup_steps) / decay) if decay else 1.0
        return self.end_lr + (self.peak_lr - self.end_lr) * self._remaining(frac)

    def _remaining(self, frac: float) -> float:
        """The share of ``peak_lr - end_lr`` left after ``frac`` of the decay."""
        raise NotImplementedError


@attrs.frozen
class warmup_linear(_Warmup):
    """Linear warmup from 0 to ``peak_lr`` over ``warmup_steps``, then linear decay to ``end_lr`` at ``total_steps``.

    Examples:
        >>> s = warmup_linear(1.0, warmup_steps=10, total_steps=110)
        >>> [s(0), s(5), s(10), s(60), s(110), s(200)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """

    def _remaining(self, frac: float) -> float:
        return 1.0 - frac


@attrs.frozen
class warmup_cosine(_Warmup):
    """Linear warmup to ``peak_lr``, then half a cosine down to ``end_lr`` at ``total_steps`` (held after).

    Examples:
        >>> s = warmup_cosine(1.0, warmup_steps=10, total_steps=110)
        >>> [round(s(k), 6) for k in (0, 10, 60, 110, 500)]
        [0.0, 1.0, 0.5, 0.0, 0.0]
    """

    def _remaining(self, frac: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * frac))
