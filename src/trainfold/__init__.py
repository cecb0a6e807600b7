"""trainfold: functional, composable PyTorch training primitives on Hugging Face Accelerate."""

from trainfold._version import __version__ as __version__
from trainfold.base.history import History as History
from trainfold.base.history import Record as Record
from trainfold.base.metrics import RunningSums as RunningSums
from trainfold.base.records import register_record as register_record
from trainfold.base.types import Batch as Batch
from trainfold.base.types import LossFn as LossFn
from trainfold.checkpoint.every import CheckpointEvery as CheckpointEvery
from trainfold.checkpoint.every import checkpoint_every as checkpoint_every
from trainfold.checkpoint.export import checkpoint_weights as checkpoint_weights
from trainfold.checkpoint.export import export_checkpoint as export_checkpoint
from trainfold.checkpoint.load import load_checkpoint as load_checkpoint
from trainfold.checkpoint.load import verify_checkpoint as verify_checkpoint
from trainfold.checkpoint.root import latest_checkpoint as latest_checkpoint
from trainfold.checkpoint.root import list_checkpoints as list_checkpoints
from trainfold.checkpoint.save import save_checkpoint as save_checkpoint
from trainfold.compose.batch_size import BatchSizeFound as BatchSizeFound
from trainfold.compose.batch_size import find_batch_size as find_batch_size
from trainfold.compose.epoch import run_epoch as run_epoch
from trainfold.compose.epoch_fns import early_stop as early_stop
from trainfold.compose.epoch_fns import log_epoch as log_epoch
from trainfold.compose.epoch_fns import reduce_lr_on_plateau as reduce_lr_on_plateau
from trainfold.compose.epoch_fns import restore_best as restore_best
from trainfold.compose.epoch_fns import save_best as save_best
from trainfold.compose.evaluate import evaluate as evaluate
from trainfold.compose.fit import fit as fit
from trainfold.compose.local_sgd import average_parameters as average_parameters
from trainfold.compose.local_sgd import local_sgd as local_sgd
from trainfold.compose.loop import every_epochs as every_epochs
from trainfold.compose.loop import loop as loop
from trainfold.compose.loop import repeat as repeat
from trainfold.compose.loop import until as until
from trainfold.compose.plot import plot_history as plot_history
from trainfold.compose.predict import evaluate_metrics as evaluate_metrics
from trainfold.compose.predict import predict as predict
from trainfold.compose.profiling import profile as profile
from trainfold.compose.schedules import constant as constant
from trainfold.compose.schedules import warmup_cosine as warmup_cosine
from trainfold.compose.schedules import warmup_linear as warmup_linear
from trainfold.compose.stopping import stop_when as stop_when
from trainfold.compose.tracking import progress_bar as progress_bar
from trainfold.compose.transforms import ema as ema
from trainfold.compose.transforms import ema_model as ema_model
from trainfold.compose.transforms import every_steps as every_steps
from trainfold.compose.transforms import log_every as log_every
from trainfold.compose.transforms import lr_schedule as lr_schedule
from trainfold.compose.transforms import max_steps as max_steps
from trainfold.core.context import Context as Context
from trainfold.core.runtime import Runtime as Runtime
from trainfold.core.guard import nan_guard as nan_guard
from trainfold.core.snapshot import Snapshot as Snapshot
from trainfold.core.snapshot import restore as restore
from trainfold.core.snapshot import snapshot as snapshot
from trainfold.core.stages import MicroBatch as MicroBatch
from trainfold.core.stages import Stage as Stage
from trainfold.core.stages import StageSpec as StageSpec
from trainfold.core.stages import clip_by_norm as clip_by_norm
from trainfold.core.stages import clip_by_value as clip_by_value
from trainfold.core.state import TrainState as TrainState
from trainfold.core.stop import Stop as Stop
from trainfold.core.step import make_step as make_step
from trainfold.core.tokens import normalize_tokens as normalize_tokens
from trainfold.core.types import EpochFn as EpochFn
from trainfold.core.types import Step as Step
from trainfold.core.types import StepTransformer as StepTransformer
from trainfold.errors import CheckpointError as CheckpointError

__all__ = [
    "Batch",
    "BatchSizeFound",
    "CheckpointError",
    "CheckpointEvery",
    "Context",
    "EpochFn",
    "History",
    "LossFn",
    "MicroBatch",
    "Record",
    "RunningSums",
    "Runtime",
    "Snapshot",
    "Stage",
    "StageSpec",
    "Step",
    "StepTransformer",
    "Stop",
    "TrainState",
    "__version__",
    "average_parameters",
    "checkpoint_every",
    "checkpoint_weights",
    "clip_by_norm",
    "clip_by_value",
    "constant",
    "early_stop",
    "ema",
    "ema_model",
    "evaluate",
    "evaluate_metrics",
    "every_epochs",
    "every_steps",
    "export_checkpoint",
    "find_batch_size",
    "fit",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "local_sgd",
    "log_epoch",
    "log_every",
    "loop",
    "lr_schedule",
    "make_step",
    "max_steps",
    "nan_guard",
    "normalize_tokens",
    "plot_history",
    "predict",
    "profile",
    "progress_bar",
    "reduce_lr_on_plateau",
    "register_record",
    "repeat",
    "restore",
    "restore_best",
    "run_epoch",
    "save_best",
    "save_checkpoint",
    "snapshot",
    "stop_when",
    "until",
    "verify_checkpoint",
    "warmup_cosine",
    "warmup_linear",
]
