// One rollout: its waves, each gate with the figures it was judged by and its verdict, each device's
// state, and (for operator tokens only) pause, resume, cancel and roll back.
import { html, render, nothing } from "/static/lit-html.js";
import { badge, fig, bar, when, deviceLink, refresh } from "/static/views.js";

const id = Number(location.pathname.replace(/^\/rollouts\//, "").replace(/\/$/, ""));
document.getElementById("rollout-id").textContent = `#${id}`;
document.title = `edgefleet · rollout ${id}`;

// Which action each state allows (controller/db/states.py RolloutState); the API refuses the rest.
const ACTIONS = [
  ["pause", "Pause", (s) => s === "running", ""],
  ["resume", "Resume", (s) => s === "paused", ""],
  ["cancel", "Cancel", (s) => s === "running" || s === "paused", "Cancel this rollout? Devices still applying go back; active ones keep it."],
  ["rollback", "Roll back", (s) => s !== "failed" && s !== "rolled_back", "Roll back every device this deployment reached?"],
];
let canOperate = false;
let notice = "";

async function act(dep, name, confirmText) {
  if (confirmText && !window.confirm(confirmText)) return;
  try {
    await EF.post(`/api/v1/deployments/${dep.id}/${name}`);
    notice = "";
  } catch (e) {
    notice = `${name} refused: ${e.message}`;
  }
  again();
}

function actions(dep, ro) {
  if (!canOperate) return nothing;
  return html`<div class="actions" id="actions">${ACTIONS.map(([name, text, ok, confirmText]) =>
    html`<button type="button" class=${name === "rollback" || name === "cancel" ? "danger" : ""} data-action=${name}
      ?disabled=${!ok(ro.state)} @click=${() => act(dep, name, confirmText)}>${text}</button>`)}</div>`;
}

function summary(dep, ro) {
  const p = ro.progress || {};
  const ships = dep.kind === "agent" ? `agent ${dep.agent_version}` : `${dep.model}:${dep.version}`;
  return html`<h2>${dep.name} <span class="sub">${ships} · selector ${dep.selector || "(every device)"} · priority ${dep.priority}</span></h2>
    <p><span id="state" data-state=${ro.state}>${badge(ro.state)}</span> wave ${ro.current_wave} of ${ro.plan.length} ·
      ${p.active ?? 0} of ${p.planned ?? 0} devices active${p.failed ? `, ${p.failed} failed` : ""}${p.rolled_back ? `, ${p.rolled_back} rolled back` : ""}
      · started ${when(ro.created_at)}${ro.finished_at ? html` · ended ${when(ro.finished_at)}` : nothing}</p>
    ${ro.reason ? html`<p class="reason" id="reason">${ro.reason}</p>` : nothing}
    ${bar(p.planned ? 100 * (p.active ?? 0) / p.planned : 0)}
    ${actions(dep, ro)}
    ${notice ? html`<p class="err" id="action-error">${notice}</p>` : nothing}`;
}

// "what it measured (the bound)" for each figure the gate judged; bounds that are not set are left out.
// Each figure carries the API's value (data-value) next to the text it shows.
function figures(g) {
  const failed = (g.failed || []).length;
  const out = [
    ["failed", "failed", failed, `${failed} of ${g.size}`, `at most ${(100 * g.max_failure_ratio).toFixed(0)} %`],
    ["fps_ratio_min", "FPS after / before (lowest)", g.fps_ratio_min, fig(g.fps_ratio_min, 2), `at least ${g.min_fps_ratio.toFixed(2)}`],
    ["latency_ms_max", `latency, ${[...new Set(Object.values(g.latency_stat || {}))].join("/") || "p99"} (highest)`, g.latency_ms_max, fig(g.latency_ms_max, 1, "ms"),
      g.max_latency_ms != null ? `at most ${g.max_latency_ms.toFixed(1)} ms` : "no bound"],
  ];
  if (g.max_latency_ratio != null) out.push(["latency_ratio_max", "latency after / before (highest)", g.latency_ratio_max, fig(g.latency_ratio_max, 2), `at most ${g.max_latency_ratio.toFixed(2)}`]);
  const restarts = Object.values(g.watchdog || {}).reduce((a, w) => Math.max(a, w.restarts || 0), 0);
  out.push(["watchdog", "watchdog restarts (most)", restarts, String(restarts), `at most ${g.max_watchdog_restarts ?? 0}`]);
  return html`<dl class="figures">${out.map(([key, name, value, text, bound]) =>
    html`<div data-figure=${key} data-value=${value ?? ""}><dt>${name}</dt><dd>${text} <span class="muted">(${bound})</span></dd></div>`)}</dl>
    ${Object.keys(g.failures || {}).length ? html`<ul class="alerts">${Object.entries(g.failures).map(([d, why]) => html`<li class="bad">${d}: ${why || "failed"}</li>`)}</ul>` : nothing}`;
}

function wave(ro, i) {
  const n = i + 1;
  const planned = ro.plan[i] - (i ? ro.plan[i - 1] : 0);
  const members = ro.devices.filter((m) => m.wave === n);
  const gates = ro.gates.filter((g) => g.wave === n);
  const g = gates[gates.length - 1];
  const verdict = g ? (g.passed ? "passed" : "failed") : n === ro.current_wave && ["running", "paused"].includes(ro.state) ? "judging" : "not reached";
  return html`<div class="card wave" data-wave=${String(n)} data-verdict=${verdict}>
    <h3>wave ${n} <span class="muted">(${ro.waves[i] ?? ""}: ${planned} device${planned === 1 ? "" : "s"}, ${members.length} admitted)</span> ${badge(verdict.replace(" ", "-"))}</h3>
    ${g ? html`<p class="reason" data-field="gate-reason">${g.reason}</p>${figures(g)}` : nothing}
  </div>`;
}

function member(m, agent) {
  return html`<tr data-device=${m.device_id} data-state=${m.state}>
    <td data-label="device">${deviceLink(m.device_id)}</td>
    <td class="num" data-label="wave">${m.wave}</td>
    <td data-label="state">${badge(m.state)}${m.progress_pct != null && m.state === "applying" ? html` ${fig(m.progress_pct, 0, "%")}` : nothing}</td>
    <td data-label="cameras">${m.cameras.join(", ") || "—"}</td>
    <td class="num" data-label="FPS before">${fig(m.baseline_fps, 1)}</td>
    <td class="num" data-label="latency before">${fig(m.baseline_latency_ms, 1, "ms")}</td>
    ${agent ? html`<td data-label="agent">${m.agent_version || "—"}${m.agent_state ? html` ${badge(m.agent_state)}` : nothing}</td>` : nothing}
    <td data-label="admitted">${when(m.admitted_at)}</td>
    <td class="why" data-label="why">${m.reason || ""}</td>
  </tr>`;
}

function show([dep, ro]) {
  render(summary(dep, ro), document.getElementById("summary"));
  render(ro.plan.map((_, i) => wave(ro, i)), document.getElementById("waves"));
  const agent = dep.kind === "agent";
  render(ro.devices.length ? html`<table class="cards members">
      <thead><tr><th>device</th><th class="num">wave</th><th>state</th><th>cameras</th><th class="num">FPS before</th><th class="num">latency before</th>
        ${agent ? html`<th>agent</th>` : nothing}<th>admitted</th><th>why</th></tr></thead>
      <tbody>${ro.devices.map((m) => member(m, agent))}</tbody></table>`
    : html`<p class="muted">no device admitted yet</p>`, document.getElementById("members"));
}

async function load() {
  const ro = (await EF.api("/api/v1/rollouts")).find((r) => r.id === id);
  if (!ro) throw new Error(`rollout ${id} is not known`);
  const dep = await EF.api(`/api/v1/deployments/${ro.deployment_id}`);
  return [dep, dep.rollout && dep.rollout.id === id ? dep.rollout : ro];
}

let again = () => {};
EF.allows("operator").then((ok) => {
  canOperate = ok;
  document.body.dataset.operator = String(ok);
  again = refresh(load, show, 2000);
});
