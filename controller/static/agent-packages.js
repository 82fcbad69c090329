// Agent packages: each uploaded version, how many devices run it now, the agent deployments that
// ship it and their rollouts.
import { html, render, nothing } from "/static/lit-html.js";
import { badge, when, short, bytes, deviceLink, refresh } from "/static/views.js";
import { reachedBy, rolloutSummary } from "/static/rollouts.js";

function runningOn(version, devices) {
  return devices.filter((d) => ((d.agent || {}).version || d.agent_version) === version).map((d) => d.id).sort();
}

function pkgRow(p, devices, deployments) {
  const running = runningOn(p.version, devices);
  const shipping = deployments.filter((d) => d.agent_version === p.version);
  return html`<tr data-package=${p.version} data-running=${String(running.length)}>
    <td data-label="version"><strong>${p.version}</strong></td>
    <td data-label="uploaded">${when(p.uploaded_at)}</td>
    <td class="num" data-label="size">${bytes(p.size)}</td>
    <td data-label="sha256">${short(p.sha256)}</td>
    <td data-label="requires" class="src">${p.requires.length ? p.requires.join(", ") : html`<span class="muted">—</span>`}</td>
    <td data-label="running on">${running.length}${running.length ? html`: ${running.map((id, i) => html`${i ? ", " : ""}${deviceLink(id)}`)}` : nothing}</td>
    <td data-label="deployments">${shipping.length ? shipping.map((d) => html`<div>${d.name} ${rolloutSummary(d.rollout)}</div>`) : html`<span class="muted">none</span>`}</td>
  </tr>`;
}

function depRow(d, devices) {
  const reached = reachedBy(d, devices);
  return html`<tr data-deployment=${d.name} data-state=${d.state} data-reached=${String(reached.length)}>
    <td data-label="deployment"><strong>${d.name}</strong><div class="muted">${when(d.created_at)}</div></td>
    <td data-label="version">${d.agent_version}</td>
    <td data-label="selector" class="src">${d.selector ? html`<code>${d.selector}</code>` : html`<span class="muted">every device</span>`}</td>
    <td class="num" data-label="priority">${d.priority}</td>
    <td data-label="state">${badge(d.state)}</td>
    <td data-label="devices reached">${reached.length}</td>
    <td data-label="rollout">${rolloutSummary(d.rollout)}</td>
  </tr>`;
}

function show([packages, deployments, devices]) {
  const agentDeps = deployments.filter((d) => d.kind === "agent");
  render(packages.length ? html`<table class="cards">
      <thead><tr><th>version</th><th>uploaded</th><th class="num">size</th><th>sha256</th><th>requires</th><th>running on</th><th>deployments</th></tr></thead>
      <tbody>${packages.map((p) => pkgRow(p, devices, agentDeps))}</tbody></table>`
    : html`<p class="muted">no agent package uploaded</p>`, document.getElementById("packages"));
  render(agentDeps.length ? html`<table class="cards">
      <thead><tr><th>deployment</th><th>version</th><th>selector</th><th class="num">priority</th><th>state</th><th>devices reached</th><th>rollout</th></tr></thead>
      <tbody>${agentDeps.map((d) => depRow(d, devices))}</tbody></table>`
    : html`<p class="muted">no agent deployment</p>`, document.getElementById("agent-deployments"));
}

refresh(() => Promise.all([EF.api("/api/v1/agent-packages"), EF.api("/api/v1/deployments"), EF.api("/api/v1/devices")]), show, 3000);
