"""Training methods, each a registered object: one file per method plus one line in BUILTIN below.

    from qatfactory.train.methods import Method, register
    class MySFT(Method):
        name = "my_sft"
        recipe = {"method": {"name": "my_sft", "loss": {"kind": "ce"}, "eval_teacher": False}}
        def loss(self, student, input_ids, attn, mask, teacher): ...
    register(MySFT)

    qatfactory train plugins=[my.module] method=my_sft ...

``plugins`` (a RunConfig field) names modules imported before the config is checked; each
registers its methods at import. ``method=<name>`` then picks the method's ``recipe`` as if it were
recipes/method/<name>.yaml; the built-in methods have their recipe files there, one per method.
"""
from __future__ import annotations

import importlib
from typing import Dict, Iterable, List, Type

from .base import NO_QUANT, Context, Method, Needs, Student, quantized
from .dapo import DAPO
from .grpo import GRPO
from .ptq import PTQ
from .qad import QAD
from .qad_cached import QADCached
from .qad_lora import QADLoRA
from .qat import QAT
from .scale_adapter import ScaleAdapter

BUILTIN = (PTQ, QAT, QAD, QADCached, QADLoRA, GRPO, DAPO, ScaleAdapter)   # the registry lines

REGISTRY: Dict[str, Type[Method]] = {}


def register(cls: Type[Method]) -> Type[Method]:
    """Add a Method subclass (usable as a decorator). A second class under a taken name is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Method)) or not cls.name:
        raise TypeError(f"register({cls!r}): expected a qatfactory.train.methods.Method subclass with a name")
    old = REGISTRY.get(cls.name)
    if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"method {cls.name!r} is already registered by {old.__module__}.{old.__qualname__}")
    REGISTRY[cls.name] = cls
    return cls


for _m in BUILTIN:
    register(_m)


def method_names() -> List[str]:
    return list(REGISTRY)


def get_method(name: str) -> Method:
    """A fresh instance of the method registered as ``name`` (one per run: hooks may keep state)."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"method.name={name!r} is not a registered method; registered: {method_names()} "
                         f"(a method outside the package: plugins=[your.module] imports the module that "
                         f"registers it)")
    return cls()


def load_plugins(modules: Iterable[str]) -> None:
    """Import each module named in ``plugins`` (its import registers its methods)."""
    for mod in modules or ():
        if not isinstance(mod, str) or not mod or any(c in mod for c in "/\\ "):
            raise ValueError(f"plugins: {mod!r} is not a module name (dotted, e.g. my_pkg.methods)")
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"plugins: cannot import {mod!r} ({e}); is it on PYTHONPATH?") from None


__all__ = ["BUILTIN", "REGISTRY", "Context", "Method", "NO_QUANT", "Needs", "Student", "get_method",
           "load_plugins", "method_names", "quantized", "register"]
