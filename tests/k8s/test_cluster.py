"""The cluster does what a cluster does: it schedules and runs pods, its Services are reached by
their DNS names through kube-proxy, and its NetworkPolicies are enforced (kube-router), each
checked from inside a pod with the probe (scripts/k8s/probe)."""

from __future__ import annotations

import pytest
from probes import connects, probe_pod, start
from waiting import wait_until

pytestmark = pytest.mark.k8s


def _service(name: str, selector: dict[str, str], port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": selector, "ports": [{"port": port, "targetPort": port}]},
    }


def test_a_pod_reaches_another_through_its_service_by_name(namespace) -> None:
    server = probe_pod("server", {"app": "server"}, ["serve", "8080"])
    client = probe_pod("client", {"app": "client"}, ["serve", "9999"])
    namespace.apply(_service("server", {"app": "server"}, 8080))
    start(namespace, server, client)
    resolved = namespace.kubectl("exec", "client", "--", "/probe", "resolve", "server", timeout=30).split()
    cluster_ip = namespace.kubectl("get", "service", "server", "-o", "jsonpath={.spec.clusterIP}")
    assert resolved == [cluster_ip], "the Service's name did not resolve to its cluster IP"
    # A ready pod joins its Service's endpoints, and kube-proxy's rules, a moment later.
    wait_until(lambda: connects(namespace, "client", "server:8080"), "the Service to reach its pod", 60)
    fqdn = f"server.{namespace.name}.svc.cluster.local:8080"
    assert connects(namespace, "client", fqdn)
    assert not connects(namespace, "client", "server:8081"), "a port the Service does not have answered"


def test_a_network_policy_admits_the_pods_it_names_and_refuses_the_others(namespace) -> None:
    server = probe_pod("server", {"app": "server"}, ["serve", "8080"])
    friend = probe_pod("friend", {"app": "friend"}, ["serve", "9999"])
    stranger = probe_pod("stranger", {"app": "stranger"}, ["serve", "9999"])
    namespace.apply(_service("server", {"app": "server"}, 8080))
    start(namespace, server, friend, stranger)
    wait_until(lambda: connects(namespace, "friend", "server:8080"), "the Service to reach its pod", 60)
    assert connects(namespace, "stranger", "server:8080"), "a pod no policy selects refused a connection"
    namespace.apply(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "server-from-friend"},
            "spec": {
                "podSelector": {"matchLabels": {"app": "server"}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "friend"}}}]}],
            },
        }
    )
    # kube-router applies a policy within its sync: the refusal is awaited, then must hold.
    wait_until(lambda: not connects(namespace, "stranger", "server:8080"), "the policy to refuse the stranger", 90)
    server_ip = namespace.kubectl("get", "pod", "server", "-o", "jsonpath={.status.podIP}")
    assert not connects(namespace, "stranger", f"{server_ip}:8080"), "the pod's own address bypassed the policy"
    assert connects(namespace, "friend", "server:8080"), "the policy refused the pod it admits"
    assert connects(namespace, "friend", f"{server_ip}:8080")
