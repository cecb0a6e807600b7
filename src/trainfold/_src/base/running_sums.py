"""Running sums of a run's batch values, kept on the device, and their one reduction per epoch or log interval.

Owned here: :class:`RunningSums` (the one running-sum value ``run_epoch``,
``evaluate`` and ``log_every`` use) and :func:`reduce_means` (sum over
processes, divide, one host transfer).
"""

from __future__ import annotations

import zlib
from types import MappingProxyType
from typing import AbstractSet, Any, Iterable, Mapping

import attrs
import torch
from accelerate import Accelerator

_NO_AUX: Mapping[str, torch.Tensor] = MappingProxyType({})

#: The aux name under which sums that mask non-finite losses count them.
NONFINITE = "nonfinite"

#: The suffix of an aux value that weights another: ``x`` with ``x@weight`` (or the loss with ``loss@weight``) is a
#: mean over ``weight`` units (tokens; 1 for an update, 0 for a micro-batch without one), and its recorded mean is
#: ``sum(x * weight) / sum(weight)`` over the batches, not a mean of per-batch values.
WEIGHT = "@weight"

#: A batch's ``(loss, aux)``, detached, waiting in :attr:`RunningSums.pending` to be added.
Entry = tuple[torch.Tensor, Mapping[str, torch.Tensor]]

#: How many batches :class:`RunningSums` holds before it adds them: one stack and one sum per name.
FOLD_EVERY = 64


@attrs.frozen
class RunningSums:
    """The sums of the batch losses and aux values seen so far, on the device, never synchronised.

    :meth:`add` launches no kernel: it keeps the batch's detached ``(loss, aux)``
    in ``pending``, and every ``FOLD_EVERY`` batches adds them to the sums with
    one stack and one sum per name (a step then costs no tensor operation for its
    bookkeeping: ~1.3 µs a step measured, see ``benchmarks/README.md``). The
    properties ``loss`` and ``aux`` include the pending batches. Sums are of
    ``dtype`` (float32 unless asked: ``evaluate`` keeps float64 sums) whatever the
    values' dtypes.

    With ``mask_nonfinite`` (under ``nan_guard``), a non-finite loss adds 0 to the
    loss sum and 1 to ``aux["nonfinite"]``; :meth:`means` then divides the loss by
    the finite batches only.

    Examples:
        >>> sums = RunningSums.zero(torch.device("cpu"))
        >>> for x in (1.0, 2.0, 6.0):
        ...     sums = sums.add(torch.tensor(x), {"acc": torch.tensor(x > 1)})
        >>> sums.loss.item(), sums.aux["acc"].item(), len(sums.pending)
        (9.0, 2.0, 3)
    """

    folded_loss: torch.Tensor | None = attrs.field(default=None, eq=False)
    folded_aux: Mapping[str, torch.Tensor] = attrs.field(default=_NO_AUX, eq=False)
    pending: tuple[Entry, ...] = attrs.field(default=(), eq=False)
    mask_nonfinite: bool = False
    #: the sums' dtype: float32 for a run's batch values, float64 for ``evaluate``'s weighted ones
    dtype: torch.dtype = attrs.field(default=torch.float32, eq=False)
    #: the epoch's batch these sums start after: 0, or where an epoch resumed on another number of processes, whose
    #: sums were each process's own, restarted them (a mean divides by the batches since)
    started_at: int = attrs.field(default=0, eq=False)
    #: the last batch added, detached ``(loss, aux)`` as given (None in fresh sums): kept when the
    #: pending batches are folded, so a step transformer can always read its step's values
    last: Entry | None = attrs.field(default=None, eq=False, repr=False)
    #: in the sums :meth:`reset` gives a new epoch, until its first batch: the sums the epoch before ended with (folded)
    #: and its batches, which a report due at that epoch's last update, made after the epoch closed, reads (``log_every``
    #: on a run resumed from a checkpoint saved in that update)
    closed: tuple[RunningSums, int] | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def zero(
        cls, device: torch.device | str, *, mask_nonfinite: bool = False, dtype: torch.dtype = torch.float32
    ) -> RunningSums:
        """Empty sums whose loss sum is a 0-d zero of ``dtype`` on ``device``."""
        return cls(torch.zeros((), device=device, dtype=dtype), _NO_AUX, (), mask_nonfinite, dtype)

    def add(self, loss: torch.Tensor, aux: Mapping[str, torch.Tensor]) -> RunningSums:
        """These sums with one more batch: no kernel, except one fold every ``FOLD_EVERY`` batches.

        Raises:
            ValueError: ``aux`` has other names than the earlier batches'.
        """
        last = self.last
        if last is None:  # fresh sums, or restored from a checkpoint: what was summed says
            check_same_names(self.folded_aux, self.pending, aux)
        elif (aux or last[1]) and aux.keys() != last[1].keys():  # the last batch's names are the earlier ones
            raise ValueError(_aux_names_changed(last[1].keys(), aux))
        entry = detached(loss, aux)
        pending = (*self.pending, entry)
        if len(pending) < FOLD_EVERY:
            return RunningSums(
                self.folded_loss, self.folded_aux, pending, self.mask_nonfinite, self.dtype, self.started_at, entry
            )
        loss_sum, aux_sums = fold(
            self.folded_loss, self.folded_aux, pending, mask_nonfinite=self.mask_nonfinite, dtype=self.dtype
        )
        return RunningSums(loss_sum, aux_sums, (), self.mask_nonfinite, self.dtype, self.started_at, entry)

    def folded(self) -> RunningSums:
        """These sums with the pending batches added (a few kernels, no sync)."""
        if not self.pending:
            return self
        loss_sum, aux_sums = fold(
            self.folded_loss, self.folded_aux, self.pending, mask_nonfinite=self.mask_nonfinite, dtype=self.dtype
        )
        return RunningSums(loss_sum, aux_sums, (), self.mask_nonfinite, self.dtype, self.started_at, self.last)

    def masking(self, mask_nonfinite: bool = True) -> RunningSums:
        """These sums, masking non-finite losses from now on (or not)."""
        if mask_nonfinite == self.mask_nonfinite:
            return self
        return RunningSums(
            self.folded_loss, self.folded_aux, self.pending, mask_nonfinite, self.dtype, self.started_at, self.last
        )

    def reset(self, device: torch.device | str, batches: int | None = None, *, started_at: int = 0) -> RunningSums:
        """Empty sums on ``device`` that mask as these do: a new epoch's, which (given the epoch's ``batches``) hold these,
        folded, as ``closed`` until their first batch; or, with ``started_at``, the rest of an epoch's from that batch."""
        fresh = RunningSums.zero(device, mask_nonfinite=self.mask_nonfinite, dtype=self.dtype)
        if started_at:
            fresh = attrs.evolve(fresh, started_at=started_at)
        return fresh if batches is None else attrs.evolve(fresh, closed=(self.folded(), batches))

    def interval(self, epoch: int, last: Any) -> tuple[Mapping[str, torch.Tensor] | None, int]:
        """Where the interval these sums (of ``epoch``) hold since ``last`` began: ``last``'s sums and batch (a
        ``log_every`` report: ``epoch``, ``batches``, ``sums``) where it is of this epoch, with these names, and these
        sums held its batches; else no sums to subtract, from the batch these sums start after."""
        if (
            last is not None
            and last.epoch == epoch
            and last.batches >= self.started_at
            and last.sums.keys() == self.as_dict().keys()
        ):
            return last.sums, last.batches
        return None, self.started_at

    @property
    def loss(self) -> torch.Tensor | None:
        """The loss sum, a 0-d float32 tensor on the device (None if there never was one)."""
        return self.folded().folded_loss

    @property
    def aux(self) -> Mapping[str, torch.Tensor]:
        """The aux sums by name (0-d float32 tensors on the device)."""
        return self.folded().folded_aux

    def as_dict(self) -> dict[str, torch.Tensor]:
        """``{"loss": ..., **aux}``, folded (no ``"loss"`` if there is no loss sum)."""
        done = self.folded()
        return dict(done.folded_aux) if done.folded_loss is None else {"loss": done.folded_loss, **done.folded_aux}

    def means(
        self, accelerator: Accelerator, count: torch.Tensor | int, *, since: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, float]:
        """The means over every process: the sums (minus ``since``, an earlier :meth:`as_dict`) over ``count``.

        One all-reduce and one host transfer: call it once per epoch or log interval.
        """
        return self.means_and_totals(accelerator, count, since=since)[0]

    def means_and_totals(
        self,
        accelerator: Accelerator,
        count: torch.Tensor | int,
        *,
        since: Mapping[str, torch.Tensor] | None = None,
        totals: Mapping[str, torch.Tensor | float] | None = None,
    ) -> tuple[dict[str, float], dict[str, Any]]:
        """:meth:`means`, and ``totals`` (counts of this process: samples, FLOPs) summed over every process, from the
        same one all-reduce; with totals, the sums (minus ``since``) themselves too, summed, under ``"sum:<name>"``."""
        sums = self.as_dict()
        if since is not None:
            sums = {k: v - since[k] for k, v in sums.items()}
        if not sums and not totals:
            return {}, {}
        extra = (
            {**totals, **{f"sum:{k}": v for k, v in sums.items()}} if totals else {}
        )  # (none: the plain means, in float32 as ever)
        means, summed = reduce_with_totals(accelerator, sums, count, extra)
        return (weighted_means(finite_loss_mean(means)) if sums else {}), summed


def detached(loss: torch.Tensor, aux: Mapping[str, torch.Tensor]) -> Entry:
    """``(loss, aux)`` without their autograd graphs, which an entry must not keep alive (activations)."""
    if loss.requires_grad:
        loss = loss.detach()
    if aux and any(v.requires_grad for v in aux.values()):
        aux = MappingProxyType({k: v.detach() for k, v in aux.items()})
    return loss, aux


def check_same_names(sums: Mapping[str, torch.Tensor], pending: tuple[Entry, ...], aux: Mapping[str, Any]) -> None:
    """Raise if a batch's aux names differ from the earlier ones (a dict-keys comparison)."""
    earlier: AbstractSet[str]
    if pending:
        earlier = pending[-1][1].keys()
    elif sums:
        earlier = sums.keys() - {NONFINITE} if NONFINITE in sums else sums.keys()
    else:
        return
    if aux.keys() != earlier:
        raise ValueError(_aux_names_changed(earlier, aux))


def fold(
    loss_sum: torch.Tensor | None,
    aux_sums: Mapping[str, torch.Tensor],
    pending: tuple[Entry, ...],
    *,
    mask_nonfinite: bool,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, Mapping[str, torch.Tensor]]:
    """Add the pending batches to the sums: one stack and one sum per name, in ``dtype``. No host sync.

    A value with a weight (``x`` and ``x@weight``, ``loss`` and ``loss@weight``) is summed as
    ``x * weight``: it is a mean over ``weight`` units (tokens, updates), and the sums hold its total.
    Under masking, a non-finite loss adds nothing to the loss sum, nor its weight to the weight's.
    """
    if not pending:
        return loss_sum, aux_sums
    names = pending[0][1].keys()
    stacked = {name: torch.stack([aux[name] for _, aux in pending]) for name in names}
    losses = torch.stack([loss for loss, _ in pending])
    new: dict[str, torch.Tensor] = {}
    loss_weight = "loss" + WEIGHT
    if mask_nonfinite:
        masked = losses.nan_to_num(0.0, 0.0, 0.0)  # nan, +inf, -inf
        finite = losses.eq(masked)
        new[NONFINITE] = finite.logical_not().sum(dtype=dtype)
        losses = masked
        if loss_weight in stacked:
            stacked[loss_weight] = stacked[loss_weight] * finite
    if loss_weight in stacked:
        losses = losses * stacked[loss_weight]
    total = losses.sum(dtype=dtype)
    loss_sum = total if loss_sum is None else loss_sum + total
    for name, values in stacked.items():
        weight = stacked.get(name + WEIGHT)
        new[name] = (values if weight is None else values * weight).sum(dtype=dtype)
    # the names were checked per batch (check_same_names); "nonfinite" is there only when masking
    merged = dict(aux_sums)
    for name, value in new.items():
        merged[name] = merged[name] + value if name in merged else value
    return loss_sum, MappingProxyType(merged)


def weighted(value: torch.Tensor, weight: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``value * weight`` detached, in ``dtype`` (0 for a weight of 0, even for an infinite value)."""
    value = as_float32(value) if dtype is torch.float32 else value.detach().to(dtype)
    if weight == 0:
        return torch.zeros_like(value)  # not value * 0, which is nan for an infinite value
    return value if weight == 1.0 else value * weight


def as_float32(value: torch.Tensor) -> torch.Tensor:
    """``value.detach().float()``, skipping each call that has nothing to do (this runs per batch)."""
    if value.requires_grad:
        value = value.detach()
    return value if value.dtype is torch.float32 else value.float()  # sync: none: a cast on the device


def _aux_names_changed(earlier: Iterable[str], aux: Iterable[str]) -> str:
    return (
        f"loss_fn returned aux names {sorted(aux)} but earlier batches of this epoch returned "
        f"{sorted(earlier)}: return the same names for every batch (use a zero tensor for a "
        "term that is absent)."
    )


def reduce_means(
    accelerator: Accelerator, sums: Mapping[str, torch.Tensor], count: torch.Tensor | int
) -> dict[str, float]:
    """Sum ``sums`` and ``count`` over processes and return the means as Python floats.

    One stacked tensor, one all-reduce, one host transfer: call this once per
    epoch or log interval, never per step.
    """
    return reduce_with_totals(accelerator, sums, count, {})[0]


def reduce_with_totals(
    accelerator: Accelerator,
    sums: Mapping[str, torch.Tensor],
    count: torch.Tensor | int,
    totals: Mapping[str, torch.Tensor | float],
) -> tuple[dict[str, float], dict[str, Any]]:
    """:func:`reduce_means`, and ``totals`` summed over processes, in the same one all-reduce and host transfer.

    A total is a number (its sum comes back as a float) or a 1-D tensor of the same length on every process (its sum
    comes back as a tuple of floats): a vector of one slot per process, each process writing its own slot and zeros
    elsewhere, carries every process's figure in the one sum."""
    names, extra = list(sums), list(totals)
    dtype = torch.float64 if any(v.dtype is torch.float64 for v in sums.values()) or extra else torch.float32
    device = accelerator.device
    pieces = [torch.as_tensor(totals[n], dtype=dtype, device=device).reshape(-1) for n in extra]
    scalars = [sums[n].to(dtype) for n in names] + [torch.as_tensor(count, dtype=dtype, device=device)]
    vectors = {n: p.numel() for n, p in zip(extra, pieces) if _is_vector(totals[n])}
    local = torch.cat([torch.stack(scalars), *pieces]) if pieces else torch.stack(scalars)
    if accelerator.num_processes > 1:
        _check_same_names(accelerator, names + extra + [f"{n}[{k}]" for n, k in vectors.items()])
        local = accelerator.reduce(local, reduction="sum")
    values = local.tolist()  # sync: once per epoch / log interval
    n = values[len(names)]
    means = {name: (v / n if n else float("nan")) for name, v in zip(names, values)}  # sync: none: host numbers
    summed: dict[str, Any] = {}
    at = len(names) + 1
    for name, piece in zip(extra, pieces):
        width = piece.numel()
        summed[name] = tuple(values[at : at + width]) if name in vectors else values[at]
        at += width
    return means, summed


def _is_vector(total: torch.Tensor | float) -> bool:
    return isinstance(total, torch.Tensor) and total.ndim == 1


def _check_same_names(accelerator: Accelerator, names: list[str]) -> None:
    """Refuse to all-reduce sums that differ between processes: gloo and NCCL would hang or mix them."""
    key = torch.tensor([len(names), zlib.crc32(",".join(names).encode())], dtype=torch.int64, device=accelerator.device)
    keys = accelerator.gather(key).view(-1, 2).tolist()  # sync: once per epoch / log interval
    if any(k != keys[0] for k in keys):
        raise RuntimeError(
            f"process {accelerator.process_index} has metrics {names}, but not every process has the "
            "same names: the loss_fn must return the same aux names on every process and batch."
        )


def finite_loss_mean(means: dict[str, float], nonfinite: str = NONFINITE) -> dict[str, float]:
    """Under ``nan_guard`` a non-finite loss adds 0 to the sum: rescale the mean to the finite batches.

    A weighted loss (``loss@weight``) needs no rescaling: its weight left the non-finite batches out.
    """
    if nonfinite in means and "loss" in means and "loss" + WEIGHT not in means:
        finite_share = 1.0 - means[nonfinite]
        means = {
            **means,
            "loss": means["loss"] / finite_share if finite_share > 0 else float("nan"),  # sync: none: host numbers
        }
    return means


def weighted_means(means: dict[str, float], suffix: str = WEIGHT) -> dict[str, float]:
    """Divide each value that has a weight (``name`` and ``name@weight``) by its weight's mean, and drop the weights.

    Both were divided by the same count, so the ratio is ``sum(name) / sum(weight)``: the
    weighted mean, from the same one reduction.

    Examples:
        >>> weighted_means({"loss": 2.0, "grad_norm": 0.5, "grad_norm@weight": 0.25})
        {'loss': 2.0, 'grad_norm': 2.0}
    """
    if not any(name.endswith(suffix) for name in means):
        return means
    out = {}
    for name, value in means.items():
        if name.endswith(suffix):
            continue
        weight = means.get(name + suffix)
        mean = value if weight is None else (value / weight if weight else float("nan"))  # sync: none: host numbers
        out[name] = mean
    return out
