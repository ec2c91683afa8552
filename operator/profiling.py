"""Profiling Jobs: one per pool without a ModelProfile, retried with backoff, never endlessly.

For each pool whose ModelProfile is missing the operator runs a Job (builders.build_profile_job:
`exitplan profile`, then `exitplan operator publish-profile`). Kubernetes retries the Job's pod up to
its backoffLimit; when the Job has failed for good, the service gets the condition ProfilingFailed
(True) carrying the Job's failure (its Failed condition's reason and message, and its pod's
termination message: the last log lines of the step that failed), a Warning event, and the phase
ProfilingFailed. The next Job follows after a backoff (settings.profile_retry_seconds, doubled after
each failure) until settings.profile_attempts Jobs of the current spec generation ran; then the
operator stops: a change of the spec (a new generation) tries again, and a ModelProfile published by
hand ends the wait at once. Jobs carry their spec generation and attempt in annotations, and
status.profileAttempts keeps the count when finished Jobs expire (ttlSecondsAfterFinished).

A pool whose profile exists can be measured again (:func:`reprofile`, when the measured goodput is
persistently off the plan's: plan_accuracy.py): the same Job, annotated with its reason instead of a
spec generation (it is no attempt of the wait above), while the current plan keeps serving; the
ModelProfile it publishes re-plans the service (reason profile-change). One Job per pool at a time,
and at most one re-profile per pool in REPROFILE_BACKOFF_SECONDS.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

from exitplan.api.manifest import Manifest
from exitplan.api.resources import EarlyExitServiceSpec
from exitplan.operator import apply as applying
from exitplan.operator import builders, names, provider_health
from exitplan.operator.kube import path
from exitplan.operator.service_state import Service, ServiceResources
from exitplan.operator.status import ConditionType, Phase, ServiceStatus, set_condition

A_GENERATION = "exitplan.io/spec-generation"
A_ATTEMPT = "exitplan.io/profile-attempt"
A_REASON = "exitplan.io/profile-reason"
"""On a re-profiling Job (:func:`reprofile`): why the pool is measured again (e.g. plan-mismatch)."""
CONDITION: ConditionType = "ProfilingFailed"
REPROFILE_BACKOFF_SECONDS = 3600.0
"""A pool is re-profiled (:func:`reprofile`) at most once in this many seconds: the newest profiling
Job's creation time tells, so a restarted operator does not start another."""

Job = Manifest
"""A batch/v1 Job as read from the API."""


def _condition(job: Job, kind: str) -> dict[str, Any] | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return dict(cond)
    return None


def finished(job: Job) -> bool:
    return bool((job.get("status") or {}).get("succeeded")) or any(_condition(job, k) for k in ("Complete", "Failed"))


def failed(job: Job) -> bool:
    return _condition(job, "Failed") is not None


def _epoch(stamp: str | None) -> float | None:
    try:
        return dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() if stamp else None
    except ValueError:
        return None


def failed_at(job: Job) -> float:
    """When the Job failed (its Failed condition's transition; else its start or creation)."""
    cond = _condition(job, "Failed") or {}
    status = job.get("status") or {}
    for stamp in (cond.get("lastTransitionTime"), status.get("completionTime"), status.get("startTime")):
        if (when := _epoch(stamp)) is not None:
            return when
    return _epoch(job["metadata"].get("creationTimestamp")) or time.time()


async def failure(svc: Service, job: Job) -> tuple[str, str]:
    """(reason, message) of a failed Job: its Failed condition, and what its pods' failed
    containers said (their termination messages: the logs' tail with FallbackToLogsOnError)."""
    cond = _condition(job, "Failed") or {}
    reason = str(cond.get("reason") or "JobFailed")
    message = str(cond.get("message") or "the Job failed")
    name = job["metadata"]["name"]
    details = []
    for pod in await svc.client.list(path("Pod", svc.namespace), f"job-name={name}"):
        status = pod.get("status") or {}
        for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term and int(term.get("exitCode") or 0) != 0:
                said = str(term.get("message") or term.get("reason") or "").strip()
                details.append(f"container {cs.get('name')} exited {term.get('exitCode')}: {said[-600:]}")
    detail = details[-1] if details else ""
    if provider_health.MARK in detail or provider_health.MARK in message:  # it refused the CPU for the GPU
        reason = provider_health.REASON
    return reason, f"{message}; {detail}" if detail and detail not in message else message


@dataclass
class PoolProfiling:
    """Where the profiling of one pool stands."""

    pool: str
    attempts: int = 0
    """Jobs started for the current spec generation."""
    running: str = ""
    """The Job that runs now."""
    failed_job: str = ""
    failed_attempt: int = 0
    failure: tuple[str, str] | None = None
    """(reason, message) of the newest failed Job of this generation."""
    exhausted: bool = False
    retry_in: float = 0.0

    @property
    def headline(self) -> str:
        """What names the failed Job in the condition's message (and tells whether it was reported)."""
        return f"profiling Job {self.failed_job} on pool {self.pool} failed"

    def describe(self, limit: int, delay: float) -> str:
        reason, message = self.failure or ("", "")
        head = f"{self.headline} (attempt {self.failed_attempt} of {limit}): "
        if self.running:
            tail = f"Job {self.running} measures again"
        elif self.exhausted:
            tail = (
                "no more attempts for this spec generation: fix the bundle or the pool, then change the "
                "EarlyExitService spec (or publish the ModelProfile) to try again"
            )
        else:
            tail = f"the next Job follows after a {delay:g} s backoff"
        return f"{head}{reason}: {message}; {tail}"


def _jobs_of(jobs: list[Job], generation: int) -> list[Job]:
    mine = [j for j in jobs if (j["metadata"].get("annotations") or {}).get(A_GENERATION) == str(generation)]
    return sorted(mine, key=lambda j: int((j["metadata"].get("annotations") or {}).get(A_ATTEMPT) or 0))


async def _start(
    svc: Service, spec: EarlyExitServiceSpec, inputs: ServiceResources, st: PoolProfiling, jobs: list[Job]
) -> None:
    """Create the pool's next profiling Job (named `-2`, `-3`, ... after the Jobs that exist)."""
    taken = {j["metadata"]["name"] for j in jobs}
    index = next(i for i in range(len(taken) + 1) if builders.profile_job_name(svc.name, st.pool, i) not in taken)
    prof = builders.profile_name(spec.model.name, st.pool)
    job = builders.build_profile_job(svc.body, spec, st.pool, inputs.pools[st.pool], prof, attempt=index)
    st.attempts += 1
    job["metadata"]["annotations"] = {A_GENERATION: str(svc.generation), A_ATTEMPT: str(st.attempts)}
    await applying.apply_one(svc.client, job, applying.ApplyReport())
    st.running = job["metadata"]["name"]
    what = f"Job {st.running} measures model {spec.model.name} on pool {st.pool} and publishes ModelProfile {prof}"
    if st.failure is None:
        svc.event("Normal", "Profiling", f"no ModelProfile for model {spec.model.name} on pool {st.pool}: {what}")
    else:
        svc.event(
            "Warning",
            "ProfilingRetry",
            f"profiling Job {st.failed_job} failed ({st.failure[0]}); attempt {st.attempts} of "
            f"{svc.settings.profile_attempts}: {what}",
        )


async def _pool(
    svc: Service, spec: EarlyExitServiceSpec, inputs: ServiceResources, pool: str, floor: int
) -> PoolProfiling:
    """Where the pool's profiling stands; starts its next Job when none runs, the backoff after the
    last failure has passed and attempts are left."""
    selector = f"{names.L_SERVICE}={svc.name},{names.L_POOL}={pool},{names.L_COMPONENT}=profiler"
    jobs = await svc.client.list(path("Job", svc.namespace), selector)
    mine = _jobs_of(jobs, svc.generation)
    st = PoolProfiling(pool, attempts=max(len(mine), floor))
    settings = svc.settings
    running = [j for j in jobs if not finished(j)]  # of any generation: one Job at a time per pool
    done = [j for j in mine if finished(j)]
    if done and failed(done[-1]):  # the newest finished Job failed: report it (a retry may run already)
        st.failed_job, st.failure = done[-1]["metadata"]["name"], await failure(svc, done[-1])
        st.failed_attempt = int((done[-1]["metadata"].get("annotations") or {}).get(A_ATTEMPT) or len(done))
        failures = sum(failed(j) for j in mine)
        st.retry_in = failed_at(done[-1]) + settings.retry_delay(failures) - time.time()
    if running:
        st.running = running[-1]["metadata"]["name"]
    elif st.attempts >= settings.profile_attempts:
        st.exhausted = True
    elif st.retry_in <= 0:
        await _start(svc, spec, inputs, st, jobs)
    return st


def _attempts_floor(status: ServiceStatus, generation: int) -> dict[str, int]:
    return dict(status.profile_attempts) if status.observed_generation == generation else {}


async def wait_for_profiles(
    svc: Service, spec: EarlyExitServiceSpec, inputs: ServiceResources, status: ServiceStatus
) -> ServiceStatus:
    """Start, retry or give up the profiling Jobs of the pools without a profile; write the status."""
    gen, settings = svc.generation, svc.settings
    floor = _attempts_floor(status, gen)
    states = [await _pool(svc, spec, inputs, pool, floor.get(pool, 0)) for pool in inputs.missing_profiles]
    status.profile_attempts = {s.pool: s.attempts for s in states}
    waiting = [s.pool for s in states]
    invalid = f" (ignored invalid: {inputs.bad_profiles})" if inputs.bad_profiles else ""
    before = next((c.message for c in status.conditions if c.type == CONDITION and c.status == "True"), "")
    texts: list[str] = []
    reason: str = CONDITION
    for s in states:
        if s.failure is not None:
            texts.append(s.describe(settings.profile_attempts, settings.retry_delay(s.attempts)))
            reason = s.failure[0]
            if s.headline not in before:  # each failed Job is reported once
                svc.event("Warning", reason if reason == provider_health.REASON else CONDITION, texts[-1])
        elif s.exhausted:  # Jobs ran (and expired, or succeeded) but no valid profile came of them
            texts.append(
                f"{s.attempts} profiling Job(s) for pool {s.pool} ran for this spec generation, but there is no "
                f"valid ModelProfile {builders.profile_name(spec.model.name, s.pool)}{invalid}; no more attempts: "
                "change the EarlyExitService spec (or publish the ModelProfile) to try again"
            )
    if texts:
        status.conditions = set_condition(status.conditions, CONDITION, True, reason, "; ".join(texts), gen)
    why: str = CONDITION
    if any(not s.running and (s.failure is not None or s.exhausted) for s in states):
        message, phase, progressing = "; ".join(texts), Phase.profiling_failed, False
    else:
        message = (
            f"waiting for ModelProfile(s) of model {spec.model.name} on pool(s) {waiting}; "
            f"profiling Jobs measure them{invalid}"
        )
        phase, progressing, why = Phase.profiling, True, "ProfileMissing"
    status.conditions = set_condition(status.conditions, "Progressing", progressing, why, message, gen)
    status.conditions = set_condition(status.conditions, "Planned", False, why, message, gen)
    if any(c.type == "PlanInfeasible" and c.status == "True" for c in status.conditions):  # an earlier refusal
        status.conditions = set_condition(status.conditions, "PlanInfeasible", False, why, message, gen)
    status.phase, status.message, status.waiting_for_profiles = phase, message, waiting
    status.observed_generation = gen
    await svc.write_status(status)
    return status


def profiles_present(status: ServiceStatus, generation: int) -> None:
    """Every profile is there: the wait and a ProfilingFailed condition end."""
    status.waiting_for_profiles = []
    status.profile_attempts = {}
    if any(c.type == CONDITION and c.status == "True" for c in status.conditions):
        status.conditions = set_condition(
            status.conditions, CONDITION, False, "ProfilesPresent", "every ModelProfile is present", generation
        )


async def reprofile(
    svc: Service, spec: EarlyExitServiceSpec, inputs: ServiceResources, pools: list[str], why: str, reason: str
) -> dict[str, str]:
    """Measure the named pools again (their ModelProfiles exist): a profiling Job per pool unless one
    runs or one was started less than REPROFILE_BACKOFF_SECONDS ago. Pool -> what happened (for
    messages); each started Job posts a Reprofiling event saying `why`."""
    out: dict[str, str] = {}
    for pool in pools:
        if pool not in inputs.pools:
            continue
        selector = f"{names.L_SERVICE}={svc.name},{names.L_POOL}={pool},{names.L_COMPONENT}=profiler"
        jobs = await svc.client.list(path("Job", svc.namespace), selector)
        running = [j for j in jobs if not finished(j)]
        if running:
            out[pool] = f"Job {running[-1]['metadata']['name']} measures it"
            continue
        created = [(_epoch(j["metadata"].get("creationTimestamp")) or 0.0, j["metadata"]["name"]) for j in jobs]
        if created and time.time() - max(created)[0] < REPROFILE_BACKOFF_SECONDS:
            out[pool] = f"Job {max(created)[1]} measured it less than {REPROFILE_BACKOFF_SECONDS:g} s ago"
            continue
        taken = {j["metadata"]["name"] for j in jobs}
        index = next(i for i in range(len(taken) + 1) if builders.profile_job_name(svc.name, pool, i) not in taken)
        prof = builders.profile_name(spec.model.name, pool)
        job = builders.build_profile_job(svc.body, spec, pool, inputs.pools[pool], prof, attempt=index)
        job["metadata"]["annotations"] = {A_REASON: reason}
        await applying.apply_one(svc.client, job, applying.ApplyReport())
        name = job["metadata"]["name"]
        out[pool] = f"Job {name} measures it again"
        svc.event(
            "Normal",
            "Reprofiling",
            f"{why}: Job {name} measures model {spec.model.name} on pool {pool} again and publishes "
            f"ModelProfile {prof}; the new profile re-plans the service",
        )
    return out
