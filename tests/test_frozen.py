"""What is frozen is frozen: no attrs-frozen class of trainfold holds a container that changes.

A frozen class promises a value: two reads give the same thing, and nothing a
function does to it is hidden from the reader of its signature. A dict, set,
list or weak collection inside one breaks that promise without a word, so
what a run holds and changes lives in :class:`trainfold.Runtime`, an openly
mutable object reached from the Context.
"""

import importlib
import pkgutil
import re
import typing

import attrs
import pytest
from attr._make import _frozen_setattrs  # what attrs installs as a frozen class's __setattr__

import trainfold

MUTABLE = re.compile(
    r"\b(dict|set|list|defaultdict|WeakSet|WeakKeyDictionary|WeakValueDictionary|MutableMapping|MutableSet)\b"
)


def _modules():
    for info in pkgutil.walk_packages(trainfold.__path__, "trainfold."):
        if info.name != "trainfold.__main__":
            yield importlib.import_module(info.name)


def _frozen_classes():
    seen = {}
    for module in _modules():
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and attrs.has(value)
                and value.__module__.startswith("trainfold")
                and value.__setattr__ is _frozen_setattrs
            ):
                seen[f"{value.__module__}.{value.__qualname__}"] = value
    return seen


FROZEN = _frozen_classes()


def test_the_walk_finds_the_frozen_classes():
    assert {"trainfold._src.core.state.TrainState", "trainfold._src.core.context.Context"} <= set(FROZEN)


@pytest.mark.parametrize("name", sorted(FROZEN))
def test_no_frozen_class_declares_a_mutable_container(name):
    cls = FROZEN[name]
    declared = {
        f.name: f.type if isinstance(f.type, str) else typing.get_type_hints(cls).get(f.name) for f in attrs.fields(cls)
    }
    assert {k: str(v) for k, v in declared.items() if MUTABLE.search(str(v))} == {}


@pytest.mark.parametrize("name", sorted(FROZEN))
def test_no_frozen_class_fills_a_mutable_default(name):
    """A field typed ``Mapping`` whose default is ``factory=dict`` is a dict that code fills after creation."""
    made = {
        f.name: f.default.factory.__name__
        for f in attrs.fields(FROZEN[name])
        if isinstance(f.default, attrs.Factory)
        and not f.default.takes_self
        and MUTABLE.search(f.default.factory.__name__)
    }
    assert made == {}


def _containers(value):
    """The mutable containers held by an attrs value's fields, by field name."""
    found = {}
    for field in attrs.fields(type(value)):
        held = getattr(value, field.name)
        if (
            isinstance(held, (dict, set, list))
            or type(held).__module__ == "weakref"
            or type(held).__name__.startswith("Weak")
        ):
            found[field.name] = type(held).__name__
    return found


def test_a_context_and_a_trained_state_hold_no_mutable_container(tmp_path):
    from trainfold import testing

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    saving = trainfold.checkpoint_every(ctx, 2, tmp_path)
    step = trainfold.log_every(ctx, 2)(saving(trainfold.make_step(ctx, loss_fn)))
    state = saving.at_end(trainfold.loop(trainfold.run_epoch(ctx, step, loader), max_epochs=2)(state))
    assert _containers(ctx) == {}
    assert _containers(saving) == {}
    assert (_containers(state), _containers(state.extras["log_every"])) == ({}, {})
