"""The rendered NetworkPolicies, evaluated as Kubernetes does (a pod no policy selects accepts
everything; one that some policy selects accepts what any of them admits) for every pair of
roles, a stranger pod of the namespace, Prometheus from its namespace, a pod calling itself
Prometheus from another and an operator's API client, against the table of who may talk to whom
(tests/manifests.py). tests/k8s/test_policies.py checks the same table on a real cluster."""

from __future__ import annotations

import pytest
from manifests import GRPC, HTTP, MAY, SOURCES, admitted, destinations, render, role


@pytest.mark.parametrize("path", ["deploy/k8s/base", "deploy/k8s/overlays/production", "deploy/k8s/overlays/local"])
def test_who_may_talk_to_whom(path) -> None:
    policies = [o for o in render(path) if o["kind"] == "NetworkPolicy"]
    wrong = []
    for source in SOURCES:
        for name, (destination, ports) in destinations(with_store=path.endswith("local")).items():
            allowed = MAY.get((source.name, name), set())
            for port in ports:
                if admitted(policies, source, destination, port) != (port in allowed):
                    wrong.append(f"{source.name} -> {name}:{port} {'admitted' if port not in allowed else 'refused'}")
    assert not wrong, "\n".join(wrong)


def test_the_evaluation_can_fail() -> None:
    """A policy that admits any source (the old one) is caught."""
    open_to_all = {"kind": "NetworkPolicy", "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": GRPC}]}]}}
    stranger = next(s for s in SOURCES if s.name == "stranger")
    assert admitted([open_to_all], stranger, role("embedding-ps"), GRPC)
    assert not admitted([open_to_all], stranger, role("embedding-ps"), HTTP)
