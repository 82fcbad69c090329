// Technician device page: is it working, and if not, why; what each camera sees now.
"use strict";
(() => {
  const { api, el, num, badge, when, ago } = EF;
  const id = decodeURIComponent(location.pathname.replace(/^\/devices\//, "").replace(/\/$/, ""));
  const enc = encodeURIComponent(id);
  document.getElementById("device-id").textContent = id;
  document.title = `edgefleet · ${id}`;
  const $ = (x) => document.getElementById(x);

  function setVal(node, value, digits, unit, hbTs) {
    node.replaceChildren(num(value, digits, unit));
    node.dataset.value = value === null || value === undefined ? "" : String(value);
    node.dataset.hbTs = hbTs === undefined ? "" : String(hbTs);
  }

  // The p99 beside the median: a slow tail (what the rollout gate judges) hides under a fine median.
  // "—", not "not measured": agents from before p99 do not report it at all.
  function p99Cell(v, hbTs) {
    const absent = v === null || v === undefined || Number.isNaN(v);
    return el("td", { class: "num", dataset: { field: "p99", value: absent ? "" : String(v), hbTs: hbTs === undefined ? "" : String(hbTs) } },
      absent ? "—" : `${Number(v).toFixed(1)} ms`);
  }

  function duration(s) {
    if (s === null || s === undefined) return EF.notMeasured();
    if (s < 120) return `${s.toFixed(0)} s`;
    if (s < 7200) return `${(s / 60).toFixed(0)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }

  // A model on its way (download, verify, engine build): how far, as the device last reported it.
  function inProgress(rep) {
    if (rep.progress_pct === null || rep.progress_pct === undefined) return "";
    if (!["fetching", "verifying", "loading"].includes(rep.state)) return "";
    const pct = Math.max(0, Math.min(100, Number(rep.progress_pct)));
    return el("span", { class: "progress", dataset: { field: "progress", value: String(pct) } },
      " ", el("progress", { max: "100", value: String(pct) }), ` ${pct.toFixed(0)}%`);
  }

  async function snapshot(camera, btn) {
    const box = $("snapshot-box");
    btn.disabled = true;
    box.replaceChildren(el("p", { class: "muted" }, `asking ${id} for ${camera}'s current frame…`));
    try {
      const r = await EF.authFetch(`/api/v1/devices/${enc}/cameras/${encodeURIComponent(camera)}/snapshot?boxes=true`);
      if (!r.ok) throw await EF.failure(r);
      const url = URL.createObjectURL(await r.blob());
      const img = el("img", { id: "snapshot-img", alt: `snapshot of ${camera}`, src: url });
      box.replaceChildren(el("p", { class: "muted" }, `${camera}, frame ${r.headers.get("X-Snapshot-Frame") || "?"}, ${r.headers.get("X-Snapshot-Boxes") || 0} boxes, taken ${new Date().toLocaleTimeString()}`), img);
    } catch (e) {
      box.replaceChildren(el("p", { class: "err", id: "snapshot-error" }, `snapshot failed: ${e.message}`));
    } finally {
      btn.disabled = false;
    }
  }

  function render(d, energy) {
    const h = d.last_health || {};
    const hb = h.ts;
    const st = $("status");
    st.replaceChildren(badge(d.status));
    st.dataset.status = d.status;
    $("status-since").textContent = d.status === "online" ? `online since ${when(d.online_since)}`
      : d.status === "decommissioned" ? `decommissioned ${when(d.decommissioned_at)}`
      : `offline since ${when(d.offline_since)}`;
    $("last-heartbeat").textContent = hb ? `${new Date(hb * 1000).toLocaleTimeString()} (${ago(new Date(hb * 1000).toISOString())})` : "none yet";
    $("last-heartbeat").dataset.hbTs = hb === undefined ? "" : String(hb);
    const ag = d.agent || {};
    $("agent-version").textContent = ag.version || d.agent_version || "unknown";
    // Running version vs. desired, the update's state and, after a failure or roll back, why.
    const upd = [];
    if (ag.desired && ag.desired !== ag.version) upd.push(`→ ${ag.desired}`);
    if (ag.state && ag.state !== "idle") upd.push(ag.progress_pct == null ? ag.state : `${ag.state} ${ag.progress_pct.toFixed(0)}%`);
    if (ag.error && (ag.state === "failed" || ag.state === "rolled_back")) upd.push(ag.error);
    $("agent-update").textContent = upd.length ? upd.join(" · ") : ag.desired ? "up to date" : "–";
    $("agent-update").dataset.state = ag.state || "";
    $("incarnation").textContent = d.incarnation
      ? `${d.incarnation.slice(0, 8)} since ${when(d.incarnation_started_at)}` : "legacy / none";
    $("incarnation").dataset.incarnation = d.incarnation || "";
    clock(d);
    setVal($("cpu"), h.cpu_pct, 1, "%", hb);
    setVal($("memory"), h.memory_pct, 1, "%", hb);
    setVal($("disk"), h.disk_pct, 1, "%", hb);
    setVal($("disk-free"), h.disk_free_mb === undefined || h.disk_free_mb === null ? null : h.disk_free_mb / 1024, 1, "GiB", hb);
    $("uptime").replaceChildren(duration(h.uptime_s));
    $("outbox").textContent = h.outbox_pending === undefined ? "–" : `${h.outbox_pending} / ${h.outbox_dropped}`;
    const e = energy && energy.devices.find((x) => x.device === id);
    $("energy-jpf").replaceChildren(e && e.joules_per_frame !== null ? `${e.joules_per_frame.toFixed(3)} J` : EF.notMeasured());
    $("energy-power").replaceChildren(e && e.avg_power_w !== null ? `${e.avg_power_w.toFixed(1)} W (${e.sources.join(", ")})` : EF.notMeasured());

    const gpus = h.gpus || [];
    $("gpus").replaceChildren(...(gpus.length ? gpus.map((g) => el("tr", { dataset: { gpu: g.index } },
      el("td", {}, `${g.index}: ${g.name}`),
      el("td", { class: "num" }, num(g.utilization_pct, 0, "%")),
      el("td", { class: "num" }, g.memory_used_mb === null || g.memory_used_mb === undefined ? EF.notMeasured()
        : `${(g.memory_used_mb / 1024).toFixed(1)} / ${g.memory_total_mb ? (g.memory_total_mb / 1024).toFixed(1) : "?"} GiB`),
      el("td", { class: "num" }, num(g.temperature_c, 0, "°C")),
      el("td", { class: "num" }, num(g.power_w, 1, "W")),
    )) : [el("tr", {}, el("td", { colspan: 5 }, el("span", { class: "nm" }, "no GPU reported: GPU metrics not measured")))]));

    const cams = d.cameras || [];
    const known = new Set(cams.map((c) => c.camera));
    for (const cam of Object.keys(d.models || {})) if (!known.has(cam)) cams.push({ camera: cam, state: "unknown" });
    $("cameras").replaceChildren(...(cams.length ? cams.map((c) => {
      const rep = (d.models || {})[c.camera] || {};
      const btn = el("button", { type: "button", class: "snap", dataset: { camera: c.camera } }, "snapshot");
      btn.addEventListener("click", () => snapshot(c.camera, btn));
      if (d.status !== "online") btn.disabled = true;
      return labelled(el("tr", { dataset: { camera: c.camera } },
        el("td", {}, c.camera),
        el("td", {}, badge(c.state)),
        el("td", { class: "num", dataset: { field: "fps" } }, num(c.fps, 1)),
        el("td", { class: "num" }, c.dropped === undefined ? "–" : String(c.dropped)),
        el("td", { class: "num hide-sm" }, c.frames === undefined ? "–" : String(c.frames)),
        el("td", { class: "num", dataset: { field: "median" } }, num(c.inference_ms, 1, "ms")),
        p99Cell(c.inference_p99_ms, hb),
        el("td", {}, rep.model || c.model || "none", rep.state ? " " : "", rep.state ? badge(rep.state) : "",
          inProgress(rep), rep.error ? el("div", { class: "err" }, rep.error) : ""),
        el("td", {}, btn)), "cameras");
    }) : [el("tr", {}, el("td", { colspan: 9, class: "muted" }, "no cameras reported yet"))]));
    online = d.status === "online";
    syncTiles(cams.map((c) => c.camera));
  }

  // Detection times are the device's clock: one that is off misplaces them, so it is flagged here.
  function clock(d) {
    const off = Boolean(d.clock_off), v = d.clock_offset_s;
    $("clock-offset").textContent = v === null || v === undefined ? "not measured"
      : `${v >= 0 ? "+" : ""}${v.toFixed(1)} s${off ? " (off: check the device's NTP)" : ""}`;
    $("clock").classList.toggle("clock-off", off);
    $("clock").dataset.off = String(off);
  }

  // Each cell names its column (data-label): under a phone's width the rows are cards (app.css).
  function labelled(tr, tbody) {
    const heads = [...$(tbody).closest("table").querySelectorAll("thead th")].map((th) => th.textContent);
    [...tr.children].forEach((td, i) => { if (heads[i]) td.dataset.label = heads[i]; });
    return tr;
  }

  // ---- the latest frame of each camera with the boxes of its newest stored detections drawn over it
  const FRAME_EVERY_MS = 5000;
  const SVG = "http://www.w3.org/2000/svg";
  const tiles = new Map(); // camera -> {fig, img, svg, cap, busy, url}
  let online = false;

  function svgEl(tag, attrs) {
    const n = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
    return n;
  }

  function syncTiles(cameras) {
    for (const [cam, t] of tiles) {
      if (cameras.includes(cam)) continue;
      t.fig.remove();
      if (t.url) URL.revokeObjectURL(t.url);
      tiles.delete(cam);
    }
    let fresh = false;
    for (const cam of cameras) {
      if (tiles.has(cam)) continue;
      const img = el("img", { alt: `latest frame of ${cam}` });
      const svg = svgEl("svg", { preserveAspectRatio: "none", "aria-hidden": "true" });
      const cap = el("figcaption", {}, "waiting for a frame…");
      const fig = el("figure", { class: "frame", dataset: { camera: cam } }, el("div", { class: "pic" }, img, svg), cap);
      tiles.set(cam, { fig, img, svg, cap, busy: false, url: "" });
      $("frames").append(fig);
      EFTroubleshoot.cameraTile(cam, fig);
      EFZones.cameraTile(cam, fig);
      fresh = true;
    }
    if (fresh) refreshFrames();
  }

  // Boxes are in the frame's pixels; the viewBox is the snapshot's size, so they land where the
  // detector saw them whatever size the image is shown at.
  function drawBoxes(svg, w, h, boxes) {
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    const size = Math.max(10, h / 28);
    svg.replaceChildren(...boxes.map((d) => {
      const g = svgEl("g", { "data-label": d.label });
      const color = EF.color(d.label);
      const { x0, y0, x1, y1 } = d.box;
      g.append(svgEl("rect", { x: x0, y: y0, width: Math.max(0, x1 - x0), height: Math.max(0, y1 - y0), stroke: color }));
      const text = svgEl("text", { x: x0 + 2, y: Math.max(size, y0 - 3), fill: color, "font-size": size });
      text.textContent = `${d.label} ${(d.score * 100).toFixed(0)}%`;
      g.append(text);
      return g;
    }));
  }

  async function loadFrame(camera, t) {
    if (t.busy) return;
    t.busy = true;
    const cam = encodeURIComponent(camera);
    try {
      const [r, page] = await Promise.all([
        EF.authFetch(`/api/v1/devices/${enc}/cameras/${cam}/snapshot`),
        api(`/api/v1/detections?device=${enc}&camera=${cam}&limit=100`),
      ]);
      if (!r.ok) throw await EF.failure(r);
      const url = URL.createObjectURL(await r.blob());
      await new Promise((ok, bad) => { t.img.onload = ok; t.img.onerror = () => bad(new Error("not an image")); t.img.src = url; });
      if (t.url) URL.revokeObjectURL(t.url);
      t.url = url;
      const w = Number(r.headers.get("X-Snapshot-Width")) || t.img.naturalWidth;
      const h = Number(r.headers.get("X-Snapshot-Height")) || t.img.naturalHeight;
      const newest = page.items[0];
      const boxes = newest ? page.items.filter((x) => x.frame === newest.frame && x.captured_at === newest.captured_at) : [];
      drawBoxes(t.svg, w, h, boxes);
      EFZones.frameDrawn(camera, t.svg, w, h);
      Object.assign(t.fig.dataset, {
        boxes: String(boxes.length),
        detFrame: newest ? String(newest.frame) : "",
        detCaptured: newest ? newest.captured_at : "",
        snapshotFrame: r.headers.get("X-Snapshot-Frame") || "",
        error: "",
      });
      t.cap.textContent = `${camera} · frame ${r.headers.get("X-Snapshot-Frame") || "?"} at ${new Date().toLocaleTimeString()} · `
        + (newest ? `${boxes.length} box${boxes.length === 1 ? "" : "es"} from frame ${newest.frame} (${ago(newest.captured_at)})` : "no detections stored yet");
    } catch (e) {
      t.fig.dataset.error = e.message;
      t.cap.textContent = `${camera}: no current frame (${e.message})`;
    } finally {
      t.busy = false;
    }
  }

  function refreshFrames() {
    if (!online || document.visibilityState !== "visible") return;
    for (const [cam, t] of tiles) loadFrame(cam, t);
  }

  // Rows that would bury the rest: a model download reports every 10 %, a busy camera starts and
  // ends a track every second, and each live frame above is a snapshot command with its result
  // recorded. A download is one row per (camera, model), its newest report shown (going back in time,
  // a verify, activate or failure of that camera's model ends the run, so an earlier download is a
  // row of its own); consecutive track events of a camera, and consecutive successful command
  // results, are one row each.
  const EVENT_ROWS = 25;
  const TRACK_KINDS = new Set(["track_started", "track_ended"]);
  function collapseEvents(events) {
    const rows = [];
    const open = new Map();
    let run = null;
    for (const e of events) {
      const cam = e.camera || "";
      const kind = TRACK_KINDS.has(e.kind) ? "tracks" : e.kind === "command_result" && e.severity === "info" ? "commands" : "";
      if (kind) {
        if (!run || run.kind !== kind || run.camera !== e.camera) {
          run = Object.assign({}, e, { kind, count: 0, started: 0, ended: 0, labels: new Map() });
          rows.push(run);
        }
        run.count += 1;
        if (kind === "tracks") {
          run[e.kind === "track_started" ? "started" : "ended"] += 1;
          const label = (e.data || {}).label || "?";
          run.labels.set(label, (run.labels.get(label) || 0) + 1);
        }
        continue;
      }
      run = null;
      if (e.kind === "model_download") {
        const key = `${cam}\u0000${(e.data || {}).model || ""}`;
        const run = open.get(key);
        if (run) { run.reports += 1; continue; }
        const row = Object.assign({}, e, { reports: 1 });
        open.set(key, row);
        rows.push(row);
        continue;
      }
      if (e.kind.startsWith("model_")) for (const key of [...open.keys()]) if (key.startsWith(`${cam}\u0000`)) open.delete(key);
      rows.push(e);
    }
    // The newest rows, and any older error or warning the cut would hide.
    return rows.slice(0, EVENT_ROWS).concat(rows.slice(EVENT_ROWS).filter((e) => e.severity !== "info"));
  }

  // The newest events with the newest errors and warnings, which a burst of others must not push out.
  function mergeEvents(recent, problems) {
    const seen = new Set(recent.map((e) => e.id));
    return recent.concat(problems.filter((e) => !seen.has(e.id)))
      .sort((a, b) => new Date(b.ts) - new Date(a.ts) || b.id - a.id);
  }

  function eventMessage(e) {
    if (e.kind === "commands") return el("span", { dataset: { field: "commands", count: String(e.count) } }, `${e.count} answered`);
    if (e.kind === "tracks") {
      const labels = [...e.labels].map(([l, n]) => `${l} ×${n}`).join(", ");
      return el("span", { dataset: { field: "tracks", started: String(e.started), ended: String(e.ended) } },
        `${e.started} started, ${e.ended} ended`, el("span", { class: "muted" }, ` (${labels})`));
    }
    if (e.kind !== "model_download") return e.message || "";
    const data = e.data || {};
    const pct = Math.max(0, Math.min(100, Number(data.pct) || 0));
    return el("span", { class: "progress", dataset: { field: "download", model: data.model || "", value: String(pct), reports: String(e.reports) } },
      `${data.model || "model"} `, el("progress", { max: "100", value: String(pct) }), ` ${pct.toFixed(0)}%`,
      e.reports > 1 ? el("span", { class: "muted" }, ` (${e.reports} progress reports)`) : "");
  }

  function renderEvents(events) {
    const rows = collapseEvents(events);
    $("events").replaceChildren(...(rows.length ? rows.map((e) => labelled(el("tr", { dataset: { kind: e.kind, severity: e.severity } },
      el("td", {}, new Date(e.ts).toLocaleString()),
      el("td", {}, badge(e.severity)),
      el("td", {}, e.kind),
      el("td", { class: "hide-sm" }, e.camera || ""),
      el("td", {}, eventMessage(e))), "events")) : [el("tr", {}, el("td", { colspan: 5, class: "muted" }, "no events"))]));
  }

  function renderHistory(samples) {
    const pts = samples.slice().reverse().map((s) => [new Date(s.ts).getTime(), s.payload || {}]);
    EF.lineChart($("chart-system"), [
      { name: "CPU %", points: pts.map(([t, p]) => [t, p.cpu_pct]) },
      { name: "memory %", points: pts.map(([t, p]) => [t, p.memory_pct]) },
    ], "%");
    EF.legend($("legend-system"), ["CPU %", "memory %"]);
    const cams = new Set();
    for (const [, p] of pts) for (const c of p.cameras || []) cams.add(c.camera);
    const fps = [...cams].sort().map((cam) => ({ name: cam, points: pts.map(([t, p]) => [t, ((p.cameras || []).find((c) => c.camera === cam) || {}).fps]) }));
    EF.lineChart($("chart-fps"), fps, "");
    EF.legend($("legend-fps"), fps.map((s) => s.name));
    const gpus = new Set();
    for (const [, p] of pts) for (const g of p.gpus || []) gpus.add(g.index);
    const gs = [];
    for (const i of [...gpus].sort()) {
      gs.push({ name: `GPU${i} W`, points: pts.map(([t, p]) => [t, ((p.gpus || []).find((g) => g.index === i) || {}).power_w]) });
      gs.push({ name: `GPU${i} °C`, points: pts.map(([t, p]) => [t, ((p.gpus || []).find((g) => g.index === i) || {}).temperature_c]) });
    }
    EF.lineChart($("chart-gpu"), gs, "");
    EF.legend($("legend-gpu"), gs.map((s) => s.name));
  }

  async function refresh() {
    try {
      const [d, events, problems, energy] = await Promise.all([
        api(`/api/v1/devices/${enc}`),
        api(`/api/v1/events?device=${enc}&limit=200`),
        api(`/api/v1/events/search?device=${enc}&severity=error&severity=warning&limit=${EVENT_ROWS}`),
        api(`/api/v1/energy?device=${enc}&since=${encodeURIComponent(new Date(Date.now() - 600e3).toISOString())}`).catch(() => null),
      ]);
      render(d, energy);
      EFZones.update(d);
      renderEvents(mergeEvents(events, problems));
      $("error").textContent = "";
    } catch (e) {
      $("error").textContent = `could not load ${id}: ${e.message}`;
    }
  }
  async function refreshHistory() {
    try { renderHistory(await api(`/api/v1/devices/${enc}/health?limit=600`)); } catch (_) { /* shown by refresh */ }
  }
  EFTroubleshoot.mount(id, $("camera-section"));
  refresh();
  refreshHistory();
  setInterval(refresh, 2000);
  setInterval(refreshHistory, 10000);
  setInterval(refreshFrames, FRAME_EVERY_MS);
  document.addEventListener("visibilitychange", refreshFrames);
})();
