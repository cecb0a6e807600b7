"""Plain-value encoding for checkpoints: JSON for structure, a flat dict of tensors for safetensors.

Nothing here unpickles or imports by name: decoding only rebuilds JSON values,
tuples, dicts, tensors, torch dtypes (from a fixed list) and the record types
registered with :func:`~trainfold.register_record`. That is what makes loading a
checkpoint unable to run code.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Mapping

import attrs
import numpy as np
import torch

from trainfold._src.base.io import ALIGNMENT
from trainfold._src.base.records import lookup, record_name

#: How deep a decoded value may nest (trainfold's own values nest a few levels).
MAX_DEPTH = 64

#: The dtypes a checkpoint may name, by name: decoding never looks a name up on the torch module.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` where torch would have allocated it: itself at an :data:`ALIGNMENT` boundary, else a copy.

    A tensor read from a checkpoint is a view into the file's buffer, at the offset the file gives it. Copied into a
    live tensor it needs nothing; kept by the run (a batch read ahead, an optimizer's state) it must sit where the
    uninterrupted run's would: CPU kernels (a matmul's backward, a sum) add in another order at another alignment, so
    a resumed run differed from an uninterrupted one in the last bits.

    Examples:
        >>> buf = bytearray(68)
        >>> view = torch.frombuffer(buf, dtype=torch.float32, count=16, offset=4)
        >>> aligned(view).data_ptr() % ALIGNMENT, torch.equal(aligned(view), view)
        (0, True)
    """
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


class Encoder:
    """Collects tensors under unique keys while turning a value into JSON.

    ``shared``: the run's model's frozen parameters, by ``id`` to their names. A module in the value (an EMA's average)
    that holds one of them itself (``ema`` shares a frozen base rather than copying it) records it by name, not by
    value: an adapter checkpoint holds no copy of the base, and a load takes it from the model.
    """

    def __init__(self, shared: Mapping[int, str] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.shared: Mapping[int, str] = shared or {}

    def tensor(self, key: str, t: torch.Tensor) -> dict[str, str]:
        # not copied: the file is written from the tensor's memory right away (_safetensors.write)
        self.tensors[key] = t.detach()
        return {"__tensor__": key}

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor(path, value)
        if isinstance(value, torch.nn.Module):
            held = value.state_dict(keep_vars=True)
            shared = {k: self.shared[id(t)] for k, t in held.items() if id(t) in self.shared}
            for k, t in held.items():
                if k not in shared:
                    self.tensor(f"{path}.{k}", t)
            return {"__module__": path, "shared": shared} if shared else {"__module__": path}
        name = record_name(type(value)) if attrs.has(type(value)) else None
        if name is not None:
            fields = {
                f.alias: self.encode(getattr(value, f.name), f"{path}.{f.name}")
                for f in attrs.fields(type(value))
                if f.init
            }
            return {"__record__": name, "fields": fields}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            return {
                "__dict__": [
                    [self.encode(k, f"{path}.key{i}"), self.encode(v, f"{path}.{k}")]
                    for i, (k, v) in enumerate(value.items())
                ]
            }
        if isinstance(value, (bytes, bytearray)):
            self.tensor(
                path,
                torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.empty(0, dtype=torch.uint8),
            )
            return {"__bytes__": path}
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            self.tensor(path, torch.from_numpy(np.ascontiguousarray(value)))
            return {"__ndarray__": path}
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return value.item()  # sync: none: a numpy scalar
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # kept as its fields; a resumed loader's own batches give the type back (_batch.like)
            return {
                "__fields__": [
                    [f.name, self.encode(getattr(value, f.name), f"{path}.{f.name}")] for f in dataclasses.fields(value)
                ]
            }
        raise TypeError(
            f"cannot write {path} to a checkpoint: it is a {type(value).__name__}. Checkpoints hold "
            "numbers, strings, bytes, tensors, numpy arrays, tuples, lists, dicts, dataclasses and registered records: "
            "decorate your attrs record with @trainfold.register_record, or keep other objects out of state.extras "
            "(and out of batches)."
        )


def decode(
    obj: Any,
    tensors: Mapping[str, torch.Tensor],
    *,
    module_template: Callable[[Mapping[str, str]], torch.nn.Module] | None = None,
    device: Any = None,
) -> Any:
    """Rebuild what :meth:`Encoder.encode` wrote. Tensors go to ``device`` if given; a module is ``module_template(shared)``
    (:func:`deep_template`: a copy of the run's model holding its parameters named by ``shared`` itself) given the rest."""

    def go(o: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"a value nested more than {MAX_DEPTH} levels deep: not one trainfold writes")
        depth += 1
        if isinstance(o, list):
            return [go(v, depth) for v in o]
        if not isinstance(o, dict):
            return o
        if "__tensor__" in o:
            t = tensors[o["__tensor__"]]
            return aligned(t if device is None else t.to(device))  # kept by the run: where torch would have put it
        if "__tuple__" in o:
            return tuple(go(v, depth) for v in o["__tuple__"])
        if "__ndarray__" in o:
            return tensors[o["__ndarray__"]].numpy()
        if "__bytes__" in o:
            data = tensors[o["__bytes__"]]
            if data.dtype != torch.uint8 or data.dim() != 1:
                raise ValueError(
                    f"bytes {o['__bytes__']!r} are a {data.dtype} tensor of shape {tuple(data.shape)}, not bytes"
                )
            return data.numpy().tobytes()
        if "__fields__" in o:
            return {name: go(v, depth) for name, v in o["__fields__"]}
        if "__dict__" in o:
            return {go(k, depth): go(v, depth) for k, v in o["__dict__"]}
        if "__dtype__" in o:
            dtype = DTYPES.get(o["__dtype__"]) if isinstance(o["__dtype__"], str) else None
            if dtype is None:
                raise ValueError(f"the checkpoint names an unknown dtype {o['__dtype__']!r}")
            return dtype
        if "__record__" in o:
            cls = lookup(o["__record__"]) if isinstance(o["__record__"], str) else None
            if cls is None:
                raise ValueError(
                    f"the checkpoint holds an unknown record type {o['__record__']!r} (a record of your own: "
                    "import the module that registers it before load_checkpoint)"
                )
            return cls(**{k: go(v, depth) for k, v in o["fields"].items()})
        if "__module__" in o:
            if module_template is None:
                raise ValueError("the checkpoint holds a model copy (an EMA?) but no model to copy its structure from")
            prefix = o["__module__"] + "."
            shared = o.get("shared", {})
            if not isinstance(shared, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in shared.items()
            ):
                raise ValueError("a model copy's shared parameters are not names")
            module = module_template(shared)
            result = module.load_state_dict(
                {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}, strict=False
            )
            if set(result.missing_keys) != set(shared) or result.unexpected_keys:
                raise ValueError(
                    f"a model copy does not fit this model (missing {sorted(set(result.missing_keys) - set(shared))[:3]}, "
                    f"unexpected {sorted(result.unexpected_keys)[:3]})"
                )
            return module.to(device) if device is not None else module
        raise ValueError(f"unreadable value in the checkpoint: {sorted(o)}")

    return go(obj)


def deep_template(model: torch.nn.Module) -> Callable[[Mapping[str, str]], torch.nn.Module]:
    """``make(shared)``: a deep copy of ``model`` (the user's module, unwrapped) that holds the parameters ``shared`` names
    (its names to the model's) as the model's own objects, not copies.

    Raises:
        ValueError: a shared name the model has not, or of a trainable parameter (only frozen ones are ever shared).
    """

    def make(shared: Mapping[str, str]) -> torch.nn.Module:
        params = dict(model.named_parameters(remove_duplicate=False))
        memo: dict[int, Any] = {}
        for name in shared.values():
            p = params.get(name)
            if p is None or p.requires_grad:
                raise ValueError(
                    f"a model copy shares the model's frozen parameter {name!r}, which this model has not (or trains)"
                )
            memo[id(p)] = p
        return copy.deepcopy(model, memo)

    return make
