// The technician page's troubleshooting: the device's recent log, a diagnostics bundle and a probe of
// each camera's source, asked of the device itself through the controller. Operator and admin tokens
// only: a device's log and configuration are not for every viewer (the API refuses them a 403 anyway,
// so a viewer is not shown buttons that can only fail).
"use strict";

const EFTroubleshoot = (() => {
  const { el } = EF;
  // The device's own bound on a probe; the API waits that long plus its command timeout.
  const PROBE_TIMEOUT_S = 10;
  const LOG_LINES = 200;
  const LEVELS = ["debug", "info", "warning", "error"];

  let enc = "";
  let allowed = null; // a promise of whether this token may troubleshoot

  // Why the device could not answer, in a technician's words; the API's detail follows.
  const REFUSALS = {
    403: "this token may not troubleshoot devices (the operator role is needed)",
    404: "not known to the controller",
    409: "the device is offline, so it cannot answer",
    502: "the device answered with an error",
    503: "the device or the controller's broker link is not ready",
    504: "the device did not answer in time",
  };

  async function ask(method, path) {
    let r;
    try {
      r = await EF.authFetch(path, { method, headers: { Accept: "application/json" } });
    } catch (e) {
      throw new Error(`could not reach the controller (${e.message})`);
    }
    if (r.ok) return r.json();
    let detail = "";
    try { detail = (await r.json()).detail || ""; } catch (_) { /* not JSON */ }
    if (typeof detail !== "string") detail = JSON.stringify(detail);
    const words = REFUSALS[r.status] || `the controller answered ${r.status} ${r.statusText}`;
    const err = new Error(detail ? `${words}: ${detail}` : words);
    err.status = r.status;
    throw err;
  }

  function failed(box, what, e) {
    box.dataset.state = "error";
    box.dataset.status = e.status ? String(e.status) : "";
    box.replaceChildren(el("p", { class: "err", dataset: { field: "error" } }, `${what} failed: ${e.message}`));
  }

  // Run `work` with the button disabled and a line saying what is awaited; errors shown in `box`.
  async function busy(btn, box, waiting, what, work) {
    btn.disabled = true;
    box.dataset.state = "waiting";
    box.replaceChildren(el("p", { class: "muted" }, waiting));
    try {
      await work();
      box.dataset.state = "done";
    } catch (e) {
      failed(box, what, e);
    } finally {
      btn.disabled = false;
    }
  }

  function time(ts) {
    return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
  }

  // ---- logs: oldest first from the API, so the newest line is at the bottom, scrolled into view
  async function showLogs(btn, level, box) {
    const lvl = level.value;
    await busy(btn, box, `asking the device for its log (${lvl} and above)…`, "logs", async () => {
      const got = await ask("GET", `/api/v1/devices/${enc}/logs?lines=${LOG_LINES}&level=${encodeURIComponent(lvl)}`);
      const lines = got.lines.map((ln) => el("div", { class: `logline ${ln.level}`, dataset: { level: ln.level } },
        el("span", { class: "t" }, time(ln.ts)),
        el("span", { class: "lvl" }, ln.level),
        el("span", { class: "lg" }, ln.logger),
        el("span", { class: "msg" }, ln.message)));
      const list = el("div", { class: "loglines", tabindex: "0" },
        lines.length ? lines : [el("p", { class: "muted" }, `no ${lvl} lines or worse`)]);
      box.dataset.level = got.level;
      box.dataset.count = String(got.lines.length);
      box.replaceChildren(
        el("p", { class: "muted" }, `${got.lines.length} newest lines at ${lvl} and above, newest last`
          + (got.lost ? ` (${got.lost} older lines let go by the device)` : "")),
        list);
      list.scrollTop = list.scrollHeight;
    });
  }

  // ---- diagnose: the bundle's key facts; the rest is `edgefleet devices diagnose --json`
  function fact(field, key, value, warn) {
    return el("div", { dataset: { field }, class: warn ? "warn" : null },
      el("span", { class: "k" }, key), el("span", { class: "v" }, value));
  }

  function clockFact(clock) {
    if (!clock) return fact("clock", "clock", EF.notMeasured(), false);
    const text = `${clock.offset_s >= 0 ? "+" : ""}${clock.offset_s.toFixed(3)} s (round trip ${clock.round_trip_s.toFixed(3)} s)`;
    const f = fact("clock", clock.off ? "clock: OFF" : "clock", text, clock.off);
    f.dataset.off = String(clock.off);
    return f;
  }

  function renderDiagnostics(box, diag) {
    const b = diag.bundle || {};
    const stack = b.inference_stack || {};
    const up = b.uplink || {};
    const sys = b.system || {};
    const out = b.outbox || {};
    const problems = Object.entries(stack.provider_problems || {});
    const errors = (up.connect_errors || []).slice(-5).reverse();
    const ort = stack.onnxruntime ? `${stack.onnxruntime}${stack.onnxruntime_device ? ` (${stack.onnxruntime_device})` : ""}` : "not installed";
    box.replaceChildren(
      el("div", { class: "kv diag" },
        fact("agent-version", "agent version", b.agent_version || "unknown", false),
        fact("onnxruntime", "onnxruntime", ort, !stack.onnxruntime),
        fact("providers", "usable providers", (stack.providers_usable || []).join(", ") || "none", !(stack.providers_usable || []).length),
        fact("uplink", "uplink", up.connected ? "connected" : `not connected${up.last_error ? `: ${up.last_error}` : ""}`, !up.connected),
        fact("disk", "disk free", sys.disk_free_mb == null ? EF.notMeasured()
          : `${(sys.disk_free_mb / 1024).toFixed(1)} GiB${sys.disk_pct == null ? "" : ` (${sys.disk_pct.toFixed(0)} % used)`}`, false),
        fact("outbox", "outbox pending / dropped", `${out.pending ?? "?"} / ${out.dropped ?? "?"}`, Boolean(out.dropped)),
        clockFact(diag.clock)),
      problems.length ? el("div", { dataset: { field: "provider-problems" } },
        el("h3", {}, "Providers that do not open here"),
        el("ul", { class: "plain" }, problems.map(([p, why]) => el("li", {}, el("strong", {}, p), `: ${why}`)))) : "",
      el("div", { dataset: { field: "connect-errors", count: String((up.connect_errors || []).length) } },
        el("h3", {}, "Uplink connect errors"),
        errors.length ? el("ul", { class: "plain" }, errors.map((e) => el("li", {},
          el("span", { class: "muted" }, `${new Date(e.at * 1000).toLocaleString()} `), e.error)))
          : el("p", { class: "muted" }, "none since the agent started")));
  }

  function showDiagnostics(btn, box) {
    return busy(btn, box, "asking the device for a diagnostics bundle…", "diagnose", async () => {
      renderDiagnostics(box, await ask("GET", `/api/v1/devices/${enc}/diagnostics`));
    });
  }

  // ---- probe: a camera's source opened on a connection of its own
  function probeText(p) {
    if (!p.ok) return `no frame after ${Number(p.elapsed_s).toFixed(1)} s: ${p.error || "unknown error"}`;
    const parts = [`${p.width}x${p.height}`];
    if (p.fps) parts.push(`${Number(p.fps).toFixed(1)} FPS`);
    if (p.codec) parts.push(p.codec);
    if (p.decode) parts.push(`decoded by ${p.decode}`);
    if (p.first_frame_s != null) parts.push(`first frame in ${Number(p.first_frame_s).toFixed(2)} s`);
    return parts.join(" · ");
  }

  function probe(camera, btn, box) {
    return busy(btn, box, `opening ${camera}'s source (up to ${PROBE_TIMEOUT_S} s)…`, "probe", async () => {
      const p = await ask("POST", `/api/v1/devices/${enc}/cameras/${encodeURIComponent(camera)}/probe?probe_timeout_s=${PROBE_TIMEOUT_S}`);
      box.dataset.ok = String(Boolean(p.ok));
      box.replaceChildren(el("p", { class: p.ok ? "" : "err", dataset: { field: "probe" } }, probeText(p)));
    });
  }

  function addProbe(camera, fig) {
    const box = el("div", { class: "probe-out", dataset: { camera } });
    const btn = el("button", { type: "button", class: "secondary probe-btn", dataset: { camera } }, "Probe");
    btn.addEventListener("click", () => probe(camera, btn, box));
    fig.append(el("div", { class: "probe" }, btn, box));
  }

  // ---- hooks for device.js
  function mount(deviceId, after) {
    enc = encodeURIComponent(deviceId);
    allowed = EF.allows("operator");
    allowed.then((ok) => {
      document.body.dataset.troubleshoot = ok ? "yes" : "no";
      if (!ok) return;
      const level = el("select", { id: "ts-level", "aria-label": "lowest log level" },
        LEVELS.map((l) => el("option", { value: l, selected: l === "info" ? "" : null }, l)));
      const logsBtn = el("button", { type: "button", id: "ts-logs" }, "Logs");
      const diagBtn = el("button", { type: "button", id: "ts-diagnose" }, "Diagnose");
      const logsOut = el("div", { id: "ts-logs-out", class: "ts-out" });
      const diagOut = el("div", { id: "ts-diagnose-out", class: "ts-out" });
      logsBtn.addEventListener("click", () => showLogs(logsBtn, level, logsOut));
      diagBtn.addEventListener("click", () => showDiagnostics(diagBtn, diagOut));
      after.after(el("section", { class: "wide", id: "troubleshoot-section" },
        el("h2", {}, "Troubleshoot ", el("span", { class: "sub" }, "asked of the device now; each ask is recorded with who asked")),
        el("div", { class: "actions" }, el("label", {}, "level ", level), logsBtn, diagBtn),
        logsOut, diagOut));
    });
  }

  // A camera's tile was made: it gets a Probe button once the token is known to be allowed.
  function cameraTile(camera, fig) {
    if (allowed) allowed.then((ok) => { if (ok && fig.isConnected) addProbe(camera, fig); });
  }

  return { mount, cameraTile };
})();
