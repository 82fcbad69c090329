// What the operator pages (models, deployments, rollout, agent packages) share: lit-html templates for
// badges, figures and progress, and the refresh loop. Data reaches the DOM only through lit-html's
// bindings, which never parse it as HTML.
import { html, nothing } from "/static/lit-html.js";

export const badge = (text) => html`<span class="badge ${text}">${text}</span>`;

// A figure, or "—" where the API has none (not measured, not judged).
export function fig(v, digits = 1, unit = "") {
  if (v === null || v === undefined || Number.isNaN(v)) return html`<span class="muted">—</span>`;
  return `${Number(v).toFixed(digits)}${unit ? " " + unit : ""}`;
}

export function bar(pct, cls = "") {
  const p = Math.max(0, Math.min(100, Number(pct) || 0));
  return html`<div class="bar ${cls}" role="progressbar" aria-valuenow=${p.toFixed(0)} aria-valuemin="0" aria-valuemax="100"><span style="width:${p}%"></span></div>`;
}

export const when = (iso) => iso ? html`<span title=${new Date(iso).toLocaleString()}>${EF.ago(iso)}</span>` : html`<span class="muted">—</span>`;
export const short = (sha) => sha ? html`<code title=${sha}>${sha.slice(0, 12)}</code>` : nothing;

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(0)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

export const deviceLink = (id) => html`<a href="/devices/${encodeURIComponent(id)}">${id}</a>`;

// load() every `ms`, rendered by show(data); a failed load says why in #error and keeps the last view.
// Returns the function that loads and renders at once (after an action).
export function refresh(load, show, ms) {
  const err = document.getElementById("error");
  async function tick() {
    try {
      const data = await load();
      for (const n of document.querySelectorAll(".loading")) n.remove();
      show(data);
      err.textContent = "";
    } catch (e) {
      err.textContent = `could not load: ${e.message}`;
    }
  }
  tick();
  setInterval(tick, ms);
  return tick;
}
