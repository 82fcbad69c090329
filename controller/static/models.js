// Model versions: each one's build (stage and progress, live), and its variants with the latency and
// fidelity figures they were judged by, and why a variant is unfit (devices never get an unfit one).
import { html, render, nothing } from "/static/lit-html.js";
import { badge, fig, bar, when, short, bytes, refresh } from "/static/views.js";

const ORDER = { fp32: 0, fp16: 1, int8: 2 };

function variantRow(v) {
  return html`<tr data-variant=${v.variant} data-fit=${String(v.fit)}>
    <td data-label="variant"><strong>${v.variant}</strong></td>
    <td data-label="for">${v.target}${v.int8_isa ? html` <span class="muted">(${v.int8_isa})</span>` : nothing}</td>
    <td data-label="verdict">${badge(v.fit ? "fit" : "unfit")}</td>
    <td class="num" data-label="latency 1 thread" data-field="latency_1t" data-value=${v.latency_ms_1t ?? ""}>${fig(v.latency_ms_1t, 1, "ms")}</td>
    <td class="num" data-label="latency 2 threads" data-field="latency_2t" data-value=${v.latency_ms_2t ?? ""}>${fig(v.latency_ms_2t, 1, "ms")}</td>
    <td class="num" data-label="F1 vs fp32" data-field="f1" data-value=${v.f1 ?? ""}>${fig(v.f1, 3)}</td>
    <td class="num" data-label="mean IoU" data-field="mean_iou" data-value=${v.mean_iou ?? ""}>${fig(v.mean_iou, 3)}</td>
    <td class="num" data-label="detections">${v.detections ?? "—"}</td>
    <td class="num" data-label="size">${bytes(v.size)}</td>
    <td class="why" data-label="why unfit" data-field="reason">${v.fit ? nothing : html`<span class="reason">${v.reason || "not judged fit"}</span>`}</td>
  </tr>`;
}

function build(m) {
  if (m.status === "building") {
    return html`<div class="build" data-field="build">
      <div class="load-head"><span>building: ${m.build_stage || "queued"}</span>
        <span class="load-num" data-field="progress" data-value=${m.build_progress}>${m.build_progress.toFixed(0)} %</span></div>
      ${bar(m.build_progress, "build")}</div>`;
  }
  if (m.status === "failed") return html`<p class="err" data-field="build">build failed: ${m.build_error || "no reason given"} (fp32 still serves)</p>`;
  return nothing;
}

function version(m) {
  const key = `${m.name}:${m.version}`;
  const variants = [...m.variants].sort((a, b) => (ORDER[a.variant] ?? 9) - (ORDER[b.variant] ?? 9));
  const labels = (m.manifest && m.manifest.labels) || [];
  return html`<div class="card model" data-model=${key} data-status=${m.status}>
    <h3>${key} ${badge(m.status)}</h3>
    <p class="muted">${m.manifest && m.manifest.decoder ? `${m.manifest.decoder} decoder · ` : ""}${labels.length} label${labels.length === 1 ? "" : "s"} · ${bytes(m.size)} · ${short(m.sha256)} · uploaded ${when(m.created_at)}</p>
    ${build(m)}
    ${variants.length ? html`<table class="cards variants">
        <thead><tr><th>variant</th><th>for</th><th>verdict</th><th class="num">latency 1 thread</th><th class="num">2 threads</th>
          <th class="num" title="agreement with the fp32 model's detections on held-out frames">F1 vs fp32</th><th class="num">mean IoU</th>
          <th class="num">detections</th><th class="num">size</th><th>why unfit</th></tr></thead>
        <tbody>${variants.map(variantRow)}</tbody></table>`
      : m.status === "building" ? nothing
      : html`<p class="muted" data-field="no-variants">no variants built: devices get the model as uploaded (fp32)</p>`}
  </div>`;
}

function show(models) {
  const list = [...models].sort((a, b) => a.name.localeCompare(b.name) || b.created_at.localeCompare(a.created_at));
  render(list.length ? list.map(version) : html`<p class="muted">no models registered</p>`, document.getElementById("models"));
}

// Every 2 s: a build's stage and progress move while the operator watches.
refresh(() => EF.api("/api/v1/models"), show, 2000);
