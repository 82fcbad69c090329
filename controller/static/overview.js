// Fleet overview: devices grouped by their "site" label, alerts, live feed and per-label chart.
"use strict";
(() => {
  const { api, el, num, badge, ago } = EF;
  const BUCKET_S = 10, WINDOW_S = 300, FEED_MAX = 60;

  function alertsOf(d, errors) {
    const out = [];
    if (d.status !== "online") out.push(["bad", `offline ${d.offline_since ? "since " + ago(d.offline_since) : ""}`.trim()]);
    for (const c of d.cameras) if (c.state !== "up") out.push(["bad", `camera ${c.camera} ${c.state}`]);
    for (const [cam, m] of Object.entries(d.models || {})) if (m.state === "failed") out.push(["bad", `${cam}: model failed${m.error ? " (" + m.error + ")" : ""}`]);
    if (d.stats && d.stats.lost > 0) out.push(["warn", `${d.stats.lost} messages lost`]);
    const h = d.last_health || {};
    if (h.disk_pct !== null && h.disk_pct !== undefined && h.disk_pct > 90) out.push(["warn", `disk ${h.disk_pct}% full`]);
    if (h.outbox_dropped > 0) out.push(["warn", `outbox dropped ${h.outbox_dropped}`]);
    const n = errors.get(d.id) || 0;
    if (n) out.push(["warn", `${n} error event${n > 1 ? "s" : ""} in the last hour`]);
    return out;
  }

  function modelsOf(d) {
    const names = new Set();
    for (const m of Object.values(d.models || {})) if (m.model) names.add(m.model);
    for (const c of d.cameras) if (c.model) names.add(c.model);
    return [...names].join(", ") || "—";
  }

  function deviceRow(d, errors, energy) {
    const fps = d.cameras.reduce((a, c) => a + (c.fps || 0), 0);
    const alerts = alertsOf(d, errors);
    const e = energy.get(d.id);
    return el("tr", { dataset: { device: d.id, status: d.status } },
      el("td", {}, el("a", { href: `/devices/${encodeURIComponent(d.id)}` }, d.name ? `${d.name} (${d.id})` : d.id)),
      el("td", {}, badge(d.status)),
      el("td", {}, modelsOf(d)),
      el("td", { class: "num" }, d.cameras.length ? fps.toFixed(1) : "—"),
      el("td", { class: "num hide-sm" }, e && e.joules_per_frame !== null ? `${e.joules_per_frame.toFixed(3)} J` : EF.notMeasured()),
      el("td", { class: "hide-sm" }, d.agent_version || "—"),
      el("td", {}, alerts.length ? el("ul", { class: "alerts" }, alerts.map(([k, t]) => el("li", { class: k }, t))) : el("span", { class: "muted" }, "none")),
    );
  }

  async function refreshDevices() {
    const errBox = document.getElementById("devices-error");
    try {
      const since = new Date(Date.now() - 3600e3).toISOString();
      const [devices, events, energy] = await Promise.all([
        api("/api/v1/devices"),
        api(`/api/v1/events/search?severity=error&since=${encodeURIComponent(since)}&limit=1000`).catch(() => []),
        api(`/api/v1/energy?since=${encodeURIComponent(new Date(Date.now() - 600e3).toISOString())}`).catch(() => null),
      ]);
      const errors = new Map();
      for (const e of events) errors.set(e.device_id, (errors.get(e.device_id) || 0) + 1);
      const en = new Map();
      if (energy) for (const d of energy.devices) en.set(d.device, d);
      const sites = new Map();
      for (const d of devices) {
        const site = (d.labels && d.labels.site) || "(no site label)";
        if (!sites.has(site)) sites.set(site, []);
        sites.get(site).push(d);
      }
      const box = document.getElementById("sites");
      if (!devices.length) { box.replaceChildren(el("p", { class: "muted" }, "no devices yet")); }
      else box.replaceChildren(...[...sites.keys()].sort().map((site) => {
        const list = sites.get(site);
        const on = list.filter((d) => d.status === "online").length;
        return el("div", { class: "site", dataset: { site } },
          el("h3", {}, `${site} `, el("span", { class: "muted" }, `${on}/${list.length} online`)),
          el("div", { class: "scroll" }, el("table", {},
            el("thead", {}, el("tr", {}, ["device", "status", "models", "FPS", "J/frame", "agent", "alerts"].map((h, i) =>
              el("th", { class: [3, 4].includes(i) ? "num" + (i === 4 ? " hide-sm" : "") : i === 5 ? "hide-sm" : "" }, h)))),
            el("tbody", {}, list.map((d) => deviceRow(d, errors, en))))));
      }));
      const online = devices.filter((d) => d.status === "online").length;
      document.getElementById("count-online").textContent = `${online} online`;
      document.getElementById("count-offline").textContent = `${devices.length - online} offline`;
      const f = energy && energy.fleet;
      document.getElementById("fleet-energy").replaceChildren("energy (10 min): ",
        f && f.energy_j !== null ? `${f.energy_j.toFixed(0)} J, ${f.joules_per_frame !== null ? f.joules_per_frame.toFixed(3) + " J/frame" : "no frames"}` : EF.notMeasured());
      errBox.textContent = "";
    } catch (e) {
      errBox.textContent = `could not load devices: ${e.message}`;
    }
  }

  // ---- camera pools: hidden while there are none, so a fleet without pools sees no empty box
  async function refreshPools() {
    const section = document.getElementById("pools-section");
    const errBox = document.getElementById("pools-error");
    try {
      const pools = await api("/api/v1/pools");
      section.dataset.pools = String(pools.length);
      section.hidden = pools.length === 0;
      document.getElementById("pools").replaceChildren(...pools.map((p) => {
        const short = p.placed < p.cameras;
        return el("tr", { dataset: { pool: p.name, devices: String(p.devices), placed: String(p.placed), cameras: String(p.cameras) } },
          el("td", {}, el("a", { class: "pool-link", href: `/pools/${encodeURIComponent(p.name)}` }, p.name)),
          el("td", { class: "num" }, String(p.devices)),
          el("td", { class: `num${short ? " warn" : ""}` }, `${p.placed} / ${p.cameras}`),
          el("td", { class: "hide-sm" }, p.selector || el("span", { class: "muted" }, "every device")),
          el("td", { class: "hide-sm" }, p.strategy));
      }));
      errBox.textContent = "";
    } catch (e) {
      section.hidden = false;
      errBox.textContent = `could not load pools: ${e.message}`;
    }
  }

  // ---- live feed and chart
  const buckets = new Map(); // bucket start (s) -> {label: n}
  const labels = new Set();
  function add(tsMs, label, n) {
    const b = Math.floor(tsMs / 1000 / BUCKET_S) * BUCKET_S;
    if (!buckets.has(b)) buckets.set(b, {});
    const c = buckets.get(b);
    c[label] = (c[label] || 0) + n;
    labels.add(label);
  }
  function drawChart() {
    const now = Math.floor(Date.now() / 1000 / BUCKET_S) * BUCKET_S;
    const list = [];
    for (let t = now - WINDOW_S + BUCKET_S; t <= now; t += BUCKET_S) list.push({ t, counts: buckets.get(t) || {} });
    for (const k of buckets.keys()) if (k < now - WINDOW_S) buckets.delete(k);
    const order = [...labels].sort();
    EF.barChart(document.getElementById("label-chart"), list, order);
    EF.legend(document.getElementById("label-legend"), order);
  }
  async function seedChart() {
    try {
      const s = await api(`/api/v1/detections/stats?bucket=${BUCKET_S}&since=${encodeURIComponent(new Date(Date.now() - WINDOW_S * 1000).toISOString())}`);
      for (const b of s.buckets) for (const [lbl, n] of Object.entries(b.counts)) add(new Date(b.start).getTime(), lbl, n);
    } catch (_) { /* the live feed still fills it */ }
    drawChart();
  }

  let droppedTotal = 0;
  function onLive(m) {
    if (m.type === "dropped") {
      droppedTotal += m.count;
      document.getElementById("feed-dropped").textContent = `${droppedTotal} detections skipped (this browser fell behind)`;
      return;
    }
    if (m.type !== "detection") return;
    add(new Date(m.captured_at || m.stored_at).getTime(), m.label, 1);
    const feed = document.getElementById("feed");
    feed.prepend(el("li", { class: "det", dataset: { label: m.label, device: m.device } },
      el("span", { class: "lbl", style: `color:${EF.color(m.label)}` }, m.label),
      el("span", {}, `${(m.score * 100).toFixed(0)}%`),
      el("span", {}, el("a", { href: `/devices/${encodeURIComponent(m.device)}` }, m.device), ` / ${m.camera}`),
      el("span", { class: "muted" }, `frame ${m.frame} · ${new Date(m.captured_at).toLocaleTimeString()}`)));
    while (feed.children.length > FEED_MAX) feed.lastChild.remove();
  }

  refreshDevices();
  setInterval(refreshDevices, 3000);
  refreshPools();
  setInterval(refreshPools, 5000);
  seedChart();
  setInterval(drawChart, 1000);
  window.addEventListener("resize", drawChart);
  EF.liveSocket({}, onLive, (s) => { document.getElementById("feed-state").textContent = s; });
})();
