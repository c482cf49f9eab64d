"""Replacement methods set on a model's module instances while the per-example hooks are attached.

T5's and MPNet's relative bias (:mod:`~dp_hf.per_example.relative_bias`), BEiT's layer scale
(:mod:`~dp_hf.per_example.ghost.layer_scale`) and Swin's window attention (:mod:`~dp_hf.per_example.swin`) each
shadow one method of a recognised module with an :class:`InstanceAdapter`, which runs the per-example version
while its owner records and the class's method otherwise. :class:`InstanceAdapters` installs them and removes
them with the hooks.

A copy of a hooked module (``copy.deepcopy``, ``pickle``: PEFT's ``modules_to_save``, a reference model) is not
hooked: its adapter has no owner and calls the class's method, and a later attach replaces it. An adapter that
kept its owner copied a whole recording engine along (an audit found Swin's still "enabled" in every copy, and
BEiT's refusing every train-mode forward of the copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["InstanceAdapter", "InstanceAdapters"]


class InstanceAdapter:
    """A replacement of ``module``'s method ``name``, set as an instance attribute; ``owner`` None: unhooked."""

    def __init__(self, module: nn.Module, owner: Any, name: str = "forward") -> None:
        self.module, self.owner, self.name = module, owner, name

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "owner": None}  # a copy is not hooked (module docstring)

    def original(self) -> Callable:
        """The class's method, bound to the module."""
        return getattr(type(self.module), self.name).__get__(self.module)


class InstanceAdapters:
    """The adapters installed on ``model``'s modules; ``remove()`` restores the classes' methods."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.installed: list[InstanceAdapter] = []

    def candidates(self) -> Iterator[nn.Module]:
        """``model``'s modules, each without the unhooked adapters a copy left on it (they are replaced)."""
        for module in self.model.modules():
            for name, value in list(module.__dict__.items()):
                if isinstance(value, InstanceAdapter) and value.owner is None:
                    delattr(module, name)
            yield module

    def install(self, adapter: InstanceAdapter) -> None:
        setattr(adapter.module, adapter.name, adapter)
        self.installed.append(adapter)

    def remove(self) -> None:
        while self.installed:
            adapter = self.installed.pop()
            if adapter.module.__dict__.get(adapter.name) is adapter:
                delattr(adapter.module, adapter.name)
