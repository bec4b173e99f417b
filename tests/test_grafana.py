"""deploy/grafana/dprouter.json names only series and labels the router exports.

The truth is a running router's own /metrics: a regular router with a failing
engine (so the error series have samples) and a P/D router (the pair series),
scraped after some traffic. ``instance`` and ``job`` are the labels Prometheus
adds to every scraped series.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dprouter.config import RouterConfig
from dprouter.sim.model.config import EngineConfig, Faults
from tests.conftest import StartCluster, StartRouter, workers
from tests.test_router_pd import deploy, served

BOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "dprouter.json"
SCRAPE_LABELS = {"instance", "job"}
METRIC = re.compile(r"\b(dprouter_[a-z0-9_]+)\b")
MATCHERS = re.compile(r"\{([^{}]*)\}")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(expression, legend) of every panel target, and the variables' label_values."""
    found = [
        (t["expr"], t.get("legendFormat", ""))
        for panel in board["panels"]
        for t in panel.get("targets", [])
    ]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            name, label = re.findall(r"label_values\((\w+),\s*(\w+)\)", variable["definition"])[0]
            found.append((f"{name}{{{label}=~'.*'}}", ""))
    return found


def labels_named(expr: str, legend: str) -> set[str]:
    names = set(LEGEND.findall(legend))
    for group in GROUPING.findall(expr):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    for matchers in MATCHERS.findall(expr):
        names |= {m.group(1) for m in re.finditer(r"(\w+)\s*(?:=~|!~|!=|=)", matchers)}
    return names


async def exported(http: aiohttp.ClientSession, *urls: str) -> dict[str, set[str]]:
    """Sample name -> its labels, over every router's /metrics."""
    found: dict[str, set[str]] = defaultdict(set)
    for url in urls:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found[sample.name] |= set(sample.labels)
    return found


async def test_every_query_names_only_exported_series_and_labels(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    failing = EngineConfig(dp_size=2, faults=Faults(fail_first=2))
    cluster = await start_cluster([EngineConfig(dp_size=2), failing])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    for _ in range(8):
        async with http.post(router.url + "/v1/completions", json={"prompt": "hi"}) as r:
            await r.read()
    async with http.post(router.url + "/v1/completions", data=b"not json") as r:
        assert r.status == 400  # a refusal: dprouter_rejected_total has a sample
    pd = await deploy(start_cluster, start_router, "sglang", (1, 2), (1, 2))
    await served(http, pd.router.url, 4)
    series = await exported(http, router.url, pd.router.url)
    assert "dprouter_upstream_errors_total" in series and "dprouter_pd_pairs_total" in series

    board = json.loads(BOARD.read_text())
    checked = queries(board)
    assert len(checked) >= 15
    queried = {n for expr, _ in checked for n in METRIC.findall(expr)}
    rl = {"dprouter_held_requests", "dprouter_worker_held", "dprouter_worker_weight_version_info"}
    assert rl <= queried  # an RL step's panels: held requests, workers' holds and versions
    for expr, legend in checked:
        names = set(METRIC.findall(expr))
        assert names, f"no dprouter series in {expr!r}"
        unknown = names - set(series)
        assert not unknown, f"{expr!r} names series the router does not export: {unknown}"
        labels = set().union(*(series[n] for n in names)) | SCRAPE_LABELS
        stray = labels_named(expr, legend) - labels
        assert not stray, f"{expr!r} names labels none of its series has: {stray}"


def test_the_board_is_a_grafana_dashboard_with_a_prometheus_source() -> None:
    board = json.loads(BOARD.read_text())
    assert board["uid"] == "dprouter" and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    sources = {t["datasource"]["uid"] for p in board["panels"] for t in p.get("targets", [])}
    assert sources == {"${datasource}"}
    kinds = {p["type"] for p in board["panels"]}
    assert {"status-history", "timeseries", "row"} <= kinds  # the heat map among them
    quantiles = [e for e, _ in queries(board) if "histogram_quantile" in e]
    assert quantiles and all("_bucket" in e and "le" in labels_named(e, "") for e in quantiles)
