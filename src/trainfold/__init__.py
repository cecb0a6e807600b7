"""trainfold: functional, composable PyTorch training primitives on Hugging Face Accelerate."""

from ._types import Batch as Batch
from ._types import EpochFn as EpochFn
from ._types import LossFn as LossFn
from ._types import Step as Step
from ._types import StepTransformer as StepTransformer
from .context import Context as Context
from .epoch import evaluate as evaluate
from .epoch import predict as predict
from .epoch import run_epoch as run_epoch
from .history import History as History
from .history import Record as Record
from .loop import every as every
from .loop import loop as loop
from .loop import repeat as repeat
from .loop import until as until
from .state import TrainState as TrainState
from .step import make_step as make_step

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Context",
    "EpochFn",
    "History",
    "LossFn",
    "Record",
    "Step",
    "StepTransformer",
    "TrainState",
    "__version__",
    "evaluate",
    "every",
    "loop",
    "make_step",
    "predict",
    "repeat",
    "run_epoch",
    "until",
]
