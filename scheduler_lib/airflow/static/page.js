// The Execution Status page: polls its snapshot endpoint and draws the running tasks,
// the log and a timeline. Plain DOM, no framework, no build step, no network but ours.
"use strict";

(function () {
  const settings = JSON.parse(document.getElementById("settings").textContent);
  const form = document.getElementById("filters");
  const problem = document.getElementById("problem");
  const STATUSES = ["RUNNING", "QUEUED", "SUCCEEDED", "FAILED", "CANCELLED"];
  const TEXT_FILTERS = ["scheduler_handle", "dag_id", "run_id", "target", "kind"];
  const expanded = new Set(); // log ids whose error is open: kept across redraws
  let timer = null;
  let inFlight = false;
  let lastData = null; // when the shown data was read (the server's clock) ...
  let readAt = 0; // ... and when the browser received it
  let clockSkew = 0; // server clock - browser clock, seconds

  // --- filters ------------------------------------------------------------------------

  for (const [name, value] of Object.entries(settings.filters)) {
    const field = form.elements[name];
    if (!field) continue;
    if (field.type === "checkbox") field.checked = value === true || value === "true";
    else field.value = value || "";
  }
  form.elements.limit.value = settings.limit;
  showCustomRange();
  form.elements.range.addEventListener("change", showCustomRange);

  function showCustomRange() {
    for (const label of form.querySelectorAll("label.custom-range")) {
      label.hidden = form.elements.range.value !== "custom";
    }
  }
  if (settings.fixedRun) {
    // The per-run tab shows one run: its DAG and run are not the user's to change, and
    // Airflow's page around the tab names them already.
    for (const name of ["dag_id", "run_id"]) form.elements[name].closest("label").hidden = true;
    for (const th of document.querySelectorAll("th.airflow")) th.textContent = "Airflow task";
  }

  function currentFilters() {
    const out = {};
    for (const name of TEXT_FILTERS) out[name] = form.elements[name].value.trim();
    out.failed = form.elements.failed.checked;
    const range = form.elements.range.value;
    if (range === "custom") {
      // datetime-local is the browser's local time; the server compares epoch seconds.
      const from = form.elements.from.value, to = form.elements.to.value;
      out.since = from ? String(new Date(from).getTime() / 1000) : "";
      out.until = to ? String(new Date(to).getTime() / 1000) : "";
    } else if (range) {
      out.since = String(Math.floor(Date.now() / 1000 + clockSkew - Number(range)));
    }
    return out;
  }

  function setFilter(name, value) {
    if (settings.fixedRun && name !== "scheduler_handle") return;
    form.elements[name].value = value;
    if (name === "dag_id") form.elements.run_id.value = "";
    refresh();
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    refresh();
  });
  document.getElementById("clear").addEventListener("click", () => {
    for (const name of ["scheduler_handle", "target", "kind", "from", "to", "range"]) {
      form.elements[name].value = "";
    }
    form.elements.failed.checked = false;
    showCustomRange();
    if (!settings.fixedRun) {
      form.elements.dag_id.value = "";
      form.elements.run_id.value = "";
    }
    refresh();
  });
  document.getElementById("auto-refresh").addEventListener("change", schedule);

  // --- polling ------------------------------------------------------------------------

  function snapshotUrl() {
    const params = new URLSearchParams();
    const filters = currentFilters();
    for (const [name, value] of Object.entries(filters)) {
      if (settings.fixedRun && (name === "dag_id" || name === "run_id")) continue;
      if (value === true) params.set(name, "true");
      else if (value) params.set(name, value);
    }
    params.set("limit", form.elements.limit.value || settings.limit);
    return settings.api + "?" + params.toString();
  }

  async function refresh() {
    if (inFlight) return;
    inFlight = true;
    try {
      // The session cookie Airflow's UI holds authenticates us (same origin).
      const response = await fetch(snapshotUrl(), {
        credentials: "same-origin",
        headers: { Accept: "application/json" },
      });
      if (!response.ok) {
        showProblem(response.status, await response.text());
        return;
      }
      const data = await response.json();
      problem.hidden = true;
      lastData = data;
      readAt = Date.now() / 1000;
      clockSkew = data.now - readAt;
      draw(data);
    } catch (error) {
      showProblem(0, String(error));
    } finally {
      inFlight = false;
      schedule();
    }
  }

  function schedule() {
    clearTimeout(timer);
    if (document.getElementById("auto-refresh").checked) {
      timer = setTimeout(refresh, settings.refreshSeconds * 1000);
    }
  }

  function showProblem(code, body) {
    let detail = body;
    try {
      detail = JSON.parse(body).detail || body;
    } catch (_) {
      /* not JSON: show the text */
    }
    if (typeof detail !== "string") detail = JSON.stringify(detail);
    const hint = code === 401 || code === 403 ? " — log in to Airflow again and reload." : "";
    problem.textContent = (code ? `${code}: ` : "") + detail + hint;
    problem.hidden = false;
  }

  // --- drawing ------------------------------------------------------------------------

  function draw(data) {
    drawSummary(data);
    drawRunning(data.running, data.now);
    drawTimeline(data.log, data.now);
    drawLog(data.log, data.now, data.complete);
    showAge();
  }

  // How old the shown data is, told every second: a page whose refreshes fail (the
  // database away, the login expired) must not pass old rows off as current.
  function showAge() {
    const updated = document.getElementById("updated");
    if (!lastData) return;
    const age = Math.max(0, Date.now() / 1000 - readAt);
    updated.textContent =
      `data of ${new Date(lastData.now * 1000).toLocaleTimeString()} (${Math.floor(age)} s old)`;
    updated.dataset.age = String(Math.floor(age));
    updated.classList.toggle("stale", age > 3 * settings.refreshSeconds + 2);
  }
  setInterval(showAge, 1000);

  function drawSummary(data) {
    const counts = {};
    for (const row of data.log) counts[row.status] = (counts[row.status] || 0) + 1;
    const busy = data.running.filter((r) => r.log_id !== null).length;
    const chips = [el("span", { class: "chip IDLE" }, `${busy} reader${busy === 1 ? "" : "s"} busy`)];
    for (const status of STATUSES) {
      if (counts[status]) {
        chips.push(el("span", { class: `chip ${status}` }, `${counts[status]} ${status.toLowerCase()}`));
      }
    }
    document.getElementById("summary").replaceChildren(...chips);
  }

  function drawRunning(rows, now) {
    const body = document.querySelector("#running tbody");
    document.getElementById("running-count").textContent =
      `${rows.length} reader${rows.length === 1 ? "" : "s"}`;
    if (!rows.length) {
      body.replaceChildren(emptyRow(9, "nothing runs now"));
      return;
    }
    body.replaceChildren(
      ...rows.map((r) =>
        el("tr", { "data-log-id": r.log_id ?? "" }, [
          el("td", {}, [el("code", {}, r.reader_name || r.reader_task_id)]),
          el("td", {}, r.queue_name),
          el("td", {}, r.log_id === null ? el("span", { class: "badge IDLE" }, "idle") : r.task_name),
          el("td", {}, airflowCell(r)),
          el("td", { class: "num" }, waveOf(r)),
          el("td", {}, handleCell(r.scheduler_handle)),
          el("td", { class: "time" }, clock(r.start_time)),
          el("td", { class: "num" }, r.start_time ? seconds(now - r.start_time) : ""),
          el("td", { class: "num" }, r.reader_heartbeat_at ? seconds(now - r.reader_heartbeat_at) + " ago" : ""),
        ]),
      ),
    );
  }

  function drawLog(rows, now, complete) {
    const body = document.querySelector("#log tbody");
    document.getElementById("log-count").textContent =
      `${rows.length} newest row${rows.length === 1 ? "" : "s"}` +
      (complete === false ? " you may see among the rows read: older ones may exist, narrow the filters" : "");
    if (!rows.length) {
      body.replaceChildren(emptyRow(10, "no rows match"));
      return;
    }
    body.replaceChildren(
      ...rows.map((r) =>
        el("tr", { "data-log-id": r.log_id, "data-status": r.status }, [
          el("td", { class: "num" }, r.log_id),
          el("td", {}, [
            el("span", { class: `badge ${r.status}` }, r.status),
            r.attempts > 1 ? el("span", { class: "muted", title: "attempts" }, ` ×${r.attempts}`) : "",
          ]),
          el("td", { class: "task-name" }, [
            el("span", { class: "name" }, r.task_name),
            el("div", { class: "muted kind" },
              `${r.task_kind} → ${r.target_service}` + (r.wave ? `, wave ${waveOf(r)}` : "")),
          ]),
          el("td", { class: "airflow" }, airflowCell(r)),
          el("td", {}, handleCell(r.scheduler_handle)),
          el("td", { class: "worker", title: r.worker_id || "" }, el("code", {}, shorten(r.worker_id, 20))),
          el("td", { class: "time" }, [
            r.status === "QUEUED" ? "" : clock(r.start_time),
            el("div", { class: "muted" }, duration(r, now)),
          ]),
          el("td", { class: "error" }, errorCell(r)),
          el("td", { class: "links" }, linksCell(r)),
          el("td", { class: "actions" }, actionsCell(r)),
        ]),
      ),
    );
  }

  // The error's first line in the table; the whole text opens in place (and stays open
  // across refreshes).
  function errorCell(r) {
    if (!r.error) return "";
    const text = String(r.error);
    const first = text.split("\n").find((line) => line.trim()) || text;
    const details = el("details", {}, [
      el("summary", { title: "show the whole error" }, first),
      el("pre", {}, text),
    ]);
    if (expanded.has(r.log_id)) details.open = true;
    details.addEventListener("toggle", () => {
      if (details.open) expanded.add(r.log_id);
      else expanded.delete(r.log_id);
    });
    return details;
  }

  function linksCell(r) {
    const links = [];
    if (r.dag_id && r.run_id && r.task_id) {
      // Airflow's task instance page opens on its log.
      const href = `${settings.airflowBase}/dags/${encodeURIComponent(r.dag_id)}/runs/` +
        `${encodeURIComponent(r.run_id)}/tasks/${encodeURIComponent(r.task_id)}`;
      const link = el("a", { class: "ti-log", href, target: "_top", title: "the Airflow task instance's log" }, "log");
      link.addEventListener("click", (event) => {
        // Airflow's UI frames the page in a sandbox that may not navigate the window: move
        // Airflow's own router instead (same origin), as its links do.
        if (window.top === window || event.ctrlKey || event.metaKey || event.shiftKey) return;
        try {
          window.top.history.pushState(null, "", href);
          window.top.dispatchEvent(new PopStateEvent("popstate"));
          event.preventDefault();
        } catch (_) {
          /* another origin: leave it to the browser */
        }
      });
      links.push(link);
    }
    if (r.spark_application_id) {
      const label = `Spark ${r.spark_job_group || r.spark_application_id}`;
      const title = `application ${r.spark_application_id}` +
        (r.spark_job_group ? `, job group ${r.spark_job_group}` : "");
      if (r.spark_ui_url && /^https?:\/\//.test(r.spark_ui_url)) {
        // The application's Jobs page: the job group labels its jobs there.
        const href = r.spark_ui_url.replace(/\/+$/, "") + "/jobs/";
        const link = el("a", { class: "spark-ui", href, target: "_blank", rel: "noopener", title }, label);
        link.addEventListener("click", (event) => {
          // The sandbox of Airflow's frame allows no new window of its own: Airflow's opens it.
          if (window.top === window) return;
          try {
            if (window.top.open(href, "_blank", "noopener") !== undefined) event.preventDefault();
          } catch (_) {
            /* another origin: leave it to the browser */
          }
        });
        links.push(link);
      } else {
        links.push(el("span", { class: "muted spark-ui", title }, label));
      }
    }
    return links.flatMap((link, i) => (i ? [" ", link] : [link]));
  }

  function actionsCell(r) {
    if (!r.editable) return "";
    if (r.status === "QUEUED" || r.status === "RUNNING") {
      return actionButton(r, "cancel", r.status === "RUNNING" && r.cancel_requested_at ? "stopping…" : "Cancel");
    }
    if (r.status === "FAILED" || r.status === "CANCELLED") return actionButton(r, "retry", "Retry");
    return "";
  }

  function actionButton(r, action, text) {
    const button = el("button", { type: "button", class: `action ${action}`, "data-action": action }, text);
    if (text === "stopping…") button.disabled = true;
    button.addEventListener("click", async () => {
      const what = action === "cancel"
        ? `Cancel task ${r.log_id} (${r.task_name})?`
        : r.dag_id
          ? `Retry task ${r.log_id}: clear Airflow task instance ${r.dag_id} / ${r.task_id}?`
          : `Retry task ${r.log_id}: send ${r.task_name} again on its scheduler?`;
      if (!window.confirm(what)) return;
      button.disabled = true;
      const response = await fetch(`${settings.actions}/${r.log_id}/${action}`, {
        method: "POST",
        credentials: "same-origin",
        // the server refuses a cookie-authenticated action without it (forgery)
        headers: { Accept: "application/json", "X-Scheduler-Lib-Action": "1" },
      });
      const text = await response.text();
      let detail = text;
      try {
        const body = JSON.parse(text);
        detail = body.message || body.detail || text;
      } catch (_) {
        /* not JSON: show the text */
      }
      if (typeof detail !== "string") detail = JSON.stringify(detail);
      const result = document.getElementById("action-result");
      result.textContent = response.ok ? detail : `${response.status}: ${detail}`;
      result.classList.toggle("refused", !response.ok);
      result.hidden = false;
      refresh();
    });
    return button;
  }

  // Rows by worker (lane) over time; queued rows wait in a lane of their own.
  function drawTimeline(rows, now) {
    const box = document.getElementById("timeline");
    const started = rows.filter((r) => r.start_time);
    if (!started.length) {
      box.replaceChildren(el("div", { class: "muted", style: "padding:12px" }, "no rows to draw"));
      return;
    }
    const end = (r) => r.end_time ?? now;
    const t0 = Math.min(...started.map((r) => r.start_time));
    // While something is open the axis runs to now; after, it ends with the last row,
    // so a finished run keeps its shape instead of shrinking as time passes.
    const open = started.some((r) => r.end_time === null || r.end_time === undefined);
    const t1 = open ? Math.max(now, ...started.map(end)) : Math.max(...started.map(end));
    // Queued rows all wait until now: each goes to the first queued lane it does not
    // overlap, so no bar hides another.
    const queuedLane = new Map();
    const lanesEnd = [];
    for (const r of started.filter((r) => laneOf(r) === "queued").sort((a, b) => a.start_time - b.start_time)) {
      let i = lanesEnd.findIndex((t) => t <= r.start_time);
      if (i < 0) i = lanesEnd.push(0) - 1;
      lanesEnd[i] = end(r);
      queuedLane.set(r.log_id, `queued ${i + 1}`);
    }
    const lane = (r) => queuedLane.get(r.log_id) || laneOf(r);
    const lanes = [...new Set(started.map(lane))].sort((a, b) => {
      const qa = a.startsWith("queued "), qb = b.startsWith("queued ");
      if (qa !== qb) return qa ? 1 : -1;
      return qa ? Number(a.slice(7)) - Number(b.slice(7)) : a.localeCompare(b);
    });
    const labelWidth = 190, laneHeight = 24, top = 22, right = 16, minBar = 4;
    const width = Math.max(box.clientWidth || 900, 600);
    const plot = width - labelWidth - right - minBar;
    const height = top + lanes.length * laneHeight + 6;
    const x = (t) => labelWidth + ((t - t0) / Math.max(t1 - t0, 1e-3)) * plot;
    const svg = svgEl("svg", { width, height, role: "img", "aria-label": "timeline" });

    for (const tick of ticks(t0, t1, 8)) {
      svg.append(svgEl("line", { class: "grid", x1: x(tick), x2: x(tick), y1: top - 4, y2: height }));
      svg.append(svgEl("text", { x: x(tick), y: 13, "text-anchor": "middle" }, `+${seconds(tick - t0)}`));
    }
    lanes.forEach((name, i) => {
      const y = top + i * laneHeight;
      if (i % 2 === 0) svg.append(svgEl("rect", { class: "lane", x: 0, y, width, height: laneHeight }));
      const text = name.startsWith("queued ") ? `queued (not started) ${name.slice(7)}` : shorten(name, 27);
      const label = svgEl("text", { x: 6, y: y + 16 }, text);
      label.append(svgEl("title", {}, name));
      svg.append(label);
    });
    for (const r of started) {
      const y = top + lanes.indexOf(lane(r)) * laneHeight + 3;
      // A bar is never thinner than a few pixels: a task that failed in 10 ms shows.
      const x0 = x(r.start_time), w = Math.max(x(end(r)) - x0, minBar);
      const bar = svgEl("rect", {
        class: `bar ${r.status}`, x: x0, y, width: w, height: laneHeight - 6, "data-log-id": r.log_id,
      });
      const tip = `${r.task_name} — ${r.status}, wave ${waveOf(r) || "?"}, ` +
        `${duration(r, now)}${r.error ? "\n" + r.error : ""}`;
      bar.append(svgEl("title", {}, tip));
      svg.append(bar);
      if (r.status === "FAILED") {
        // A mark of its own above the bar, as wide as a letter whatever the bar's width.
        const mark = svgEl("text", { class: "fail-mark", x: x0 + w / 2, y: y + 13, "text-anchor": "middle",
          "data-log-id": r.log_id }, "✕");
        mark.append(svgEl("title", {}, tip));
        svg.append(mark);
      } else if (w > 24 && r.wave !== null) {
        svg.append(svgEl("text", { class: "bar-label", x: x0 + 4, y: y + 13 }, `w${waveOf(r)}`));
      }
    }
    if (open) svg.append(svgEl("line", { class: "now", x1: x(now), x2: x(now), y1: top - 4, y2: height }));
    box.replaceChildren(svg);
  }

  function laneOf(r) {
    return r.status === "QUEUED" || !r.worker_id ? "queued" : r.worker_id;
  }

  // --- cells and helpers --------------------------------------------------------------

  function airflowCell(r) {
    if (!r.dag_id) return el("span", { class: "muted" }, "—");
    if (settings.fixedRun) return r.task_id || "";
    const parts = [filterLink("dag_id", r.dag_id, r.dag_id)];
    if (r.run_id) parts.push(" / ", filterLink("run_id", r.run_id, r.run_id, r.dag_id));
    if (r.task_id) parts.push(" / ", r.task_id);
    return el("span", {}, parts);
  }

  function handleCell(handle) {
    if (!handle) return "";
    return filterLink("scheduler_handle", handle, handle.slice(0, 8));
  }

  function filterLink(name, value, text, dagId) {
    const link = el("a", { class: "filter", title: `show only ${name} = ${value}` }, text);
    link.addEventListener("click", () => {
      if (dagId && !settings.fixedRun) form.elements.dag_id.value = dagId;
      if (name === "run_id") {
        if (!settings.fixedRun) form.elements.run_id.value = value;
        refresh();
      } else {
        setFilter(name, value);
      }
    });
    return link;
  }

  function shorten(text, room) {
    // Worker ids read host:pid:reader[:application]: keep both ends, they say most.
    if (!text) return "";
    if (text.length <= room) return text;
    const head = Math.ceil((room - 1) / 2), tail = Math.floor((room - 1) / 2);
    return text.slice(0, head) + "…" + text.slice(text.length - tail);
  }

  function waveOf(r) {
    // The log numbers waves as people (and the DAGs) do: the first is 1.
    return r.wave === null || r.wave === undefined ? "" : r.wave;
  }

  function duration(r, now) {
    if (r.status === "QUEUED") return "queued " + seconds(now - r.start_time);
    return seconds((r.end_time ?? now) - r.start_time) + (r.end_time ? "" : " …");
  }

  function seconds(s) {
    if (s < 0) s = 0;
    if (s < 10) return s.toFixed(2) + " s";
    if (s < 120) return s.toFixed(1) + " s";
    const m = Math.floor(s / 60);
    return m < 120 ? `${m} min ${Math.round(s - m * 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  function clock(t) {
    return t ? new Date(t * 1000).toLocaleTimeString() : "";
  }

  function ticks(t0, t1, count) {
    const span = Math.max(t1 - t0, 1e-3);
    const raw = span / count;
    const step = [0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400]
      .find((s) => s >= raw) || raw;
    const out = [];
    for (let t = t0; t <= t1 + 1e-9; t += step) out.push(t);
    return out;
  }

  function emptyRow(columns, text) {
    return el("tr", {}, [el("td", { class: "empty", colspan: columns }, text)]);
  }

  function el(tag, attributes, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
    append(node, children);
    return node;
  }

  function svgEl(tag, attributes, children) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
    append(node, children);
    return node;
  }

  function append(node, children) {
    if (children === undefined || children === null) return;
    for (const child of Array.isArray(children) ? children : [children]) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child ?? "")));
    }
  }

  refresh();
})();
