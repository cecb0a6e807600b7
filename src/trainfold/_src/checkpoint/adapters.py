"""An adapter checkpoint offline: its adapters as PEFT writes them, and its whole model from the base it records.

An adapter checkpoint (``frozen.py``) holds what trained and records its base by
fingerprint. Owned here, all offline (no model, no process group, peft not imported):

- :func:`peft_record`: what a save notes of a PEFT model (its active adapter's name and
  config), so that an export can write what ``PeftModel.from_pretrained`` loads;
- :func:`peft_files`: the adapters as ``adapter_model.safetensors`` and ``adapter_config.json``,
  named as PEFT names them (``get_peft_model_state_dict``: the adapter's name taken out);
- :func:`whole_weights`: the whole model from a base (a safetensors file or a
  ``save_pretrained`` folder), each of its tensors checked against the fingerprint, with a
  PEFT model's LoRA adapters merged into their layers (``W + scale * B @ A``) and the names
  the base model has.
"""

from __future__ import annotations

import enum
import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from trainfold._src.base.io import read_into
from trainfold._src.checkpoint import digest as _digest
from trainfold._src.checkpoint import safetensors as _safetensors
from trainfold._src.checkpoint.frozen import dtype_name
from trainfold._src.core.runstate import FrozenTensor
from trainfold.errors import CheckpointError

#: The prefix PEFT's wrapper puts before the base model's names.
_PREFIX = "base_model.model."


def _json_safe(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _json_safe(value.value)
    if isinstance(value, (set, frozenset)):
        return sorted((_json_safe(v) for v in value), key=str)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def peft_record(model: torch.nn.Module) -> dict[str, Any] | None:
    """``{"adapter": name, "config": {...}}`` for a PEFT model with one active adapter (its config as PEFT's
    ``adapter_config.json`` holds it), else None. peft is not imported: a PEFT model says what it is."""
    configs = getattr(model, "peft_config", None)
    if not type(model).__module__.startswith("peft.") or not isinstance(configs, dict):
        return None
    adapter = getattr(model, "active_adapter", None)
    config = configs.get(adapter) if isinstance(adapter, str) else None
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    return {"adapter": adapter, "config": _json_safe(config.to_dict())}


def _checked_record(folder: object, peft: Any) -> tuple[str, dict[str, Any]] | None:
    if peft is None:
        return None
    if not (
        isinstance(peft, dict)
        and isinstance(peft.get("adapter"), str)
        and isinstance(peft.get("config"), dict)
        and re.fullmatch(r"[A-Za-z0-9_\-]+", peft["adapter"])
    ):
        raise CheckpointError(f"{folder}: its peft entry is not an adapter's name and config: refused.")
    return peft["adapter"], peft["config"]


def peft_files(folder: object, held: Mapping[str, torch.Tensor], peft: Any) -> tuple[dict[str, torch.Tensor], bytes]:
    """The adapters as PEFT saves them: the tensors of the adapter (named without its name) and the config's JSON.

    Raises:
        CheckpointError: a damaged peft entry, or no tensor of the adapter.
    """
    record = _checked_record(folder, peft)
    assert record is not None
    adapter, config = record
    tag = f".{adapter}"
    bias = config.get("bias", "none")
    tensors = {
        name.replace(tag, ""): t
        for name, t in held.items()
        if f"{tag}." in name or (bias != "none" and name.endswith(".bias"))
    }
    if not tensors:
        raise CheckpointError(f"{folder} holds no tensor of its PEFT adapter {adapter!r}: nothing to export.")
    return tensors, json.dumps(config, indent=2, sort_keys=True).encode()


def read_base(path: str | Path) -> _safetensors.Tensors:
    """A base model's tensors: a safetensors file, or a ``save_pretrained`` folder's (every ``*.safetensors`` in it).
    Each is made when it is asked for: an export takes the frozen ones, whatever else the base holds.

    Raises:
        CheckpointError: no such file or folder, no safetensors file in the folder, a file that is not safetensors,
            a name in two files.
    """
    where = Path(path)
    files = (
        [where]
        if where.exists() and not where.is_dir()
        else sorted(where.glob("*.safetensors"))
        if where.is_dir()
        else []
    )
    if not files:
        raise CheckpointError(
            f"--base {where}: {'no *.safetensors file in that folder' if where.is_dir() else 'no such file or folder'}; "
            "name the base's safetensors file or its save_pretrained folder."
        )
    entries: dict[str, _safetensors.Entry] = {}
    for file in files:
        real = file.resolve()  # the user's own base, links followed: a hub cache's snapshot files link into blobs/
        try:
            part = _safetensors.index(read_into(real, real.stat().st_size))
        except _safetensors.FormatError as exc:
            raise CheckpointError(f"--base {file} is not a safetensors file ({exc}).") from None
        except (OSError, ValueError) as exc:
            reason = "is not a regular file" if real.exists() and not real.is_file() else f"cannot be read ({exc})"
            raise CheckpointError(
                f"--base {file} {reason}: a base folder holds the model's *.safetensors files."
            ) from None
        twice = sorted(entries.keys() & part.keys())
        if twice:
            raise CheckpointError(f"--base {where}: the tensor {twice[0]!r} is in two files.")
        entries.update(part)
    return _safetensors.Tensors(entries)


def _base_name(name: str, adapter: str | None) -> str:
    """The name a tensor of a PEFT model has in its base model (``base_model.model.fc.base_layer.weight`` -> ``fc.weight``)."""
    if adapter is None:
        return name
    name = name.removeprefix(_PREFIX)
    for part in (".base_layer.", ".original_module.", f".modules_to_save.{adapter}."):
        name = name.replace(part, ".")
    return name


def _digest_of(t: torch.Tensor) -> str:
    return _digest.of(_safetensors.raw(t))


def _frozen_from_base(
    folder: object, base_path: object, frozen: Sequence[FrozenTensor], base: _safetensors.Tensors, adapter: str | None
) -> dict[str, torch.Tensor]:
    """The frozen tensors, by the checkpoint's names, from the base, each checked against its fingerprint. A name the
    base lacks is found by its values (shape, dtype, digest) among the base's tensors: a tied weight that
    ``save_pretrained`` writes once, a backbone saved under its own names (``0.weight`` for ``backbone.0.weight``).

    Raises:
        CheckpointError: a tensor the base lacks, or of another shape, dtype or value, naming it.
    """
    digests: dict[str, str] = {}
    by_kind: dict[
        tuple[tuple[int, ...], str], list[str]
    ] = {}  # the base's names by shape and dtype, made once if needed

    def digest_of(name: str) -> str:
        if name not in digests:
            digests[name] = _digest_of(base[name])
        return digests[name]

    def alike(f: FrozenTensor) -> list[str]:
        if not by_kind:
            for n, e in base.entries.items():
                by_kind.setdefault((e.shape, dtype_name(e.dtype)), []).append(n)
        return by_kind.get((f.shape, f.dtype), [])

    out: dict[str, torch.Tensor] = {}
    for f in frozen:
        name = _base_name(f.name, adapter)
        t = base.get(name)
        if t is None:  # tied: the same bytes under another name
            t = next((base[n] for n in alike(f) if digest_of(n) == f.digest), None)
            if t is None:
                raise CheckpointError(
                    f"--base {base_path} has no tensor {name!r}, and none with the values of the frozen {f.name!r} of "
                    f"{folder}: not the base the run trained on."
                )
        elif (tuple(t.shape), dtype_name(t.dtype)) != (f.shape, f.dtype):
            raise CheckpointError(
                f"--base {base_path}: {name!r} is {dtype_name(t.dtype)} of shape {tuple(t.shape)}; the run trained on {f.dtype} of "
                f"shape {f.shape}: another base (or another dtype of it)."
            )
        elif digest_of(name) != f.digest:
            raise CheckpointError(
                f"--base {base_path}: {name!r} has other values than the frozen {f.name!r} the run trained on: another base "
                "(another model or revision). Give the base the run started from."
            )
        out[f.name] = t
    return out


def _lora_scale(folder: object, config: Mapping[str, Any]) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), refusing what this merge does not do (PEFT's merge_and_unload does)."""
    unsupported = [
        what
        for what, on in (
            (f"peft_type {config.get('peft_type')!r}", config.get("peft_type") != "LORA"),
            ("use_dora", bool(config.get("use_dora"))),  # sync: none: these are a JSON config's values
            ("lora_bias", bool(config.get("lora_bias"))),  # sync: none: config values
            ("rank_pattern", bool(config.get("rank_pattern"))),  # sync: none: config values
            ("alpha_pattern", bool(config.get("alpha_pattern"))),  # sync: none: config values
        )
        if on
    ]
    r, alpha = config.get("r"), config.get("lora_alpha")
    if unsupported or not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        reason = ", ".join(unsupported) or f"r {r!r}, lora_alpha {alpha!r}"
        raise CheckpointError(
            f"{folder}: merging its adapter ({reason}) is not done here (plain LoRA on Linear layers is). Export the "
            "adapters alone (without --base) and merge them with peft: PeftModel.from_pretrained(base, out).merge_and_unload()."
        )
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)  # sync: none: config numbers


def _merged(
    folder: object, whole: dict[str, torch.Tensor], adapter: str, config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """``whole`` (a PEFT model's names) with each LoRA pair merged into its layer's weight and taken out."""
    scale = _lora_scale(folder, config)
    transpose = bool(config.get("fan_in_fan_out"))  # sync: none: a config value
    out = dict(whole)
    for name in sorted(whole):
        suffix = f".lora_A.{adapter}.weight"
        if not name.endswith(suffix):
            continue
        module = name[: -len(suffix)]
        a, b, target = out.pop(name), out.pop(f"{module}.lora_B.{adapter}.weight"), f"{module}.base_layer.weight"
        if a.dim() != 2 or target not in out:
            raise CheckpointError(
                f"{folder}: the adapter of {module!r} is not a LoRA pair on a Linear layer: merge it with peft "
                "(export without --base, then merge_and_unload())."
            )
        delta = (b.float() @ a.float()) * scale  # sync: none: casts at an export, on the host
        weight = out[target]
        out[target] = (weight.float() + (delta.T if transpose else delta)).to(weight.dtype)  # sync: none: casts
    leftover = sorted(n for n in out if ".lora_" in n)  # embeddings' lora_embedding_A/B, DoRA's magnitudes...
    if leftover:
        raise CheckpointError(
            f"{folder}: {leftover[0]!r} belongs to no LoRA pair on a Linear layer, which is what this merge "
            "does: export the adapters alone (without --base) and merge them with peft's merge_and_unload()."
        )
    return out


def whole_weights(
    folder: object, held: Mapping[str, torch.Tensor], frozen: Sequence[FrozenTensor], peft: Any, base_path: str | Path
) -> dict[str, torch.Tensor]:
    """The whole model of an adapter checkpoint: the base's frozen tensors (checked against the fingerprint) and the
    held ones; for a PEFT model, its LoRA adapters merged and the base model's names.

    Raises:
        CheckpointError: a base that is not the one the run trained on (naming the tensor), or an adapter this merge
            does not do.
    """
    record = _checked_record(folder, peft)
    adapter = None if record is None else record[0]
    base = read_base(base_path)
    whole = {**_frozen_from_base(folder, base_path, frozen, base, adapter), **held}
    if record is None:
        return whole
    merged = _merged(folder, whole, *record)
    renamed: dict[str, torch.Tensor] = {}
    for name in sorted(
        merged, key=lambda n: f".modules_to_save.{adapter}." in n
    ):  # a module to save overrides its original
        renamed[_base_name(name, adapter)] = merged[name]
    return renamed
