// kvroute /ui: the router's decisions as they happen (server-sent events from /ui/events),
// one decision's per-worker breakdown, and per-worker figures over the last minutes.
// Plain DOM and SVG; every text goes in through textContent (prompts and reasons are data).
"use strict";

const MAX_DECISIONS = 200;
const HISTORY_S = 300;
const COLORS = ["#4a6fa5", "#e63946", "#2a9d8f", "#e9c46a", "#9b5de5", "#f4a261", "#264653",
  "#8ab17d", "#b5838d", "#6d6875"];
const TIMES = [
  ["base", "base_ms", "the request's own time on the worker, alone"],
  ["queue", "queue_ms", "what the worker's load adds"],
  ["residual", "residual_ms", "the learned correction"],
  ["predicted", "predicted_ms", "base + queue + residual"],
  ["impact", "impact_ms",
    "the delay its prefill adds to the worker's other requests, and the refetch of what its copy evicts"],
  ["cost", "cost_ms", "predicted + impact: the lowest wins"],
];

const view = {
  summary: null,
  decisions: [], // newest first
  byId: new Map(),
  selected: null,
  pinned: false,
  history: [],
  token: sessionStorage.getItem("kvroute-token") || "",
  fresh: new Set(),
  dirty: false,
  abort: null,
};

function $(id) { return document.getElementById(id); }

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value; else node.setAttribute(key, value);
  }
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

function clock() { return view.summary && view.summary.time_scale !== 1 ? "emulated " : ""; }

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "-";
  const abs = Math.abs(ms);
  const text = abs >= 1000 ? (ms / 1000).toFixed(2) + " s" : ms.toFixed(1) + " ms";
  return text.startsWith("-0.0 ") ? text.slice(1) : text;
}

function fmtTime(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function colorOf(worker) {
  const names = (view.summary ? view.summary.workers : []).map((w) => w.worker);
  const index = names.indexOf(worker);
  return COLORS[(index < 0 ? names.length : index) % COLORS.length];
}

// -- events -----------------------------------------------------------------------------
function onHello(data) {
  view.summary = data;
  view.decisions = [];
  view.byId.clear();
  for (const record of data.decisions) addDecision(record, false);
  view.history = data.history.slice(-HISTORY_S);
  if (view.decisions.length && !view.pinned) view.selected = view.decisions[0].decision_id;
  render();
}

function addDecision(record, fresh) {
  if (view.byId.has(record.decision_id)) return;
  view.decisions.unshift(record);
  view.byId.set(record.decision_id, record);
  while (view.decisions.length > MAX_DECISIONS) {
    view.byId.delete(view.decisions.pop().decision_id);
  }
  if (fresh) view.fresh.add(record.decision_id);
  if (!view.pinned) view.selected = record.decision_id;
}

function onOutcome(record) {
  const known = view.byId.get(record.decision_id);
  if (known) known.outcome = record.outcome; else addDecision(record, true);
}

function onStats(data) {
  view.summary = Object.assign({}, view.summary, data);
  for (const row of data.history) {
    const last = view.history[view.history.length - 1];
    if (!last || row.t > last.t) view.history.push(row);
  }
  const cutoff = data.now - HISTORY_S;
  while (view.history.length && view.history[0].t < cutoff) view.history.shift();
}

function handle(event, data) {
  if (event === "hello") onHello(data);
  else if (event === "decision") addDecision(data, true);
  else if (event === "outcome") onOutcome(data);
  else if (event === "stats") onStats(data);
  schedule();
}

function schedule() {
  if (view.dirty) return;
  view.dirty = true;
  requestAnimationFrame(() => { view.dirty = false; render(); });
}

// -- the stream: fetch, so that the admin token can go in a header ----------------------
function setConnection(on, text) {
  const node = $("connection");
  node.className = "connection " + (on ? "on" : "off");
  node.textContent = text;
}

async function connect() {
  if (view.abort) view.abort.abort();
  const abort = new AbortController();
  view.abort = abort;
  const headers = view.token ? { Authorization: "Bearer " + view.token } : {};
  try {
    const response = await fetch("/ui/events", { headers, cache: "no-store", signal: abort.signal });
    if (!response.ok) throw new Error("HTTP " + response.status);
    setConnection(true, "live");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const chunk = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        let data = "";
        for (const line of chunk.split("\n")) {
          if (line.startsWith("event: ")) event = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        if (data) handle(event, JSON.parse(data));
      }
    }
    setConnection(false, "ended; reconnecting");
  } catch (error) {
    if (abort.signal.aborted) return;
    setConnection(false, "disconnected; retrying");
  }
  if (!abort.signal.aborted) setTimeout(connect, 2000);
}

// -- rendering --------------------------------------------------------------------------
function render() {
  renderSummary();
  renderDecisions();
  renderBreakdown();
  renderCharts();
}

function renderSummary() {
  const s = view.summary;
  if (!s) return;
  $("policy").textContent = s.policy;
  $("replica").textContent = s.replica_id;
  $("model").textContent = s.model ? s.model.kind + " v" + s.model.version : "none";
  const error = s.model && s.model.mae_ms !== null && s.model.mae_ms !== undefined;
  $("model-error").textContent = error ? fmtMs(s.model.mae_ms) + " (" + clock() + "MAE)" : "-";
  $("access").textContent = s.admin
    ? "admin: every figure shown" + (s.prompts ? ", prompts too (prompt logging is on)" : "")
    : s.admin_configured ? "without the admin token: labels only, no per-worker figures"
      : "no admin token configured: labels only, no per-worker figures";
  $("latency-head").textContent = "latency" + (clock() ? " (emulated)" : "");
}

function renderDecisions() {
  const body = $("decision-rows");
  body.replaceChildren();
  for (const d of view.decisions.slice(0, 100)) {
    const row = el("tr", { "data-id": d.decision_id });
    if (d.decision_id === view.selected) row.classList.add("selected");
    if (view.fresh.has(d.decision_id)) row.classList.add("fresh");
    const outcome = d.outcome;
    row.append(
      el("td", {}, fmtTime(d.t)),
      el("td", { title: d.decision_id }, d.decision_id.slice(0, 10)),
      el("td", { title: d.chosen }, d.chosen.replace(/^https?:\/\//, "")),
      el("td", { class: "num" }, d.units),
      el("td", {}, outcome ? outcome.status : "in flight"),
      el("td", { class: "num" }, outcome ? fmtMs(outcome.latency_ms) : "-"),
    );
    row.addEventListener("click", () => {
      view.pinned = view.selected !== d.decision_id || !view.pinned;
      view.selected = d.decision_id;
      render();
    });
    body.append(row);
  }
  view.fresh.clear();
  $("decision-count").textContent = view.decisions.length
    ? view.decisions.length + " kept" + (view.pinned ? "; pinned (click again to follow)" : "")
    : "none yet: send a request to the router";
}

function barRow(label, value, scale, kind, title) {
  const row = el("div", { class: "bar-row", title: title || "" });
  const track = el("div", { class: "track" });
  const width = value === null || value === undefined || !scale ? 0
    : Math.min(100, (Math.abs(value) / scale) * 100);
  const bar = el("div", { class: "bar " + kind + (value < 0 ? " negative" : "") });
  bar.style.width = width + "%";
  track.append(bar);
  row.append(el("span", { class: "label" }, label), track, el("span", { class: "value" }, fmtMs(value)));
  return row;
}

function cacheRow(c, scale) {
  const row = el("div", { class: "bar-row", title: "prompt units the worker holds / must prefill" });
  const track = el("div", { class: "track" });
  for (const [kind, value] of [["cached", c.cached], ["uncached", c.uncached]]) {
    const bar = el("div", { class: "bar " + kind });
    bar.style.width = (value && scale ? (value / scale) * 100 : 0) + "%";
    track.append(bar);
  }
  const text = c.cached === null ? "-" : c.cached + " / " + c.uncached;
  row.append(el("span", { class: "label" }, "cached"), track, el("span", { class: "value" }, text));
  return row;
}

function renderLegend() {
  const legend = $("legend");
  if (legend.childElementCount) return;
  const items = [["cached", "cached units"], ["uncached", "uncached units"]].concat(
    TIMES.map(([label]) => [label, label]));
  for (const [kind, label] of items) {
    const item = el("span", {});
    const swatch = el("i", { class: "bar " + kind });
    item.append(swatch, document.createTextNode(label));
    legend.append(item);
  }
}

function renderBreakdown() {
  renderLegend();
  const groups = $("groups");
  groups.replaceChildren();
  if (!view.byId.has(view.selected) && view.decisions.length) {
    view.pinned = false; // the pinned decision aged out: follow the newest again
    view.selected = view.decisions[0].decision_id;
  }
  const d = view.byId.get(view.selected);
  if (!d) return;
  $("breakdown-title").textContent = d.decision_id.slice(0, 10) + ": " + d.policy
    + (d.branch ? " (" + d.branch + ")" : "") + ", " + d.units + " units -> " + d.chosen;
  const shown = d.candidates.some((c) => c.cost_ms !== null || c.predicted_ms !== null);
  $("breakdown-note").textContent = shown
    ? "times in " + clock() + "ms or s; bars scaled to the largest cost"
    : "per-worker figures are shown with the admin token (or the policy has none)";
  const scale = Math.max(1, ...d.candidates.map((c) => Math.max(
    Math.abs(c.cost_ms || 0), Math.abs(c.predicted_ms || 0), Math.abs(c.base_ms || 0),
    Math.abs(c.queue_ms || 0), Math.abs(c.impact_ms || 0))));
  const units = Math.max(1, ...d.candidates.map((c) => (c.cached || 0) + (c.uncached || 0)));
  for (const c of d.candidates) {
    const group = el("div", { class: "worker-group", "data-worker": c.worker });
    const head = el("div", { class: "name" }, c.worker);
    if (c.worker === d.chosen) {
      group.classList.add("chosen");
      head.append(el("span", { class: "mark" }, "chosen"));
    }
    if (!c.eligible) head.append(el("span", { class: "mark" }, "not eligible: " + c.reason));
    if (c.in_flight !== null && c.in_flight !== undefined) {
      head.append(el("span", { class: "note" }, "  " + c.in_flight + " in flight"));
    }
    group.append(head, cacheRow(c, units));
    for (const [label, key, title] of TIMES) group.append(barRow(label, c[key], scale, label, title));
    groups.append(group);
  }
  $("prompt").textContent = d.prompt ? "prompt: " + d.prompt : "";
}

function series(key) {
  const out = new Map();
  for (const row of view.history) {
    for (const [worker, figures] of Object.entries(row.workers)) {
      if (!out.has(worker)) out.set(worker, []);
      const value = figures[key];
      if (value !== null && value !== undefined) out.get(worker).push([row.t, value]);
    }
  }
  return out;
}

function drawChart(svg, key, fixedMax) {
  svg.replaceChildren();
  const lines = series(key);
  const now = view.summary ? view.summary.now : Date.now() / 1000;
  // The x axis spans the history there is, up to HISTORY_S seconds, ending now.
  const first = view.history.length ? view.history[0].t : now - 60;
  const span = Math.max(60, Math.min(HISTORY_S, now - first));
  let max = fixedMax || 0;
  for (const points of lines.values()) for (const [, v] of points) max = Math.max(max, v);
  if (!max) max = 1;
  for (let i = 1; i < 4; i++) {
    svg.append(svgEl("line", { x1: 0, x2: 400, y1: i * 30, y2: i * 30, stroke: "#eee" }));
  }
  for (const [worker, points] of lines) {
    if (!points.length) continue;
    const coords = points.map(([t, v]) => {
      const x = 400 - ((now - t) / span) * 400;
      const y = 118 - (v / max) * 112;
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    if (coords.length === 1) coords.push(coords[0]);
    svg.append(svgEl("polyline", { points: coords.join(" "), stroke: colorOf(worker),
      "data-worker": worker }));
  }
  const range = svg.parentElement.querySelector(".range");
  range.textContent = "last " + Math.round(span) + " s; top " + (fixedMax ? max : max.toFixed(1));
}

function renderCharts() {
  const legend = $("worker-legend");
  legend.replaceChildren();
  for (const w of view.summary ? view.summary.workers : []) {
    const item = el("span", {});
    const swatch = el("i", {});
    swatch.style.background = colorOf(w.worker);
    item.append(swatch, document.createTextNode(w.worker + (w.healthy ? "" : " (unhealthy)")));
    legend.append(item);
  }
  drawChart($("chart-load"), "queue_ms");
  drawChart($("chart-hit"), "hit_rate", 1);
  drawChart($("chart-flight"), "in_flight");
}

// -- start ------------------------------------------------------------------------------
$("token").value = view.token;
$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  view.token = $("token").value.trim();
  sessionStorage.setItem("kvroute-token", view.token);
  connect();
});
connect();
