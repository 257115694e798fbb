"""The NetworkPolicies the operator makes admit exactly the flows kubestar's data flow needs.

The operator's pure builders make a SandboxPool, a RolloutFleet and a TrainingRun of two
trainer workers in namespace `team`, and the same three in namespace `other` (another
tenant). Their pods are read from the workloads' pod templates (labels, named container
ports), beside pods kubestar does not make: the operator (in `kubestar-system`), the
cluster's DNS, a Prometheus (in `monitoring`), an ordinary pod in each tenant's namespace,
and two addresses that are not pods: the API server (as policies see it, after the
kubernetes Service's translation) and one on the internet.

A small evaluator of NetworkPolicy semantics (`Cluster.allows`) says whether a connection
is allowed: by the source's egress AND the destination's ingress, each open unless a policy
of its namespace selects the pod for that direction, and then only if a rule of one of those
policies admits the peer (podSelector of the policy's namespace, namespaceSelector, both,
ipBlock) and the port (by number, or by name resolved against the destination's container
ports; no ports: all).

`NEEDED` is the table of flows the design needs, with why; `DELIBERATE` what the policies
admit on purpose beyond them. The tests check that every needed flow is allowed, that every
governed connection (one whose source or destination kubestar made) outside the two tables
is denied, that every rule of every policy is needed by some flow (drop one and a needed flow
is denied), and the settings that change the picture: networkPolicies.metricsFrom and
apiServerPeers, an OpenAI or HTTP port, a fleet that syncs weights through a volume.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubestar.api.v1alpha1 import RolloutFleetSpec, SandboxPoolSpec, TrainingRunSpec
from kubestar.operator import build_fleet, build_sandbox, build_trainer
from kubestar.operator import objects as o
from kubestar.operator.settings import OperatorSettings

from tests.operator.support import CHART, parent
from tests.operator.test_auth import helm_binary

Obj = dict[str, Any]

TEAM, OTHER = "team", "other"
OPERATOR_NAMESPACE = "kubestar-system"
NAMESPACE_NAME = "kubernetes.io/metadata.name"
# An address of the API server as policies see it (its own, not the kubernetes Service's),
# and one on the internet.
API_SERVER_IP = "172.18.0.2"
INTERNET_IP = "203.0.113.7"
# A port one end of a torch.distributed or broadcast connection picks at random.
EPHEMERAL = 45678
ANY_PORT = None  # in a table: every TCP port


# --- The cluster: endpoints, and what NetworkPolicy semantics allow between them ----------


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace set) or an address outside the pod network (namespace empty)."""

    name: str  # NAMESPACE/NAME for pods
    ip: str
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    ports: Mapping[str, int] = field(default_factory=dict, hash=False, compare=False)
    # Made by the operator (its policies govern it), as opposed to other pods and addresses.
    governed: bool = False

    @property
    def is_pod(self) -> bool:
        return bool(self.namespace)


@dataclass(frozen=True)
class Flow:
    source: str
    target: str
    port: int
    protocol: str = "TCP"

    def __str__(self) -> str:
        udp = "/UDP" if self.protocol == "UDP" else ""
        return f"{self.source} -> {self.target}:{self.port}{udp}"


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A label selector; only matchLabels, which is all kubestar and these tests write."""
    assert set(selector) <= {"matchLabels"}, f"the evaluator reads matchLabels only: {selector}"
    wanted = selector.get("matchLabels") or {}
    return all(labels.get(key) == value for key, value in wanted.items())


@dataclass
class Cluster:
    endpoints: dict[str, Endpoint]
    policies: list[Obj]
    namespace_labels: dict[str, dict[str, str]]

    def peer_matches(self, peer: Mapping[str, Any], namespace: str, other: Endpoint) -> bool:
        """Whether `other` is `peer` of a rule in a policy of `namespace`."""
        if "ipBlock" in peer:
            assert set(peer) == {"ipBlock"}, peer
            block = peer["ipBlock"]
            address = ipaddress.ip_address(other.ip)
            excluded = (ipaddress.ip_network(cidr) for cidr in block.get("except", []))
            return address in ipaddress.ip_network(block["cidr"]) and not any(
                address in cidr for cidr in excluded
            )
        if not other.is_pod:
            return False  # selectors name pods only
        if "namespaceSelector" in peer:
            labels = self.namespace_labels[other.namespace]
            if not selects(peer["namespaceSelector"], labels):
                return False
        elif other.namespace != namespace:
            return False  # a podSelector alone: the policy's own namespace
        return selects(peer.get("podSelector", {}), other.labels)

    @staticmethod
    def port_matches(ports: list[Obj] | None, target: Endpoint, port: int, protocol: str) -> bool:
        if not ports:
            return True
        for item in ports:
            if item.get("protocol", "TCP") != protocol:
                continue
            wanted = item.get("port")
            if wanted is None:
                return True
            first = target.ports.get(wanted) if isinstance(wanted, str) else int(wanted)
            if first is not None and first <= port <= int(item.get("endPort", first)):
                return True
        return False

    def _admits(self, pod: Endpoint, direction: str, other: Endpoint, flow: Flow) -> bool:
        """Whether a policy selecting `pod` admits `other` (the peer) for `flow` in
        `direction`."""
        kind, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        target = pod if direction == "Ingress" else other
        for policy in self._selecting(pod, direction):
            namespace = policy["metadata"]["namespace"]
            for rule in policy["spec"].get(kind) or []:
                peers = rule.get(peers_key)
                peer_ok = not peers or any(
                    self.peer_matches(peer, namespace, other) for peer in peers
                )
                if peer_ok and self.port_matches(
                    rule.get("ports"), target, flow.port, flow.protocol
                ):
                    return True
        return False

    def _selecting(self, pod: Endpoint, direction: str) -> Iterator[Obj]:
        for policy in self.policies:
            spec = policy["spec"]
            if (
                policy["metadata"]["namespace"] == pod.namespace
                and direction in spec["policyTypes"]
                and selects(spec["podSelector"], pod.labels)
            ):
                yield policy

    def _selected(self, pod: Endpoint, direction: str) -> bool:
        return pod.is_pod and any(True for _ in self._selecting(pod, direction))

    def egress_allows(self, flow: Flow) -> bool:
        source, target = self.endpoints[flow.source], self.endpoints[flow.target]
        if not source.is_pod or not self._selected(source, "Egress"):
            return True
        return self._admits(source, "Egress", target, flow)

    def ingress_allows(self, flow: Flow) -> bool:
        source, target = self.endpoints[flow.source], self.endpoints[flow.target]
        if not target.is_pod or not self._selected(target, "Ingress"):
            return True
        return self._admits(target, "Ingress", source, flow)

    def allows(self, flow: Flow) -> bool:
        return self.egress_allows(flow) and self.ingress_allows(flow)

    def ports(self) -> list[int]:
        """Every port worth trying: each pod's, the well-known ones, a random one."""
        found = {port for endpoint in self.endpoints.values() for port in endpoint.ports.values()}
        return sorted(found | {53, 443, 6443, 29500, 29600, EPHEMERAL})

    def governed_flows(self) -> Iterator[Flow]:
        """Every connection whose source or destination kubestar made (a pod to itself
        aside: policies do not stand between a pod and itself)."""
        ports = self.ports()
        for source in self.endpoints.values():
            for target in self.endpoints.values():
                if source == target or not (source.governed or target.governed):
                    continue
                for port in ports:
                    yield Flow(source.name, target.name, port)
                yield Flow(source.name, target.name, 53, "UDP")


def pods_of_workload(workload: Obj) -> Iterator[Endpoint]:
    """The pods a Deployment, StatefulSet or Job of the builders runs, named by component
    (and ordinal, or trainer worker): team/engine-0, team/scheduler, team/trainer-1, ..."""
    meta = workload["metadata"]
    template = workload["spec"]["template"]
    labels = template["metadata"]["labels"]
    ports = {
        port["name"]: port["containerPort"]
        for container in template["spec"]["containers"]
        for port in container.get("ports", [])
    }
    component = labels[o.LABEL_COMPONENT]
    if workload["kind"] == "Job":
        names = [f"{component}-{labels[o.LABEL_WORKER]}"]
    elif workload["spec"]["replicas"] == 1:
        names = [component]
    else:
        names = [f"{component}-{i}" for i in range(workload["spec"]["replicas"])]
    for name in names:
        yield Endpoint(
            f"{meta['namespace']}/{name}",
            ip="",
            namespace=meta["namespace"],
            labels=labels,
            ports=ports,
            governed=True,
        )


# --- What kubestar makes --------------------------------------------------------------------


def settings_with(**network_policies: Any) -> OperatorSettings:
    return OperatorSettings.model_validate(
        {"networkPolicies": {"operatorNamespace": OPERATOR_NAMESPACE, **network_policies}}
    )


def run_spec() -> TrainingRunSpec:
    return TrainingRunSpec.model_validate(
        {
            "rolloutFleetRef": {"name": "fleet"},
            "sandboxPoolRef": {"name": "pool"},
            "trainer": {"workers": 2},
            "stages": [
                {
                    "name": "s",
                    "maxResponseTokens": 64,
                    "steps": 1,
                    "dataset": {"generator": "basic_arithmetic"},
                }
            ],
        }
    )


def kubestar_children(
    namespace: str,
    settings: OperatorSettings,
    fleet_spec: RolloutFleetSpec,
    pool_spec: SandboxPoolSpec,
) -> list[Obj]:
    """A tenant's pool, fleet and run, as the reconciles make them."""
    pool = parent("SandboxPool", "pool", namespace)
    fleet = parent("RolloutFleet", "fleet", namespace)
    run = parent("TrainingRun", "run", namespace)
    spec = run_spec()
    return [
        *build_sandbox.children(pool, pool_spec, settings),
        *build_fleet.children(fleet, fleet_spec, settings),
        *build_trainer.network_policies(run, spec, settings),
        *build_trainer.jobs(run, spec, fleet_spec, pool_spec, settings),
    ]


def others() -> list[Endpoint]:
    """Pods kubestar does not make, and addresses that are not pods."""

    def pod(
        namespace: str, name: str, labels: dict[str, str], ports: Mapping[str, int] | None = None
    ) -> Endpoint:
        return Endpoint(f"{namespace}/{name}", "", namespace, labels, ports or {})

    operator = {o.LABEL_NAME: "kubestar", o.LABEL_COMPONENT: "operator"}
    return [
        pod(OPERATOR_NAMESPACE, "operator", operator),
        pod("kube-system", "coredns", {"k8s-app": "kube-dns"}, {"dns": 53}),
        pod("monitoring", "prometheus", {"app": "prometheus"}),
        pod(TEAM, "app", {"app": "notebook"}),
        pod(OTHER, "app", {"app": "notebook"}),
        Endpoint("api-server", API_SERVER_IP),
        Endpoint("internet", INTERNET_IP),
    ]


def cluster(
    settings: OperatorSettings | None = None,
    fleet_spec: RolloutFleetSpec | None = None,
    pool_spec: SandboxPoolSpec | None = None,
) -> Cluster:
    settings = settings or settings_with()
    fleet_spec = fleet_spec or RolloutFleetSpec(replicas=2)
    pool_spec = pool_spec or SandboxPoolSpec(replicas=2)
    objects = [
        obj
        for namespace in (TEAM, OTHER)
        for obj in kubestar_children(namespace, settings, fleet_spec, pool_spec)
    ]
    workloads = [obj for obj in objects if obj["kind"] in ("Deployment", "StatefulSet", "Job")]
    endpoints = [pod for workload in workloads for pod in pods_of_workload(workload)]
    endpoints += others()
    # Pod addresses: 10.244.0.0/16, away from the API server's and the internet's.
    endpoints = [
        Endpoint(e.name, f"10.244.0.{i + 1}", e.namespace, e.labels, e.ports, e.governed)
        if e.is_pod
        else e
        for i, e in enumerate(endpoints)
    ]
    namespaces = {e.namespace for e in endpoints if e.is_pod}
    return Cluster(
        endpoints={e.name: e for e in endpoints},
        policies=[obj for obj in objects if obj["kind"] == "NetworkPolicy"],
        namespace_labels={ns: {NAMESPACE_NAME: ns} for ns in namespaces},
    )


# --- The flows kubestar's data flow needs -----------------------------------------------------


@dataclass(frozen=True)
class Need:
    """`source` reaches `target` on `port`: a container port's name of the target, a number,
    or ANY_PORT (every TCP port). Names without a namespace are the tenant's."""

    source: str
    target: str
    port: str | int | None
    why: str
    protocol: str = "TCP"

    def label(self) -> str:
        port = "any" if self.port is ANY_PORT else self.port
        udp = "/UDP" if self.protocol == "UDP" else ""
        return f"{self.source} -> {self.target}:{port}{udp}"


def both_ways(a: str, b: str, why: str) -> list[Need]:
    return [Need(a, b, ANY_PORT, why), Need(b, a, ANY_PORT, why)]


def dns(source: str, why: str) -> list[Need]:
    return [Need(source, "kube-system/coredns", 53, why, protocol) for protocol in ("UDP", "TCP")]


COLLECTIVES = "torch.distributed: the ranks' gloo/NCCL connections, on ports each picks"
BROADCAST = (
    "a weights broadcast: the session's process group (gloo pairs, NCCL sockets) connects "
    "every pair of members on a random port, either end dialling"
)
SCRAPE = "metrics scrape (networkPolicies.metricsFrom; empty: pods of the same namespace)"

NEEDED: list[Need] = [
    # The trainer: rank 0 (worker 0's pod) drives rollouts, calls the services, serves weights.
    Need("trainer-0", "scheduler", "grpc", "rollouts: Generate, UpdateWeights, status"),
    Need("trainer-0", "sandbox-dispatcher", "grpc", "the agent loop's tool calls"),
    Need("trainer-1", "trainer-0", 29500, "the rendezvous: torch.distributed's store"),
    *both_ways("trainer-0", "trainer-1", COLLECTIVES),
    Need("trainer-0", "api-server", 6443, "rank 0 patches the TrainingRun's status"),
    Need("trainer-1", "api-server", 6443, "a worker reads worker 0's address from the status"),
    *dns("trainer-0", "the scheduler, dispatcher and rendezvous are dialled by name"),
    *dns("trainer-1", "the rendezvous is dialled by name"),
    # Engines: generation and weights from their scheduler; a broadcast with rank 0.
    Need("scheduler", "engine-0", "http", "generation, KV gauges, the weights route"),
    Need("scheduler", "engine-1", "http", "generation, KV gauges, the weights route"),
    Need("engine-0", "trainer-0", 29600, "the weight server's store (a broadcast's start)"),
    Need("engine-1", "trainer-0", 29600, "the weight server's store (a broadcast's start)"),
    *both_ways("engine-0", "trainer-0", BROADCAST),
    *both_ways("engine-1", "trainer-0", BROADCAST),
    *both_ways("engine-0", "engine-1", BROADCAST),
    Need("scheduler", "api-server", 6443, "engine discovery: lists the fleet's pods"),
    Need(f"{OPERATOR_NAMESPACE}/operator", "scheduler", "grpc", "probe (KV capacity, weights)"),
    # The sandbox.
    Need("sandbox-dispatcher", "sandbox-worker-0", "grpc", "executes calls"),
    Need("sandbox-dispatcher", "sandbox-worker-1", "grpc", "executes calls"),
    *dns("sandbox-dispatcher", "the workers are dialled by name"),
    # Scrapers.
    *(
        Need("app", target, port, SCRAPE)
        for target, port in (
            ("sandbox-worker-0", "metrics"),
            ("sandbox-worker-1", "metrics"),
            ("sandbox-dispatcher", "metrics"),
            ("scheduler", "metrics"),
            ("engine-0", "http"),
            ("engine-1", "http"),
            ("trainer-0", "metrics"),
        )
    ),
]

# Admitted on purpose beyond NEEDED: the API server's and DNS's addresses are not pods a
# policy can name, so those rules name ports, not peers (networkPolicies.apiServerPeers
# names the API server's addresses instead).
API_SERVER_CALLERS = ("trainer-0", "trainer-1", "scheduler")
DNS_CALLERS = ("trainer-0", "trainer-1", "sandbox-dispatcher")
UNGOVERNED = "*ungoverned*"  # every pod kubestar did not make, and every address
DELIBERATE: list[Need] = [
    *(
        Need(caller, UNGOVERNED, port, "the API server's ports, to any address")
        for caller in API_SERVER_CALLERS
        for port in (443, 6443)
    ),
    *(
        Need(caller, UNGOVERNED, 53, "name lookups, to any address", protocol)
        for caller in DNS_CALLERS
        for protocol in ("UDP", "TCP")
    ),
]


def qualified(name: str, namespace: str) -> str:
    return name if "/" in name or name in ("api-server", "internet") else f"{namespace}/{name}"


def expand(needs: Iterable[Need], world: Cluster) -> dict[Flow, str]:
    """The flows `needs` stand for in both tenants' namespaces, each with why."""
    flows: dict[Flow, str] = {}
    for need in needs:
        for namespace in (TEAM, OTHER):
            source = qualified(need.source, namespace)
            if need.target == UNGOVERNED:
                targets = [e for e in world.endpoints.values() if not e.governed]
            else:
                targets = [world.endpoints[qualified(need.target, namespace)]]
            for target in targets:
                if need.port is ANY_PORT:
                    ports = world.ports()
                elif isinstance(need.port, str):
                    ports = [target.ports[need.port]]
                else:
                    ports = [need.port]
                for port in ports:
                    flows[Flow(source, target.name, port, need.protocol)] = need.why
    return flows


def allowed_flows(world: Cluster) -> set[Flow]:
    return {flow for flow in world.governed_flows() if world.allows(flow)}


def differences(world: Cluster, expected: Mapping[Flow, str]) -> tuple[list[str], list[str]]:
    allowed = allowed_flows(world)
    denied_needed = sorted(f"{flow} ({expected[flow]})" for flow in set(expected) - allowed)
    extra = sorted(str(flow) for flow in allowed - set(expected))
    return denied_needed, extra


# --- The tests --------------------------------------------------------------------------------


def test_every_kubestar_pod_is_isolated_both_ways() -> None:
    world = cluster()
    governed = [e for e in world.endpoints.values() if e.governed]
    # Per tenant: 2 sandbox workers, the dispatcher, 2 engines, the scheduler, 2 trainers.
    assert len(governed) == 2 * 8
    for pod in governed:
        assert world._selected(pod, "Ingress"), pod.name
        assert world._selected(pod, "Egress"), pod.name
    for policy in world.policies:
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]


@pytest.mark.parametrize("need", NEEDED, ids=Need.label)
def test_every_flow_the_design_needs_is_allowed(need: Need) -> None:
    world = cluster()
    for flow, why in expand([need], world).items():
        assert world.egress_allows(flow), f"{flow}: the source's egress denies it ({why})"
        assert world.ingress_allows(flow), f"{flow}: the target's ingress denies it ({why})"


def test_nothing_else_is_allowed() -> None:
    world = cluster()
    denied_needed, extra = differences(world, expand([*NEEDED, *DELIBERATE], world))
    assert not denied_needed, "needed but denied:\n" + "\n".join(denied_needed)
    assert not extra, "allowed but not needed:\n" + "\n".join(extra)


def test_forbidden_flows_are_denied() -> None:
    world = cluster()

    def denied(source: str, target: str, port: int, protocol: str = "TCP") -> bool:
        return not world.allows(Flow(source, target, port, protocol))

    team = {name: e for name, e in world.endpoints.items() if e.namespace == TEAM}
    # A sandbox worker reaches nothing at all, DNS included: an escaped call meets a wall.
    for target in world.endpoints:
        for port in world.ports():
            assert denied("team/sandbox-worker-0", target, port), target
        assert denied("team/sandbox-worker-0", target, 53, "UDP")
    # Engines never reach the sandbox; the dispatcher never reaches a trainer.
    for target in ("team/sandbox-dispatcher", "team/sandbox-worker-0"):
        for port in world.ports():
            assert denied("team/engine-0", target, port)
    for port in world.ports():
        assert denied("team/sandbox-dispatcher", "team/trainer-0", port)
    # Nothing of another namespace reaches this one's services, kubestar's pods included.
    for source in ("other/app", "other/trainer-0", "other/scheduler", "other/engine-0"):
        for target in ("team/scheduler", "team/sandbox-dispatcher", "team/engine-0"):
            for port in (*team[target].ports.values(), EPHEMERAL):
                assert denied(source, target, port), (source, target, port)
        assert denied(source, "team/trainer-0", 29600)
    # The other ranks call no service; only rank 0 does.
    assert denied("team/trainer-1", "team/scheduler", team["team/scheduler"].ports["grpc"])
    assert denied("team/trainer-1", "team/engine-0", team["team/engine-0"].ports["http"])
    # The internet on 443: only the API server's callers, whose address is not known here
    # (networkPolicies.apiServerPeers closes that: see below); no other port, for anyone.
    for pod in (e for e in world.endpoints.values() if e.governed):
        short = pod.name.split("/")[1]
        if short not in API_SERVER_CALLERS:
            assert denied(pod.name, "internet", 443), pod.name
        for port in (80, 8080, EPHEMERAL):
            assert denied(pod.name, "internet", port), pod.name
    # Metrics are not open to other namespaces by default.
    for target, name in (("team/scheduler", "metrics"), ("team/engine-0", "http")):
        assert denied("monitoring/prometheus", target, team[target].ports[name])


def drop_rule(policies: list[Obj], index: int, kind: str, rule: int) -> list[Obj]:
    changed = [dict(policy) for policy in policies]
    spec = dict(changed[index]["spec"])
    spec[kind] = [r for i, r in enumerate(spec[kind]) if i != rule]
    changed[index] = {**changed[index], "spec": spec}
    return changed


MONITORING = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME: "monitoring"}}}


def scraped_from_monitoring() -> list[Need]:
    """NEEDED with the scrapes made by the monitoring namespace's Prometheus."""
    return [
        Need("monitoring/prometheus", need.target, need.port, SCRAPE)
        if need.why == SCRAPE
        else need
        for need in NEEDED
    ]


def test_every_rule_is_needed() -> None:
    """Dropping any one rule of any policy denies a needed flow: the table leaves no rule
    unexplained, and the tests above fail if a rule (an egress rule above all) goes. With
    scrapers of their own namespace (the default) the engines' rule for their scheduler is
    also covered by the scrapers' (the scheduler is a pod of that namespace): checked with
    scrapers elsewhere."""
    world = cluster(settings_with(metricsFrom=[MONITORING]))
    needed = expand(scraped_from_monitoring(), world)
    assert all(world.allows(flow) for flow in needed)
    for index, policy in enumerate(world.policies):
        for kind in ("ingress", "egress"):
            for rule in range(len(policy["spec"][kind])):
                crippled = Cluster(
                    world.endpoints,
                    drop_rule(world.policies, index, kind, rule),
                    world.namespace_labels,
                )
                lost = [flow for flow in needed if not crippled.allows(flow)]
                name = policy["metadata"]["namespace"] + "/" + policy["metadata"]["name"]
                assert lost, f"{name} {kind}[{rule}] admits no needed flow"


def test_metrics_from_names_the_scrapers() -> None:
    world = cluster(settings_with(metricsFrom=[MONITORING]))
    denied_needed, extra = differences(
        world, expand([*scraped_from_monitoring(), *DELIBERATE], world)
    )
    assert not denied_needed and not extra, (denied_needed, extra)
    # The namespace's own pods no longer scrape.
    assert not world.allows(Flow("team/app", "team/scheduler", 9092))


def test_api_server_peers_close_the_internet() -> None:
    block = {"ipBlock": {"cidr": f"{API_SERVER_IP}/32"}}
    world = cluster(settings_with(apiServerPeers=[block]))
    for caller in API_SERVER_CALLERS:
        for port in (443, 6443):
            assert world.allows(Flow(f"team/{caller}", "api-server", port))
            assert not world.allows(Flow(f"team/{caller}", "internet", port))
    api_server = [
        Need(caller, "api-server", port, "the API server, at its addresses")
        for caller in API_SERVER_CALLERS
        for port in (443, 6443)
    ]
    deliberate = [need for need in DELIBERATE if need.port not in (443, 6443)]
    denied_needed, extra = differences(world, expand([*NEEDED, *api_server, *deliberate], world))
    assert not denied_needed and not extra, (denied_needed, extra)


def test_the_openai_and_http_ports_are_open_to_their_callers() -> None:
    """Clients of the OpenAI API and of the sandbox's HTTP dialects run wherever the user
    runs them (verl, a notebook): those ports alone take anyone (they require the token)."""
    fleet = RolloutFleetSpec.model_validate({"replicas": 2, "scheduler": {"openaiPort": 8001}})
    pool = SandboxPoolSpec.model_validate({"replicas": 2, "httpPort": 8080})
    world = cluster(fleet_spec=fleet, pool_spec=pool)
    scheduler = world.endpoints["team/scheduler"].ports
    dispatcher = world.endpoints["team/sandbox-dispatcher"].ports
    for caller in world.endpoints.values():
        if caller.governed and caller.namespace == TEAM:
            continue
        for target, port in (("team/scheduler", 8001), ("team/sandbox-dispatcher", 8080)):
            assert world.ingress_allows(Flow(caller.name, target, port)), (caller, target)
    assert world.allows(Flow("other/app", "team/scheduler", 8001))
    assert not world.allows(Flow("other/app", "team/scheduler", scheduler["grpc"]))
    assert not world.allows(Flow("other/app", "team/sandbox-dispatcher", dispatcher["grpc"]))
    # Kubestar's own pods do not call them: their egress stays as it was.
    assert not world.allows(Flow("team/engine-0", "team/scheduler", 8001))
    assert not world.allows(Flow("team/trainer-0", "team/scheduler", 8001))


def test_a_volume_fleet_takes_no_broadcast() -> None:
    """Engines that read the weights from a volume reach nothing and take no trainer. Rank
    0's side towards its fleet's engines does not depend on the fleet's weightSync (its
    policy is made before the fleet is read), so rank 0's pod, a pod of the engines'
    namespace, is still one of their default scrapers."""
    fleet = RolloutFleetSpec.model_validate({"replicas": 2, "weightSync": "volume"})
    world = cluster(fleet_spec=fleet)
    (engines,) = [
        p
        for p in world.policies
        if p["metadata"] == {**p["metadata"], "name": "fleet-engine", "namespace": TEAM}
    ]
    assert engines["spec"]["egress"] == []
    broadcast = {n for n in NEEDED if n.source.startswith("engine") and "trainer" in n.target}
    broadcast |= {n for n in NEEDED if n.why == BROADCAST}
    scraping = [Need("trainer-0", f"engine-{i}", "http", SCRAPE) for i in range(2)]
    kept = [n for n in [*NEEDED, *DELIBERATE] if n not in broadcast]
    denied_needed, extra = differences(world, expand([*kept, *scraping], world))
    assert not denied_needed and not extra, (denied_needed, extra)
    for engine in ("team/engine-0", "team/engine-1"):
        assert not world.allows(Flow(engine, "team/trainer-0", 29600))


def test_the_evaluator_reads_policies_as_kubernetes_does() -> None:
    """The semantics the tests rely on, on hand-written policies."""
    web = Endpoint("a/web", "10.0.0.1", "a", {"app": "web"}, {"http": 80}, governed=True)
    client = Endpoint("a/client", "10.0.0.2", "a", {"app": "client"})
    stranger = Endpoint("b/client", "10.0.0.3", "b", {"app": "client"})
    outside = Endpoint("outside", "192.0.2.1")

    def policy(spec: Obj) -> Obj:
        return {"metadata": {"namespace": "a"}, "spec": spec}

    def world(*policies: Obj) -> Cluster:
        endpoints = {e.name: e for e in (web, client, stranger, outside)}
        return Cluster(endpoints, list(policies), {"a": {NAMESPACE_NAME: "a"}, "b": {}})

    select_web = {"matchLabels": {"app": "web"}}
    open_world = world()
    assert open_world.allows(Flow("b/client", "a/web", 80))
    closed = world(policy({"podSelector": select_web, "policyTypes": ["Ingress"]}))
    assert not closed.allows(Flow("a/client", "a/web", 80))
    assert closed.allows(Flow("a/web", "outside", 443))  # egress not isolated
    by_name = world(
        policy(
            {
                "podSelector": select_web,
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                        "ports": [{"protocol": "TCP", "port": "http"}],
                    }
                ],
                "egress": [{"to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}]}],
            }
        )
    )
    assert by_name.allows(Flow("a/client", "a/web", 80))
    assert not by_name.allows(Flow("a/client", "a/web", 81))
    assert not by_name.allows(Flow("b/client", "a/web", 80))  # a podSelector: own namespace
    assert by_name.allows(Flow("a/web", "outside", 9999))
    assert not by_name.allows(Flow("a/web", "a/client", 80))
    both = world(
        policy(
            {
                "podSelector": select_web,
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"namespaceSelector": {}}]}],
            }
        )
    )
    assert both.allows(Flow("b/client", "a/web", 80)) and not both.allows(
        Flow("outside", "a/web", 80)
    )


# --- The chart passes the values on ----------------------------------------------------------


def rendered_settings(tmp_path: Path, values: Obj) -> OperatorSettings:
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values))
    args = [helm_binary(tmp_path), "template", "kubestar", str(CHART), "--namespace", "ks"]
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path), "HELM_CONFIG_HOME": str(tmp_path)}
    done = subprocess.run(
        [*args, "-f", str(file)], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    docs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return OperatorSettings.model_validate(yaml.safe_load(config["data"]["settings.yaml"]))


def test_the_chart_passes_the_peers_to_the_operator(tmp_path: Path) -> None:
    default = rendered_settings(tmp_path, {})
    assert default.network_policies.metrics_from == []
    assert default.network_policies.api_server_peers == []
    block = {"ipBlock": {"cidr": "10.0.0.1/32"}}
    values = {"networkPolicies": {"metricsFrom": [MONITORING], "apiServerPeers": [block]}}
    settings = rendered_settings(tmp_path, values)
    assert settings.network_policies.metrics_from == [MONITORING]
    assert settings.network_policies.api_server_peers == [block]
    assert settings.network_policies.operator_namespace == "ks"


def test_the_values_schema_takes_only_peers() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    jsonschema.validate(values, schema)

    def with_policies(**extra: Any) -> Obj:
        return {**values, "networkPolicies": {**values["networkPolicies"], **extra}}

    jsonschema.validate(with_policies(metricsFrom=[MONITORING, {"podSelector": {}}]), schema)
    wrongs: list[Obj] = [{"namespace": "monitoring"}, {}, {"ipBlock": {"except": []}}]
    for wrong in wrongs:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(with_policies(metricsFrom=[wrong]), schema)
    with pytest.raises(ValueError, match="not a NetworkPolicy peer"):
        settings_with(apiServerPeers=[{"ipBlock": {"cidr": "10.0.0.1/32"}, "podSelector": {}}])
