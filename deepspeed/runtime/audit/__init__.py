# SPDX-License-Identifier: Apache-2.0
"""The gradient audit: a check, inside a running job, that the optimizer gets the gradient the loss defines.

``engine.audit_gradients(loss_fn, micro_batches)`` runs one audit; the ``gradient_audit`` config section runs
it at accumulation boundaries. See docs/audit.md.
"""

from deepspeed.runtime.audit.auditor import GradientAuditor, auditing
from deepspeed.runtime.audit.config import GradientAuditConfig, get_gradient_audit_config
from deepspeed.runtime.audit.report import AuditReport, DirectionResult, GroupResult
from deepspeed.runtime.audit.schedule import AuditSchedule, ForwardInputs, GradientAuditError

__all__ = [
    "AuditReport", "AuditSchedule", "DirectionResult", "ForwardInputs", "GradientAuditConfig", "GradientAuditError",
    "GradientAuditor", "GroupResult", "auditing", "get_gradient_audit_config"
]
