"""The DP optimizer family (ALGORITHMS.md §2) and :func:`create_dp_optimizer`.

Every optimizer is a ``torch.optim.Optimizer`` built on
:class:`~dp_hf.optim.base.DPOptimizer`: per-example gradients in
``p.grad_sample`` are clipped and noised by the one privatizer, then the rule
updates the parameters.
"""

from __future__ import annotations

import importlib
import inspect

from dp_hf.optim.adam import DPAdam, DPAdamW
from dp_hf.optim.base import DPOptimizer, PrivacyBudgetExceededError
from dp_hf.optim.sgd import DPSGD

# name used in configs -> (module, class). Modules are imported on first use.
OPTIMIZERS: dict[str, tuple[str, str]] = {
    "dp-sgd": ("dp_hf.optim.sgd", "DPSGD"),
    "dp-adam": ("dp_hf.optim.adam", "DPAdam"),
    "dp-adamw": ("dp_hf.optim.adam", "DPAdamW"),
    "dp-adambc": ("dp_hf.optim.adambc", "DPAdamBC"),
    "dp-adamw-bc": ("dp_hf.optim.adambc", "DPAdamWBC"),
    "dp-macadam": ("dp_hf.optim.macadam", "DPMacAdam"),
    "dp-macadam-bc": ("dp_hf.optim.macadam", "DPMacAdamBC"),
    "dp-adam-stp": ("dp_hf.optim.stp", "DPAdamSTP"),
    "dp-adamw-stp": ("dp_hf.optim.stp", "DPAdamWSTP"),
    "dp-microadam": ("dp_hf.optim.microadam", "DPMicroAdam"),
}


def get_optimizer_class(name: str) -> type[DPOptimizer]:
    """The class registered under ``name`` (e.g. ``"dp-adamw"``)."""
    key = name.strip().lower().replace("_", "-")
    if key not in OPTIMIZERS:
        raise ValueError(f"Unknown DP optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}.")
    module_name, class_name = OPTIMIZERS[key]
    return getattr(importlib.import_module(module_name), class_name)


#: Constructor arguments that are plumbing, not options: what subclasses pass to their base
#: (``defaults``, ``extra_defaults``, ``decoupled_weight_decay``: dp-adam vs dp-adamw) and what the
#: Trainer decides (``distributed``).
_PLUMBING = frozenset(
    {"self", "params", "defaults", "extra_defaults", "decoupled_weight_decay", "distributed"}
)


def optimizer_keywords(optimizer: str | type[DPOptimizer]) -> set[str] | None:
    """The options a DP optimizer (name or class) takes by keyword through its ``**kwargs`` chain; None: any.

    ``inspect.signature(cls.__init__)`` alone misses them: scale-then-privatize takes ``**kwargs`` for
    DP-Adam's ``betas`` and ``eps``. Constructor plumbing (:data:`_PLUMBING`) is left out.
    """
    accepted: set[str] = set()
    cls = get_optimizer_class(optimizer) if isinstance(optimizer, str) else optimizer
    refused = getattr(cls, "keywords_not_taken", frozenset())  # a parent's keyword the class sets itself
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        accepted.update(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return accepted - _PLUMBING - refused
    return None


def create_dp_optimizer(name: str, params, **kwargs) -> DPOptimizer:
    """Build the DP optimizer called ``name`` on ``params``.

    ``kwargs`` are the common DP arguments (``lr``, ``noise_multiplier``,
    ``max_grad_norm``, ``expected_batch_size``, ``noise_seed``/``generator``,
    ``secure_mode``) and the rule's own hyperparameters.
    """
    return get_optimizer_class(name)(params, **kwargs)


__all__ = [
    "DPAdam",
    "DPAdamW",
    "DPOptimizer",
    "DPSGD",
    "OPTIMIZERS",
    "PrivacyBudgetExceededError",
    "create_dp_optimizer",
    "get_optimizer_class",
    "optimizer_keywords",
]
