"""Loading a checkpoint: all or nothing, every file verified as it is read, the run checked before anything changes.

The format of the checkpoint (chosen once, from its manifest) reads, checks and
puts it back; nothing here branches on the engine.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, Mapping, Sequence, overload

from toolz import curry

from trainfold._version import __version__
from trainfold._src.base.checks import user_stacklevel
from trainfold._src.checkpoint.formats import for_load
from trainfold._src.checkpoint.manifest import read_manifest
from trainfold._src.checkpoint.root import expect_path, newest_first, newest_first_with_manifests
from trainfold._src.checkpoint.save import position_of
from trainfold._src.checkpoint.storage import Stored, open_root
from trainfold._src.core.checks import expect_context, expect_owned, expect_state
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState
from trainfold._src.distributed.control import gather_objects
from trainfold.errors import CheckpointError, DamagedCheckpoint

logger = logging.getLogger("trainfold")


@overload
def load_checkpoint(
    ctx: Context,
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    missing_ok: bool = ...,
    storage_options: Mapping[str, Any] | None = ...,
) -> Any: ...


@overload
def load_checkpoint(
    ctx: Context,
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    state: TrainState,
    *,
    missing_ok: bool = ...,
    storage_options: Mapping[str, Any] | None = ...,
) -> TrainState: ...


@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def load_checkpoint(
    ctx: Context,
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    state: TrainState,
    *,
    missing_ok: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> TrainState:
    """Load a checkpoint into ``state``'s model, optimizer and scheduler and return the saved state.

    ``path`` is a checkpoint folder, or a root of them (then the newest complete
    one, by the position it records; if its bytes are damaged, a bit flipped
    on disk or a file truncated or missing, a warning names it and the newest
    one before it that loads is loaded instead: on several processes, every
    process falls back alike). All or nothing: every file is read once
    and verified against the manifest while it is read, every value is decoded
    and the checkpoint is checked against the run (the same parameters, names and
    shapes, the same optimizer layout, a scheduler on both sides or neither; for a
    gathered checkpoint, the same number of processes) before anything is changed.
    A sharded checkpoint written by another number of processes is resharded into
    this run's layout, and its interrupted epoch continues by its position in
    samples (see the guide "Sharded, elastic and background checkpoints"). A DeepSpeed
    checkpoint's engine files are parsed with torch's restricted unpickler and checked against
    the live engine (processes, ZeRO stage, parameter shapes) before DeepSpeed is given them.
    Then the weights, optimizer,
    scheduler, scaler and Accelerate's accumulation counter are restored in
    place, the random states are restored, and a state is returned whose next
    ``run_epoch`` continues the interrupted epoch from the next batch, in the
    same order. Call ``run_epoch`` next: anything that draws random numbers in
    between changes what follows.

    With ``missing_ok=True`` a root where no save has completed yet (none there, or only
    one cut short) gives ``state`` back unchanged: the one line with which a script resumes
    by itself whenever it is started again, by hand or by an engine (torchrun elastic,
    Kubernetes, SLURM), on any number of processes. The ``trainfold`` logger says which
    happened (``resumed from ckpt-... at update N``, or ``starting at update 0``). On
    several processes they agree first on the newest checkpoint they see, and a root that
    is not the same on every node (a local folder on each) is refused, naming what each saw.

    Given a list of roots (a memory tier saved every few updates, then the durable root), the
    newest complete checkpoint of any of them is loaded, by the position each records (the
    root listed first at the same position); a damaged one falls back to the next newest of
    any root. The last root says which run this is: another root's checkpoints of another run
    (a memory folder an earlier job left) are passed over with a warning, as is a root that is
    not the same on every process. See the guide "Checkpoints that cannot lie".

    Args:
        ctx: the run's Context.
        path: a checkpoint folder, or a root of them (its newest complete checkpoint); a local path or a URL. Or a
            list of roots, a memory tier first and the durable root last: the newest complete checkpoint of any.
        state: the state to load into (made with ``TrainState.create`` for the same model and optimizer;
            curried: ``load_checkpoint(ctx, path)`` is an epoch function).
        missing_ok: give ``state`` back where ``path`` holds no complete checkpoint, instead of raising.
        storage_options: options for the store's fsspec filesystem (a URL only).

    Returns:
        The saved state, with ``state``'s handles (the model, optimizer and scheduler, loaded in place).

    Raises:
        DamagedCheckpoint: the checkpoint ``path`` names, or every checkpoint of the root (or roots), is damaged
            (naming the file).
        ValueError: an empty list of roots.
        CheckpointError: a damaged or hostile checkpoint (naming the file), another model
            (naming the first parameter that differs), another optimizer layout,
            another world size, another accumulation setting, DeepSpeed on one side only,
            processes that see different newest checkpoints; no checkpoint (unless ``missing_ok``).
            Nothing is changed.

    Examples:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> trained = save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
        >>> resumed = load_checkpoint(ctx, root, state)
        >>> resumed.step, resumed.epoch
        (4, 1)
    """
    expect_context("load_checkpoint", "load_checkpoint(ctx, path, state)", ctx)
    state = expect_owned("load_checkpoint", ctx, expect_state("load_checkpoint", state))
    ctx.wait_for_checkpoints()  # a background save of this run is committed before anything is read
    roots = _roots(path)
    found = (
        _newest_alike(ctx, roots[0], storage_options, missing_ok)
        if len(roots) == 1
        else _newest_across(ctx, roots, storage_options, missing_ok)
    )
    if not found:
        if ctx.is_main_process:
            where = " or ".join(os.fspath(r) for r in roots)
            logger.info("no checkpoint under %s yet: starting at update %d", where, state.step)
        return state
    for n, folder in enumerate(found):
        try:
            loaded = _agreed(ctx, lambda: _load(ctx, folder, state))
            break
        except DamagedCheckpoint as exc:
            if n + 1 == len(found):
                raise DamagedCheckpoint(
                    f"{exc} No checkpoint under the root loads: each is damaged." if n else str(exc)
                ) from None
            _warn_damaged(exc, folder, found[n + 1])
    # the root holds this position: a finished run started again does not save its end a second time (CheckpointEvery.at_end)
    ctx.runtime.note_held(open_root(os.path.dirname(os.fspath(folder.path)), storage_options).key, position_of(loaded))
    _warn_trackers_started(ctx, loaded)
    ctx.runtime.resumed_from = loaded.step or None
    if ctx.is_main_process:
        processes = ctx.accelerator.num_processes
        logger.info(
            "resumed from %s at update %d (epoch %d, batch %d) on %d process%s",
            folder.name if len(roots) == 1 else folder,
            loaded.step,
            loaded.epoch,
            loaded.batch_in_epoch,
            processes,
            "" if processes == 1 else "es",
        )
    return loaded


def _roots(path: Any) -> list[str | os.PathLike[str]]:
    """``path`` as a list of roots: one path, or a list or tuple of them (the fast tier first, the durable one last)."""
    if isinstance(path, (list, tuple)):
        if not path:
            raise ValueError(
                "load_checkpoint got an empty list of roots: give a checkpoint folder or root, or several roots "
                "(the memory tier first, the durable root last)."
            )
        return [expect_path("load_checkpoint", p) for p in path]
    return [expect_path("load_checkpoint", path)]


def _newest_across(
    ctx: Context, roots: list[str | os.PathLike[str]], storage_options: Mapping[str, Any] | None, missing_ok: bool
) -> list[Stored]:
    """The complete checkpoints of every root, the newest first by the position each records (at the same position,
    the root listed first), the same on every process; none, with ``missing_ok``.

    A root that is not the same on every process (a node's own memory, after a restart on other nodes) is passed over
    with a warning, as is a checkpoint of another run than the last root's newest (a memory root left by an earlier
    job): the last root, the durable one, says which run this is, where it holds a checkpoint.

    Raises:
        CheckpointError: no root holds a complete checkpoint (unless ``missing_ok``).
    """
    per_root: list[list[tuple[Stored, dict[str, Any]]]] = []
    for root in roots:
        try:
            per_root.append(newest_first_with_manifests(root, storage_options))
        except CheckpointError:
            per_root.append([])
    if ctx.accelerator.num_processes > 1:
        newest = [found[0][0].name if found else None for found in per_root]
        seen = gather_objects(ctx.runtime.control.group(), newest)
        for i, root in enumerate(roots):
            names = [views[i] for views in seen]
            if len(set(names)) > 1:
                said = ", ".join(f"process {rank} {name or 'none'}" for rank, name in enumerate(names))
                _warn_passed_over(root, f"the processes see different newest checkpoints there ({said})")
                per_root[i] = []
    run = per_root[-1][0][1].get("run_id") if per_root[-1] else None
    candidates = []
    for i, manifests in enumerate(per_root):
        others = [m.get("run_id") for _, m in manifests if run is not None and m.get("run_id") != run]
        if others:
            _warn_passed_over(
                roots[i], f"its checkpoints of run {others[0]} are not of {os.fspath(roots[-1])}'s run {run}"
            )
        candidates += [
            ((m.get("micro_step", 0), m.get("step", 0)), -i, stored)
            for stored, m in manifests
            if run is None or m.get("run_id") == run
        ]
    if not candidates and not missing_ok:
        raise CheckpointError(f"no complete checkpoint under {' or '.join(os.fspath(r) for r in roots)}.")
    return [stored for *_, stored in sorted(candidates, key=lambda c: c[:2], reverse=True)]


def _warn_passed_over(where: object, why: str) -> None:
    warnings.warn(
        f"load_checkpoint: {where} is passed over: {why}. Loading from the other roots.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _newest_alike(
    ctx: Context, path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, missing_ok: bool
) -> list[Stored]:
    """The checkpoints at ``path``, the newest first, the same on every process (or none, with ``missing_ok``).

    Raises:
        CheckpointError: none there (without ``missing_ok``), or processes that see different newest checkpoints.
    """
    try:
        found, error = newest_first(path, storage_options), None
    except CheckpointError as exc:
        found, error = [], exc
    if ctx.accelerator.num_processes > 1:
        seen = gather_objects(ctx.runtime.control.group(), found[0].name if found else None)
        if len(set(seen)) > 1:
            said = ", ".join(f"process {rank} {name or 'none'}" for rank, name in enumerate(seen))
            raise CheckpointError(
                f"the processes see different newest checkpoints under {os.fspath(path)} ({said}): every node must "
                "see the same root, a shared filesystem or an object store, not a local folder on each."
            )
    if found or missing_ok:
        return found
    assert error is not None
    raise error


def _warn_trackers_started(ctx: Context, loaded: TrainState) -> None:
    """Trackers started before the load went on as a fresh run's: a resumed run's updates after its checkpoint would be
    logged twice (TensorBoard not cut back, MLflow's and the others' runs not found)."""
    trackers = [t.name for t in ctx.accelerator.trackers]
    if loaded.step > 0 and trackers and ctx.runtime.warn_once("trackers of a resumed run") and ctx.is_main_process:
        warnings.warn(
            f"load_checkpoint: the Accelerator's trackers ({', '.join(trackers)}) were started before this load, for a run "
            f"from update 0, and the run goes on from update {loaded.step}: what the run before logged after its checkpoint "
            "would be logged again beside it. Start them with init_trackers(ctx, project_name, state) after load_checkpoint, "
            "given the loaded state.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _load(ctx: Context, folder: Stored, state: TrainState) -> TrainState:
    manifest = read_manifest(folder, version=__version__)
    return for_load(ctx, folder, manifest).load(ctx, folder, manifest, state)


def _agreed(ctx: Context, work: Callable[[], TrainState]) -> TrainState:
    """``work`` on every process, which agree (one all-reduce on several) on whether it loaded, met a damaged
    checkpoint (every process then falls back alike) or was refused: a process's refusal is every process's."""
    try:
        result, error = work(), None
    except Exception as exc:  # noqa: BLE001  # agreed first, raised below
        result, error = None, exc
    outcome = 0 if error is None else 1 if isinstance(error, DamagedCheckpoint) else 2
    if ctx.accelerator.num_processes > 1:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([float(outcome)])  # sync: none: a host number
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.runtime.control.group())
        outcome = int(flag.item())  # sync: none, a CPU tensor
    if outcome == 0:
        assert result is not None
        return result
    if outcome == 1:
        raise (
            error
            if error is not None
            else DamagedCheckpoint("a process found the checkpoint damaged (its warning names the file)")
        )
    if error is not None and not isinstance(error, DamagedCheckpoint):
        raise error
    raise CheckpointError(
        "load_checkpoint was refused on another process (see its error); nothing is loaded here either."
    )


def _warn_damaged(exc: DamagedCheckpoint, damaged: Stored, previous: Stored) -> None:
    warnings.warn(
        f"load_checkpoint: {exc} Loading {previous}, the newest checkpoint before it, instead. The damaged one stays in "
        f"the root ({damaged}): `trainfold verify` names what is wrong with it, and this run's save at its update "
        "replaces it.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
