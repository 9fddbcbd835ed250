// The kvferry pool page: polls /ui/state and redraws engines, sparklines and routing decisions.
// Vanilla JS, no dependencies. Every value from the router is written with textContent (never as HTML):
// request ids come from clients.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function hostOf(url) {
  return url.replace(/^[a-z]+:\/\//, "");
}

function pct(ratio) {
  return ratio === null || ratio === undefined ? "–" : `${(ratio * 100).toFixed(1)}%`;
}

function ms(value) {
  if (value === null || value === undefined) return "–";
  return value >= 100 ? `${value.toFixed(0)} ms` : `${value.toFixed(1)} ms`;
}

function clock(unix) {
  return new Date(unix * 1000).toLocaleTimeString([], { hour12: false });
}

// A sparkline of one series: gaps (null) break the line, a point with no neighbour is a dot; the y axis
// runs from 0 to the series' max (in the tooltip).
function sparkline(values, label) {
  const width = 160, height = 36, pad = 3;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("class", "spark");
  svg.setAttribute("role", "img");
  const known = values.filter((v) => v !== null);
  const top = Math.max(...known, 0) || 1;
  const title = document.createElementNS(SVG, "title");
  title.textContent = `${label}: ${known.length} of ${values.length} polls had requests; max ${ms(known.length ? top : null)}`;
  svg.append(title);
  const step = values.length > 1 ? (width - 2 * pad) / (values.length - 1) : 0;
  const x = (i) => (pad + i * step).toFixed(1);
  const y = (v) => (height - pad - (v / top) * (height - 2 * pad)).toFixed(1);
  let d = "";
  values.forEach((v, i) => {
    if (v === null) return;
    const joined = i > 0 && values[i - 1] !== null;
    d += `${joined ? "L" : "M"}${x(i)},${y(v)} `;
    const alone = !joined && (i === values.length - 1 || values[i + 1] === null);
    if (alone || i === values.length - 1) {
      const dot = document.createElementNS(SVG, "circle");
      dot.setAttribute("cx", x(i));
      dot.setAttribute("cy", y(v));
      dot.setAttribute("r", 2);
      svg.append(dot);
    }
  });
  if (d) {
    const path = document.createElementNS(SVG, "path");
    path.setAttribute("d", d.trim());
    svg.prepend(path);
  }
  return svg;
}

function metric(name, value, extra) {
  return el("div", { class: "metric" }, el("span", { class: "label" }, name), el("span", { class: "value" }, value), extra);
}

function kvBar(usage) {
  const bar = el("div", { class: "bar" }, el("div", { class: "fill" }));
  const fill = bar.firstChild;
  fill.style.width = `${Math.min(Math.max(usage, 0), 1) * 100}%`;
  if (usage > 0.9) fill.classList.add("hot");
  return bar;
}

function engineCard(e) {
  const card = el("article", { class: `engine ${e.health}`, "data-engine": e.url, "data-health": e.health });
  card.append(
    el("div", { class: "engine-head" },
      el("span", { class: `health ${e.health}`, title: e.health }),
      el("span", { class: "name" }, hostOf(e.url)),
      el("span", { class: `role role-${e.role}` }, e.role),
      el("span", { class: "state" }, e.health)),
    el("div", { class: "metrics" },
      metric("KV usage", pct(e.kv_usage), kvBar(e.kv_usage)),
      metric("running", e.running),
      metric("waiting", e.waiting),
      metric("prefix hits", pct(e.prefix_hit_rate)),
      metric("predictions right", pct(e.prediction_accuracy))),
    el("div", { class: "sparks" },
      el("div", { class: "spark-box" }, el("span", { class: "label" }, "TTFT ", el("b", {}, ms(e.ttft_ms))),
        sparkline(e.series.ttft_ms, `TTFT of ${e.url}`)),
      el("div", { class: "spark-box" }, el("span", { class: "label" }, "ITL ", el("b", {}, ms(e.itl_ms))),
        sparkline(e.series.itl_ms, `ITL of ${e.url}`))),
    el("div", { class: "foot dim" },
      e.num_blocks ? `${e.num_blocks} KV blocks` : null,
      e.max_model_len ? ` · context ${e.max_model_len}` : null,
      e.lora_adapters.length ? ` · LoRA ${e.lora_adapters.join(", ")}` : null,
      Object.keys(e.tier_blocks).length ? el("span", { "data-tiers": "" }, ` · holds ${tiers(e.tier_blocks)}`) : null,
      e.load_only ? " · routed by load only: the index mispredicts its cache" : null));
  return card;
}

function tiers(blocks) {
  return Object.entries(blocks).map(([tier, n]) => `${tier} ${n}`).join(", ") + " blocks";
}

function scoreList(candidates) {
  const list = el("ul", { class: "scores" });
  for (const c of candidates) {
    const parts = Object.entries(c.parts).map(([name, v]) => `${name} ${v.toFixed(2)}`).join(" + ");
    const total = c.total === null ? "round-robin" : `= ${c.total.toFixed(2)}`;
    list.append(el("li", { class: c.chosen ? "chosen" : null, "data-candidate": c.url },
      el("span", { class: "name" }, hostOf(c.url)), " ", el("span", { class: "dim" }, parts), " ",
      el("b", {}, total),
      c.cached_tokens ? el("div", { class: "dim held" }, `holds ${c.cached_tokens} tokens: ${tiers(c.tiers)}`) : null));
  }
  return list;
}

function decisionRow(d) {
  const engine = el("td", {}, el("span", { class: "name" }, hostOf(d.decode)));
  if (d.prefill) engine.append(el("div", { class: "dim" }, `prefill ${hostOf(d.prefill)}`));
  const scores = el("td", {}, scoreList(d.candidates));
  if (d.prefill_candidates.length) scores.append(el("div", { class: "dim" }, "prefill:"), scoreList(d.prefill_candidates));
  const request = el("td", { class: "rid" }, el("code", {}, d.request_id));
  if (d.attempt > 0) request.append(el("span", { class: "retry" }, ` retry ${d.attempt}`));
  return el("tr", { "data-request-id": d.request_id, "data-seq": d.seq },
    el("td", { class: "dim" }, clock(d.at)),
    request,
    el("td", {}, `${d.prompt_tokens} tok`, el("div", { class: "dim" },
      `${d.kind}${d.stream ? " · stream" : ""}${d.lora ? ` · ${d.lora}` : ""}`)),
    el("td", {}, el("span", { class: `mode mode-${d.mode}` }, d.mode.replace("_", "-")),
      el("div", { class: "dim" }, `index ${d.index}`)),
    engine,
    scores,
    el("td", { class: "reason" }, d.pd_reason, el("div", { class: "dim" }, `${d.cached_tokens} cached / ${d.uncached_tokens} uncached`),
      d.session ? el("div", { class: "dim" }, `session ${d.session}: ${d.affinity}`) : null),
    el("td", { class: "num" }, d.route_ms.toFixed(2)));
}

function routerLine(r) {
  const weights = Object.entries(r.weights).map(([k, v]) => `${k} ${v}`).join(", ");
  const modes = Object.entries(r.decisions_by_mode).map(([k, v]) => `${v} ${k.replace("_", "-")}`).join(", ");
  const status = r.problems.length
    ? el("span", { class: "bad", title: r.problems.join("; ") }, `not ready: ${r.problems.join("; ")}`)
    : el("span", { class: "good" }, "self-check ok");
  return [
    el("span", {}, "model ", el("b", {}, r.model)),
    el("span", {}, `strategy ${r.strategy}${weights ? ` (${weights})` : ""}`),
    el("span", {}, `P/D threshold ${r.pd_threshold} tokens`),
    el("span", {}, `block ${r.block_size}`),
    el("span", {}, `index ${r.index}`),
    el("span", {}, modes ? `routed: ${modes}` : "nothing routed yet"),
    status,
  ];
}

function queueLine(q) {
  if (!q) return [el("span", { class: "dim" }, "no admission")];
  if (!q.flow_control) return [el("span", { class: "dim" }, `flow control off; ${q.inflight} in flight`)];
  const rows = q.rows.map((r) => el("span", {}, `${r.band} / ${r.tenant}: ${r.waiting}`));
  return [
    el("span", {}, `${q.inflight} in flight`),
    el("span", { class: q.held ? "bad" : "good" }, `${q.held} waiting`),
    el("span", { class: q.full ? "bad" : "good" }, q.full ? `full: ${q.full}` : "room"),
    ...rows,
  ];
}

function render(state) {
  document.getElementById("queue").replaceChildren(...queueLine(state.queue));
  document.getElementById("router").replaceChildren(...routerLine(state.router));
  const engines = state.engines.map(engineCard);
  document.getElementById("engines").replaceChildren(...engines);
  const healthy = state.engines.filter((e) => e.health === "healthy").length;
  document.getElementById("engine-count").textContent = `${healthy} of ${state.engines.length} healthy`;
  const rows = state.decisions.map(decisionRow);
  const body = document.getElementById("decisions");
  if (rows.length) body.replaceChildren(...rows);
  const total = Object.values(state.router.decisions_by_mode).reduce((a, b) => a + b, 0);
  document.getElementById("decision-count").textContent = total ? `last ${rows.length} of ${total}` : "";
}

function setLive(kind, text) {
  document.getElementById("live").dataset.state = kind;
  document.getElementById("live-text").textContent = text;
}

// /ui?decisions=N shows the last N decisions (the router's default otherwise). Built on the origin: a
// page opened with user:key@ before the host has credentials in its URL, and fetch refuses URLs with them
// (the browser still sends the Basic credentials it holds for the origin).
function stateUrl() {
  const url = new URL("/ui/state", location.origin);
  const shown = new URLSearchParams(location.search).get("decisions");
  if (shown !== null) url.searchParams.set("decisions", shown);
  return url;
}

async function failure(reply) {
  try {
    return new Error((await reply.json()).error.message);
  } catch {
    return new Error(`HTTP ${reply.status}`);
  }
}

async function poll() {
  try {
    const reply = await fetch(stateUrl(), { cache: "no-store" });
    if (!reply.ok) throw await failure(reply);
    const state = await reply.json();
    render(state);
    setLive("live", `live · ${clock(state.now)}`);
    document.body.dataset.updated = String(state.now);
  } catch (err) {
    setLive("down", `no state: ${err.message}; retrying`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
