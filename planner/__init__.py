"""exitplan.planner: pure planning library (cost model, E3 DP, Arlo, DensePipe, forecasting, simulator).

The one entry point others call:

    from exitplan.planner import plan_service, PlanInfeasible, ProfileError

Names are resolved lazily so that the data plane, which imports only `exitplan.planner.dispatch`,
does not load the solvers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {
    "plan_service": "service",
    "PlanResult": "service",
    "PlanChange": "service",
    "plan_change": "service",
    "PlannerError": "errors",
    "PlanInfeasible": "errors",
    "ProfileError": "errors",
    "SpecError": "errors",
    "PlanInvalid": "errors",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover
    from exitplan.planner.errors import PlanInfeasible as PlanInfeasible
    from exitplan.planner.errors import PlanInvalid as PlanInvalid
    from exitplan.planner.errors import PlannerError as PlannerError
    from exitplan.planner.errors import ProfileError as ProfileError
    from exitplan.planner.errors import SpecError as SpecError
    from exitplan.planner.service import PlanChange as PlanChange
    from exitplan.planner.service import PlanResult as PlanResult
    from exitplan.planner.service import plan_change as plan_change
    from exitplan.planner.service import plan_service as plan_service


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'exitplan.planner' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)
