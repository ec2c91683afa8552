"""The exit thresholds of a service as one versioned object, and the rule every holder follows.

Every router and every worker that decides exits holds a `ThresholdSet`: the thresholds per exit ramp,
a version (a counter that each change raises by one) and a digest of the values. Of two sets, the one
with the higher (version, digest) key wins, everywhere: a holder adopts a set only when its key is
higher than the one it holds, so sets pushed in any order, pulled from a peer router or read from the
plan file converge on the same one (two changes made at once on two routers get the same version; the
digest breaks the tie the same way on every holder).

How a change is made (`ThresholdSet.changed`): a POST /v1/thresholds without a version merges the ramps
it names into the set in force (the others keep their values) unless it says `"replace": true`, and
raises the version by one; a post with a version (the tuner's, a peer router's forward) is taken as
that version when it is newer. Where the sets come from and go to: `classify/router_thresholds.py`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PLAN_UPDATE = "plan-update"
"""The reason of a set read from a new plan file."""


def digest_of(values: Mapping[str, float]) -> str:
    """A short digest of the values (the same on every holder: sorted names, rounded values)."""
    text = json.dumps({k: round(float(v), 9) for k, v in sorted(values.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class ThresholdSet:
    """The thresholds in force (ramp -> value) at a version."""

    values: dict[str, float] = field(default_factory=dict)
    version: int = 0

    @property
    def digest(self) -> str:
        return digest_of(self.values)

    def key(self) -> tuple[int, str]:
        """What orders two sets: the version, then the digest (a tie between two concurrent changes)."""
        return (self.version, self.digest)

    def newer_than(self, other: ThresholdSet) -> bool:
        return self.key() > other.key()

    @property
    def label(self) -> str:
        """`v<version>-<digest>`: what an answer's metadata names."""
        return f"v{self.version}-{self.digest}"

    def changed(self, given: Mapping[str, float], *, replace: bool, version: int | None) -> ThresholdSet:
        """This set changed by a post: the ramps `given` merged in (or, `replace`, only those), at
        `version` when the post names one, else at this version plus one."""
        values = {k: float(v) for k, v in given.items()} if replace else {**self.values, **given}
        return ThresholdSet(values, self.version + 1 if version is None else version)

    def to_json(self) -> dict[str, Any]:
        return {"thresholds": dict(self.values), "version": self.version, "digest": self.digest}

    @classmethod
    def from_answer(cls, body: Any) -> ThresholdSet:
        """The set of a GET or POST /v1/thresholds answer; ValueError, KeyError, TypeError or
        AttributeError when it is not one (an answer without a version is version 0)."""
        version = body.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        return cls({str(k): float(v) for k, v in body["thresholds"].items()}, version)


@dataclass
class ThresholdHolder:
    """What one router or worker holds: the set in force, replaced only by a newer one."""

    current: ThresholdSet
    reason: str = "plan"
    """Why the set in force was taken ("api", "plan-update", a tuner's reason...). A pod that missed a push
    is brought up to date under this reason (`threshold_push.catch_up`), so every pod counts one change
    under the one reason it was made for, whichever way the set reached it."""

    @property
    def values(self) -> dict[str, float]:
        return self.current.values

    def adopt(self, candidate: ThresholdSet, reason: str) -> bool:
        """Take `candidate` (made for `reason`) when it is newer; True when it was taken."""
        if not candidate.newer_than(self.current):
            return False
        self.current, self.reason = candidate, reason
        return True

    def adopt_plan(self, thresholds: Mapping[str, float], version: int) -> bool:
        """The thresholds of a new plan file: a versioned plan (one the tuner or the operator wrote the
        live thresholds into) is one more candidate; an unversioned one (version 0: a re-plan) whose
        values differ from the set in force replaces them as the next version (every holder reads the
        same file, so they all take the same set)."""
        values = {k: float(v) for k, v in thresholds.items()}
        if version > 0:
            return self.adopt(ThresholdSet(values, version), PLAN_UPDATE)
        if digest_of(values) == self.current.digest:
            return False
        self.current, self.reason = ThresholdSet(values, self.current.version + 1), PLAN_UPDATE
        return True
