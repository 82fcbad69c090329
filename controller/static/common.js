// Shared helpers of the edgefleet dashboard: API calls, the token's role, the page links, safe DOM
// building, formatting, canvas charts.
"use strict";

const EF = (() => {
  // The API token: taken once from the URL fragment (#token=…; browsers never send a fragment to the
  // server, so it lands in no log), then kept in localStorage and sent with every request.
  const TOKEN_KEY = "edgefleet.token";
  let memToken = "";  // when localStorage is not available (private windows of some browsers)

  function setToken(t) {
    memToken = t;
    try { if (t) localStorage.setItem(TOKEN_KEY, t); else localStorage.removeItem(TOKEN_KEY); } catch (_) { /* memory only */ }
  }
  function token() {
    try { return localStorage.getItem(TOKEN_KEY) || memToken; } catch (_) { return memToken; }
  }
  (function adoptFragmentToken() {
    const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
    if (!m) return;
    setToken(decodeURIComponent(m[1]));
    // Out of the address bar, history and bookmarks.
    history.replaceState(null, "", location.pathname + location.search);
  })();

  function tokenPrompt(detail) {
    if (document.getElementById("token-prompt")) return;
    const had = Boolean(token());
    const input = el("input", { id: "token-input", type: "password", autocomplete: "off", placeholder: "API token", "aria-label": "API token" });
    const save = el("button", { id: "token-save", type: "button" }, "Use this token");
    const forget = had ? el("button", { id: "token-forget", type: "button", class: "secondary" }, "Forget the stored token") : null;
    const box = el("div", { id: "token-prompt", class: "token-prompt", role: "alert" },
      el("strong", {}, had ? "The API token of this browser was refused." : "An API token is needed."),
      el("p", {}, `${had && detail ? detail.replace(/\.?$/, ". ") : ""}Ask an admin for a viewer token `
        + "(edgefleet tokens create --role viewer --name YOU) and open this page as …/#token=YOUR_TOKEN, or paste it here:"),
      el("div", { class: "token-row" }, input, save, forget));
    save.addEventListener("click", () => { if (input.value.trim()) { setToken(input.value.trim()); location.reload(); } });
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") save.click(); });
    if (forget) forget.addEventListener("click", () => { setToken(""); location.reload(); });
    document.body.prepend(box);
  }

  // fetch with the token; a 401 shows the token prompt (once).
  async function authFetch(path, opts = {}) {
    const t = token();
    const headers = Object.assign({}, opts.headers || {}, t ? { Authorization: `Bearer ${t}` } : {});
    const r = await fetch(path, Object.assign({}, opts, { headers }));
    if (r.status === 401) {
      let detail = "";
      try { detail = (await r.clone().json()).detail || ""; } catch (_) { /* not JSON */ }
      tokenPrompt(typeof detail === "string" ? detail : "");
    }
    return r;
  }

  async function failure(r) {
    let detail = r.statusText;
    try { detail = (await r.json()).detail || detail; } catch (_) { /* not JSON */ }
    return new Error(`${r.status}: ${typeof detail === "string" ? detail : JSON.stringify(detail)}`);
  }

  async function api(path) {
    const r = await authFetch(path, { headers: { Accept: "application/json" } });
    if (!r.ok) throw await failure(r);
    return r.json();
  }

  // An action (POST without a body); the API's refusal (403 for a viewer) comes back as the error.
  async function post(path) {
    const r = await authFetch(path, { method: "POST", headers: { Accept: "application/json" } });
    if (!r.ok) throw await failure(r);
    return r.json();
  }

  // What this browser's token may do ({name, role, allows}), asked once per page load. Pages show
  // actions by it; the API still decides every call.
  let me = null;
  function whoami() {
    if (!me) me = api("/api/v1/whoami").catch((e) => { me = null; throw e; });
    return me;
  }
  async function allows(role) {
    try { return (await whoami()).allows.includes(role); } catch (_) { return false; }
  }

  // The operator pages' links, in every page's <nav id="nav">; the current one marked.
  const PAGES = [["/", "fleet"], ["/models", "models"], ["/deployments", "deployments"], ["/agent-packages", "agent packages"]];
  function nav() {
    const box = document.getElementById("nav");
    if (!box) return;
    box.className = "pages";
    box.replaceChildren(...PAGES.map(([href, text]) =>
      el("a", { href, "aria-current": location.pathname === href ? "page" : null }, text)));
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", nav); else nav();

  // el("td", {class: "num", dataset: {x: 1}}, "text", childNode, ...): never parses HTML.
  function el(tag, attrs, ...children) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "dataset") Object.assign(n.dataset, v);
      else if (k === "class") n.className = v;
      else n.setAttribute(k, v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      n.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return n;
  }

  function notMeasured() { return el("span", { class: "nm" }, "not measured"); }

  function num(v, digits = 1, unit = "") {
    if (v === null || v === undefined || Number.isNaN(v)) return notMeasured();
    return `${Number(v).toFixed(digits)}${unit ? " " + unit : ""}`;
  }

  function ago(iso) {
    if (!iso) return "never";
    const s = (Date.now() - new Date(iso).getTime()) / 1000;
    if (s < 0) return "just now";
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
    return `${(s / 86400).toFixed(1)} d ago`;
  }

  function when(iso) {
    if (!iso) return "—";
    const d = new Date(iso);
    return `${d.toLocaleString()} (${ago(iso)})`;
  }

  function badge(text) { return el("span", { class: `badge ${text}` }, text); }

  const PALETTE = ["#58a6ff", "#3fb950", "#d29922", "#f85149", "#bc8cff", "#39c5cf", "#ff9bce", "#e3b341"];
  const colors = new Map();
  function color(key) {
    if (!colors.has(key)) colors.set(key, PALETTE[colors.size % PALETTE.length]);
    return colors.get(key);
  }

  function sizeCanvas(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 300, h = canvas.clientHeight || 180;
    if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return { ctx, w, h };
  }

  function axes(ctx, w, h, max, unit) {
    ctx.strokeStyle = "#2a3542"; ctx.fillStyle = "#8b98a5"; ctx.font = "11px system-ui";
    for (let i = 0; i <= 4; i++) {
      const y = 8 + (h - 24) * (1 - i / 4);
      ctx.beginPath(); ctx.moveTo(36, y); ctx.lineTo(w - 4, y); ctx.stroke();
      ctx.fillText(fmtTick(max * i / 4) + (i === 4 && unit ? unit : ""), 2, y + 4);
    }
  }
  function fmtTick(v) { return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2); }

  // Stacked bars: buckets = [{t, counts: {label: n}}], labels in stacking order.
  function barChart(canvas, buckets, labels) {
    const { ctx, w, h } = sizeCanvas(canvas);
    let max = 1;
    for (const b of buckets) max = Math.max(max, Object.values(b.counts).reduce((a, c) => a + c, 0));
    axes(ctx, w, h, max, "");
    const n = Math.max(buckets.length, 1), bw = (w - 44) / n;
    buckets.forEach((b, i) => {
      let y = h - 16;
      for (const lbl of labels) {
        const c = b.counts[lbl] || 0;
        if (!c) continue;
        const bh = (h - 24) * c / max;
        ctx.fillStyle = color(lbl);
        ctx.fillRect(40 + i * bw, y - bh, Math.max(1, bw - 2), bh);
        y -= bh;
      }
    });
  }

  // Lines: series = [{name, points: [[t_ms, value|null], ...]}].
  function lineChart(canvas, series, unit) {
    const { ctx, w, h } = sizeCanvas(canvas);
    let max = 0, t0 = Infinity, t1 = -Infinity;
    for (const s of series) for (const [t, v] of s.points) {
      if (v === null || v === undefined) continue;
      max = Math.max(max, v); t0 = Math.min(t0, t); t1 = Math.max(t1, t);
    }
    if (!Number.isFinite(t0)) {
      ctx.fillStyle = "#8b98a5"; ctx.font = "13px system-ui"; ctx.fillText("not measured", 44, h / 2);
      return;
    }
    max = max > 0 ? max * 1.1 : 1;
    axes(ctx, w, h, max, unit);
    const span = Math.max(t1 - t0, 1);
    for (const s of series) {
      ctx.strokeStyle = color(s.name); ctx.lineWidth = 1.5; ctx.beginPath();
      let pen = false;
      for (const [t, v] of s.points) {
        if (v === null || v === undefined) { pen = false; continue; }
        const x = 40 + (w - 46) * (t - t0) / span, y = 8 + (h - 24) * (1 - v / max);
        if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        pen = true;
      }
      ctx.stroke();
    }
  }

  function legend(container, names) {
    container.replaceChildren(...names.map((n) => el("span", { style: `--c:${color(n)}` }, n)));
  }

  function liveSocket(params, onMessage, onState) {
    const qs = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== null && v !== undefined && v !== ""));
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    let ws, retry = 1000;
    function open() {
      // Browsers cannot set headers on a WebSocket: the token goes as a second subprotocol (base64url),
      // next to "edgefleet", the one the controller answers with.
      const t = token();
      const protocols = t ? ["edgefleet", `bearer.${b64url(t)}`] : [];
      ws = new WebSocket(`${proto}//${location.host}/api/v1/detections/live?${qs}`, protocols);
      ws.onopen = () => { retry = 1000; onState("live"); };
      ws.onmessage = (e) => { try { onMessage(JSON.parse(e.data)); } catch (_) { /* ignore */ } };
      ws.onclose = () => { onState("reconnecting"); setTimeout(open, retry); retry = Math.min(retry * 2, 15000); };
    }
    open();
    return () => ws && ws.close();
  }

  function b64url(text) {
    let bin = "";
    for (const b of new TextEncoder().encode(text)) bin += String.fromCharCode(b);
    return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  return { api, post, failure, whoami, allows, authFetch, el, num, ago, when, badge, color, barChart, lineChart, legend, liveSocket, notMeasured };
})();
