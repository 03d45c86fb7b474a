// Chainswarm's two pages: the swarm dashboard (/) and the chat page (/chat). No framework, no build step.
// Everything a peer or a client chooses (node, client and model names, messages) is put into the page as text
// (textContent, createElement, setAttribute) — never parsed as markup.
"use strict";

const $ = (id) => document.getElementById(id);

// el("td", {class: "num", title: "..."}, child, "text", 42): children that are not nodes become text nodes.
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const fixed = (x, digits) => (typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "–");
const ms = (seconds, digits = 1) => (typeof seconds === "number" ? `${fixed(seconds * 1e3, digits)} ms` : "–");
const clock = (unixSeconds) => new Date(unixSeconds * 1000).toLocaleTimeString([], {hour12: false});
const span = (a, b) => `[${a}, ${b})`;

function storedInput(input, key, onChange) {
  input.value = localStorage.getItem(key) || "";
  input.addEventListener("change", () => {
    const value = input.value.trim();
    if (value) localStorage.setItem(key, value); else localStorage.removeItem(key);
    if (onChange) onChange();
  });
  return () => input.value.trim();
}

function authHeaders(key) {
  return key ? {Authorization: `Bearer ${key}`} : {};
}

// ---------------------------------------------------------------------------------------------- dashboard
const PALETTE = ["#2f6fd6", "#e07b26", "#2e9d5b", "#9c4dc4", "#d9534f", "#1aa3a3", "#b58b00", "#6b7a8f", "#c2185b"];
const EVENT_LABELS = {server_joined: "join", server_left: "leave", plan: "re-plan", plan_dropped: "plan dropped",
  server_failed: "failover", refused: "refusal", server_refused: "server refused", lease: "lease",
  lease_expired: "lease expired"};
const CHART_WINDOW_S = 300;
const POLL_TIMEOUT_MS = 5000; // an orchestrator that accepts but never answers counts as unreachable

function swarmHealth(doc) {
  const plan = doc.plan;
  const ready = doc.chains.filter((c) => c.ready);
  if (!plan) return ["broken", doc.plan_error || "no plan"];
  if (!ready.length) return ["broken", "no chain is ready"];
  const byNode = new Map(doc.servers.map((s) => [s.node_id, s]));
  const problems = [];
  if (ready.length < doc.chains.length) problems.push(`${ready.length} of ${doc.chains.length} chains ready`);
  for (const planned of plan.servers) {
    if (planned.start === null || planned.end <= planned.start) continue;
    const server = byNode.get(planned.id);
    if (!server) problems.push(`${planned.id} is gone`);
    else if (server.suspect) problems.push(`${planned.id} is suspect`);
    else if (server.state !== "serving") problems.push(`${planned.id} is ${server.state}`);
  }
  return problems.length ? ["degraded", problems.join("; ")] : ["healthy", "a full chain serves and the plan is current"];
}

function planSummary(doc) {
  const plan = doc.plan;
  const parts = [`model ${doc.model}`, `policy ${doc.policy}`];
  if (plan) {
    parts.push(`plan ${plan.plan_id}`);
    parts.push(plan.c === null ? "c kept from the previous plan" : `c = ${plan.c}`);
    parts.push(`total capacity ${plan.total_capacity} sessions`);
    parts.push(plan.bounds ? `predicted mean response ${fixed(plan.bounds.lower, 2)}–${fixed(plan.bounds.upper, 2)} s`
      : "predicted mean response: overloaded (no bound)");
  }
  parts.push(`${doc.servers.length} servers`);
  return parts.join(" · ");
}

class Dashboard {
  constructor() {
    this.seen = new Map(); // node -> its last server record (a server absent now is drawn as gone)
    this.adminKey = storedInput($("admin-key"), "chainswarm.adminKey", () => this.poll());
    $("copy-join").addEventListener("click", () => this.copyJoin());
    this.timer = null;
    this.poll();
  }

  async poll() {
    clearTimeout(this.timer);
    try {
      const response = await fetch("/v1/swarm", {headers: authHeaders(this.adminKey()), cache: "no-store",
        signal: AbortSignal.timeout(POLL_TIMEOUT_MS)});
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        const message = `GET /v1/swarm answered ${response.status}: ${body.error?.message || response.statusText}`;
        this.unreachable(response.status === 401 || response.status === 403 ? "admin key rejected" : "unreachable",
          response.status === 401 || response.status === 403 ? `${message} (clear or correct the admin key)` : message);
      } else {
        this.render(await response.json());
      }
    } catch (err) {
      this.unreachable("unreachable", `orchestrator unreachable (${err.message})`);
    }
    this.timer = setTimeout(() => this.poll(), 1000);
  }

  unreachable(label, message) {
    const badge = $("state");
    badge.className = "badge broken";
    badge.textContent = label;
    $("summary").textContent = message;
  }

  render(doc) {
    const [health, why] = swarmHealth(doc);
    const badge = $("state");
    badge.className = `badge ${health}`;
    badge.textContent = health;
    badge.title = why;
    $("summary").textContent = `${planSummary(doc)} · ${why} · updated ${new Date().toLocaleTimeString([], {hour12: false})}`;
    this.renderBlocks(doc);
    this.renderChains(doc);
    this.renderClients(doc);
    this.renderEvents(doc);
    this.renderJoin(doc);
  }

  renderBlocks(doc) {
    const blocks = doc.num_blocks || doc.plan?.inputs?.model?.num_blocks || 1;
    const checks = doc.verification;
    const verified = checks ? `; spot checks: ${checks.counts.passed} passed, ${checks.counts.strikes} strikes, `
      + `${Object.keys(checks.banned).length} banned (overhead ${(100 * checks.overhead).toFixed(1)}%)` : "";
    $("blocks-caption").textContent = `${blocks} blocks; each bar is the server's planned span${verified}`;
    // node -> [used, total] over the chains it is on: sessions, or with token admission KV tokens per block
    const byTokens = doc.chains.some((chain) => chain.kv_tokens != null);
    const slots = new Map();
    for (const chain of doc.chains) {
      for (const node of new Set(chain.servers)) {
        const [used, total] = slots.get(node) || [0, 0];
        slots.set(node, byTokens ? [used + (chain.kv_tokens_held || 0), total + (chain.kv_tokens || 0)]
          : [used + chain.active, total + chain.capacity]);
      }
    }
    const current = new Set(doc.servers.map((s) => s.node_id));
    for (const server of doc.servers) this.seen.set(server.node_id, server);
    const rows = [...this.seen.values()].map((server) => {
      const assigned = server.assignment && server.assignment.end > server.assignment.start ? server.assignment : null;
      const [start, end] = assigned ? [assigned.start, assigned.end]
        : server.start !== null && server.end > server.start ? [server.start, server.end] : [null, null];
      let state = server.state === "serving" ? "serving" : "loading";
      if (server.suspect) state = "suspect";
      if (server.banned) state = "banned";  // caught by the spot checks (its answers were wrong)
      if (!current.has(server.node_id)) state = "gone";
      return {server, start, end, state};
    });
    rows.sort((a, b) => (a.state === "gone") - (b.state === "gone") || (a.start ?? 1e9) - (b.start ?? 1e9)
      || a.server.node_id.localeCompare(b.server.node_id));
    const cells = [el("div", {class: "head"}, "server"), el("div", {class: "head"}, `blocks 0 … ${blocks}`),
      el("div", {class: "head"}, "state"), el("div", {class: "head num"}, "step time"),
      el("div", {class: "head num"}, "RTT"),
      el("div", {class: "head num"}, byTokens ? "KV tokens used / total" : "slots used / total")];
    for (const {server, start, end, state} of rows) {
      const track = el("div", {class: "track", "data-node": server.node_id});
      track.style.setProperty("--b", `${100 / blocks}%`);
      if (start !== null) {
        const bar = el("div", {class: `span ${state}`, title: `${server.node_id}: blocks ${span(start, end)}`});
        bar.style.left = `${(100 * start) / blocks}%`;
        bar.style.width = `${(100 * (end - start)) / blocks}%`;
        track.append(bar);
      }
      const label = state === "loading" || state === "suspect" || state === "gone" || state === "banned"
        ? (state === "loading" ? server.state : state) : "serving";
      const n = start === null ? 0 : end - start;
      const [used, total] = state === "gone" ? [0, 0] : slots.get(server.node_id) || [0, 0];
      const rowClass = state === "gone" ? "row-gone" : "";
      cells.push(
        el("div", {class: `name ${rowClass}`, title: server.node_id, "data-node": server.node_id, "data-state": state},
          server.node_id),
        track,
        el("div", {class: rowClass}, el("span", {class: `state-tag state-${state}`}, label),
          start === null ? " no blocks" : ` ${span(start, end)}`),
        el("div", {class: `num ${rowClass}`, title: `decode, ${ms(server.decode_s, 2)} per block`},
          n ? ms(server.decode_s * n) : "–"),
        el("div", {class: `num ${rowClass}`}, ms(server.rtt_s)),
        el("div", {class: `num ${rowClass}`}, `${used} / ${total}`));
    }
    $("block-map").replaceChildren(...cells);
  }

  renderChains(doc) {
    const chains = [...doc.chains].sort((a, b) => a.service_time - b.service_time);
    const rows = chains.map((chain, i) => {
      const route = chain.servers.map((node, k) => `${node} ${span(...chain.spans[k])}`).join(" → ");
      // token admission: a chain holds as many sessions as its KV budget has room for, so its bar is that budget
      const byTokens = chain.kv_tokens != null;
      const [used, total] = byTokens ? [chain.kv_tokens_held, chain.kv_tokens] : [chain.active, chain.capacity];
      const fill = el("span");
      fill.style.width = `${total ? Math.min(100, (100 * used) / total) : 0}%`;
      const occupancy = byTokens
        ? `${chain.active} session${chain.active === 1 ? "" : "s"} · ${used} / ${total} KV tokens`
        : `${used} / ${total} sessions`;
      const title = byTokens ? `${used} of ${total} KV tokens per block held (planned: ${chain.capacity} sessions ` +
        "of the expected length)" : `${used} active of ${total}`;
      return el("div", {class: "chain", "data-chain": chain.id},
        el("div", {}, `#${i + 1}`, chain.ready ? null : el("small", {}, " not ready")),
        el("div", {class: "route"}, route),
        el("div", {}, el("div", {class: "bar", title}, fill), el("small", {class: "occupancy"}, occupancy)),
        el("div", {class: "num"}, `${fixed(chain.service_time, 2)} s service`));
    });
    $("chains").replaceChildren(...(rows.length ? rows : [el("p", {class: "note"}, "no chains")]));
  }

  renderClients(doc) {
    const tbody = $("clients").tBodies[0];
    const prefix = doc.prefix;
    $("prefix").textContent = !prefix ? "" : prefix.enabled
      ? `prefix cache: ${fixed(100 * prefix.hit_rate, 0)}% of requests hit, ${fixed(100 * prefix.token_hit_rate, 0)}% of prompt tokens reused (${prefix.tokens_saved} tokens saved)`
      : "prefix cache: off";
    if (!doc.clients) {
      $("clients-note").textContent = "operator detail needs the admin key";
      tbody.replaceChildren();
      $("service-chart").replaceChildren();
      return;
    }
    const clients = Object.entries(doc.clients).sort((a, b) => b[1].service - a[1].service);
    $("clients-note").textContent = clients.length ? "" : "no clients yet";
    tbody.replaceChildren(...clients.map(([name, c]) => el("tr", {"data-client": name}, el("td", {}, name),
      el("td", {class: "num"}, c.waiting), el("td", {class: "num"}, fixed(c.service, 0)),
      el("td", {class: "num"}, "deficit" in c ? (c.deficit === null ? "∞" : fixed(c.deficit, 0)) : "–"))));
    this.renderChart(doc.service_history, clients.map(([name]) => name));
  }

  renderChart(history, names) {
    const box = $("service-chart");
    if (!history) {
      box.replaceChildren(el("p", {class: "note"}, "operator detail needs the admin key"));
      return;
    }
    const samples = history.samples;
    const colours = new Map([...names].sort().map((name, i) => [name, PALETTE[i % PALETTE.length]]));
    const colour = (name) => colours.get(name) || PALETTE[PALETTE.length - 1];
    const NS = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(NS, "svg");
    const W = 600, H = 140;
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", "service per client over time");
    const last = samples.length ? samples[samples.length - 1].time : 0;
    const shown = samples.filter((s) => s.time > last - CHART_WINDOW_S);
    // the window grows with the history (at least a minute, at most CHART_WINDOW_S)
    const window_s = Math.min(CHART_WINDOW_S, Math.max(60, shown.length ? last - shown[0].time + history.period_s : 0));
    const top = Math.max(1, ...shown.map((s) => Object.values(s.service).reduce((a, b) => a + b, 0)));
    const width = Math.max(1, (W * history.period_s) / window_s - 1);
    for (const sample of shown) {
      let y = H;
      const x = W - ((last - sample.time) / window_s) * W - width;
      for (const [name, value] of Object.entries(sample.service).sort()) {
        const h = (value / top) * (H - 10);
        const rect = document.createElementNS(NS, "rect");
        for (const [k, v] of [["x", x], ["y", y - h], ["width", width], ["height", h], ["fill", colour(name)]]) {
          rect.setAttribute(k, String(v));
        }
        const title = document.createElementNS(NS, "title");
        title.textContent = `${name}: ${fixed(value, 0)}`;
        rect.append(title);
        svg.append(rect);
        y -= h;
      }
    }
    const legend = el("p", {class: "note"}, `stacked service per ${history.period_s} s over the last ${fixed(window_s / 60, 1)} min; peak ${fixed(top, 0)} per period `);
    for (const name of names) {
      const swatch = el("span", {class: "swatch"});
      swatch.style.background = colour(name);
      legend.append(el("span", {class: "legend-item"}, swatch, name));
    }
    box.replaceChildren(svg, legend);
  }

  renderEvents(doc) {
    if (!doc.events) {
      $("events-note").textContent = "operator detail needs the admin key";
      $("events").replaceChildren();
      return;
    }
    $("events-note").textContent = doc.events.length ? "" : "no events yet";
    const items = [...doc.events].reverse().map((e) => el("li", {"data-event": e.event},
      el("time", {}, clock(e.time)), el("span", {class: "kind"}, EVENT_LABELS[e.event] || e.event), describe(e)));
    $("events").replaceChildren(...items);
  }

  renderJoin(doc) {
    const parts = ["chainswarm server", `--model /path/to/${doc.model}`, `--initial-peers ${doc.initial_peers.join(" ")}`];
    if (doc.dht_prefix) parts.push(`--dht-prefix ${doc.dht_prefix}`);
    if (doc.torch_dtype) parts.push(`--torch-dtype ${doc.torch_dtype}`);
    $("join-command").textContent = parts.join(" ");
  }

  async copyJoin() {
    const text = $("join-command").textContent;
    try {
      await navigator.clipboard.writeText(text);
      $("copy-join").textContent = "Copied";
    } catch {
      window.getSelection().selectAllChildren($("join-command"));
      $("copy-join").textContent = "Selected: press Ctrl+C";
    }
    setTimeout(() => { $("copy-join").textContent = "Copy"; }, 2000);
  }
}

function describe(e) {
  switch (e.event) {
    case "server_joined": case "server_left": return e.node;
    case "server_failed": return `${e.node} failed a session; excluded`;
    case "plan": return `plan ${e.plan_id}: ${e.servers.length} servers, ${e.chains.length} chains`
      + (e.kept_ranges ? " (block ranges kept)" : ` (c = ${e.c})`);
    case "refused": return `${e.client}: ${e.reason}` + (e.count > 1 ? ` (×${e.count})` : "");
    case "lease": return `${e.client} on chain ${e.chain}`;
    case "lease_expired": return `${e.client} (${e.lease_id ?? "lease"})`;
    case "plan_dropped": return e.reason;
    case "server_refused": return `${e.node}: ${e.reason}`;
    default: {
      const {time, event, ...rest} = e;
      return JSON.stringify(rest);
    }
  }
}

// --------------------------------------------------------------------------------------------------- chat
class Chat {
  constructor() {
    this.history = []; // the conversation sent with every request: {role, content}
    this.model = null;
    this.apiKey = storedInput($("api-key"), "chainswarm.apiKey");
    $("ask").addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); this.send(); }
    });
    $("clear").addEventListener("click", () => { this.history = []; $("conversation").replaceChildren(); });
    this.loadModel();
  }

  async loadModel() {
    try {
      const response = await fetch("/v1/models", {cache: "no-store"});
      const doc = await response.json();
      this.model = doc.data[0].id;
      $("model").textContent = this.model;
    } catch (err) {
      $("model").textContent = "unknown";
      $("chat-status").textContent = `cannot read the served model: ${err.message}`;
    }
  }

  bubble(role, text) {
    const body = el("div", {class: "text"}, text);
    const item = el("li", {class: role}, body);
    $("conversation").append(item);
    item.scrollIntoView({block: "end"});
    return {item, body};
  }

  async send() {
    const prompt = $("prompt").value.trim();
    if (!prompt || this.busy) return;
    this.busy = true;
    $("send").disabled = true;
    $("prompt").value = "";
    this.history.push({role: "user", content: prompt});
    this.bubble("user", prompt);
    const answer = this.bubble("assistant", "");
    const meta = el("div", {class: "meta"}, "waiting for a chain…");
    answer.item.append(meta);
    try {
      const text = await this.stream(answer, meta);
      this.history.push({role: "assistant", content: text});
    } catch (err) {
      this.history.pop(); // the question was not answered: it is not part of the conversation
      answer.item.classList.add("error");
      meta.textContent = err.message;
      $("prompt").value = prompt;
    } finally {
      this.busy = false;
      $("send").disabled = false;
    }
  }

  async stream(answer, meta) {
    const body = {model: this.model, messages: this.history, stream: true, stream_options: {include_usage: true},
      temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value)};
    const started = performance.now();
    const response = await fetch("/v1/chat/completions", {method: "POST", body: JSON.stringify(body),
      headers: {"Content-Type": "application/json", ...authHeaders(this.apiKey())}});
    if (!response.ok) throw new Error(await refusalMessage(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", text = "", firstAt = null, info = null, usage = null;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const doc = JSON.parse(data);
          if (doc.error) throw new Error(`the swarm stopped: ${doc.error.message}`);
          const piece = doc.choices?.[0]?.delta?.content;
          if (piece) {
            if (firstAt === null) firstAt = performance.now();
            text += piece;
            answer.body.textContent = text;
            meta.textContent = "streaming…";
          }
          if (doc.chainswarm) info = doc.chainswarm;
          if (doc.usage) usage = doc.usage;
        }
      }
    }
    const ended = performance.now();
    const tokens = usage ? usage.completion_tokens : null;
    const parts = [];
    if (info) parts.push(`chain ${info.chain_id}: ${info.servers.join(" → ")}`);
    if (tokens !== null) parts.push(`${tokens} tokens`);
    if (tokens && firstAt !== null) {
      const rate = tokens > 1 && ended > firstAt ? (tokens - 1) / ((ended - firstAt) / 1000) : tokens / ((ended - started) / 1000);
      parts.push(`${fixed(rate, 1)} tokens/s`);
    }
    if (firstAt !== null) parts.push(`first token after ${fixed((firstAt - started) / 1000, 2)} s`);
    if (info) parts.push(`waited ${fixed(info.waiting_s, 2)} s in the queue`);
    meta.textContent = parts.join(" · ");
    answer.item.scrollIntoView({block: "end"});
    return text;
  }
}

async function refusalMessage(response) {
  const doc = await response.json().catch(() => ({}));
  const message = doc.error?.message || response.statusText;
  const retry = response.headers.get("Retry-After");
  let text = `refused (${response.status}): ${message}`;
  if (retry !== null && /^\d+$/.test(retry)) {
    const at = new Date(Date.now() + Number(retry) * 1000).toLocaleTimeString([], {hour12: false});
    text += ` — retry after ${retry} s (at ${at})`;
  } else if (retry) {
    text += ` — retry after ${retry}`;
  }
  return text;
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  if (page === "dashboard") window.chainswarmPage = new Dashboard();
  else if (page === "chat") window.chainswarmPage = new Chat();
});
