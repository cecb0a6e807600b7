"""trainfold: functional, composable PyTorch training primitives on Hugging Face Accelerate.

The public names load on first use (PEP 562): ``import trainfold`` and the command line start
without importing torch; ``trainfold.make_step`` (or ``from trainfold import make_step``) imports
what it needs then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainfold._version import __version__ as __version__

if TYPE_CHECKING:
    from trainfold._src.base.history import History as History
    from trainfold._src.base.history import Record as Record
    from trainfold._src.base.running_sums import RunningSums as RunningSums
    from trainfold._src.base.records import register_record as register_record
    from trainfold._src.base.types import Batch as Batch
    from trainfold._src.base.types import LossFn as LossFn
    from trainfold._src.checkpoint.every import CheckpointEvery as CheckpointEvery
    from trainfold._src.checkpoint.every import checkpoint_every as checkpoint_every
    from trainfold._src.checkpoint.export import checkpoint_weights as checkpoint_weights
    from trainfold._src.checkpoint.export import export_checkpoint as export_checkpoint
    from trainfold._src.checkpoint.load import load_checkpoint as load_checkpoint
    from trainfold._src.checkpoint.root import verify_checkpoint as verify_checkpoint
    from trainfold._src.checkpoint.root import latest_checkpoint as latest_checkpoint
    from trainfold._src.checkpoint.root import list_checkpoints as list_checkpoints
    from trainfold._src.checkpoint.save import save_checkpoint as save_checkpoint
    from trainfold._src.compose.batch_size import BatchSizeFound as BatchSizeFound
    from trainfold._src.compose.batch_size import find_batch_size as find_batch_size
    from trainfold._src.compose.epoch import run_epoch as run_epoch
    from trainfold._src.compose.epoch_fns import early_stop as early_stop
    from trainfold._src.compose.epoch_fns import log_epoch as log_epoch
    from trainfold._src.compose.epoch_fns import reduce_lr_on_plateau as reduce_lr_on_plateau
    from trainfold._src.compose.epoch_fns import restore_best as restore_best
    from trainfold._src.compose.epoch_fns import save_best as save_best
    from trainfold._src.compose.evaluate import evaluate as evaluate
    from trainfold._src.compose.fit import fit as fit
    from trainfold._src.compose.local_sgd import average_parameters as average_parameters
    from trainfold._src.compose.local_sgd import local_sgd as local_sgd
    from trainfold._src.compose.loop import every_epochs as every_epochs
    from trainfold._src.compose.loop import loop as loop
    from trainfold._src.compose.loop import repeat as repeat
    from trainfold._src.compose.loop import until as until
    from trainfold._src.compose.plot import plot_history as plot_history
    from trainfold._src.compose.metrics import evaluate_metrics as evaluate_metrics
    from trainfold._src.compose.predict import predict as predict
    from trainfold._src.compose.profiling import profile as profile
    from trainfold._src.compose.schedules import constant as constant
    from trainfold._src.compose.schedules import warmup_cosine as warmup_cosine
    from trainfold._src.compose.schedules import warmup_linear as warmup_linear
    from trainfold._src.compose.stopping import stop_when as stop_when
    from trainfold._src.compose.tracking import progress_bar as progress_bar
    from trainfold._src.compose.transforms import ema as ema
    from trainfold._src.compose.transforms import ema_model as ema_model
    from trainfold._src.compose.transforms import every_steps as every_steps
    from trainfold._src.compose.tracking import init_trackers as init_trackers
    from trainfold._src.compose.transforms import log_every as log_every
    from trainfold._src.compose.watch import Watch as Watch
    from trainfold._src.compose.transforms import lr_schedule as lr_schedule
    from trainfold._src.compose.transforms import max_steps as max_steps
    from trainfold._src.core.compiling import Compile as Compile
    from trainfold._src.core.context import Context as Context
    from trainfold._src.core.runtime import Runtime as Runtime
    from trainfold._src.core.guard import nan_guard as nan_guard
    from trainfold._src.core.snapshot import Snapshot as Snapshot
    from trainfold._src.core.snapshot import restore as restore
    from trainfold._src.core.snapshot import snapshot as snapshot
    from trainfold._src.core.stages import MicroBatch as MicroBatch
    from trainfold._src.core.stages import Stage as Stage
    from trainfold._src.core.stages import StageSpec as StageSpec
    from trainfold._src.core.stages import clip_by_norm as clip_by_norm
    from trainfold._src.core.stages import clip_by_value as clip_by_value
    from trainfold._src.core.state import TrainState as TrainState
    from trainfold._src.core.stop import Stop as Stop
    from trainfold._src.core.step import make_step as make_step
    from trainfold._src.core.tokens import normalize_tokens as normalize_tokens
    from trainfold._src.core.types import EpochFn as EpochFn
    from trainfold._src.core.types import Step as Step
    from trainfold._src.core.types import StepTransformer as StepTransformer
    from trainfold.errors import CheckpointError as CheckpointError
    from trainfold.errors import DamagedCheckpoint as DamagedCheckpoint

#: each public name, and the module that defines it: the one list of them (``__all__`` is made from it, and a test
#: checks that the imports for type checkers above name the same)
_WHERE: dict[str, str] = {
    "Batch": "trainfold._src.base.types",
    "BatchSizeFound": "trainfold._src.compose.batch_size",
    "CheckpointError": "trainfold.errors",
    "CheckpointEvery": "trainfold._src.checkpoint.every",
    "Compile": "trainfold._src.core.compiling",
    "Context": "trainfold._src.core.context",
    "DamagedCheckpoint": "trainfold.errors",
    "EpochFn": "trainfold._src.core.types",
    "History": "trainfold._src.base.history",
    "LossFn": "trainfold._src.base.types",
    "MicroBatch": "trainfold._src.core.stages",
    "Record": "trainfold._src.base.history",
    "RunningSums": "trainfold._src.base.running_sums",
    "Runtime": "trainfold._src.core.runtime",
    "Snapshot": "trainfold._src.core.snapshot",
    "Stage": "trainfold._src.core.stages",
    "StageSpec": "trainfold._src.core.stages",
    "Step": "trainfold._src.core.types",
    "StepTransformer": "trainfold._src.core.types",
    "Stop": "trainfold._src.core.stop",
    "TrainState": "trainfold._src.core.state",
    "average_parameters": "trainfold._src.compose.local_sgd",
    "checkpoint_every": "trainfold._src.checkpoint.every",
    "checkpoint_weights": "trainfold._src.checkpoint.export",
    "clip_by_norm": "trainfold._src.core.stages",
    "clip_by_value": "trainfold._src.core.stages",
    "constant": "trainfold._src.compose.schedules",
    "early_stop": "trainfold._src.compose.epoch_fns",
    "ema": "trainfold._src.compose.transforms",
    "ema_model": "trainfold._src.compose.transforms",
    "evaluate": "trainfold._src.compose.evaluate",
    "evaluate_metrics": "trainfold._src.compose.metrics",
    "every_epochs": "trainfold._src.compose.loop",
    "every_steps": "trainfold._src.compose.transforms",
    "export_checkpoint": "trainfold._src.checkpoint.export",
    "find_batch_size": "trainfold._src.compose.batch_size",
    "fit": "trainfold._src.compose.fit",
    "latest_checkpoint": "trainfold._src.checkpoint.root",
    "list_checkpoints": "trainfold._src.checkpoint.root",
    "load_checkpoint": "trainfold._src.checkpoint.load",
    "local_sgd": "trainfold._src.compose.local_sgd",
    "log_epoch": "trainfold._src.compose.epoch_fns",
    "log_every": "trainfold._src.compose.transforms",
    "init_trackers": "trainfold._src.compose.tracking",
    "Watch": "trainfold._src.compose.watch",
    "loop": "trainfold._src.compose.loop",
    "lr_schedule": "trainfold._src.compose.transforms",
    "make_step": "trainfold._src.core.step",
    "max_steps": "trainfold._src.compose.transforms",
    "nan_guard": "trainfold._src.core.guard",
    "normalize_tokens": "trainfold._src.core.tokens",
    "plot_history": "trainfold._src.compose.plot",
    "predict": "trainfold._src.compose.predict",
    "profile": "trainfold._src.compose.profiling",
    "progress_bar": "trainfold._src.compose.tracking",
    "reduce_lr_on_plateau": "trainfold._src.compose.epoch_fns",
    "register_record": "trainfold._src.base.records",
    "repeat": "trainfold._src.compose.loop",
    "restore": "trainfold._src.core.snapshot",
    "restore_best": "trainfold._src.compose.epoch_fns",
    "run_epoch": "trainfold._src.compose.epoch",
    "save_best": "trainfold._src.compose.epoch_fns",
    "save_checkpoint": "trainfold._src.checkpoint.save",
    "snapshot": "trainfold._src.core.snapshot",
    "stop_when": "trainfold._src.compose.stopping",
    "until": "trainfold._src.compose.loop",
    "verify_checkpoint": "trainfold._src.checkpoint.root",
    "warmup_cosine": "trainfold._src.compose.schedules",
    "warmup_linear": "trainfold._src.compose.schedules",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'trainfold' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = ["__version__", *sorted(_WHERE)]
