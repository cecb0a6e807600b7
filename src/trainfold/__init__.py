"""trainfold: functional, composable PyTorch training primitives on Hugging Face Accelerate."""

from trainfold._version import __version__ as __version__
from trainfold._src.base.history import History as History
from trainfold._src.base.history import Record as Record
from trainfold._src.base.metrics import RunningSums as RunningSums
from trainfold._src.base.records import register_record as register_record
from trainfold._src.base.types import Batch as Batch
from trainfold._src.base.types import LossFn as LossFn
from trainfold._src.checkpoint.every import CheckpointEvery as CheckpointEvery
from trainfold._src.checkpoint.every import checkpoint_every as checkpoint_every
from trainfold._src.checkpoint.export import checkpoint_weights as checkpoint_weights
from trainfold._src.checkpoint.export import export_checkpoint as export_checkpoint
from trainfold._src.checkpoint.load import load_checkpoint as load_checkpoint
from trainfold._src.checkpoint.load import verify_checkpoint as verify_checkpoint
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
from trainfold._src.compose.transforms import log_every as log_every
from trainfold._src.compose.transforms import lr_schedule as lr_schedule
from trainfold._src.compose.transforms import max_steps as max_steps
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
