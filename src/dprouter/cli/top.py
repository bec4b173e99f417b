"""``dprouter top URL``: the dashboard's view in a terminal, from ``/dashboard/data``.

It reads the JSON the page reads (docs/router.md, "Dashboard"), so the two never
disagree; ``--once`` prints one snapshot for scripts and CI logs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiohttp
import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "load": lambda t: (-t["load"], -t["in_flight"], t["target"]),
    "target": lambda t: (t["worker"], t["dp_rank"] if t["dp_rank"] is not None else -1),
    "rate": lambda t: (-t["requests_per_second"], t["target"]),
    "ttfb": lambda t: (-(t["ttfb_p99_seconds"] or 0.0), t["target"]),
    "errors": lambda t: (-sum(t["errors"].values()), t["target"]),
}


class TopError(click.ClickException):
    pass


async def fetch(session: aiohttp.ClientSession, url: str, token: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with session.get(url.rstrip("/") + "/dashboard/data", headers=headers) as r:
            if r.status == 404:
                raise TopError(f"{url} has no dashboard: start it with dprouter serve --dashboard")
            if r.status == 401:
                raise TopError(f"{url} wants the admin token: give --token")
            if r.status != 200:
                raise TopError(f"{url}/dashboard/data answered {r.status}")
            found: dict[str, Any] = await r.json()
            return found
    except aiohttp.ClientError as exc:
        raise TopError(f"cannot reach {url}: {exc}") from None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _heat(load: int, busiest: int) -> str:
    """The page's colours, roughly: idle dim, then green, yellow, red toward the busiest."""
    if load <= 0:
        return "dim"
    share = load / max(busiest, 4)
    return "green" if share < 0.34 else "yellow" if share < 0.67 else "bold red"


def _state_style(target: dict[str, Any], hold: str | None) -> str:
    if not target["ready"] or target["breaker"] != "closed":
        return "bold red"
    return "bold yellow" if hold else ""


def _held(router: dict[str, Any]) -> str:
    """The requests held in the router: how many, and of which classes (those holding);
    a router older than the count says nothing."""
    held = router.get("held_requests")
    if held is None:
        return "held: -"
    classes = {name: sum(n.values()) for name, n in held["classes"].items()}
    which = ", ".join(f"{name} {n}" for name, n in classes.items() if n)
    return f"{held['total']} held" + (f" ({which})" if which else "")


def worker_table(data: dict[str, Any]) -> Table:
    """Each worker's state, hold (paused, updating, asleep) and weights' version."""
    flying: dict[str, int] = {}
    for t in data["targets"]:
        flying[t["worker"]] = flying.get(t["worker"], 0) + t["in_flight"]
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("worker", "role", "state", "hold", "weights", "ranks", "in flight"):
        table.add_column(name, justify="right" if name == "in flight" else "left")
    for w in data["workers"]:
        hold = w.get("hold")
        table.add_row(
            w["id"],
            w["role"],
            w["state"] + (f": {w['error']}" if w["error"] else ""),
            Text(hold or "serving", style="bold yellow" if hold else ""),
            w["weight_version"] or "-",
            str(w["dp_size"] or "-"),
            str(flying.get(w["id"], 0)),
        )
    return table


def render(data: dict[str, Any], sort: str = "load") -> Group:
    r = data["router"]
    w = r["discovery"]["workers"]
    stale = ", STALE" if r["discovery"]["stale"] else ""
    head = Text(
        f"dprouter {r['version']} · {r['requests_per_second']:.1f} req/s · "
        f"{r['in_flight']} in flight · {_held(r)} · "
        f"loop lag {_ms(r['event_loop_lag_seconds'])} · "
        f"workers {w['ready']}/{sum(w.values())} ready ({r['discovery']['source']}{stale}) · "
        f"{r['sessions']} sessions · {r['policy']}, {r['processes']} process(es) · "
        f"up {r['uptime_seconds'] / 60:.0f} min · rates over {data['window_seconds']:.0f} s",
        style="bold",
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (
        ("target", "left"),
        ("role", "left"),
        ("load", "right"),
        ("in flight", "right"),
        ("engine", "right"),
        ("req/s", "right"),
        ("TTFB p50", "right"),
        ("TTFB p99", "right"),
        ("errors", "left"),
        ("state", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    targets = sorted(data["targets"], key=SORTS[sort])
    busiest = max((t["load"] for t in targets), default=0)
    holds = {w["id"]: w.get("hold") for w in data["workers"]}
    for t in targets:
        hold = holds.get(t["worker"])
        state = (
            ("ready" if t["ready"] else "not ready")
            + (f", {hold}" if hold else "")
            + (", breaker open" if t["breaker"] == "open" else "")
        )
        table.add_row(
            t["target"],
            t["role"],
            Text(str(t["load"]), style=_heat(t["load"], busiest)),
            str(t["in_flight"]),
            str(t["engine_load"]),
            f"{t['requests_per_second']:.2f}",
            _ms(t["ttfb_p50_seconds"]),
            _ms(t["ttfb_p99_seconds"]),
            ", ".join(f"{c} {n}" for c, n in t["errors"].items()),
            Text(state, style=_state_style(t, hold)),
        )
    parts: list[Any] = [head, table, Text(""), worker_table(data)]
    for p in data.get("pairs") or []:
        parts.append(Text(f"pair {p['prefill']} → {p['decode']}: {p['requests']}"))
    return Group(*parts)


async def top(
    url: str,
    *,
    token: str | None = None,
    sort: str = "load",
    once: bool = False,
    interval: float = 1.0,
    console: Console | None = None,
    frames: int | None = None,  # live frames before returning (tests); None: until Ctrl-C
) -> None:
    console = console or Console()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        data = await fetch(session, url, token)
        if once:
            console.print(render(data, sort))
            return
        with Live(render(data, sort), console=console, auto_refresh=False) as live:
            shown = 1
            while frames is None or shown < frames:
                await asyncio.sleep(interval)
                live.update(render(await fetch(session, url, token), sort), refresh=True)
                shown += 1


@click.command("top")
@click.argument("url")
@click.option("--sort", type=click.Choice(list(SORTS)), default="load", show_default=True)
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option(
    "--token",
    envvar="DPROUTER_ADMIN_TOKEN",
    default=None,
    help="The router's admin token; also read from DPROUTER_ADMIN_TOKEN.",
)
@click.option("--interval", type=click.FloatRange(min=0.2), default=1.0, show_default=True)
def top_command(url: str, sort: str, once: bool, token: str | None, interval: float) -> None:
    """Every target of a router started with --dashboard, live (sorted by load)."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(top(url, token=token, sort=sort, once=once, interval=interval))
