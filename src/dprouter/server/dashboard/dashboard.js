// dprouter's live view: reads /dashboard/data once a second and draws it with plain
// SVG and DOM calls (no build step, no library, nothing from another host).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const CELL = 34, GAP = 4, LABEL = 150, ROW = CELL + GAP;
let shape = "";  // the targets drawn: the heat map is rebuilt only when they change

function el(name, attrs, text) {
  const node = name === "svg" || name === "rect" || name === "text" || name === "title" ||
    name === "line" || name === "g" ? document.createElementNS(SVG, name) : document.createElement(name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : (seconds * 1000).toFixed(0) + " ms";
}

// load 0: pale green; then green to yellow to red as the load nears the busiest (at least 4)
function colour(load, scale) {
  if (load <= 0) return "hsl(140, 25%, 88%)";
  const f = Math.min(load / scale, 1);
  return `hsl(${Math.round(120 * (1 - f))}, 75%, ${Math.round(50 - 10 * f)}%)`;
}

function describe(t, hold) {
  const errors = Object.entries(t.errors).map(([c, n]) => `${c} ${n}`).join(", ") || "none";
  return `${t.target} (${t.role})\nin flight ${t.in_flight}, engine running + waiting ` +
    `${t.engine_load}\n${t.requests_per_second} req/s, TTFB p50 ${ms(t.ttfb_p50_seconds)}, ` +
    `p99 ${ms(t.ttfb_p99_seconds)}\nerrors: ${errors}\nbreaker ${t.breaker}` +
    (t.ready ? "" : ", worker not ready") + (hold ? `, worker ${hold}` : "");
}

// a target's state: its worker's readiness and hold, its breaker
function stateOf(t, hold) {
  return (t.ready ? "ready" : "not ready") + (hold ? `, ${hold}` : "") +
    (t.breaker === "open" ? ", breaker open" : "");
}

function drawRouter(r, data) {
  const box = document.getElementById("router");
  const w = r.discovery.workers;
  const stats = [
    [r.requests_per_second.toFixed(1), "requests/s"],
    [r.in_flight, "in flight"],
    [r.held_requests.total, "held in the router"],
    [ms(r.event_loop_lag_seconds), "event-loop lag"],
    [`${w.ready}/${w.ready + w.discovering + w.error}`, `workers ready (${r.discovery.source}` +
      (r.discovery.stale ? ", STALE" : "") + ")"],
    [data.targets.length, "targets"],
    [r.sessions, "sessions held"],
    [`${Math.floor(r.uptime_seconds / 60)} min`, "uptime"],
    [r.policy, `policy, ${r.processes} process(es)`],
    [r.version, "version"],
  ];
  box.replaceChildren(...stats.map(([value, label]) => {
    const div = el("div", { class: "stat" });
    div.append(el("b", {}, String(value)), el("span", {}, label));
    return div;
  }));
}

function drawHeat(data) {
  const svg = document.getElementById("heat");
  const byWorker = new Map(data.workers.map((w) => [w.id, []]));
  for (const t of data.targets) (byWorker.get(t.worker) || []).push(t);
  const key = data.targets.map((t) => t.target).join(",") + "|" + data.workers.map((w) => w.id).join(",");
  const widest = Math.max(1, ...[...byWorker.values()].map((ts) => ts.length));
  if (key !== shape) {
    shape = key;
    svg.replaceChildren();
    svg.setAttribute("width", LABEL + widest * (CELL + GAP) + 10);
    svg.setAttribute("height", data.workers.length * ROW + 24);
    data.workers.forEach((w, row) => {
      const y = 8 + row * ROW;
      svg.append(el("text", { x: 8, y: y + 22 }, `${w.id} ${w.role === "regular" ? "" : w.role}`));
      (byWorker.get(w.id) || []).forEach((t, i) => {
        const x = LABEL + i * (CELL + GAP);
        const cell = el("rect", { class: "cell", x, y, width: CELL, height: CELL, rx: 3,
          "data-target": t.target });
        cell.append(el("title"));
        svg.append(cell, el("text", { class: "small", x: x + 4, y: y + CELL - 5 }, String(t.dp_rank ?? "")));
      });
      if (!(byWorker.get(w.id) || []).length) {
        svg.append(el("text", { class: "small", x: LABEL, y: y + 17 }, w.state + (w.error ? `: ${w.error}` : "")));
      }
    });
  }
  const scale = Math.max(4, ...data.targets.map((t) => t.load));
  const holds = new Map(data.workers.map((w) => [w.id, w.hold]));
  for (const t of data.targets) {
    const cell = svg.querySelector(`rect[data-target="${CSS.escape(t.target)}"]`);
    if (!cell) continue;
    const hold = holds.get(t.worker);
    cell.setAttribute("fill", colour(t.load, scale));
    cell.setAttribute("data-load", t.load);
    cell.setAttribute("class", "cell" + (t.breaker === "open" ? " open" : "") +
      (t.ready ? "" : " down") + (hold ? " held" : ""));
    cell.firstChild.textContent = describe(t, hold);
  }
}

function drawLanes(data) {
  const section = document.getElementById("pd");
  if (!data.lanes) { section.hidden = true; return; }
  section.hidden = false;
  const svg = document.getElementById("lanes");
  const left = 20, right = 420, step = 22;
  const rows = Math.max(data.lanes.prefill.length, data.lanes.decode.length, 1);
  svg.setAttribute("width", 600);
  svg.setAttribute("height", rows * step + 40);
  const y = (side, name) => 40 + data.lanes[side].indexOf(name) * step;
  const busiest = Math.max(1, ...data.pairs.map((p) => p.requests));
  const parts = [el("text", { x: left, y: 20 }, "prefill"), el("text", { x: right, y: 20 }, "decode")];
  for (const p of data.pairs) {
    const line = el("line", { x1: left + 120, y1: y("prefill", p.prefill) - 4, x2: right - 8,
      y2: y("decode", p.decode) - 4, "stroke-width": 1 + 6 * p.requests / busiest });
    line.append(el("title", {}, `${p.prefill} → ${p.decode}: ${p.requests} (${p.requests_per_second}/s)`));
    parts.push(line);
  }
  for (const side of ["prefill", "decode"]) {
    for (const name of data.lanes[side]) {
      parts.push(el("text", { x: side === "prefill" ? left : right, y: y(side, name) }, name));
    }
  }
  svg.replaceChildren(...parts);
}

function row(cells, attrs) {
  const tr = el("tr", attrs);
  for (const v of cells) tr.append(el("td", {}, String(v)));
  return tr;
}

// the requests held in the router now, by class: waiting for a running slot (the
// dispatcher) or for a worker that may serve them (held, or older than the weights asked)
function drawHeld(r) {
  const held = r.held_requests;
  const body = document.querySelector("#held tbody");
  body.replaceChildren(...Object.entries(held.classes).map(([name, n]) => {
    const slot = n.slot || 0, worker = n.worker || 0;
    return row([name, slot, worker, slot + worker], { "data-class": name,
      class: slot + worker ? "busy" : "" });
  }));
  document.querySelector("#held tfoot td:last-child").textContent = String(held.total);
}

// each worker's hold (paused, updating, asleep: the engine commands relayed) and version
function drawWorkers(data) {
  const flying = new Map();
  for (const t of data.targets) flying.set(t.worker, (flying.get(t.worker) || 0) + t.in_flight);
  const body = document.querySelector("#workers tbody");
  body.replaceChildren(...data.workers.map((w) => row([w.id, w.role,
    w.state + (w.error ? `: ${w.error}` : ""), w.hold || "serving", w.weight_version ?? "–",
    w.dp_size ?? "–", flying.get(w.id) || 0], { "data-worker": w.id, class: w.hold ? "held" : "" })));
}

function drawTable(data) {
  const body = document.querySelector("#table tbody");
  const holds = new Map(data.workers.map((w) => [w.id, w.hold]));
  body.replaceChildren(...data.targets.map((t) => {
    const tr = el("tr");
    const errors = Object.entries(t.errors).map(([c, n]) => `${c} ${n}`).join(", ");
    const state = stateOf(t, holds.get(t.worker));
    for (const v of [t.target, t.role, t.in_flight, t.engine_load, t.requests_per_second.toFixed(2),
      ms(t.ttfb_p50_seconds), ms(t.ttfb_p99_seconds), errors, state]) tr.append(el("td", {}, String(v)));
    return tr;
  }));
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("/dashboard/data", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    drawRouter(data.router, data);
    drawHeat(data);
    drawLanes(data);
    drawTable(data);
    drawHeld(data.router);
    drawWorkers(data);
    status.textContent = `live · ${new Date().toLocaleTimeString()}`;
    status.className = "status";
  } catch (err) {
    status.textContent = `router unreachable (${err.message}); retrying`;
    status.className = "status down";
  }
}

refresh();
setInterval(refresh, 1000);
