"""Typed planner errors. Each names the input field at fault and says what to do about it.

Solvers never raise anything else for bad input: `plan_service` checks its inputs first and turns
every infeasibility it meets into `PlanInfeasible` with the binding constraint in words.
"""

from __future__ import annotations


class PlannerError(ValueError):
    """Base of the planner's input errors. `field` names the input at fault (a dotted path)."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field

    def __str__(self) -> str:  # the message already reads as a sentence; prefix the field once
        base = super().__str__()
        return f"{self.field}: {base}" if self.field and not base.startswith(self.field) else base


class SpecError(PlannerError):
    """The EarlyExitService spec (or a GPUPool) holds a value the planner cannot use."""


class ProfileError(PlannerError):
    """A ModelProfile is malformed: missing cells, negative or non-monotone latencies, bad survival."""


class PlanInfeasible(PlannerError):
    """No plan satisfies the constraints; the message names the binding one."""


class PlanInvalid(PlannerError):
    """`PlanResult.verify()` found a plan that breaks one of its own invariants (a planner bug)."""
