// What the deployments, rollout and agent-package pages say about rollouts and the devices a
// deployment reaches.
import { html, nothing } from "/static/lit-html.js";
import { badge } from "/static/views.js";

// The devices a deployment reaches now: for a model deployment, those with a camera whose winning
// layer it is; for an agent deployment, those whose agent version it sets.
export function reachedBy(d, devices) {
  const out = [];
  for (const dev of devices) {
    const hit = d.kind === "agent"
      ? (dev.agent || {}).deployment === d.name
      : Object.values(dev.assignments || {}).some((a) => a.source === "deployment" && a.deployment === d.name);
    if (hit) out.push(dev.id);
  }
  return out.sort();
}

export function rolloutSummary(ro) {
  if (!ro) return html`<span class="muted">none</span>`;
  const p = ro.progress || {};
  return html`<a class="rollout-link" href="/rollouts/${ro.id}" data-rollout=${String(ro.id)}>${badge(ro.state)}</a>
    wave ${ro.current_wave}/${ro.plan.length} · ${p.active ?? 0}/${p.planned ?? 0} active${p.failed ? html` · <span class="err">${p.failed} failed</span>` : nothing}`;
}
