// Site operator's pool page: which device analyses which camera at what FPS, how full each device is,
// what cannot run and why, and what moved or is about to move.
"use strict";
(() => {
  const { api, el, badge, when } = EF;
  const name = decodeURIComponent(location.pathname.replace(/^\/pools\//, "").replace(/\/$/, ""));
  const enc = encodeURIComponent(name);
  const $ = (x) => document.getElementById(x);
  $("pool-name").textContent = name;
  document.title = `edgefleet · pool ${name}`;

  const fps = (v) => Number(v).toFixed(1);
  const msps = (v) => Number(v).toFixed(0);
  const devLink = (id) => el("a", { href: `/devices/${encodeURIComponent(id)}` }, id);
  const flag = (b) => String(Boolean(b));

  // Coloured by how close to the pool's headroom: the limit is already headroom x capacity, so a full
  // bar means "the planner will not add more here", not "the device is at 100 %".
  function loadBar(resource, label, value, limit) {
    const share = limit > 0 ? value / limit : 0;
    const level = share >= 1 ? "bad" : share >= 0.75 ? "warn" : "ok";
    return el("div", { class: "load", dataset: { resource, value: String(value), limit: String(limit) } },
      el("div", { class: "load-head" },
        el("span", {}, label),
        el("span", { class: "load-num" }, `${msps(value)} / ${msps(limit)} ms/s`)),
      el("div", {
        class: `bar ${level}`, role: "meter", "aria-label": `${label} load`,
        "aria-valuemin": "0", "aria-valuemax": String(limit), "aria-valuenow": String(value),
      }, el("span", { style: `width:${Math.min(100, share * 100).toFixed(1)}%` })));
  }

  function whyNoLoad(d) {
    if (d.draining) return "draining: takes no cameras";
    if (d.status === "decommissioned") return "decommissioned";
    if (!d.online && !d.in_grace) return "offline: takes no cameras";
    return "takes no cameras now";
  }

  function deviceStates(d) {
    const out = [badge(d.status)];
    if (d.in_grace) out.push(el("span", { class: "badge warning", title: "offline for less than the failover grace: keeps its cameras, takes no new" }, "in grace"));
    if (d.draining) out.push(badge("draining"));
    else if (d.cordoned) out.push(badge("cordoned"));
    return out;
  }

  function deviceCard(d, placed, leaving, degraded) {
    const load = d.load;
    const dataset = {
      device: d.id, status: d.status, online: flag(d.online), inGrace: flag(d.in_grace),
      cordoned: flag(d.cordoned), draining: flag(d.draining), cameras: String(d.cameras),
    };
    const cams = placed.map(([cam, p]) => {
      const deg = degraded[cam];
      const away = leaving.get(cam);
      return el("li", { class: "placement", dataset: { camera: cam, device: p.device, fps: String(p.fps) } },
        el("span", { class: "cam" }, cam),
        el("span", { class: "num" }, `${fps(p.fps)} FPS`),
        deg ? el("span", { class: "badge degraded", title: deg.reason }, `degraded, target ${fps(deg.target_fps)}`) : "",
        away ? el("span", { class: "muted" }, `→ ${away.target} (${away.reason})`) : "");
    });
    return el("div", { class: "pool-device", dataset },
      el("h3", {}, d.member === false ? d.id : devLink(d.id), " ", ...deviceStates(d)),
      load
        ? el("div", { class: "loads" },
          loadBar("lane", "inference", load.lane_ms_per_s, load.lane_limit),
          loadBar("cpu", "CPU", load.cpu_ms_per_s, load.cpu_limit),
          el("p", { class: "muted util", dataset: { field: "util", value: load.util === null ? "" : String(load.util) } },
            load.util === null ? "share of headroom: not measured" : `${(load.util * 100).toFixed(0)}% of headroom used`))
        : el("p", { class: "muted", dataset: { field: "load", value: "" } }, whyNoLoad(d)),
      cams.length ? el("ul", { class: "cams" }, cams) : el("p", { class: "muted" }, "no cameras"));
  }

  function renderDevices(p) {
    const byDevice = new Map();
    for (const [cam, pl] of Object.entries(p.placements)) {
      if (!byDevice.has(pl.device)) byDevice.set(pl.device, []);
      byDevice.get(pl.device).push([cam, pl]);
    }
    const leaving = new Map(p.pending.map((m) => [m.camera, m]));
    const devices = p.devices.slice();
    // A camera still recorded on a device the selector no longer matches: shown, not lost.
    for (const id of byDevice.keys()) {
      if (!devices.some((d) => d.id === id)) {
        devices.push({ id, member: false, online: false, status: "gone", in_grace: false, cordoned: false, draining: false, cameras: byDevice.get(id).length, load: null });
      }
    }
    $("devices").replaceChildren(...(devices.length
      ? devices.map((d) => deviceCard(d, byDevice.get(d.id) || [], leaving, p.degraded))
      : [el("p", { class: "muted" }, `no enrolled device matches the selector ${p.selector || "(every device)"}`)]));
  }

  function renderAttention(p) {
    const rows = [];
    for (const [cam, why] of Object.entries(p.unplaced)) {
      rows.push(el("tr", { class: "unplaced", dataset: { camera: cam, reason: why } },
        el("td", {}, cam), el("td", {}, badge("unplaced")), el("td", { class: "num" }, "—"), el("td", { class: "why" }, why)));
    }
    for (const [cam, d] of Object.entries(p.degraded)) {
      rows.push(el("tr", { class: "degraded", dataset: { camera: cam, fps: String(d.fps), targetFps: String(d.target_fps), reason: d.reason } },
        el("td", {}, cam), el("td", {}, badge("degraded")), el("td", { class: "num" }, `${fps(d.fps)} / ${fps(d.target_fps)}`),
        el("td", { class: "why" }, d.reason)));
    }
    $("attention").replaceChildren(...(rows.length ? rows
      : [el("tr", {}, el("td", { colspan: 4, class: "muted" }, "none: every camera runs at its target FPS"))]));
  }

  function moveCells(m) {
    return [
      el("td", {}, m.camera),
      el("td", {}, devLink(m.source), " → ", devLink(m.target)),
      el("td", { class: "num" }, fps(m.fps)),
    ];
  }
  const moveData = (m) => ({ camera: m.camera, source: m.source, target: m.target, fps: String(m.fps), reason: m.reason });

  function renderPending(p) {
    const rows = p.pending.map((m) => el("tr", { class: "pending", dataset: moveData(m) },
      ...moveCells(m), el("td", {}, el("span", { class: "reason" }, m.reason))));
    for (const h of p.held) {
      rows.push(el("tr", { class: "held", dataset: Object.assign(moveData(h), { why: h.why }) },
        ...moveCells(h), el("td", {}, el("span", { class: "reason" }, h.reason), " ", badge("held"), el("div", { class: "muted" }, h.why))));
    }
    $("pending").replaceChildren(...(rows.length ? rows
      : [el("tr", {}, el("td", { colspan: 4, class: "muted" }, "none: the stored plan is what a plan made now says"))]));
  }

  function renderMoves(p) {
    $("moves").replaceChildren(...(p.recent_moves.length ? p.recent_moves.map((m) => el("tr", { class: "move", dataset: Object.assign(moveData(m), { ts: m.ts }) },
      el("td", {}, when(m.ts)), ...moveCells(m), el("td", {}, el("span", { class: "reason" }, m.reason))))
      : [el("tr", {}, el("td", { colspan: 5, class: "muted" }, "no moves yet"))]));
  }

  function renderCameras(p) {
    $("cameras").replaceChildren(...(p.cameras.length ? p.cameras.map((c) => {
      const pl = p.placements[c.id];
      return el("tr", { class: "camera", dataset: { camera: c.id, device: pl ? pl.device : "", fps: pl ? String(pl.fps) : "" } },
        el("td", {}, c.id, c.pin ? el("span", { class: "muted", title: "an operator moved it here" }, ` (pinned to ${c.pin})`) : ""),
        el("td", {}, pl ? devLink(pl.device) : badge("unplaced")),
        el("td", { class: "num" }, `${pl ? fps(pl.fps) : "—"} / ${fps(c.target_fps)}`),
        el("td", { class: "num hide-sm" }, fps(c.min_fps)),
        el("td", {}, `${c.model}:${c.version}`),
        el("td", { class: "num hide-sm" }, String(c.priority)),
        el("td", { class: "hide-sm src" }, c.source));
    }) : [el("tr", {}, el("td", { colspan: 7, class: "muted" }, "no cameras declared"))]));
  }

  function renderPolicy(p) {
    const kv = (field, k, v, value) => el("div", {},
      el("span", { class: "k" }, k), el("span", { class: "v", dataset: { field, value: String(value) } }, v));
    $("policy").replaceChildren(
      kv("selector", "Selector", p.selector || "every device", p.selector),
      kv("strategy", "Strategy", p.strategy, p.strategy),
      kv("headroom", "Headroom", `${(p.headroom * 100).toFixed(0)}%`, p.headroom),
      kv("reserve_n1", "Keep N+1 reserve", p.reserve_n1 ? "yes" : "no", p.reserve_n1),
      kv("failover_grace_s", "Failover grace", `${p.failover_grace_s} s`, p.failover_grace_s),
      kv("failback", "Failback", p.failback, p.failback),
      kv("max_moves_per_min", "Moves a minute (not failures)", String(p.max_moves_per_min), p.max_moves_per_min),
      kv("min_dwell_s", "Minimum dwell", `${p.min_dwell_s} s`, p.min_dwell_s),
      kv("updated_at", "Declared", when(p.updated_at), p.updated_at));
  }

  function renderSummary(p) {
    const placed = Object.keys(p.placements).length;
    const unplaced = Object.keys(p.unplaced).length, degraded = Object.keys(p.degraded).length;
    const pl = $("placed");
    pl.textContent = `${placed}/${p.cameras.length} cameras placed on ${p.devices.length} device${p.devices.length === 1 ? "" : "s"}`;
    Object.assign(pl.dataset, { placed: String(placed), declared: String(p.cameras.length) });
    const pr = $("problems");
    pr.textContent = unplaced || degraded ? `${unplaced} unplaced, ${degraded} degraded` : "every camera at its target";
    pr.className = unplaced ? "err" : degraded ? "warn" : "muted";
    const n1 = $("n1");
    n1.replaceChildren("N+1 ", p.n_plus_one ? badge("ok") : el("span", { class: "badge risk" }, "at risk"));
    n1.dataset.value = flag(p.n_plus_one);
    $("pool").dataset.updatedAt = p.updated_at;
  }

  let busy = false;
  async function refresh() {
    if (busy) return;  // a slow answer must not be overwritten by an older one, nor pile up
    busy = true;
    try {
      const p = await api(`/api/v1/pools/${enc}`);
      renderSummary(p);
      renderDevices(p);
      renderAttention(p);
      renderPending(p);
      renderMoves(p);
      renderCameras(p);
      renderPolicy(p);
      $("refreshed").textContent = `updated ${new Date().toLocaleTimeString()}`;
      $("error").textContent = "";
    } catch (e) {
      $("error").textContent = e.message.startsWith("404") ? `no pool named ${name}` : `could not load pool ${name}: ${e.message}`;
    } finally {
      busy = false;
    }
  }
  refresh();
  setInterval(refresh, 2000);
})();
