"""dp_hf: differentially private fine-tuning of Hugging Face models.

The Trainer integration (:class:`DPTrainer`, :class:`DPTrainingArguments`) is
imported lazily so that ``import dp_hf`` and the ``dp-hf`` command stay fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "DPTrainer": "dp_hf.trainer",
    "DPTrainingArguments": "dp_hf.training_args",
    "DPTrainerMixin": "dp_hf.trainer",
    "DPArgumentsMixin": "dp_hf.training_args",
    "make_private_trainer": "dp_hf.trainer",
    "DPSFTTrainer": "dp_hf.sft",
    "DPSFTConfig": "dp_hf.sft",
    "create_dp_optimizer": "dp_hf.optim",
    "compute_epsilon": "dp_hf.accounting",
    "calibrate_noise_multiplier": "dp_hf.accounting",
    "PrivacyAccountant": "dp_hf.accounting",
    "attach_grad_sample": "dp_hf.per_example",
    "PoissonDataLoader": "dp_hf.loader",
    "audit_optimizer": "dp_hf.audit",
    "audit_trainer": "dp_hf.audit",
    "AuditReport": "dp_hf.audit",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dp_hf' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
