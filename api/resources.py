"""Typed models of exitplan's three custom resources: GPUPool, EarlyExitService, ModelProfile.

These are the contract between users, the operator, the planner and the data plane (DESIGN.md
"The objects"). Field names are camelCase on the wire (Kubernetes style) and snake_case in Python.
The CRD schemas in ``crds/`` are generated from these models.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "exitplan.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class Model(BaseModel):
    """Base for every spec model: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The wire form (camelCase, no unset optionals)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------- GPUPool (cluster-scoped)


DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class LocalObjectReference(Model):
    name: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
    """Name of an object in the same namespace."""


class Toleration(Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class GPUPoolSpec(Model):
    """A set of identical accelerators the planner may place workers on."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Labels of the nodes of this pool; copied into each worker pod's nodeSelector."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations added to worker pods on this pool (e.g. for tainted GPU nodes)."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name requested per worker; an empty string means CPU-only pods."""
    gpus_per_node: Annotated[int, Field(ge=1, le=64)] = 1
    """Accelerators on each node of the pool."""
    capacity: Annotated[int, Field(ge=0, le=100000)]
    """Total accelerators in the pool that exitplan may use (one worker replica uses one)."""
    cost_per_hour: Annotated[float, Field(ge=0.0)] = 1.0
    """Cost of one accelerator for one hour, in any currency unit; the planner minimises it."""
    memory_bytes: Annotated[int, Field(ge=1)] = 16 * 2**30
    """Memory of one accelerator in bytes."""
    link_bandwidth_gbps: Annotated[float, Field(gt=0.0)] = 10.0
    """Bandwidth between workers of this pool and the next hop, in Gbit/s."""
    shared_cores: Annotated[int, Field(ge=1, le=4096)] | None = None
    """CPU cores that this pool's worker processes share with each other (and, when every pool of a
    service shares cores, with its routers): a pool of worker processes on one machine, as `exitplan up`
    runs them (it sets this to the machine's cores for CPU pools that leave it unset). The planner caps
    the goodput it predicts at what those cores can compute. Unset: each worker replica has its own
    accelerator, and host cores are no limit."""
    shared_devices: Annotated[int, Field(ge=1, le=100000)] | None = None
    """Accelerators that this pool's `capacity` worker processes share, each time-sliced between the processes
    that run on it (several runtimes on one GPU, as Arlo packs its per-bucket runtimes): `capacity` then counts
    worker processes, not accelerators, and the planner caps the goodput it predicts at what these devices
    can compute (their time shared by every batch of the pool). Unset: each worker replica has an accelerator
    of its own. Needs a gpuResource; each process asks for it (a device plugin that shares GPUs, or MPS)."""
    cpu: str = "2"
    """CPU request of a worker pod on this pool."""
    memory: str = "4Gi"
    """Memory request of a worker pod on this pool."""
    image: Annotated[str, Field(min_length=1, pattern=r"^\S+$")] | None = None
    """Container image of the worker and profiling pods on this pool (default: the operator's data-plane
    image, chart value dataPlane.image): e.g. the CUDA worker image on GPU pools, worker-cpu on CPU ones."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """imagePullPolicy of those pods' containers (default: chart value dataPlane.image.pullPolicy)."""
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    """Secrets of the service's namespace for pulling this pool's images, added to the chart's
    dataPlane.imagePullSecrets."""

    @property
    def process_memory_bytes(self) -> int:
        """The accelerator memory one worker process may hold: `memoryBytes`, or with `sharedDevices` that memory
        split between the processes packed on one device (`capacity` processes over `sharedDevices` devices,
        rounded up: the fullest device), so that every process of a shared device fits beside the others."""
        if self.shared_devices is None:
            return self.memory_bytes
        return self.memory_bytes // -(-max(self.capacity, 1) // self.shared_devices)

    @model_validator(mode="after")
    def _devices_need_a_gpu(self) -> GPUPoolSpec:
        if self.shared_devices is not None and not self.gpu_resource:
            raise ValueError("sharedDevices needs a gpuResource (worker processes sharing CPU cores: sharedCores)")
        if self.shared_devices is not None and self.shared_devices > max(self.capacity, 1):
            raise ValueError(
                f"sharedDevices ({self.shared_devices}) is more than the worker processes of the pool (capacity "
                f"{self.capacity}); every shared device runs at least one process"
            )
        return self


# ---------------------------------------------------------------- EarlyExitService (namespaced)


class Task(str, Enum):
    text_classification = "text-classification"
    image_classification = "image-classification"
    text_generation = "text-generation"


class ModelRef(Model):
    name: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    """Model name served at /v2/models/{name}; also the ModelProfile's model."""
    bundle: Annotated[str, Field(min_length=1, max_length=4096)]
    """Bundle URI. A path or file:// URI: a directory holding bundle.yaml on the node (a hostPath, only
    under the operator's allowed prefixes). pvc://CLAIM/PATH: a directory of a PersistentVolumeClaim of
    the namespace, mounted read-only. s3://BUCKET/PREFIX: any S3-compatible store (bundleSecret names
    the endpoint and credentials). https://HOST/PATH.tar.gz: a tarball (bundleSha256 pins it).
    oci://IMAGE: an image holding the bundle at /bundle. The pods' storage-init container fetches a
    remote bundle and verifies it against the digests in its bundle.yaml."""
    bundle_secret: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)] | None = None
    """For s3:// bundles: a Secret of the namespace whose keys become the storage initializer's
    environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, and optionally AWS_SESSION_TOKEN,
    AWS_ENDPOINT_URL (e.g. http://minio.storage:9000; default AWS S3), AWS_REGION, AWS_CA_BUNDLE."""
    bundle_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    """sha256 of a tarball bundle (https:// and http://, where it is required; s3://.../x.tar.gz):
    `exitplan bundle push` prints it."""
    bundle_size: Annotated[int, Field(ge=1)] | None = None
    """Bytes the bundle unpacks to (`exitplan bundle push` prints it): storage-init refuses a remote bundle
    bigger than this, and the pods' bundle emptyDir (sizeLimit) and ephemeral-storage requests and limits
    are sized from it. Unset: the operator's default limit (env EXITPLAN_BUNDLE_MAX_BYTES, 20 GiB) bounds
    the volume and the pods request no storage for the bundle."""
    task: Task = Task.text_classification

    @model_validator(mode="after")
    def _bundle_source(self) -> ModelRef:
        from exitplan.api.bundle_source import HTTP, S3, parse_bundle_uri

        source = parse_bundle_uri(self.bundle)
        if source.kind == HTTP and self.bundle_sha256 is None:
            raise ValueError(
                "model.bundleSha256 is required for an http(s):// bundle (`exitplan bundle push` prints it)"
            )
        if self.bundle_sha256 is not None and not source.tarball:
            raise ValueError(
                "model.bundleSha256 applies to tarball bundles only (https://, http://, s3://.../x.tar.gz)"
            )
        if self.bundle_secret is not None and source.kind != S3:
            raise ValueError("model.bundleSecret applies to s3:// bundles only")
        return self


class SLO(Model):
    latency_ms: Annotated[float, Field(gt=0.0, le=600000.0)]
    """Target p99 end-to-end latency in milliseconds."""
    slack_ms: Annotated[float, Field(ge=0.0)] = 0.0
    """Latency reserved for the network and the router; the planner plans for latency_ms - slack_ms."""

    @model_validator(mode="after")
    def _slack_below_latency(self) -> SLO:
        if self.slack_ms >= self.latency_ms:
            raise ValueError(f"slo.slackMs ({self.slack_ms}) must be below slo.latencyMs ({self.latency_ms})")
        return self


class Accuracy(Model):
    max_drop: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.01
    """Largest allowed disagreement with the full model, as a fraction (0.01 = 1 %)."""
    shadow_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.05
    """Fraction of exited inputs that keep running to the last block for accuracy feedback."""


class Workload(Model):
    rps: Annotated[float, Field(gt=0.0)] = 10.0
    """Expected request rate; a hint for the first plan before observations arrive."""
    length_buckets: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    """Max input length of each bucket runtime; empty = chosen by the planner from the profile."""
    easy_fraction: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """Optional hint of the share of inputs that exit at the first ramp."""

    @model_validator(mode="after")
    def _buckets_increase(self) -> Workload:
        if any(b >= c for b, c in zip(self.length_buckets, self.length_buckets[1:])):
            raise ValueError(f"workload.lengthBuckets must increase strictly, got {self.length_buckets}")
        return self


class PoolRef(Model):
    name: Annotated[str, Field(min_length=1)]
    """Name of a GPUPool."""
    max_gpus: Annotated[int, Field(ge=0)] | None = None
    """Cap on accelerators this service may use from the pool (default: the pool's capacity)."""


class Objective(str, Enum):
    max_goodput = "max-goodput"
    min_cost = "min-cost"


class Mode(str, Enum):
    active = "active"
    advisory = "advisory"


class DriftLimits(Model):
    length_score: Annotated[float, Field(gt=0.0, le=1.0)] = 0.15
    """Re-plan when the length histogram's total-variation distance from the planned one exceeds this."""
    survival_error: Annotated[float, Field(gt=0.0, le=1.0)] = 0.1
    """Re-plan when the forecast survival curve moves this far (max abs difference) from the planned one."""
    slo_risk: Annotated[float, Field(gt=0.0, le=2.0)] = 0.95
    """Re-plan when observed p99 exceeds this fraction of the SLO."""
    cooldown_seconds: Annotated[int, Field(ge=0)] = 300
    """Minimum time between two applied re-plans."""
    max_move_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
    """Cap on the fraction of worker replicas one re-plan may move."""


class PlannerSettings(Model):
    objective: Objective = Objective.max_goodput
    cost_cap_per_hour: Annotated[float, Field(gt=0.0)] | None = None
    """For max-goodput: the most the plan may cost per hour (default: every allowed GPU)."""
    target_rps: Annotated[float, Field(gt=0.0)] | None = None
    """For min-cost: the goodput the plan must reach (default: workload.rps)."""
    period_seconds: Annotated[int, Field(ge=5, le=86400)] = 120
    """How often the drift loop reads observations."""
    mode: Mode = Mode.active
    """active applies plans; advisory only reports what it would do."""
    drift: DriftLimits = Field(default_factory=DriftLimits)
    max_splits: Annotated[int, Field(ge=1, le=64)] = 4
    max_replicas: Annotated[int, Field(ge=1, le=100000)] = 64
    """The most worker replicas (accelerators) a plan of this service may run over all its pools:
    max-goodput otherwise spends every allowed GPU, so a pool with capacity 100000 would get a
    100000-replica plan. The drift loop's re-plans keep to it too."""
    colocate: Literal["auto", "on", "off"] = "auto"
    """Run split 0 inside the router processes (no hop from the router to split 0): auto where the
    profiles' serving-path costs predict more goodput that way, on always (the plan fails with the reason
    where it cannot: split 0 over several pools, no measurement), off never."""
    rebatch: bool = True
    """Let splits rebatch (when exits are on): each block of such a split keeps its own fusion queue
    and runs on a full batch of the rows that reached it, instead of on what is left of one
    entering batch after its exits, so deep blocks do not run half-empty batches. The planner
    rebatches a split where its cost model finds that no slower (the inner queues must fill within
    a cycle). Turn it off to plan E3's split-and-replicate alone (every block of a split runs the
    survivors of one batch), e.g. when the workers cannot rebatch or to compare against it; rows
    then wait less at the inner blocks of a lightly loaded split."""


class RouterSettings(Model):
    replicas: Annotated[int, Field(ge=1, le=64)] = 2
    """Router pods. With 2 or more the operator also keeps a PodDisruptionBudget (minAvailable 1), so
    an eviction (a node drain) never takes the last one; a router that leaves drains (SIGTERM) without
    losing requests."""
    queue_lambda: Annotated[float, Field(gt=0.0, le=1.0)] = 0.85
    """Arlo's congestion threshold: a bucket is congested above lambda of its capacity."""
    queue_alpha: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    """Arlo's decay applied to the threshold at each demotion level."""
    peek_depth: Annotated[int, Field(ge=1, le=64)] = 6
    """How many longer buckets Arlo's dispatcher may demote a request to."""
    max_body_bytes: Annotated[int, Field(ge=1024)] = 1 << 20
    """Largest accepted request body; larger bodies get 413."""
    max_queue: Annotated[int, Field(ge=1)] = 4096
    """Requests in flight above this get 503 with Retry-After."""
    truncate: bool = False
    """Truncate inputs longer than the largest bucket instead of rejecting them with 400."""


class EarlyExitServiceSpec(Model):
    model: ModelRef
    slo: SLO
    accuracy: Accuracy = Field(default_factory=Accuracy)
    workload: Workload = Field(default_factory=Workload)
    pools: Annotated[list[PoolRef], Field(min_length=1)]
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)

    @model_validator(mode="after")
    def _unique_pools(self) -> EarlyExitServiceSpec:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pools must name each GPUPool once, got {names}")
        return self


# ---------------------------------------------------------------- ModelProfile (namespaced)


class BlockProfile(Model):
    name: str
    latency_ms: list[list[Annotated[float, Field(ge=0.0)]]]
    """latencyMs[i][j]: latency of one batch of batchSizes[j] inputs of length seqLens[i]."""
    weight_bytes: Annotated[int, Field(ge=0)] = 0
    """Memory of the block's weights."""
    output_bytes: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Activation bytes per sample leaving this block, per entry of seqLens."""


class RampProfile(Model):
    name: str
    after_block: Annotated[int, Field(ge=0)]
    """Index of the block this ramp follows."""
    latency_ms: list[list[Annotated[float, Field(ge=0.0)]]]
    """Same layout as BlockProfile.latency_ms."""


class ServingCosts(Model):
    """What the serving path costs beside the model, measured on the profiled machine by running the real
    router and worker processes (`exitplan profile`, localrun/serving_costs.py)."""

    router_ms: Annotated[float, Field(ge=0.0)]
    """Router CPU per request: reading, decoding and tokenizing it, admission, the hop out, the answer."""
    hop_ms: Annotated[float, Field(ge=0.0)]
    """Worker CPU per batch beyond the model's compute: the hop in (decode, validate) and the answer or
    forward out. The planner adds it to every split's time per batch."""
    colocated_ms: Annotated[float, Field(ge=0.0)] | None = None
    """Router CPU per request beyond the model's compute when the router runs split 0 in its own process
    (`exitplan router --colocate`): everything routerMs holds but the hop out, plus split 0's batching.
    None: not measured (the planner then keeps the router and split 0 apart)."""
    threads: Annotated[int, Field(ge=1)] = 1
    """ONNX Runtime intra-op threads per worker: the cores one busy worker keeps busy."""
    cores: Annotated[int, Field(ge=1)] = 1
    """Cores the measuring process could use (its CPU affinity and cgroup quota)."""
    requests: Annotated[int, Field(ge=0)] = 0
    """Requests the figures were measured over."""
    compute_scale: list[Annotated[float, Field(gt=0.0)]] = Field(default_factory=list)
    """Per entry of seqLens: the model's mean CPU time per input as a CPU pool's workers run it (the first
    batch size, the sessions they run: a free length where they trim) over what the block and head tables
    say there (the fastest of repeats, fixed shapes). A CPU pool's tables are multiplied by it in the
    planner (empty: 1; a GPU pool's tables are never scaled: there the workers do not compute on the CPU)."""


class ModelProfileSpec(Model):
    model: str
    pool: str
    batch_sizes: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]
    seq_lens: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]
    """Sequence lengths measured; [1] for models without a sequence axis."""
    blocks: Annotated[list[BlockProfile], Field(min_length=1)]
    ramps: list[RampProfile] = Field(default_factory=list)
    survival: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=list)
    """Observed fraction of inputs still running after each ramp (same order as ramps)."""
    input_bytes: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Bytes per sample entering the first block, per entry of seqLens."""
    measured_on: str = ""
    """Free text: the machine and runtime that measured the profile."""
    providers: list[str] = Field(default_factory=list)
    """The ONNX Runtime execution providers the measured sessions ran on, the first the one that ran their
    nodes (`exitplan profile` records them; empty in a profile written by hand or derived from tables). A
    pool that asks for accelerators (a gpuResource) refuses a profile measured on the CPU provider, and a
    pool of CPU cores one measured on a GPU's, with the reason (planner/costmodel.py `check_device`)."""
    serving: ServingCosts | None = None
    """The serving path's own costs on the profiled machine (absent: not measured; counted as free)."""


class Resource(BaseModel):
    """A whole custom resource document (apiVersion, kind, metadata, spec)."""

    model_config = ConfigDict(extra="allow")

    api_version: str = Field(API_VERSION, alias="apiVersion")
    kind: str
    metadata: dict[Any, Any] = Field(default_factory=dict)


class GPUPool(Resource):
    kind: Literal["GPUPool"] = "GPUPool"
    spec: GPUPoolSpec


class EarlyExitService(Resource):
    kind: Literal["EarlyExitService"] = "EarlyExitService"
    spec: EarlyExitServiceSpec


class ModelProfile(Resource):
    kind: Literal["ModelProfile"] = "ModelProfile"
    spec: ModelProfileSpec


KINDS: dict[str, type[Resource]] = {
    "GPUPool": GPUPool,
    "EarlyExitService": EarlyExitService,
    "ModelProfile": ModelProfile,
}
PLURALS = {"GPUPool": "gpupools", "EarlyExitService": "earlyexitservices", "ModelProfile": "modelprofiles"}
