// The Execution Status page: polls its snapshot endpoint and draws the running tasks,
// the log and a timeline. Plain DOM, no framework, no build step, no network but ours.
"use strict";

(function () {
  const settings = JSON.parse(document.getElementById("settings").textContent);
  const form = document.getElementById("filters");
  const problem = document.getElementById("problem");
  const STATUSES = ["RUNNING", "QUEUED", "SUCCEEDED", "FAILED", "CANCELLED"];
  let timer = null;
  let inFlight = false;

  // --- filters ------------------------------------------------------------------------

  for (const [name, value] of Object.entries(settings.filters)) {
    form.elements[name].value = value || "";
  }
  form.elements.limit.value = settings.limit;
  if (settings.fixedRun) {
    // The per-run tab shows one run: its DAG and run are not the user's to change, and
    // Airflow's page around the tab names them already.
    for (const name of ["dag_id", "run_id"]) form.elements[name].closest("label").hidden = true;
    for (const th of document.querySelectorAll("th.airflow")) th.textContent = "Airflow task";
  }

  function currentFilters() {
    const out = {};
    for (const name of ["scheduler_handle", "dag_id", "run_id"]) {
      out[name] = form.elements[name].value.trim();
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
    form.elements.scheduler_handle.value = "";
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
    if (filters.scheduler_handle) params.set("scheduler_handle", filters.scheduler_handle);
    if (!settings.fixedRun) {
      if (filters.dag_id) params.set("dag_id", filters.dag_id);
      if (filters.run_id) params.set("run_id", filters.run_id);
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
    drawLog(data.log, data.now);
    document.getElementById("updated").textContent =
      "updated " + new Date(data.now * 1000).toLocaleTimeString();
  }

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

  function drawLog(rows, now) {
    const body = document.querySelector("#log tbody");
    document.getElementById("log-count").textContent =
      `${rows.length} newest row${rows.length === 1 ? "" : "s"}`;
    if (!rows.length) {
      body.replaceChildren(emptyRow(12, "no rows match"));
      return;
    }
    body.replaceChildren(
      ...rows.map((r) =>
        el("tr", { "data-log-id": r.log_id, "data-status": r.status }, [
          el("td", { class: "num" }, r.log_id),
          el("td", {}, el("span", { class: `badge ${r.status}` }, r.status)),
          el("td", { class: "task-name" }, r.task_name),
          el("td", {}, r.task_kind),
          el("td", { class: "num" }, waveOf(r)),
          el("td", {}, airflowCell(r)),
          el("td", {}, handleCell(r.scheduler_handle)),
          el("td", { title: r.worker_id || "" }, el("code", {}, shorten(r.worker_id, 30))),
          el("td", { class: "time" }, r.status === "QUEUED" ? "" : clock(r.start_time)),
          el("td", { class: "num time" }, duration(r, now)),
          el("td", { class: "num" }, r.attempts),
          el("td", { class: "error", title: r.error || "" }, r.error || ""),
        ]),
      ),
    );
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
    const lanes = [...new Set(started.map((r) => laneOf(r)))].sort((a, b) =>
      a === "queued" ? 1 : b === "queued" ? -1 : a.localeCompare(b),
    );
    const labelWidth = 190, laneHeight = 24, top = 22, right = 16;
    const width = Math.max(box.clientWidth || 900, 600);
    const plot = width - labelWidth - right;
    const height = top + lanes.length * laneHeight + 6;
    const x = (t) => labelWidth + ((t - t0) / Math.max(t1 - t0, 1e-3)) * plot;
    const svg = svgEl("svg", { width, height, role: "img", "aria-label": "timeline" });

    for (const tick of ticks(t0, t1, 8)) {
      svg.append(svgEl("line", { class: "grid", x1: x(tick), x2: x(tick), y1: top - 4, y2: height }));
      svg.append(svgEl("text", { x: x(tick), y: 13, "text-anchor": "middle" }, `+${seconds(tick - t0)}`));
    }
    lanes.forEach((lane, i) => {
      const y = top + i * laneHeight;
      if (i % 2 === 0) svg.append(svgEl("rect", { class: "lane", x: 0, y, width, height: laneHeight }));
      const label = svgEl("text", { x: 6, y: y + 16 }, lane === "queued" ? "queued (not started)" : shorten(lane, 27));
      label.append(svgEl("title", {}, lane));
      svg.append(label);
    });
    for (const r of started) {
      const y = top + lanes.indexOf(laneOf(r)) * laneHeight + 3;
      const x0 = x(r.start_time), w = Math.max(x(end(r)) - x0, 2);
      const bar = svgEl("rect", {
        class: `bar ${r.status}`, x: x0, y, width: w, height: laneHeight - 6, "data-log-id": r.log_id,
      });
      bar.append(svgEl("title", {}, `${r.task_name} — ${r.status}, wave ${waveOf(r) || "?"}, ` +
        `${duration(r, now)}${r.error ? "\n" + r.error : ""}`));
      svg.append(bar);
      if (w > 24 && r.wave !== null) {
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
