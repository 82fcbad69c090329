// The device page's zones and counting lines: drawn over each camera's latest frame, in the frame's
// pixels like the boxes, with today's line counts and each zone's occupancy now in a table below it.
"use strict";

const EFZones = (() => {
  const { api, el } = EF;
  const SVG = "http://www.w3.org/2000/svg";
  // Of the frame's shorter side: how long the arrow that marks a line's "in" side is.
  const ARROW = 0.06;

  let enc = "";
  const places = new Map(); // camera -> {zones, lines}, as the device reports them in effect
  const tiles = new Map(); // camera -> {svg, w, h, body}
  let counting = false;

  function svgEl(tag, attrs, ...children) {
    const n = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
    n.append(...children);
    return n;
  }

  function label(x, y, size, color, text) {
    return svgEl("text", { x, y, fill: color, "font-size": size, class: "place-label" }, text);
  }

  // Walking along a line from a to b, "in" is crossing it from the left to the right (the contract):
  // with y down, that is towards (-dy, dx). Positive scaling keeps the side, so pixels will do.
  function lineGroup(line, w, h, size) {
    const color = EF.color(`line:${line.id}`);
    const [ax, ay, bx, by] = [line.a[0] * w, line.a[1] * h, line.b[0] * w, line.b[1] * h];
    const len = Math.hypot(bx - ax, by - ay) || 1;
    const nx = -(by - ay) / len, ny = (bx - ax) / len;
    const reach = ARROW * Math.min(w, h);
    const mx = (ax + bx) / 2, my = (ay + by) / 2;
    const tx = mx + nx * reach, ty = my + ny * reach;
    const head = reach / 3;
    const back = [tx - nx * head, ty - ny * head];
    const arrow = `M${mx},${my} L${tx},${ty} M${back[0] + ny * head / 2},${back[1] - nx * head / 2} L${tx},${ty} L${back[0] - ny * head / 2},${back[1] + nx * head / 2}`;
    return svgEl("g", { class: "count-line", "data-line": line.id },
      svgEl("line", { x1: ax, y1: ay, x2: bx, y2: by, stroke: color, "data-line": line.id }),
      svgEl("path", { d: arrow, stroke: color, class: "in-arrow" }),
      label(tx + nx * size * 0.6 - size / 2, ty + ny * size * 0.6 + size / 3, size, color, "in"),
      label(ax + 3, ay - 3, size, color, line.id));
  }

  function zoneGroup(zone, w, h, size) {
    const color = EF.color(`zone:${zone.id}`);
    const pts = zone.points.map(([x, y]) => [x * w, y * h]);
    const top = pts.reduce((p, q) => (q[1] < p[1] || (q[1] === p[1] && q[0] < p[0]) ? q : p));
    return svgEl("g", { class: "zone", "data-zone": zone.id },
      svgEl("polygon", { points: pts.map((p) => p.join(",")).join(" "), fill: color, stroke: color, "data-zone": zone.id }),
      label(top[0] + 3, top[1] + size, size, color, zone.id));
  }

  // Under the boxes: a box stays readable over a zone's fill.
  function draw(camera) {
    const t = tiles.get(camera);
    if (!t || !t.svg || !t.w) return;
    const old = t.svg.querySelector("g.places");
    if (old) old.remove();
    const p = places.get(camera) || { zones: [], lines: [] };
    if (!p.zones.length && !p.lines.length) return;
    const size = Math.max(10, t.h / 28);
    const g = svgEl("g", { class: "places" });
    g.append(...p.zones.map((z) => zoneGroup(z, t.w, t.h, size)), ...p.lines.map((l) => lineGroup(l, t.w, t.h, size)));
    t.svg.prepend(g);
  }

  function tile(camera) {
    if (!tiles.has(camera)) tiles.set(camera, { svg: null, w: 0, h: 0, body: null });
    return tiles.get(camera);
  }

  // device.js calls this with each new figure: the counts table goes under its picture.
  function cameraTile(camera, fig) {
    const body = el("tbody", {});
    const table = el("table", { class: "zone-counts", dataset: { camera }, hidden: "" },
      el("thead", {}, el("tr", {}, el("th", {}, "line / zone"), el("th", { class: "num" }, "in today"),
        el("th", { class: "num" }, "out today"), el("th", { class: "num" }, "inside now"))),
      body);
    fig.append(table);
    tile(camera).body = body;
  }

  // device.js calls this after each frame's boxes are drawn, with the frame's size in pixels.
  function frameDrawn(camera, svg, w, h) {
    Object.assign(tile(camera), { svg, w, h });
    draw(camera);
  }

  function same(a, b) {
    return JSON.stringify(a) === JSON.stringify(b);
  }

  // Each refresh of the device view (the page's own timer): the places each camera reports in effect
  // (an agent that does not know zones reports none), then today's counts for them.
  function update(device) {
    enc = encodeURIComponent(device.id);
    for (const [camera, rep] of Object.entries(device.models || {})) {
      const p = { zones: rep.zones || [], lines: rep.lines || [] };
      if (same(places.get(camera), p)) continue;
      places.set(camera, p);
      draw(camera);
    }
    refreshCounts();
  }

  function sum(rows, field) {
    return rows.reduce((n, r) => n + (Number(r[field]) || 0), 0);
  }

  function row(kind, id, cells) {
    return el("tr", { dataset: Object.assign({ [kind]: id }, Object.fromEntries(cells.map(([k, v]) => [k, v === "" ? "" : String(v)]))) },
      el("td", {}, `${kind} ${id}`),
      ...cells.map(([, v]) => el("td", { class: "num" }, v === "" ? "–" : String(v))));
  }

  function renderCounts(camera, body, answer) {
    const p = places.get(camera) || { zones: [], lines: [] };
    const mine = (r) => r.camera === camera;
    const lines = answer.totals.lines.filter(mine), occ = answer.occupancy.filter(mine);
    // The places in effect first, then any counted earlier today that are no longer set.
    const lineIds = [...new Set([...p.lines.map((l) => l.id), ...lines.map((r) => r.line)])];
    const zoneIds = [...new Set([...p.zones.map((z) => z.id), ...occ.map((r) => r.zone)])];
    body.replaceChildren(
      ...lineIds.map((l) => {
        const rows = lines.filter((r) => r.line === l);
        return row("line", l, [["in", sum(rows, "in")], ["out", sum(rows, "out")], ["occupancy", ""]]);
      }),
      ...zoneIds.map((z) => {
        const rows = occ.filter((r) => r.zone === z);
        return row("zone", z, [["in", ""], ["out", ""], ["occupancy", rows.length ? sum(rows, "count") : ""]]);
      }));
    body.closest("table").hidden = !(lineIds.length || zoneIds.length);
    body.closest("table").dataset.asOf = answer.until;
  }

  async function refreshCounts() {
    if (counting || !enc || document.visibilityState !== "visible") return;
    if (![...tiles.values()].some((t) => t.body)) return;
    counting = true;
    try {
      const day = new Date();
      day.setHours(0, 0, 0, 0);
      const answer = await api(`/api/v1/counts?device=${enc}&bucket=86400&since=${encodeURIComponent(day.toISOString())}`);
      for (const [camera, t] of tiles) if (t.body) renderCounts(camera, t.body, answer);
    } catch (_) {
      /* the page's own refresh shows why the controller cannot be reached */
    } finally {
      counting = false;
    }
  }

  return { cameraTile, frameDrawn, update };
})();
