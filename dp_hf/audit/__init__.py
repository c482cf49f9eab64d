"""Privacy auditing: an empirical lower bound on epsilon, and a loud failure when it exceeds the claim.

Both audits are one-run audits (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training
Run", NeurIPS 2023): ``m`` canaries are each included with probability 1/2, independently, one
training run is made, the auditor guesses which canaries were included from what the run released,
and the number of correct guesses bounds epsilon from below (:mod:`dp_hf.audit.bound`).

* :func:`audit_optimizer` (white-box, :mod:`dp_hf.audit.whitebox`): gradient canaries (each spread
  over all parameter tensors) fed through a DP optimizer's real ``clip -> accumulate -> step`` path,
  scored on its released privatized gradients, with direct checks of the noise level and of the clip
  bound (:mod:`dp_hf.audit.checks`). Strong enough to catch implementation bugs (noise too small,
  clipping off, loose or per tensor, noise scaled by the realized batch) in a second.
* :func:`audit_trainer` (input-space, :mod:`dp_hf.audit.inputspace`): canary examples in a whole
  :class:`~dp_hf.trainer.DPTrainer` run with the user's data, collator and model, scored by loss or
  gradient alignment. End to end, but much weaker.

Each returns an :class:`AuditReport` (``epsilon_lower_bound``, ``claimed_epsilon``, ``passed``, the
guess counts, ``summary``); a failed audit issues a :class:`PrivacyAuditWarning` (or raises
:class:`PrivacyAuditError` with ``raise_on_failure=True``). A pass is not a proof: see
``docs/auditing.md``.
"""

from __future__ import annotations

import importlib

# Imported on first use, so that ``dp-hf audit --help`` (dp_hf.audit.cli) does not load torch.
_LAZY = {
    "GuessResult": "dp_hf.audit.bound",
    "epsilon_lower_bound": "dp_hf.audit.bound",
    "max_epsilon_lower_bound": "dp_hf.audit.bound",
    "p_value": "dp_hf.audit.bound",
    "score_guesses": "dp_hf.audit.bound",
    "add_parser": "dp_hf.audit.cli",
    "main": "dp_hf.audit.cli",
    "audit_trainer": "dp_hf.audit.inputspace",
    "label_flip_canaries": "dp_hf.audit.inputspace",
    "AuditReport": "dp_hf.audit.report",
    "PrivacyAuditError": "dp_hf.audit.report",
    "PrivacyAuditWarning": "dp_hf.audit.report",
    "audit_card_lines": "dp_hf.audit.report",
    "audit_optimizer": "dp_hf.audit.whitebox",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dp_hf.audit' has no attribute {name!r}")


__all__ = sorted(_LAZY)
