"""The `/dashboard` page itself: one static HTML document with its CSS and script inline, served
as it is (no template: it holds no data, so it needs no key). Its script polls `/state` and
`/dashboard/live` with the API key in the Authorization header and draws everything with DOM
text nodes (never HTML built from the server's data). The server's Content-Security-Policy
(`dashboard.py`) allows exactly this script and style, and connections to the server only."""

from __future__ import annotations

STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"DejaVu Sans",sans-serif;margin:16px 20px;
color:#1d2330;background:#f7f8fa}
h1{font-size:20px;margin:0}h2{font-size:15px;margin:0 0 6px}
header{display:flex;align-items:baseline;gap:16px;flex-wrap:wrap;margin-bottom:10px}
#status{font-size:13px;color:#5b6472}#status.ok{color:#2e7d32}#status.bad{color:#b00020}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(135px,1fr));gap:8px}
.card,.panel{background:#fff;border:1px solid #d8dde3;border-radius:6px;padding:8px 10px}
.card .v{font-size:20px;font-weight:600;font-variant-numeric:tabular-nums}
.card .k{font-size:12px;color:#5b6472}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:10px;
margin-top:10px}
table{border-collapse:collapse;width:100%;font-size:13px;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:2px 8px 2px 0;border-bottom:1px solid #eef0f3}
th{color:#5b6472;font-weight:500}
.spark{display:grid;grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:8px;
margin-top:10px}
.spark svg{width:100%;height:46px;display:block}.spark .k{font-size:12px;color:#5b6472}
.spark .v{font-weight:600}
#blocks{display:flex;flex-wrap:wrap;gap:3px}
.blk{width:30px;height:22px;font:11px/22px "DejaVu Sans Mono",monospace;text-align:center;
border-radius:3px;color:#fff}
.o-free{background:#eceff3;color:#5b6472}.o-scratch{background:#8a939e}
.o-cache{background:#1b7f79}.o-pinned{background:#f2c14e;color:#1d2330}
.o-draining{background:#a78bcc}.o-spilling{background:#c2185b}.o-transfer{background:#6a4c93}
.l0{background:#e15759}.l1{background:#4e79a7}.l2{background:#f28e2b}.l3{background:#59a14f}
.l4{background:#b07aa1}.l5{background:#9c755f}.l6{background:#d4a017}.l7{background:#ff9da7}
.l8{background:#76b7b2}.l9{background:#8c6d31}
.legend{font-size:12px;color:#5b6472;margin-top:6px}
#events{max-height:260px;overflow-y:auto;font:12px "DejaVu Sans Mono",monospace}
#events div{padding:1px 0;border-bottom:1px solid #f1f3f5}
.muted{color:#8a939e}
#keyform{background:#fff;border:1px solid #d8dde3;border-radius:6px;padding:14px;max-width:520px}
#keyform input{font:inherit;width:100%;box-sizing:border-box;margin:6px 0;padding:5px}
[hidden]{display:none!important}
"""

SCRIPT = r"""
"use strict";
const $ = (id) => document.getElementById(id);
const STORE = "atom-core-api-key";
const params = new URLSearchParams(location.search);
const every = Math.min(10000, Math.max(200, Number(params.get("every")) || 1000));
const KEEP = 90;  // samples per sparkline
let key = sessionStorage.getItem(STORE) || "";
// A key in the fragment (/dashboard#key=...) is never sent to the server, so it never reaches
// a log; it is kept for this tab only and wiped from the address bar at once.
if (location.hash.startsWith("#key=")) {
  key = decodeURIComponent(location.hash.slice(5));
  sessionStorage.setItem(STORE, key);
  history.replaceState(null, "", location.pathname + location.search);
}
class AuthError extends Error {}
const series = {tps: [], itl: [], ttft: [], waiting: []};
let prev = null, timer = null;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function row(cells, attrs) {
  const tr = el("tr");
  for (const c of cells) tr.append(el("td", "", c));
  for (const [k, v] of Object.entries(attrs || {})) tr.setAttribute(k, v);
  return tr;
}
function fill(tbody, rows, empty, width) {
  tbody.replaceChildren(...rows);
  if (!rows.length) {
    const td = el("td", "muted", empty), tr = el("tr");
    td.colSpan = width;
    tr.append(td);
    tbody.append(tr);
  }
}
async function get(path) {
  const headers = key ? {"Authorization": "Bearer " + key} : {};
  const r = await fetch(path, {headers, cache: "no-store"});
  if (r.status === 401) throw new AuthError("the API key is missing or wrong");
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}
function fmt(x, digits) {
  return x === null || x === undefined || !isFinite(x) ? "-" : x.toFixed(digits);
}
function setStatus(text, cls) { const s = $("status"); s.textContent = text; s.className = cls; }
function push(name, value) {
  const s = series[name];
  s.push(value);
  if (s.length > KEEP) s.shift();
}
function spark(name, unit, digits) {
  const s = series[name], svg = $("sp-" + name), w = 230, h = 44;
  const vals = s.filter((v) => v !== null);
  const top = Math.max(1e-9, ...vals);
  // (the first samples already span the width: a fresh page shows a line, not a dot)
  const pts = s.map((v, i) => v === null ? null :
    [(i * w / Math.max(1, s.length - 1)).toFixed(1),
     (h - 2 - (h - 6) * v / top).toFixed(1)]).filter(Boolean);
  svg.querySelector("polyline").setAttribute("points", pts.map((p) => p.join(",")).join(" "));
  const last = vals.length ? vals[vals.length - 1] : null;  // (an interval without tokens: -)
  $("sv-" + name).textContent = fmt(last, digits) + " " + unit + "  (max " + fmt(vals.length ?
    top : null, digits) + ")";
}
function ownerClass(o) {
  return o.startsWith("lane:") ? "l" + (Number(o.slice(5)) % 10) : "o-" + o;
}
function render(st, live) {
  const now = live.now, stats = st.stats, cfg = live.config;
  $("model").textContent = live.model + ": " + cfg.lanes + " lanes, " + cfg.kv_blocks +
    " KV blocks of " + cfg.block_size + " tokens, max_seq_len " + cfg.max_seq_len +
    (cfg.prefix_cache ? ", prefix cache" : "") +
    (cfg.host_cache_blocks ? ", host tier of " + cfg.host_cache_blocks + " slots" : "");
  let tps = null, itl = null, ttft = null;
  if (prev) {
    const dt = now - prev.now;
    if (dt > 0) tps = (stats.generated_tokens - prev.generated) / dt;
    const di = live.latency.itl_count - prev.itl_count;
    itl = di > 0 ? 1000 * (live.latency.itl_sum - prev.itl_sum) / di : null;
    const df = live.latency.ttft_count - prev.ttft_count;
    ttft = df > 0 ? 1000 * (live.latency.ttft_sum - prev.ttft_sum) / df : null;
  }
  prev = {now, generated: stats.generated_tokens, itl_sum: live.latency.itl_sum,
          itl_count: live.latency.itl_count, ttft_sum: live.latency.ttft_sum,
          ttft_count: live.latency.ttft_count};
  push("tps", tps); push("itl", itl); push("ttft", ttft); push("waiting", st.waiting.length);
  spark("tps", "tok/s", 1); spark("itl", "ms", 1); spark("ttft", "ms", 1);
  spark("waiting", "", 0);
  const busy = st.lanes.filter((l) => l.request !== null).length;
  const cards = {"in-flight": st.in_flight, "busy": busy + " / " + st.lanes.length,
                 "waiting": st.waiting.length, "generated": stats.generated_tokens,
                 "hit-tokens": stats.prefix_hit_tokens + stats.host_hit_tokens,
                 "preemptions": stats.preemptions, "steps": live.engine_steps,
                 "engine": st.engine_running ? "running" : "STOPPED"};
  for (const [k, v] of Object.entries(cards)) $("c-" + k).textContent = v;
  fill($("lanes"), st.lanes.map((l) => row([
    l.lane, l.request === null ? "idle" : "r" + l.request,
    l.request === null ? "" : (live.phases[l.request] || ""), l.request === null ? "" : l.length,
    l.blocks.join(" ")], {"data-lane": l.lane, "data-request": l.request ?? ""})), "", 5);
  const counts = {};
  $("blocks").replaceChildren(...st.blocks.map((o, b) => {
    const d = el("div", "blk " + ownerClass(o), b);
    d.title = "block " + b + ": " + o;
    d.dataset.owner = o;
    counts[o.startsWith("lane:") ? "lanes" : o] = (counts[o.startsWith("lane:") ? "lanes" : o]
      || 0) + 1;
    return d;
  }));
  $("owners").textContent = Object.entries(counts).map(([k, v]) => k + " " + v).join(" | ");
  const queue = st.waiting.slice(0, 40).map((r) => "r" + r).join(" ");
  $("waiting").textContent = st.waiting.length ? queue + (st.waiting.length > 40 ? " ... +" +
    (st.waiting.length - 40) + " more" : "") : "nothing waits";
  fill($("cache"), st.cache.map((c) => row([c.block, c.tokens, live.hits[c.block] ?? 0,
    c.last_use], {"data-block": c.block})), "no entries", 4);
  fill($("host"), st.host_cache.map((h) => row([h.slot, h.state, h.tokens])),
       "no host tier", 3);
  $("events").replaceChildren(...live.events.slice().reverse().map((e) => {
    const d = el("div", "ev-" + e.kind);
    d.textContent = new Date(e.time * 1000).toLocaleTimeString() + "  " + e.text;
    return d;
  }));
  if (!live.events.length) $("events").append(el("div", "muted", "no events yet"));
}
async function poll() {
  timer = null;
  try {
    const [st, live] = await Promise.all([get("/state"), get("/dashboard/live")]);
    render(st, live);
    $("keyform").hidden = true;
    $("main").hidden = false;
    setStatus("live: updated " + new Date().toLocaleTimeString() + ", every " + every +
              " ms", "ok");
  } catch (e) {
    if (e instanceof AuthError) {
      $("keyform").hidden = false;
      setStatus(key ? "the key was refused: enter the server's API key" :
                "enter the server's API key", "bad");
      return;  // (no polling until a key is given)
    }
    setStatus("cannot reach the server (" + e.message + "); retrying", "bad");
  }
  timer = setTimeout(poll, every);
}
$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  key = $("key").value.trim();
  $("key").value = "";
  sessionStorage.setItem(STORE, key);
  if (timer === null) poll();
});
$("forget").addEventListener("click", () => {
  sessionStorage.removeItem(STORE);
  key = "";
  location.reload();
});
poll();
"""

BODY = """
<header><h1>atom-core</h1><span id="model" class="muted"></span><span id="status">starting
</span><button id="forget" type="button">forget the key</button></header>
<form id="keyform" hidden><b>This server needs its API key.</b>
<div class="muted">It stays in this tab (sessionStorage) and goes to the server only in the
Authorization header. Or open <code>/dashboard#key=...</code>: the part after # never reaches
the server or its logs.</div>
<input id="key" type="password" autocomplete="off" placeholder="API key">
<button type="submit">Show the server</button></form>
<div id="main" hidden>
<div class="cards">
<div class="card"><div class="v" id="c-in-flight"></div><div class="k">requests in flight
</div></div><div class="card"><div class="v" id="c-busy"></div><div class="k">busy lanes</div>
</div><div class="card"><div class="v" id="c-waiting"></div><div class="k">waiting</div></div>
<div class="card"><div class="v" id="c-generated"></div><div class="k">tokens generated</div>
</div><div class="card"><div class="v" id="c-hit-tokens"></div><div class="k">prompt tokens
reused (prefix cache + host)</div></div><div class="card"><div class="v" id="c-preemptions">
</div><div class="k">preemptions</div></div><div class="card"><div class="v" id="c-steps"></div>
<div class="k">engine steps</div></div><div class="card"><div class="v" id="c-engine"></div>
<div class="k">engine</div></div></div>
<div class="spark">
<div class="panel"><div class="k">throughput <span class="v" id="sv-tps"></span></div>
<svg id="sp-tps" viewBox="0 0 230 44" preserveAspectRatio="none"><polyline fill="none"
stroke="#4e79a7" stroke-width="1.5"/></svg></div>
<div class="panel"><div class="k">inter-token latency <span class="v" id="sv-itl"></span></div>
<svg id="sp-itl" viewBox="0 0 230 44" preserveAspectRatio="none"><polyline fill="none"
stroke="#e15759" stroke-width="1.5"/></svg></div>
<div class="panel"><div class="k">time to first token <span class="v" id="sv-ttft"></span>
</div><svg id="sp-ttft" viewBox="0 0 230 44" preserveAspectRatio="none"><polyline fill="none"
stroke="#f28e2b" stroke-width="1.5"/></svg></div>
<div class="panel"><div class="k">waiting requests <span class="v" id="sv-waiting"></span>
</div><svg id="sp-waiting" viewBox="0 0 230 44" preserveAspectRatio="none"><polyline
fill="none" stroke="#59a14f" stroke-width="1.5"/></svg></div></div>
<div class="grid">
<div class="panel"><h2>Lanes</h2><table><thead><tr><th>lane</th><th>request</th><th>phase</th>
<th>length</th><th>block table</th></tr></thead><tbody id="lanes"></tbody></table></div>
<div class="panel"><h2>KV blocks by owner</h2><div id="blocks"></div><div class="legend"
id="owners"></div><div class="legend">colour: the lane holding it (as in the lanes), teal:
prefix-cache entry, gold: pinned (a copy reads it), grey: free or scratch, purple: in a PD
transfer or draining, pink: spilling to the host tier</div></div>
<div class="panel"><h2>Waiting queue</h2><div id="waiting"></div></div>
<div class="panel"><h2>Prefix-cache entries</h2><table><thead><tr><th>block</th><th>tokens
</th><th>hits</th><th>last use</th></tr></thead><tbody id="cache"></tbody></table></div>
<div class="panel"><h2>Host tier</h2><table><thead><tr><th>slot</th><th>state</th><th>tokens
</th></tr></thead><tbody id="host"></tbody></table></div>
<div class="panel"><h2>Recent events</h2><div id="events"></div></div>
</div></div>
"""


def page_html() -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width\">"
            "<title>atom-core dashboard</title><link rel=\"icon\" href=\"data:,\">"
            f"<style>{STYLE}</style></head><body>{BODY}<script>{SCRIPT}</script></body></html>\n")
