"""trainfold: functional, composable PyTorch training primitives on Hugging Face Accelerate."""

from ._types import Batch as Batch
from ._types import EpochFn as EpochFn
from ._types import LossFn as LossFn
from ._types import Step as Step
from ._types import StepTransformer as StepTransformer
from .batch_size import BatchSizeFound as BatchSizeFound
from .batch_size import find_batch_size as find_batch_size
from .errors import CheckpointError as CheckpointError
from .export import checkpoint_weights as checkpoint_weights
from .export import export_checkpoint as export_checkpoint
from .checkpoint import checkpoint_every as checkpoint_every
from .checkpoint import latest_checkpoint as latest_checkpoint
from .checkpoint import list_checkpoints as list_checkpoints
from .checkpoint import load_checkpoint as load_checkpoint
from .checkpoint import save_checkpoint as save_checkpoint
from .checkpoint import verify_checkpoint as verify_checkpoint
from .context import Context as Context
from .epoch import evaluate as evaluate
from .epoch import evaluate_metrics as evaluate_metrics
from .epoch import predict as predict
from .epoch import run_epoch as run_epoch
from .epoch_fns import early_stop as early_stop
from .epoch_fns import log_epoch as log_epoch
from .epoch_fns import reduce_lr_on_plateau as reduce_lr_on_plateau
from .epoch_fns import restore_best as restore_best
from .epoch_fns import save_best as save_best
from .fit import fit as fit
from .guard import nan_guard as nan_guard
from .history import History as History
from .history import Record as Record
from .local_sgd import average_parameters as average_parameters
from .local_sgd import local_sgd as local_sgd
from .loop import every as every
from .loop import every_epochs as every_epochs
from .loop import loop as loop
from .loop import repeat as repeat
from .loop import until as until
from .metrics import RunningSums as RunningSums
from .plot import plot_history as plot_history
from .profiling import profile as profile
from .records import register_record as register_record
from .schedules import constant as constant
from .schedules import warmup_cosine as warmup_cosine
from .schedules import warmup_linear as warmup_linear
from .snapshot import Snapshot as Snapshot
from .snapshot import restore as restore
from .snapshot import snapshot as snapshot
from .stages import MicroBatch as MicroBatch
from .stages import Stage as Stage
from .stages import StageSpec as StageSpec
from .stages import clip_by_norm as clip_by_norm
from .stages import clip_by_value as clip_by_value
from .stages import grad_norm as grad_norm
from .stopping import stop_when as stop_when
from .state import TrainState as TrainState
from .step import make_step as make_step
from .tokens import normalize_tokens as normalize_tokens
from .tracking import progress_bar as progress_bar
from .transforms import ema as ema
from .transforms import ema_model as ema_model
from .transforms import every_steps as every_steps
from .transforms import log_every as log_every
from .transforms import lr_schedule as lr_schedule
from .transforms import max_steps as max_steps

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BatchSizeFound",
    "CheckpointError",
    "Context",
    "EpochFn",
    "History",
    "LossFn",
    "MicroBatch",
    "Record",
    "RunningSums",
    "Snapshot",
    "Stage",
    "StageSpec",
    "Step",
    "StepTransformer",
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
    "every",
    "every_epochs",
    "every_steps",
    "export_checkpoint",
    "find_batch_size",
    "fit",
    "grad_norm",
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
