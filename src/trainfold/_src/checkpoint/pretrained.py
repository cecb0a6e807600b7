"""A checkpoint's weights as a Hugging Face ``save_pretrained`` folder (``trainfold export --transformers CONFIG_DIR``).

Owned here: building the model class a ``config.json`` names without allocating its
weights (on the meta device), giving it the checkpoint's weights (every name and shape
checked), and writing it with transformers' own ``save_pretrained`` (which knows the
model's tied weights), plus the config folder's other files. transformers is imported
only here, only when asked for.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from trainfold._src.base.io import staged_beside
from trainfold.errors import CheckpointError

#: Files of a model folder that hold weights: never copied from the config folder (the checkpoint's are written).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


def _check_no_code(config_dir: Path) -> None:
    """Refuse a config whose model is code in the folder (``auto_map``): an export never runs a folder's code.

    transformers would ask whether to trust it (``trust_remote_code``), and an answer of "y" runs the folder's
    Python; the question is never asked.
    """
    path = config_dir / "config.json"
    if not path.is_file():  # through a link too: a Hugging Face cache snapshot's files are links to its blobs
        raise CheckpointError(
            f"{config_dir} has no config.json: name the folder of a Hugging Face model "
            "(save_pretrained's, or its config alone)."
        )
    try:
        config = json.loads(path.read_bytes()[: 1 << 20])
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not a JSON config ({exc}).") from None
    if isinstance(config, dict) and "auto_map" in config:
        raise CheckpointError(
            f"{path} has an auto_map: its model class is code in that folder, and trainfold never runs a folder's code "
            "(transformers' trust_remote_code). Export without --transformers (one model.safetensors), or name the "
            "config of a model class transformers has."
        )


def _model_class(config_dir: Path) -> tuple[Any, Any]:
    _check_no_code(config_dir)
    try:
        import transformers
    except ImportError:
        raise ImportError("exporting to a transformers folder needs transformers: pip install transformers") from None
    config = transformers.AutoConfig.from_pretrained(str(config_dir), local_files_only=True, trust_remote_code=False)
    names = getattr(config, "architectures", None) or []
    first = names[0] if isinstance(names, (list, tuple)) and names else None
    cls = getattr(transformers, first, None) if isinstance(first, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(
            f"{config_dir}/config.json names no model class transformers has (architectures: {names}): "
            'set "architectures" to the class the checkpoint\'s model is, e.g. ["GPT2LMHeadModel"].'
        )
    return cls, config


def _check_fits(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], config_dir: Path) -> None:
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    shapes = sorted(n for n in expected.keys() & weights.keys() if tuple(weights[n].shape) != expected[n])
    if missing or unexpected or shapes:
        parts = [
            f"missing {missing[:5]}" if missing else "",
            f"unexpected {unexpected[:5]}" if unexpected else "",
            f"{shapes[0]!r} is {tuple(weights[shapes[0]].shape)} in the checkpoint and {expected[shapes[0]]} in the model"
            if shapes
            else "",
        ]
        raise CheckpointError(
            f"the checkpoint's weights do not fit {config_dir}'s model ({type(model).__name__}): "
            + "; ".join(p for p in parts if p)
            + ". Name the config of the model that was trained."
        )


def write_pretrained(weights: Mapping[str, torch.Tensor], config_dir: Path, out: Path) -> Path:
    """Write ``weights`` as ``config_dir``'s model to the new folder ``out`` (``save_pretrained``), renamed into place when whole."""
    cls, config = _model_class(config_dir)
    with torch.device("meta"):
        model = cls(config)
    _check_fits(model, weights, config_dir)
    model.load_state_dict(
        dict(weights), strict=False, assign=True
    )  # every name checked above; tied names share one tensor below
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    with staged_beside(out, folder=True) as staging:
        model.save_pretrained(str(staging), safe_serialization=True)
        for item in sorted(config_dir.iterdir()):
            if (
                item.is_file()
                and not item.name.endswith(_WEIGHT_SUFFIXES)
                and not (staging / item.name).exists()
                and not item.name.endswith(".index.json")
            ):
                shutil.copy2(item, staging / item.name)
        os.replace(staging, out)
    return out
