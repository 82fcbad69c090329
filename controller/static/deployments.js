// Deployments: what each one ships, to which selector at which priority, the devices it reaches now
// (the layer that won on one of their cameras, or the agent version they are given) and its rollout.
import { html, render, nothing } from "/static/lit-html.js";
import { badge, when, deviceLink, refresh } from "/static/views.js";
import { reachedBy, rolloutSummary } from "/static/rollouts.js";

function what(d) {
  if (d.kind === "agent") return html`agent ${d.agent_version}`;
  return html`${d.model}:${d.version}${d.variant && d.variant !== "auto" ? html` <span class="muted">(${d.variant} pinned)</span>` : nothing}`;
}

function row(d, devices) {
  const reached = reachedBy(d, devices);
  return html`<tr data-deployment=${d.name} data-state=${d.state} data-reached=${String(reached.length)}>
    <td data-label="deployment"><strong>${d.name}</strong><div class="muted">${when(d.created_at)}</div></td>
    <td data-label="ships">${what(d)}</td>
    <td data-label="selector" class="src">${d.selector ? html`<code>${d.selector}</code>` : html`<span class="muted">every device</span>`}</td>
    <td class="num" data-label="priority" data-field="priority">${d.priority}</td>
    <td data-label="state">${badge(d.state)}</td>
    <td data-label="devices reached" data-field="reached">
      <strong>${reached.length}</strong>${reached.length ? html`: <span class="devlist">${reached.map((id, i) => html`${i ? ", " : ""}${deviceLink(id)}`)}</span>` : nothing}</td>
    <td data-label="rollout">${rolloutSummary(d.rollout)}</td>
  </tr>`;
}

function show([deployments, devices]) {
  const list = [...deployments].sort((a, b) => b.priority - a.priority || b.created_at.localeCompare(a.created_at));
  render(list.length ? html`<table class="cards">
      <thead><tr><th>deployment</th><th>ships</th><th>selector</th><th class="num">priority</th><th>state</th><th>devices reached</th><th>rollout</th></tr></thead>
      <tbody>${list.map((d) => row(d, devices))}</tbody></table>`
    : html`<p class="muted">no deployments</p>`, document.getElementById("deployments"));
}

refresh(() => Promise.all([EF.api("/api/v1/deployments"), EF.api("/api/v1/devices")]), show, 3000);
