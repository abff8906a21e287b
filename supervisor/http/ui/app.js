/* turnkeeper console: the operator's page, drawn from the daemon's HTTP API only.

   The token the operator signs in with lives in this tab's sessionStorage and travels
   only in the Authorization header of this page's own requests: never in a cookie, never
   in an address sent to the server (a `#token=` fragment is read and removed at once).
   Everything a user or an agent wrote is set as text (textContent), never parsed as HTML.
   Buttons are shown by what the API says the caller may do, but the API is what refuses. */
"use strict";
(() => {
  const KEY = "turnkeeper.token";
  const POLL_MS = 5000; // the overview's figures; paused while the tab is hidden
  const SPARK = 60; // points per chart: five minutes
  const WINDOW = 60000 / POLL_MS; // polls a chart's point covers: a minute
  const PAGE = 50; // rows per page of a list
  const TRANSCRIPT = 1000; // events of a session read at first; older ones on demand
  const main = document.getElementById("main");
  const flashBox = document.getElementById("flash");
  const nav = document.getElementById("nav");
  const who = document.getElementById("who");
  const signoutButton = document.getElementById("signout");
  const me = { token: null, admin: false };
  let leave = []; // what the current page stops when another is drawn
  let signal = null; // aborts the current page's requests

  // --- elements (text only: never innerHTML) --------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    add(node, children);
    return node;
  }

  // Replace what `node` holds with `children` (arrays flattened, nulls left out).
  function fill(node, ...children) {
    node.replaceChildren();
    return add(node, children);
  }

  function add(node, children) {
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    return node;
  }

  function link(path, text, attrs) {
    return el("a", { href: path, "data-link": true, ...(attrs || {}) }, text);
  }

  function badge(state) {
    const text = state === null || state === undefined ? "-" : String(state);
    return el("span", { class: `badge s-${text.replace(/[^a-z_]/gi, "")}` }, text);
  }

  function table(columns, rows, empty) {
    if (!rows.length) return el("p", { class: "muted" }, empty || "Nothing here.");
    const head = el("tr", {}, columns.map((c) => el("th", { class: c.class, scope: "col" }, c.title)));
    const body = rows.map((row) =>
      el("tr", {}, columns.map((c) => el("td", { class: c.class }, c.cell(row)))),
    );
    return el("div", { class: "scroll" }, el("table", {}, el("thead", {}, head), el("tbody", {}, body)));
  }

  function kv(pairs) {
    return el("dl", { class: "kv" }, pairs.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  }

  function card(label, value) {
    return el("div", { class: "card" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value));
  }

  function short(id) {
    return id ? String(id).slice(0, 8) : "-";
  }

  function when(seconds) {
    if (seconds === null || seconds === undefined) return "-";
    const at = new Date(seconds * 1000);
    const ago = Date.now() / 1000 - seconds;
    const text = ago >= 0 ? `${duration(ago)} ago` : `in ${duration(-ago)}`;
    return el("time", { datetime: at.toISOString(), title: at.toLocaleString() }, text);
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "-";
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.floor(seconds % 60)} s`;
    if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} min`;
    return `${Math.floor(seconds / 86400)} d ${Math.floor((seconds % 86400) / 3600)} h`;
  }

  function flash(text, error) {
    fill(flashBox, el("p", { class: error ? "error" : "" }, text));
    const shown = flashBox.firstChild;
    setTimeout(() => shown.remove(), error ? 12000 : 5000);
  }

  // A button whose action runs once at a time, says what failed, and redraws after.
  function action(label, run, opts) {
    const options = opts || {};
    const button = el("button", { type: "button", class: options.class, "data-action": options.name || label });
    button.textContent = label;
    let armed = false;
    button.addEventListener("click", async () => {
      if (options.confirm && !armed) {
        armed = true; // a second press within 5 s confirms
        button.textContent = options.confirm;
        setTimeout(() => {
          armed = false;
          button.textContent = label;
        }, 5000);
        return;
      }
      armed = false;
      button.disabled = true;
      try {
        const said = await run();
        if (said) flash(said);
      } catch (error) {
        flash(`${label}: ${error.message}`, true);
      } finally {
        button.disabled = false;
        button.textContent = label;
      }
    });
    return button;
  }

  // --- the API ----------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function call(method, path, body, raw) {
    const init = {
      method,
      headers: { Authorization: `Bearer ${me.token}` },
      cache: "no-store",
      credentials: "omit",
      signal,
    };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    if (raw && response.ok) return response.text();
    const text = await response.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch (_) {
      data = null;
    }
    if (response.status === 401) {
      signOut("The daemon refused the token (revoked, or mistyped): sign in again.");
      throw new ApiError(401, "unauthorized", "the token was refused");
    }
    if (!response.ok) {
      const error = (data && data.error) || {};
      throw new ApiError(response.status, error.code || "http", error.message || `HTTP ${response.status}`);
    }
    return data;
  }

  const get = (path) => call("GET", path);
  const post = (path, body) => call("POST", path, body === undefined ? {} : body);
  const del = (path) => call("DELETE", path);

  function query(params) {
    const found = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) found.set(k, v);
    const text = found.toString();
    return text ? `?${text}` : "";
  }

  function key() {
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  // --- sign-in ----------------------------------------------------------------------------

  function takeTokenFromAddress() {
    const found = /^#token=(.+)$/.exec(location.hash);
    if (!found) return;
    history.replaceState(history.state, "", location.pathname + location.search);
    try {
      sessionStorage.setItem(KEY, decodeURIComponent(found[1]));
    } catch (error) {
      // A malformed %-escape: no token from the address; the form asks for one.
    }
  }

  // Who the token is: any principal reads sessions; only the admin reads the status.
  async function identify() {
    await call("GET", "/v1/sessions?limit=1");
    try {
      await call("GET", "/v1/status");
      me.admin = true;
    } catch (error) {
      if (error.status !== 403) throw error;
      me.admin = false;
    }
    who.textContent = me.admin ? "signed in: admin" : "signed in: read/write by session ACL";
    nav.hidden = false;
    signoutButton.hidden = false;
  }

  function signOut(why) {
    sessionStorage.removeItem(KEY);
    me.token = null;
    me.admin = false;
    nav.hidden = true;
    signoutButton.hidden = true;
    who.textContent = "";
    signin(why);
  }

  function signin(why) {
    stopPage();
    const input = el("input", { id: "token", type: "password", autocomplete: "off", required: true, spellcheck: "false" });
    const form = el(
      "form",
      { class: "panel signin", id: "signin" },
      el("h1", {}, "Sign in"),
      el("p", { class: "muted" }, "Paste an API token (the admin token, or a principal's from auth.tokens_file). It is kept in this tab only."),
      why ? el("p", { class: "error", role: "alert" }, why) : null,
      el("label", { for: "token" }, "Token"),
      input,
      el("div", { class: "bar" }, el("button", { type: "submit" }, "Sign in")),
    );
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      me.token = input.value.trim();
      try {
        await identify();
        sessionStorage.setItem(KEY, me.token);
        route();
      } catch (error) {
        me.token = null;
        signin(`Not signed in: ${error.message}`);
      }
    });
    fill(main, form);
    input.focus();
  }

  // --- pages ------------------------------------------------------------------------------

  function stopPage() {
    for (const stop of leave) stop();
    leave = [];
    signal = null;
  }

  // Run `run` every `ms` while the tab is shown, one run at a time, until the page is left
  // (or the token refused: signing out leaves the page too).
  function every(ms, run) {
    let timer = null;
    let running = false;
    let stopped = false;
    const tick = async () => {
      timer = null;
      if (stopped || running) return;
      running = true;
      if (!document.hidden) {
        try {
          await run();
        } catch (error) {
          if (error.name !== "AbortError" && !stopped) flash(error.message, true);
        }
      }
      running = false;
      if (!stopped) timer = setTimeout(tick, ms);
    };
    const wake = () => {
      if (!document.hidden && timer !== null) {
        clearTimeout(timer);
        tick();
      }
    };
    document.addEventListener("visibilitychange", wake);
    leave.push(() => {
      stopped = true;
      clearTimeout(timer);
      timer = null;
      document.removeEventListener("visibilitychange", wake);
    });
    tick();
  }

  function heading(text, ...more) {
    return el("div", { class: "bar" }, el("h1", {}, text), ...more);
  }

  const ROUTES = [
    [/^\/ui\/?$/, "overview", overview],
    [/^\/ui\/overview\/?$/, "overview", overview],
    [/^\/ui\/sessions\/?$/, "sessions", sessions],
    [/^\/ui\/sessions\/([0-9a-f]{32})\/?$/, "sessions", sessionPage],
    [/^\/ui\/deliveries\/?$/, "deliveries", deliveries],
    [/^\/ui\/tasks\/?$/, "tasks", tasks],
    [/^\/ui\/schedules\/?$/, "schedules", schedules],
    [/^\/ui\/boots\/?$/, "boots", boots],
  ];

  async function route() {
    stopPage();
    if (!me.token) return signin();
    const controller = new AbortController();
    signal = controller.signal;
    leave.push(() => controller.abort());
    const path = location.pathname;
    for (const [pattern, name, draw] of ROUTES) {
      const found = pattern.exec(path);
      if (!found) continue;
      for (const a of nav.querySelectorAll("a")) {
        if (a.dataset.page === name) a.setAttribute("aria-current", "page");
        else a.removeAttribute("aria-current");
      }
      document.title = `${name} - turnkeeper`;
      fill(main, el("p", { class: "muted" }, "Loading..."));
      try {
        await draw(found.slice(1));
      } catch (error) {
        if (error.name === "AbortError" || error.status === 401) return;
        fill(main, el("h1", {}, "Could not load this page"), el("p", { class: "error" }, error.message));
      }
      return;
    }
    fill(main, el("h1", {}, "No such page"), link("/ui/", "Overview"));
  }

  function go(path, replace) {
    if (replace) history.replaceState(null, "", path);
    else history.pushState(null, "", path);
    route().then(() => main.focus({ preventScroll: true }));
  }

  // --- overview ---------------------------------------------------------------------------

  function parseMetrics(text) {
    const samples = [];
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const found = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!found) continue;
      const labels = {};
      for (const pair of (found[2] || "").matchAll(/([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
      samples.push({ name: found[1], labels, value: parseFloat(found[3]) });
    }
    return samples;
  }

  function total(samples, name, labels) {
    let sum = 0;
    for (const s of samples) {
      if (s.name !== name) continue;
      if (labels && Object.entries(labels).some(([k, v]) => s.labels[k] !== v)) continue;
      sum += s.value;
    }
    return sum;
  }

  function buckets(samples, name) {
    return samples
      .filter((s) => s.name === `${name}_bucket`)
      .map((s) => [s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le), s.value])
      .sort((a, b) => a[0] - b[0]);
  }

  // The q-quantile of what a histogram counted between two scrapes (null: nothing counted).
  function quantile(now, before, q) {
    const counts = now.map(([le, n], i) => [le, n - (before && before[i] ? before[i][1] : 0)]);
    const all = counts.length ? counts[counts.length - 1][1] : 0;
    if (all <= 0) return null;
    const rank = q * all;
    let lower = 0;
    let below = 0;
    for (const [le, n] of counts) {
      if (n >= rank) {
        if (le === Infinity) return lower;
        return lower + ((le - lower) * (rank - below)) / Math.max(n - below, 1e-9);
      }
      lower = le;
      below = n;
    }
    return lower;
  }

  function chart(title, unit) {
    const value = el("div", { class: "value" }, "-");
    const line = svg("polyline", { points: "" });
    const graph = svg("svg", { viewBox: `0 0 ${SPARK - 1} 40`, preserveAspectRatio: "none", role: "img", "aria-label": title });
    graph.append(svg("line", { x1: 0, y1: 39.5, x2: SPARK - 1, y2: 39.5 }), line);
    const points = [];
    const node = el("div", { class: "card chart", "data-chart": title }, el("div", { class: "label" }, title), value, graph);
    return {
      node,
      push(v) {
        points.push(v);
        if (points.length > SPARK) points.shift();
        value.textContent = v === null ? "-" : unit(v);
        const known = points.map((p, i) => [i + SPARK - points.length, p]).filter(([, p]) => p !== null);
        const top = Math.max(1e-9, ...known.map(([, p]) => p));
        line.setAttribute("points", known.map(([x, p]) => `${x},${(38 - (p / top) * 36).toFixed(1)}`).join(" "));
      },
    };
  }

  async function overview() {
    const cards = el("div", { class: "grid", id: "cards" });
    const charts = {
      turns: chart("turns / min", (v) => v.toFixed(1)),
      p50: chart("turn time p50, last minute", duration),
      p99: chart("turn time p99, last minute", duration),
      tokens: chart("model tokens / min", (v) => Math.round(v).toString()),
      pending: chart("deliveries pending", (v) => Math.round(v).toString()),
    };
    const pool = el("div", { id: "slots" });
    const breaker = el("div", { id: "breaker" });
    const hosts = el("div", { id: "hosts" });
    fill(main,
      heading("Overview"),
      cards,
      el("h2", {}, "Activity"),
      el("div", { class: "charts" }, Object.values(charts).map((c) => c.node)),
      me.admin ? [el("h2", {}, "Worker slots"), pool, el("h2", {}, "Breaker"), breaker, el("h2", {}, "Hosts"), hosts] : el("p", { class: "muted" }, "Slots, breaker and hosts are shown to the admin token."),
    );
    const snaps = []; // the last minute's scrapes: {at, metrics}
    every(POLL_MS, async () => {
      const [ready, metrics, status] = await Promise.all([
        fetch("/readyz", { cache: "no-store", credentials: "omit", signal }).then((r) => r.json()),
        call("GET", "/metrics", undefined, true).then(parseMetrics),
        me.admin ? get("/v1/status") : Promise.resolve(null),
      ]);
      const now = { at: Date.now() / 1000, metrics };
      const boot = status ? status.boot : {};
      // Each point covers the last minute (the polls of it kept); while the page has not
      // been open that long, the time since the boot started if that is under a minute,
      // else since the page's first poll (only the admin knows when the boot started).
      snaps.push(now);
      while (snaps.length > WINDOW + 1) snaps.shift();
      const young = boot.started_at && now.at - boot.started_at <= 60; // all of it in a minute
      const base = snaps.length > WINDOW || (!young && snaps.length > 1) ? snaps[0] : null;
      const since = base ? base.at : boot.started_at;
      const minutes = since ? Math.max(now.at - since, 1) / 60 : null;
      const rate = (name, labels) =>
        minutes ? Math.max(0, total(metrics, name, labels) - (base ? total(base.metrics, name, labels) : 0)) / minutes : null;
      charts.turns.push(rate("turnkeeper_events_committed_total", { type: "turn_ended" }));
      const turnBuckets = buckets(metrics, "turnkeeper_turn_seconds");
      const earlier = base ? buckets(base.metrics, "turnkeeper_turn_seconds") : null;
      charts.p50.push(quantile(turnBuckets, earlier, 0.5));
      charts.p99.push(quantile(turnBuckets, earlier, 0.99));
      charts.tokens.push(rate("turnkeeper_model_tokens_total"));
      charts.pending.push(total(metrics, "turnkeeper_deliveries", { status: "pending" }));
      fill(cards,
        card("readiness", badge(ready.status)),
        card("version", boot.version || "-"),
        card("configuration", status ? status.config.version.slice(0, 12) : "-"),
        card("uptime", boot.started_at ? duration(Date.now() / 1000 - boot.started_at) : "-"),
        card("sessions open", status ? String(status.sessions.open ?? 0) : String(total(metrics, "turnkeeper_sessions", { state: "open" }))),
        card("quarantined", status ? String(status.sessions.quarantined ?? 0) : String(total(metrics, "turnkeeper_sessions", { state: "quarantined" }))),
        card("worker restarts", status ? String(status.worker_restarts) : "-"),
        card("model", status ? badge(status.model.state) : "-"),
      );
      if (!status) return;
      fill(pool,
        table(
          [
            { title: "slot", cell: (s) => String(s.slot) },
            { title: "state", cell: (s) => [badge(s.state), s.spare ? " spare" : ""] },
            { title: "worker", class: "mono", cell: (s) => short(s.worker) },
            { title: "pid", class: "num wide", cell: (s) => s.pid ?? "-" },
            { title: "sessions", class: "num", cell: (s) => String(s.sessions) },
            { title: "in flight", class: "num", cell: (s) => String(s.turns) },
            { title: "served", class: "num wide", cell: (s) => String(s.turns_served) },
            { title: "MCP servers", cell: (s) => (s.mcp.length ? s.mcp.map((m) => [m.name, " ", badge(m.state), " "]) : "-") },
          ],
          status.slots,
          "No worker slots.",
        ),
      );
      const b = status.breaker || {};
      fill(breaker,
        el(
          "div",
          { class: "panel" },
          kv(Object.entries(b).map(([k, v]) => [k, typeof v === "object" && v !== null ? JSON.stringify(v) : String(v)])),
          el("div", { class: "bar" }, action("Reset the breaker", async () => {
            const done = await post("/v1/breaker/reset");
            return `Breaker reset at ${new Date(done.reset_at * 1000).toLocaleTimeString()}.`;
          }, { name: "breaker-reset", class: "quiet" })),
        ),
      );
      fill(hosts,
        status.hosts_error ? el("p", { class: "error" }, status.hosts_error) : null,
        table(
          [
            { title: "host", cell: (h) => [h.id, h.id === status.host.id ? " (this one)" : ""] },
            { title: "state", cell: (h) => badge(h.state) },
            { title: "hostname", class: "wide", cell: (h) => h.hostname || "-" },
            { title: "pid", class: "num wide", cell: (h) => h.pid ?? "-" },
            { title: "version", class: "wide", cell: (h) => h.version || "-" },
            { title: "sessions", class: "num", cell: (h) => String(h.sessions ?? "-") },
            { title: "last seen", cell: (h) => when(h.last_seen) },
          ],
          status.hosts,
          "No host rows (one daemon, no shared database).",
        ),
      );
    });
  }

  // --- sessions ---------------------------------------------------------------------------

  async function sessions() {
    const params = new URLSearchParams(location.search);
    const q = params.get("q") || "";
    const status = params.get("status") || "";
    const offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
    const search = el("input", { type: "search", name: "q", value: q, placeholder: "title or id", "aria-label": "Search sessions" });
    const filter = el(
      "select",
      { name: "status", "aria-label": "Status" },
      [["", "all"], ["open", "open"], ["quarantined", "quarantined"], ["closed", "closed"]].map(([v, t]) =>
        el("option", { value: v, selected: v === status }, t),
      ),
    );
    const form = el("form", { class: "bar", role: "search" }, search, filter, el("button", { type: "submit" }, "Search"));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      go(`/ui/sessions${query({ q: search.value.trim(), status: filter.value })}`, true);
    });
    filter.addEventListener("change", () => form.requestSubmit());
    const found = await get(`/v1/sessions${query({ limit: PAGE, offset, q, status })}`);
    const pager = el("div", { class: "pager" });
    if (offset > 0) pager.append(link(`/ui/sessions${query({ q, status, offset: Math.max(0, offset - PAGE) || "" })}`, "Previous"));
    pager.append(el("span", { class: "muted" }, `from ${offset + 1}`));
    if (found.next_offset !== null && found.next_offset !== undefined) pager.append(link(`/ui/sessions${query({ q, status, offset: found.next_offset })}`, "Next"));
    fill(main,
      heading("Sessions"),
      form,
      table(
        [
          { title: "title", cell: (s) => link(`/ui/sessions/${s.id}`, s.title || `(untitled ${short(s.id)})`, { "data-session": s.id }) },
          { title: "kind", class: "wide", cell: (s) => s.kind },
          { title: "status", cell: (s) => [badge(s.status), s.active_turn_id ? " turn in flight" : ""] },
          { title: "lease held by", class: "wide", cell: (s) => s.owner || "-" },
          { title: "last activity", cell: (s) => when(s.updated_at) },
          { title: "waiting for", class: "wide", cell: (s) => s.waiting || (s.pending ? "a turn" : "-") },
        ],
        found.sessions,
        q || status ? "No session matches." : "No sessions yet.",
      ),
      pager,
    );
  }

  // --- one session ------------------------------------------------------------------------

  function can(session, need) {
    if (me.admin) return true;
    const order = { read: 0, write: 1, admin: 2 };
    return (order[session.permission] ?? -1) >= order[need];
  }

  // The transcript: one element per event, a tool call's result folded into the call.
  function transcriptView(sessionId) {
    const box = el("div", { class: "transcript", id: "transcript", "aria-live": "polite" });
    const calls = new Map(); // call_id -> the <details> of the call
    const streaming = new Map(); // turn id -> its element of streamed text
    let deltas = 0;
    const meta = (e, label) => el("div", { class: "meta" }, `${label} · #${e.seq} · `, when(e.created_at));
    const text = (t) => el("div", { class: "text" }, t === undefined || t === null ? "" : String(t));

    function callView(e) {
      const p = e.payload || {};
      const details = el(
        "details",
        { class: "ev tool", "data-seq": e.seq, "data-type": e.type },
        el("summary", {}, `tool ${p.name || "?"}`, el("span", { class: "muted" }, ` #${e.seq}`)),
        el("pre", {}, JSON.stringify(p.arguments ?? {}, null, 2)),
      );
      if (p.call_id) calls.set(p.call_id, details);
      return details;
    }

    function resultInto(e) {
      const p = e.payload || {};
      const result = el("div", { "data-result": e.seq }, el("div", { class: "meta" }, p.is_error ? "error result" : "result", ` · #${e.seq}`), el("pre", {}, typeof p.content === "string" ? p.content : JSON.stringify(p.content, null, 2)));
      const call = calls.get(p.call_id);
      if (call) {
        call.append(result);
        call.querySelector("summary").append(p.is_error ? " (error)" : " (done)");
        return null;
      }
      return el("details", { class: "ev tool", "data-seq": e.seq, "data-type": e.type }, el("summary", {}, `result of ${p.name || "a tool"}`), result);
    }

    function view(e) {
      const p = e.payload || {};
      switch (e.type) {
        case "user_message":
          return el("div", { class: "ev user", "data-seq": e.seq, "data-type": e.type }, meta(e, `user${p.by ? ` (${p.by})` : ""}`), text(p.text));
        case "model_response": {
          const done = streaming.get(e.turn_id);
          if (done) {
            done.remove();
            streaming.delete(e.turn_id);
          }
          const calls = (p.tool_calls || []).map((c) => c.name || c.function?.name || "?");
          return el(
            "div",
            { class: "ev", "data-seq": e.seq, "data-type": e.type },
            meta(e, p.finish_reason === "length" ? "answer (cut at the token limit)" : "answer"),
            p.text ? text(p.text) : null,
            calls.length ? el("div", { class: "muted" }, `calls ${calls.join(", ")}`) : null,
          );
        }
        case "tool_call":
          return callView(e);
        case "tool_result":
          return resultInto(e);
        case "notice":
          return el("div", { class: "ev notice", role: "note", "data-seq": e.seq, "data-type": e.type }, meta(e, "notice"), text(p.text));
        case "continuation":
          return el("div", { class: "ev mark", "data-seq": e.seq, "data-type": e.type }, meta(e, `continuation${p.attempt ? ` (attempt ${p.attempt})` : ""}${p.cause ? `: ${p.cause}` : ""}`), text(p.text));
        case "compaction":
          return el("div", { class: "ev mark", "data-seq": e.seq, "data-type": e.type }, meta(e, `compaction (${p.method || "summary"}): ${p.messages ?? "?"} messages, ${p.tokens_before ?? "?"} -> ${p.tokens_after ?? "?"} tokens`), el("details", {}, el("summary", {}, "summary"), text(p.summary)));
        case "turn_started":
          return el("div", { class: "ev line", "data-seq": e.seq, "data-type": e.type }, `turn ${short(e.turn_id)} started · `, when(e.created_at));
        case "turn_ended":
          return el("div", { class: "ev line", "data-seq": e.seq, "data-type": e.type }, `turn ${short(e.turn_id)} ended: `, badge(p.outcome), p.reason ? ` (${p.reason})` : "", p.error ? ` ${p.error}` : "");
        case "subagent_spawned":
          return el("div", { class: "ev line", "data-seq": e.seq, "data-type": e.type }, "subagent ", p.subagent ? link(`/ui/sessions/${p.subagent}`, short(p.subagent)) : "", ` spawned: ${p.title || p.task || ""}`);
        case "subagent_result":
          return el("div", { class: "ev mark", "data-seq": e.seq, "data-type": e.type }, meta(e, `subagent ${short(p.subagent)}${p.status ? `: ${p.status}` : ""}`), text(p.text ?? ""));
        case "task_started":
          return el("div", { class: "ev line", "data-seq": e.seq, "data-type": e.type }, `task ${short(p.task)} started: ${p.kind || ""}`);
        case "task_result":
          return el("div", { class: "ev mark", "data-seq": e.seq, "data-type": e.type }, meta(e, `task ${short(p.task)} ${p.kind || ""}${p.status ? `: ${p.status}` : ""}`), text(p.text ?? ""));
        case "acl":
          return el("div", { class: "ev line", "data-seq": e.seq, "data-type": e.type }, `access: ${p.principal || "?"} ${p.permission || "revoked"}${p.by ? ` (by ${p.by})` : ""}`);
        default:
          return el("div", { class: "ev line", "data-seq": e.seq, "data-type": e.type }, `${e.type} #${e.seq}`);
      }
    }

    return {
      box,
      event(e) {
        const node = view(e);
        if (node) box.append(node);
      },
      delta(d) {
        let node = streaming.get(d.turn);
        if (!node) {
          node = el("div", { class: "ev streaming", "data-streaming": d.turn }, el("div", { class: "meta" }, "answering..."), text(""));
          streaming.set(d.turn, node);
          box.append(node);
        }
        node.lastChild.textContent += d.text || "";
        deltas += 1;
        box.dataset.deltas = String(deltas);
      },
      clear() {
        fill(box);
        calls.clear();
        streaming.clear();
      },
      sessionId,
    };
  }

  // Reads the attach stream (SSE) with fetch, so the token goes in a header: `id:` is the
  // seq, `event: delta` carries streamed text and no id. Reconnects with ?after=<last seq>.
  function follow(sessionId, after, onEvent, onDelta, onState) {
    let last = after;
    let stopped = false;
    let controller = null;
    async function run() {
      let wait = 1000;
      while (!stopped) {
        controller = new AbortController();
        try {
          const response = await fetch(`/v1/sessions/${sessionId}/attach?after=${last}`, {
            headers: { Authorization: `Bearer ${me.token}`, Accept: "text/event-stream" },
            cache: "no-store",
            credentials: "omit",
            signal: controller.signal,
          });
          if (response.status === 401) return signOut("The daemon refused the token: sign in again.");
          if (!response.ok) throw new Error(`attach answered ${response.status}`);
          onState("live");
          wait = 1000;
          const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
          let buffer = "";
          let fields = {};
          for (;;) {
            const { value, done } = await reader.read();
            if (done) break;
            buffer += value;
            let cut;
            while ((cut = buffer.indexOf("\n")) >= 0) {
              const line = buffer.slice(0, cut).replace(/\r$/, "");
              buffer = buffer.slice(cut + 1);
              if (line === "") {
                if (fields.data !== undefined) {
                  const data = JSON.parse(fields.data);
                  if (fields.event === "delta") onDelta(data);
                  else if (fields.id !== undefined) {
                    last = parseInt(fields.id, 10);
                    onEvent(data);
                  }
                }
                fields = {};
              } else if (line[0] !== ":") {
                const colon = line.indexOf(":");
                const name = colon < 0 ? line : line.slice(0, colon);
                const v = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
                fields[name] = name === "data" && fields.data !== undefined ? `${fields.data}\n${v}` : v;
              }
            }
          }
        } catch (error) {
          if (stopped) return;
        }
        if (stopped) return;
        onState("reconnecting");
        await new Promise((resolve) => setTimeout(resolve, wait));
        wait = Math.min(wait * 2, 15000);
      }
    }
    run();
    return () => {
      stopped = true;
      if (controller) controller.abort();
    };
  }

  function contextUse(c) {
    const used = c.last_prompt_tokens === null ? "no prompt yet" : `${c.last_prompt_tokens} tokens in the last prompt`;
    const share = c.used === null || c.used === undefined ? "" : ` (${Math.round(c.used * 100)} % of ${c.window})`;
    return `${used}${share}, ${c.compactions} compaction${c.compactions === 1 ? "" : "s"}`;
  }

  async function sessionPage([id]) {
    const base = `/v1/sessions/${id}`;
    let session = await get(base);
    const header = el("div", { id: "session-head" });
    const actions = el("div", { class: "actions", id: "session-actions" });
    const state = el("span", { class: "muted", id: "stream-state" }, "connecting...");
    const transcript = transcriptView(id);
    const side = el("div", { id: "side" });
    const composer = el("div", { id: "composer" });
    const older = el("div", {});
    fill(main,
      el("p", {}, link("/ui/sessions", "Sessions")),
      header,
      actions,
      el("div", { class: "split" }, el("section", { "aria-label": "Transcript" }, el("div", { class: "bar" }, el("h2", {}, "Transcript"), state), older, transcript.box, composer), side),
    );

    function drawHead() {
      fill(header,
        el("h1", { id: "session-title" }, session.title || `(untitled ${short(session.id)})`),
        kv([
          ["status", [badge(session.status), session.active_turn_id ? " turn in flight" : ""]],
          ["kind", session.kind],
          ["id", el("code", {}, session.id)],
          ["agent", session.agent || "default"],
          ["lease held by", session.owner || "-"],
          ["your access", me.admin ? "admin (operator)" : session.permission || "-"],
          ["waiting for", session.waiting || (session.pending ? "a turn" : "-")],
          ["created", when(session.created_at)],
          ["last activity", when(session.updated_at)],
          session.parent ? ["parent", link(`/ui/sessions/${session.parent}`, short(session.parent))] : null,
          session.quarantine_reason ? ["quarantined", session.quarantine_reason] : null,
          session.deliver_to ? ["delivers to", session.deliver_to] : null,
          session.context ? ["context", contextUse(session.context)] : null,
        ].filter(Boolean)),
      );
      const buttons = [];
      if (can(session, "write") && session.active_turn_id)
        buttons.push(action("Interrupt", async () => {
          await post(`${base}/interrupt`);
          await refresh();
          return "Interrupted.";
        }, { name: "interrupt" }));
      if (can(session, "write") && session.status === "quarantined")
        buttons.push(action("Release", async () => {
          const done = await post(`${base}/release`);
          await refresh();
          return done.released ? "Released: the next message starts a new turn." : "It was not quarantined.";
        }, { name: "release" }));
      if (can(session, "admin") && session.status !== "closed")
        buttons.push(action("Close", async () => {
          await del(base);
          await refresh();
          return "Closed.";
        }, { name: "close", class: "danger", confirm: "Press again to close" }));
      fill(actions, ...buttons);
      if (can(session, "write") && session.status === "open") {
        if (!composer.firstChild) {
          const input = el("textarea", { id: "message", "aria-label": "Message", placeholder: "A message to the agent" });
          const send = el("button", { type: "submit", "data-action": "send" }, "Send");
          const form = el("form", { class: "panel" }, el("label", { for: "message" }, "Send a message"), input, el("div", { class: "bar" }, send));
          form.addEventListener("submit", async (event) => {
            event.preventDefault();
            const text = input.value;
            if (!text.trim()) return;
            send.disabled = true;
            try {
              const done = await call("POST", `${base}/inject`, { text });
              input.value = "";
              flash(`Sent (#${done.seq}).`);
            } catch (error) {
              flash(`Send: ${error.message}`, true);
            } finally {
              send.disabled = false;
            }
          });
          input.addEventListener("keydown", (event) => {
            if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
          });
          fill(composer, form);
        }
      } else fill(composer);
    }

    let pending = null;
    let treeDue = false; // a subagent event came: the tree is read again
    async function refresh() {
      session = await get(base);
      drawHead();
      await drawSide(treeDue);
    }
    function soon(subagents) {
      treeDue = treeDue || subagents;
      if (pending) return;
      pending = setTimeout(async () => {
        pending = null;
        try {
          await refresh();
        } catch (error) {
          if (error.name !== "AbortError") flash(error.message, true);
        }
      }, 300);
    }
    leave.push(() => clearTimeout(pending));

    async function subagentTree(parent, depth) {
      const found = await get(`/v1/sessions/${parent}/subagents?limit=100`);
      if (!found.subagents.length) return null;
      return el(
        "ul",
        { class: "tree" },
        await Promise.all(
          found.subagents.map(async (s) =>
            el("li", {}, link(`/ui/sessions/${s.id}`, s.title || s.task || short(s.id)), " ", badge(s.status), depth < 3 ? await subagentTree(s.id, depth + 1) : null),
          ),
        ),
      );
    }

    let tree = null; // the subagent tree as last read: only a subagent event changes it
    async function drawSide(withTree) {
      if (withTree) treeDue = false;
      const [read, taskList, sent] = await Promise.all([
        withTree ? subagentTree(id, 1) : tree,
        get(`${base}/tasks?limit=100`),
        get(`/v1/deliveries${query({ session: id, limit: 100 })}`).catch(() => ({ deliveries: [] })),
      ]);
      tree = read;
      fill(side,
        el("h2", {}, "Subagents"),
        tree || el("p", { class: "muted" }, "None."),
        el("h2", {}, "Tasks"),
        taskList.tasks.length
          ? el("ul", { class: "tree" }, taskList.tasks.map((t) => el("li", {}, el("code", {}, short(t.id)), ` ${t.kind} `, badge(t.status))))
          : el("p", { class: "muted" }, "None."),
        el("h2", {}, "Deliveries"),
        sent.deliveries.length
          ? el("ul", { class: "tree" }, sent.deliveries.map((d) => el("li", {}, `#${d.seq} to ${d.target} `, badge(d.status), d.attempts ? ` ${d.attempts} attempts` : "")))
          : el("p", { class: "muted" }, "None."),
      );
    }

    drawHead();
    await drawSide(true);
    let from = Math.max(0, session.last_seq - TRANSCRIPT);
    const start = (after) =>
      follow(
        id,
        after,
        (e) => {
          transcript.event(e);
          if (e.type !== "tool_call" && e.type !== "model_response") soon(e.type.startsWith("subagent_"));
        },
        (d) => transcript.delta(d),
        (s) => {
          state.textContent = s;
          state.dataset.state = s;
        },
      );
    let stop = start(from);
    leave.push(() => stop());
    if (from > 0) {
      fill(older,
        el("p", { class: "muted" }, `${from} earlier events are not shown. `, action("Show all", async () => {
          stop();
          transcript.clear();
          fill(older);
          from = 0;
          stop = start(0);
        }, { class: "quiet" })),
      );
    }
  }

  // --- deliveries, tasks, schedules, boots -------------------------------------------------

  async function deliveries() {
    if (!me.admin) {
      fill(main, heading("Deliveries"), el("p", { class: "muted" }, "The outbox is listed for the admin token; a session's page lists its own deliveries."));
      return;
    }
    const [dead, rest] = await Promise.all([get("/v1/deliveries?status=dead&limit=200"), get("/v1/deliveries?limit=200")]);
    const others = rest.deliveries.filter((d) => d.status !== "dead");
    const columns = [
      { title: "delivery", class: "mono", cell: (d) => el("span", { title: d.id }, short(d.id)) },
      { title: "target", cell: (d) => d.target },
      { title: "session", cell: (d) => link(`/ui/sessions/${d.session}`, short(d.session)) },
      { title: "seq", class: "num wide", cell: (d) => String(d.seq) },
      { title: "status", cell: (d) => badge(d.status) },
      { title: "attempts", class: "num", cell: (d) => String(d.attempts) },
      { title: "last error", class: "wide", cell: (d) => d.last_error || (d.last_code ? `HTTP ${d.last_code}` : "-") },
      { title: "when", cell: (d) => (d.status === "delivered" ? when(d.delivered_at) : d.status === "pending" ? when(d.next_at) : when(d.updated_at)) },
      {
        title: "",
        cell: (d) =>
          d.status === "delivered"
            ? ""
            : action("Retry", async () => {
                await post(`/v1/deliveries/${d.id}/retry`);
                await deliveries();
                return `Delivery ${short(d.id)} is pending again.`;
              }, { name: `retry-${d.id}` }),
      },
    ];
    fill(main,
      heading("Deliveries"),
      el("h2", {}, `Dead letters (${dead.deliveries.length})`),
      table(columns, dead.deliveries, "No dead deliveries."),
      el("h2", {}, "Pending and delivered"),
      table(columns, others, "No deliveries."),
    );
  }

  // What the caller may do on each session it reads (the admin: everything).
  async function permissions() {
    if (me.admin) return null;
    const found = await get("/v1/sessions?limit=1000");
    return new Map(found.sessions.map((s) => [s.id, s.permission]));
  }

  function allowed(held, sessionId, need) {
    if (held === null) return true;
    return can({ permission: held.get(sessionId) }, need);
  }

  async function tasks() {
    const params = new URLSearchParams(location.search);
    const status = params.get("status") || "";
    const [found, held] = await Promise.all([get(`/v1/tasks${query({ limit: 200, status })}`), permissions()]);
    fill(main,
      heading("Tasks", link(`/ui/tasks${status ? "" : "?status=pending,running"}`, status ? "all" : "only pending and running")),
      table(
        [
          { title: "task", class: "mono", cell: (t) => short(t.id) },
          { title: "kind", cell: (t) => t.kind },
          { title: "session", cell: (t) => link(`/ui/sessions/${t.session}`, short(t.session)) },
          { title: "status", cell: (t) => [badge(t.status), t.cancel_requested && !t.ended_at ? " cancelling" : ""] },
          { title: "exit", class: "num wide", cell: (t) => (t.exit_code ?? "-").toString() },
          { title: "took", class: "wide", cell: (t) => duration(t.duration) },
          { title: "started", class: "wide", cell: (t) => when(t.started_at ?? t.created_at) },
          {
            title: "output",
            cell: (t) =>
              t.output_tail || t.reason
                ? el("details", {}, el("summary", {}, "tail"), t.reason ? el("p", {}, t.reason) : null, el("pre", {}, t.output_tail || ""))
                : "-",
          },
          {
            title: "",
            cell: (t) =>
              (t.status === "pending" || t.status === "running") && allowed(held, t.session, "write")
                ? action("Cancel", async () => {
                    await del(`/v1/tasks/${t.id}`);
                    await tasks();
                    return `Task ${short(t.id)} is being cancelled.`;
                  }, { name: `cancel-${t.id}` })
                : "",
          },
        ],
        found.tasks,
        "No tasks.",
      ),
    );
  }

  async function schedules() {
    const [found, held] = await Promise.all([get("/v1/schedules?limit=1000"), permissions()]);
    // A schedule of no session is listed to its owner only: the caller may change it.
    const mine = (s) => s.session === null || allowed(held, s.session, "write");
    fill(main,
      heading("Schedules"),
      table(
        [
          { title: "schedule", class: "mono wide", cell: (s) => short(s.id) },
          { title: "cron", class: "mono", cell: (s) => [s.cron, s.timezone && s.timezone !== "UTC" ? ` ${s.timezone}` : ""] },
          { title: "text", cell: (s) => s.text },
          { title: "session", class: "wide", cell: (s) => (s.session ? link(`/ui/sessions/${s.session}`, short(s.session)) : "a new one each time") },
          { title: "status", cell: (s) => badge(s.status) },
          { title: "next fire", cell: (s) => (s.status === "active" ? when(s.next_fire_at) : "-") },
          { title: "last fire", class: "wide", cell: (s) => (s.last_fire ? [when(s.last_fire.fired_at ?? s.last_fire.scheduled_for), " ", badge(s.last_fire.outcome)] : "-") },
          {
            title: "",
            cell: (s) =>
              mine(s)
                ? el(
                    "div",
                    { class: "actions" },
                    s.status === "held"
                      ? action("Resume", async () => {
                          await post(`/v1/schedules/${s.id}/resume`);
                          await schedules();
                          return "Resumed: it fires from its next time on.";
                        }, { name: `resume-${s.id}`, class: "quiet" })
                      : s.status === "active"
                        ? action("Pause", async () => {
                            await post(`/v1/schedules/${s.id}/pause`);
                            await schedules();
                            return "Held: it does not fire until resumed.";
                          }, { name: `pause-${s.id}`, class: "quiet" })
                        : null,
                    action("Remove", async () => {
                      await del(`/v1/schedules/${s.id}`);
                      await schedules();
                      return "Removed.";
                    }, { name: `remove-${s.id}`, class: "danger", confirm: "Press again to remove" }),
                  )
                : "",
          },
        ],
        found.schedules,
        "No schedules.",
      ),
    );
  }

  // What explains a boot's outcome: the breaker it found, and the side work it began.
  function reasons(b) {
    const found = [];
    if (b.outcome && b.state && b.state !== b.outcome) found.push(b.state);
    const breaker = b.breaker || {};
    if (breaker.tripped) found.push("breaker tripped");
    if (breaker.reason) found.push(String(breaker.reason));
    if (b.attempted && b.attempted.length) found.push(`began: ${b.attempted.join(", ")}`);
    return found.length ? found.join("; ") : "-";
  }

  async function boots() {
    if (!me.admin) {
      fill(main, heading("Boots"), el("p", { class: "muted" }, "The boot log is shown to the admin token."));
      return;
    }
    const found = await get("/v1/boots?limit=100");
    fill(main,
      heading("Boots"),
      table(
        [
          { title: "boot", class: "mono", cell: (b) => el("span", { title: b.boot_id }, short(b.boot_id)) },
          { title: "host", class: "wide", cell: (b) => [b.host || "-", b.pid ? ` pid ${b.pid}` : ""] },
          { title: "version", class: "wide", cell: (b) => b.version || "-" },
          { title: "started", cell: (b) => when(b.started_at) },
          { title: "ended", class: "wide", cell: (b) => (b.ended_at ? when(b.ended_at) : "-") },
          { title: "outcome", cell: (b) => badge(b.outcome || b.state) },
          { title: "why", cell: (b) => reasons(b) },
        ],
        found.boots,
        "No boots recorded.",
      ),
    );
  }

  // --- start ------------------------------------------------------------------------------

  document.addEventListener("click", (event) => {
    const a = event.target.closest("a[data-link]");
    if (!a || event.defaultPrevented || event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
    event.preventDefault();
    go(a.getAttribute("href"));
  });
  window.addEventListener("popstate", () => route());
  signoutButton.addEventListener("click", () => signOut());

  async function start() {
    takeTokenFromAddress();
    me.token = sessionStorage.getItem(KEY);
    if (!me.token) return signin();
    try {
      await identify();
    } catch (error) {
      if (error.status !== 401) signOut(`Not signed in: ${error.message}`);
      return;
    }
    route();
  }
  start();
})();
