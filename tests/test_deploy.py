"""The Kubernetes files in deploy/kubernetes: they parse, the router's command line is one
``dprouter serve`` accepts, the engine example is what that command line finds, and the
router may read pods -- get, list, watch, in its namespace -- and nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from dprouter.cli.serve import make_config, serve
from dprouter.config import RouterConfig
from dprouter.fleet.membership.labels import matches, parse_selector
from dprouter.fleet.membership.pods import PORTS_ANNOTATION

DEPLOY = Path(__file__).parent.parent / "deploy" / "kubernetes"


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    found = [
        doc
        for path in sorted(DEPLOY.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]
    assert {o["kind"] for o in found} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
    }
    return found


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def router_pod(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The router's pod template and its container."""
    for deployment in of_kind(objects, "Deployment"):
        template = deployment["spec"]["template"]
        for container in template["spec"]["containers"]:
            if container.get("command") == ["dprouter"]:
                return template, container
    raise AssertionError("no Deployment runs dprouter")


def router_config(container: dict[str, Any]) -> RouterConfig:
    """The container's command line, through ``dprouter serve``'s own parser and checks."""
    args = container["args"]
    assert args[0] == "serve"
    known = {opt for p in serve.params for opt in p.opts}
    for arg in args[1:]:
        assert arg.split("=", 1)[0] in known, f"dprouter serve has no {arg}"
    ctx = serve.make_context("serve", list(args[1:]))
    options = {k: v for k, v in ctx.params.items() if k not in ("workers", "config_file")}
    options.pop("log_level")
    return make_config(ctx, None, ctx.params["workers"], options)


def test_the_routers_command_line_is_one_serve_accepts(objects: list[dict[str, Any]]) -> None:
    _, container = router_pod(objects)
    config = router_config(container)
    assert config.discovery == "k8s" and config.selector is not None
    with pytest.raises(click.UsageError):  # the check above can fail
        serve.make_context("serve", ["--no-such-flag"])


def test_the_example_engine_is_what_the_router_selects(objects: list[dict[str, Any]]) -> None:
    _, container = router_pod(objects)
    config = router_config(container)
    assert config.selector is not None
    selector = parse_selector(config.selector)
    engines = [
        d["spec"]["template"]
        for d in of_kind(objects, "Deployment")
        if matches(selector, d["spec"]["template"]["metadata"].get("labels", {}))
    ]
    assert len(engines) == 1
    (template,) = engines
    (engine,) = template["spec"]["containers"]
    listed = template["metadata"]["annotations"][PORTS_ANNOTATION]
    assert [int(p) for p in listed.split(",")] == [p["containerPort"] for p in engine["ports"]]
    assert "readinessProbe" in engine  # membership follows the Ready condition


def test_the_router_may_get_list_and_watch_pods_in_its_namespace_and_nothing_else(
    objects: list[dict[str, Any]],
) -> None:
    template, _ = router_pod(objects)
    account = template["spec"]["serviceAccountName"]
    (role,) = of_kind(objects, "Role")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    (binding,) = of_kind(objects, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    assert (subject["kind"], subject["name"]) == ("ServiceAccount", account)
    namespaces = {o["metadata"].get("namespace") for o in objects}
    assert namespaces == {role["metadata"]["namespace"]}  # one namespace, the Role's


def test_the_service_sends_to_the_routers_port(objects: list[dict[str, Any]]) -> None:
    template, container = router_pod(objects)
    (service,) = of_kind(objects, "Service")
    assert matches(
        tuple((k, v, True) for k, v in service["spec"]["selector"].items()),
        template["metadata"]["labels"],
    )
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    assert f"--port={container['ports'][0]['containerPort']}" in container["args"]
