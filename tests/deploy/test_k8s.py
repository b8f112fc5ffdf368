"""deploy/k8s renders (kustomize, the base and the production and persia-100t overlays) and every object it renders
validates, in strict mode, against the Kubernetes OpenAPI schemas kubernetes-validate ships, for the
oldest version the manifests support (1.28: the pod-index label) and the newest bundled. What no
schema says is checked below: probes, resources, the token from a Secret, scrape annotations,
only trillium/config.py's variable names, and the persia-100t overlay's PS shards against what a
reshard accepts and their memory and disk against the sizes it declares, with a row's bytes
measured on the native store. No cluster runs them here."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import numpy as np
import pytest
from manifests import ROLES, Pod, admitted, render, role
from pydantic import BaseModel

import trillium_native
from trillium import config
from trillium.services.coordinator.bodies import ReshardRequest

VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
CONFIG_NAMES = {getattr(config, name) for name in dir(config) if name.startswith("ENV_")}
CONFIG_NAMES |= set(config.OBJECT_STORE_VARIABLES)


PERSIA_100T = "deploy/k8s/overlays/persia-100t"  # docs/scaling.md derives its counts and sizes
SHARDED = "deploy/k8s/overlays/sharded-serving"


@pytest.fixture(scope="module", params=["deploy/k8s/base", "deploy/k8s/overlays/production", PERSIA_100T, SHARDED])
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


@pytest.fixture(scope="module")
def objects(rendered) -> list[dict]:
    return rendered[1]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_openapi_schemas(objects, version) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)  # raises, naming the bad field


def test_a_misspelt_field_is_caught() -> None:
    """The validation above can fail: strict mode rejects a field Kubernetes does not know."""
    deployment = next(o for o in render("deploy/k8s/base") if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def _workloads(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def test_the_topology_and_its_kinds(rendered) -> None:
    path, objects = rendered
    kinds = {name: o["kind"] for name, o in _workloads(objects).items()}
    # More than one embedding worker or data loader needs an index each: a StatefulSet's ordinal.
    many = "StatefulSet" if path == PERSIA_100T else "Deployment"
    shards = {"serving-shard-a": "StatefulSet", "serving-shard-b": "StatefulSet"} if path == SHARDED else {}
    assert (
        kinds
        == {
            "coordinator": "Deployment",
            "embedding-ps": "StatefulSet",
            "embedding-worker": many,
            "nn-worker": "StatefulSet",
            "data-loader": many,
            "serving": "Deployment",
        }
        | shards
    )
    ps = _workloads(objects)["embedding-ps"]
    assert [c["metadata"]["name"] for c in ps["spec"]["volumeClaimTemplates"]] == ["state"]
    services = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Service"}
    assert services["coordinator"]["ports"][0]["port"] == 8080
    assert {p["name"]: p["port"] for p in services["serving"]["ports"]} == {"http": 8080, "grpc": 50051}
    assert _workloads(objects)["serving"]["spec"]["replicas"] >= 2
    assert services["kafka"]["type"] == services["redis"]["type"] == "ExternalName"


def test_every_container_is_probed_limited_and_given_its_tokens_by_a_secret(objects) -> None:
    for name, workload in _workloads(objects).items():
        template = workload["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true", name
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "trillium", name
        for c in template["spec"]["containers"]:
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", name
            assert set(c["resources"]["requests"]) >= {"cpu", "memory"}, name
            assert set(c["resources"]["limits"]) >= {"cpu", "memory"}, name
            env = {e["name"]: e for e in c["env"]}
            # Every container needs the services' token and the digest of an operator's; a serving
            # replica, of a prediction client's too (trillium.config refuses to start without them).
            needed = [config.ENV_TOKEN, config.ENV_OPERATE_DIGEST, config.ENV_REDIS_PASSWORD, config.ENV_KAFKA_PASSWORD]
            needed += [config.ENV_PREDICT_DIGEST] if "trillium.services.serving" in c["args"] else []
            for var in needed:
                assert env[var]["valueFrom"]["secretKeyRef"]["name"] == "trillium-secrets", (name, var)
            # Only names trillium/config.py reads (POD_INDEX feeds --index, not a service).
            assert set(env) - {"POD_INDEX"} <= CONFIG_NAMES, (name, set(env) - CONFIG_NAMES)


def test_the_frontends_ask_every_shard_of_both_sets_and_only_they_may() -> None:
    """Shard i is pods serving-shard-a-i and -b-i (their ordinal and TRILLIUM_SERVING_SHARD's
    COUNT), each named in the frontends' TRILLIUM_SERVING_SHARDS by its stable DNS name, and
    reached on gRPC from the frontends alone."""
    objects = render(SHARDED)
    workloads = _workloads(objects)
    frontend_env = {e["name"]: e for e in workloads["serving"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    listed = [replicas.split("|") for replicas in frontend_env[config.ENV_SERVING_SHARDS]["value"].split(",")]
    for set_ in ("a", "b"):
        shard_set = workloads[f"serving-shard-{set_}"]
        assert shard_set["spec"]["serviceName"] == f"serving-shard-{set_}"
        container = shard_set["spec"]["template"]["spec"]["containers"][0]
        place = next(e["value"] for e in container["env"] if e["name"] == config.ENV_SERVING_SHARD)
        assert place == f"$(POD_INDEX)/{shard_set['spec']['replicas']}" and len(listed) == shard_set["spec"]["replicas"]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for i, replicas in enumerate(listed):
            assert f"serving-shard-{set_}-{i}.serving-shard-{set_}:{port}" in replicas
    policies = [
        o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].startswith("serving-shard")
    ]
    assert len(policies) == 2
    for policy in policies:
        (rule,) = policy["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "serving"}}}]
        assert rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    # Both ways: the frontends' way out to the shards too (base/egress.yaml limits every pod's).
    every_policy = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for set_ in ("a", "b"):
        labels = {"app.kubernetes.io/name": "serving-shard", "app.kubernetes.io/part-of": "trillium"}
        shard = Pod(f"serving-shard-{set_}-0", labels | {"trillium.io/serving-shard-set": set_})
        assert admitted(every_policy, role("serving"), shard, 50051)
        assert not [r for r in ROLES if r != "serving" and admitted(every_policy, role(r), shard, 50051)]


def test_the_configmap_names_only_config_variables(objects) -> None:
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert set(configmap["data"]) <= CONFIG_NAMES, set(configmap["data"]) - CONFIG_NAMES


def test_the_persia_100t_overlay_is_sized_as_docs_scaling_says() -> None:
    """The counts and sizes of docs/scaling.md's summary table, and every StatefulSet's index from its
    ordinal (two pods of one role with one index would register as one worker)."""
    workloads = _workloads(render(PERSIA_100T))
    replicas = {name: w["spec"]["replicas"] for name, w in workloads.items()}
    assert replicas == {
        "coordinator": 1,
        "embedding-ps": 64,
        "embedding-worker": 64,
        "nn-worker": 64,
        "data-loader": 32,
        "serving": 2,
    }

    def container(name: str) -> dict:
        return workloads[name]["spec"]["template"]["spec"]["containers"][0]

    ps = container("embedding-ps")
    assert ps["resources"]["requests"]["memory"] == ps["resources"]["limits"]["memory"] == "10000Gi"
    assert {"name": "TRILLIUM_THREADS", "value": "32"} in ps["env"]
    assert {"name": "spill", "mountPath": "/var/lib/trillium-spill"} in ps["volumeMounts"]
    (spill,) = [v for v in workloads["embedding-ps"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "spill"]
    assert spill["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]["storage"] == "5Ti"
    nn = container("nn-worker")
    assert nn["resources"]["requests"]["nvidia.com/gpu"] == nn["resources"]["limits"]["nvidia.com/gpu"] == 1
    for name, w in workloads.items():
        if w["kind"] == "StatefulSet":
            assert "$(POD_INDEX)" in container(name)["args"], name
            assert container(name)["image"].startswith("registry.example.com/"), name


def _upper_bound(model: type[BaseModel], field: str) -> int:
    """The `le` a pydantic field declares (Field(le=...)): what a request or a setting accepts at most."""
    return min(m.le for m in model.model_fields[field].metadata if getattr(m, "le", None) is not None)


# What a reshard accepts: the API's ReshardRequest, and the local stack's topology (the launcher's
# --ps-shards), whose processes a reshard needs registered.
RESHARD_CAP = min(_upper_bound(ReshardRequest, "ps_shards"), _upper_bound(config.StackTopology, "ps_shards"))
_UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
_UNITS |= {"Ti": 1 << 40, "Pi": 1 << 50}


def _bytes(quantity: str) -> float:
    """A Kubernetes quantity ("10000Gi", "5Ti", "1e3") in bytes."""
    number, unit = re.fullmatch(r"([0-9.eE+-]+?)([KMGTP]i|[kMGTP])?", quantity).groups()
    return float(number) * _UNITS[unit or ""]


def _per_row(table: dict[str, str], tmp_path: Path) -> dict[str, float]:
    """Bytes a row of `table` takes, measured on the native store (2^17 rows in one internal shard,
    each updated once): resident (the store's own count), in a full capture's copy, in the
    snapshot file the capture writes, and in a disk tier's spill file with every row spilled."""
    dim, n = int(table["dim"]), 1 << 17
    kind = {"dtype": table["dtype"], "optimizer": table["optimizer"]}
    ids, grads = np.arange(1, n + 1, dtype=np.uint64), np.full((n, dim), 0.01, np.float32)
    store = trillium_native.EmbeddingStore(num_internal_shards=1, threads=1)
    store.create_table("t", dim, **kind)
    store.lookup("t", ids)
    store.update("t", ids, grads)
    with store.capture() as copy:
        copied = copy.memory_bytes
        written, _ = copy.write(tmp_path / "t.snap")
    tiered = trillium_native.EmbeddingStore(num_internal_shards=1, threads=1)
    tiered.create_table("t", dim, **kind, memory_budget_bytes=1 << 12, disk=str(tmp_path / "spill"))
    tiered.lookup("t", ids)
    stats = tiered.stats("t")
    assert stats["disk_rows"] > 0.9 * n, stats
    return {
        "resident": store.memory_bytes("t") / n,
        "copy": copied / n,
        "snapshot": written / n,
        "spill": stats["disk_bytes"] / stats["disk_rows"],
    }


def test_the_persia_100t_shards_fit_a_reshard_and_hold_their_rows_and_the_first_full_checkpoint(tmp_path) -> None:
    """From the sizes the overlay declares (its embedding-ps annotations): the PS shards are no
    more than a reshard accepts, and a shard's memory limit holds its rows resident (the measured
    RSS a value, or the store's own count if larger, with the declared headroom) plus the first
    full checkpoint's in-memory copy of them (each attempt's first checkpoint is full, and the
    capture copies the rows' columns whole); its /tmp holds that checkpoint's file (a checkpoint to
    object storage is written there first) and its disk-tier volume every row spilled. The bytes
    of a row are measured on the native store with the declared table's config, not assumed."""
    ps = _workloads(render(PERSIA_100T))["embedding-ps"]
    declared = ps["metadata"]["annotations"]
    shards = ps["spec"]["replicas"]
    assert shards <= RESHARD_CAP, f"{shards} PS shards: a reshard accepts at most {RESHARD_CAP}"
    table = dict(kv.split("=") for kv in declared["sizing.trillium/table"].split(","))
    rows = float(declared["sizing.trillium/parameters"]) / int(table["dim"]) / shards
    row = _per_row(table, tmp_path)
    resident = max(float(declared["sizing.trillium/ram-bytes-per-value"]) * int(table["dim"]), row["resident"])
    needed = rows * (resident * float(declared["sizing.trillium/headroom"]) + row["copy"])
    resources = ps["spec"]["template"]["spec"]["containers"][0]["resources"]
    for kind in ("requests", "limits"):
        memory = _bytes(resources[kind]["memory"])
        assert memory >= needed, f"{kind}.memory {resources[kind]['memory']} < {needed / (1 << 30):,.0f} GiB needed"
    volumes = {v["name"]: v for v in ps["spec"]["template"]["spec"]["volumes"]}

    def size(name: str) -> float:
        return _bytes(volumes[name]["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]["storage"])

    assert size("tmp") >= rows * row["snapshot"], (size("tmp"), rows * row["snapshot"])
    # A spill file grows an eighth ahead of its rows: the volume holds the largest it may be.
    assert size("spill") >= rows * row["spill"] * 9 / 8, (size("spill"), rows * row["spill"] * 9 / 8)


def test_the_sizing_check_can_fail(tmp_path) -> None:
    """The check above refuses the overlay as it was (144 shards of 2,450 GiB: more shards than a
    reshard accepts, and no room for the first full checkpoint's copy)."""
    assert 144 > RESHARD_CAP
    row = _per_row({"dim": "16", "dtype": "fp16", "optimizer": "rowwise_adagrad"}, tmp_path)
    rows = 1e14 / 16 / 144
    assert _bytes("2450Gi") < rows * (3.43 * 16 * 1.10 + row["copy"])
