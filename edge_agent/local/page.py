"""The local page: one self-contained HTML document (no external resource: the site may have no internet),
readable on a phone. It asks for the device-local token, keeps it in the browser's storage for this
device, and reads ``/api/status`` every few seconds; camera pictures are fetched with the token and
shown from blob URLs (an ``<img src>`` cannot carry the header)."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>edgefleet device</title>
<style>
body { font: 16px/1.4 system-ui, sans-serif; margin: 0; padding: 12px; color: #1b1f24; background: #f4f5f7; }
h1 { font-size: 1.2em; margin: 0 0 8px; }
h2 { font-size: 1em; margin: 0 0 6px; }
section { background: #fff; border-radius: 8px; padding: 10px 12px; margin: 0 0 10px; }
.ok { color: #116329; font-weight: 600; }
.bad { color: #b42318; font-weight: 600; }
.err { color: #b42318; overflow-wrap: anywhere; }
.muted { color: #57606a; font-size: 0.9em; }
img.snapshot { display: block; max-width: 100%; height: auto; margin-top: 6px; border-radius: 4px; }
.cam { border-top: 1px solid #d0d7de; padding-top: 8px; margin-top: 8px; }
input, button { font: inherit; padding: 8px; }
input { width: 100%; box-sizing: border-box; margin: 6px 0; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 10px; margin: 0; }
dt { color: #57606a; } dd { margin: 0; overflow-wrap: anywhere; }
</style>
</head>
<body>
<h1>edgefleet device <span id="device"></span></h1>
<form id="login" hidden>
  <section>
    <h2>Device token</h2>
    <p class="muted">The token is in the device's data folder (local_page.token) or in its provisioning
    record.</p>
    <label for="token">Token</label>
    <input id="token" name="token" type="password" autocomplete="current-password">
    <button type="submit">Show status</button>
    <p id="login-error" class="err"></p>
  </section>
</form>
<div id="status" hidden>
  <section id="uplink"><h2>Uplink</h2><div id="uplink-state"></div><div id="uplink-error" class="err"></div>
    <ul id="uplink-errors" class="muted"></ul></section>
  <section><h2>Outbox</h2><div id="outbox"></div></section>
  <section><h2>Cameras</h2><div id="cameras"></div></section>
  <section><h2>Device</h2><dl id="system"></dl></section>
  <section><h2>Agent</h2><dl id="agent"></dl></section>
  <p class="muted">Updated <span id="updated">never</span>. <button id="logout" type="button">Log out</button></p>
</div>
<script>
"use strict";
const KEY = "edgefleet-local-token";
const $ = (id) => document.getElementById(id);
let timer = null;
const shown = new Map();

function token() { return localStorage.getItem(KEY) || ""; }
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function ago(s) {
  if (s === null || s === undefined) return "-";
  return s < 120 ? s.toFixed(0) + " s" : (s / 60).toFixed(0) + " min";
}
function row(dl, k, v) { dl.append(el("dt", "", k), el("dd", "", v === null || v === undefined ? "-" : v)); }

function askToken(why) {
  clearInterval(timer); timer = null;
  $("status").hidden = true; $("login").hidden = false;
  $("login-error").textContent = why || "";
  $("token").focus();
}

async function api(path) {
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token() }, cache: "no-store" });
  if (r.status === 401) { localStorage.removeItem(KEY); askToken("Wrong token."); throw new Error("401"); }
  return r;
}

async function snapshot(cam, img) {
  try {
    const r = await api("/api/cameras/" + encodeURIComponent(cam) + "/snapshot.jpg");
    if (!r.ok) { img.alt = "no picture now"; return; }
    const url = URL.createObjectURL(await r.blob());
    const old = shown.get(cam);
    img.onload = () => { if (old) URL.revokeObjectURL(old); };
    img.src = url; shown.set(cam, url);
  } catch (e) { /* the next refresh tries again */ }
}

function render(s) {
  $("device").textContent = s.device_id;
  const up = s.uplink;
  const state = $("uplink-state");
  state.textContent = up.connected ? "connected" : "not connected";
  state.className = up.connected ? "ok" : "bad";
  $("uplink-error").textContent = up.connected ? "" : (up.last_error || "");
  const errs = $("uplink-errors"); errs.replaceChildren();
  for (const e of up.connect_errors.slice(-3).reverse()) {
    errs.append(el("li", "", new Date(e.at * 1000).toLocaleTimeString() + ": " + e.error));
  }
  $("outbox").textContent = s.outbox.pending + " waiting to be sent" +
    (s.outbox.pending ? ", oldest " + ago(s.outbox.oldest_pending_age_s) : "") +
    (s.outbox.dropped ? "; " + s.outbox.dropped + " dropped" : "");
  const cams = $("cameras"); const keep = new Set();
  for (const c of s.cameras) {
    keep.add(c.id);
    let box = document.querySelector('.cam[data-cam="' + CSS.escape(c.id) + '"]');
    if (!box) {
      box = el("div", "cam"); box.dataset.cam = c.id;
      box.append(el("h2", "cam-name"), el("div", "cam-state"), el("div", "cam-model"), el("div", "err cam-error"));
      const img = el("img", "snapshot"); img.alt = "current picture of " + c.id; box.append(img);
      cams.append(box);
    }
    box.querySelector(".cam-name").textContent = c.id;
    const st = box.querySelector(".cam-state");
    st.textContent = c.state + (c.state === "up" ? ", " + c.fps + " fps" : "");
    st.className = "cam-state " + (c.state === "up" ? "ok" : "bad");
    let model = c.model ? c.model + ": " + c.model_state : "no model";
    if (c.progress_pct !== null && c.model_state !== "running") model += " " + c.progress_pct.toFixed(0) + "%";
    if (c.inference_ms !== null && c.model_state === "running") model += ", " + c.inference_ms + " ms";
    box.querySelector(".cam-model").textContent = model;
    box.querySelector(".cam-error").textContent = [c.error, c.state !== "up" ? c.last_error : null]
      .filter(Boolean).join("; ");
    snapshot(c.id, box.querySelector("img"));
  }
  for (const box of cams.querySelectorAll(".cam")) if (!keep.has(box.dataset.cam)) box.remove();
  const sys = $("system"); sys.replaceChildren();
  const y = s.system;
  row(sys, "CPU", y.cpu_pct === null ? null : y.cpu_pct + " %");
  row(sys, "Memory", y.memory_pct === null ? null : y.memory_pct + " %");
  row(sys, "Disk free", y.disk_free_mb === null ? null : (y.disk_free_mb / 1024).toFixed(1) + " GiB (" + y.disk_pct + " % used)");
  for (const g of y.gpus) row(sys, "GPU " + g.index, g.name + ", " + (g.utilization_pct ?? "-") + " %");
  const w = s.watchdog || {};
  row(sys, "Watchdog", (w.failed ? "FAILED: " + (w.reason || "") : "ok") +
    (w.restarts ? ", " + w.restarts + " restarts" : ""));
  const ag = $("agent"); ag.replaceChildren();
  row(ag, "Version", s.agent_version);
  const u = s.update;
  if (u) {
    row(ag, "Slot", u.slot); row(ag, "Update", u.state + (u.target ? " to " + u.target : "") +
      (u.progress_pct !== null ? " " + u.progress_pct.toFixed(0) + "%" : ""));
    if (u.error) row(ag, "Update error", u.error);
    if (u.previous) row(ag, "Previous", u.previous);
  }
  $("updated").textContent = new Date(s.at * 1000).toLocaleTimeString();
}

async function refresh() {
  try {
    const r = await api("/api/status");
    if (!r.ok) return;
    render(await r.json());
    $("login").hidden = true; $("status").hidden = false;
  } catch (e) { /* shown by askToken, or the next refresh */ }
}

function begin() {
  refresh();
  clearInterval(timer);
  timer = setInterval(refresh, 3000);
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  localStorage.setItem(KEY, $("token").value.trim());
  $("token").value = "";
  begin();
});
$("logout").addEventListener("click", () => { localStorage.removeItem(KEY); askToken(""); });
if (token()) begin(); else askToken("");
</script>
</body>
</html>
"""
