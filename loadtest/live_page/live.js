// The live view: polls `data` (served by loadtest/live.py) once a second and draws every model on shared time axes.
// The server keeps the window; this page keeps what it has fetched (`data?since=<last time>` brings the rest).
"use strict";

(function () {
  const POLL_MS = 1000;
  const EMBED = new URLSearchParams(location.search).has("embed");
  const sum = (a, b) => (a == null && b == null ? null : (a || 0) + (b || 0));
  const pct = (used, total) => (used == null || !total ? null : (100 * used) / total);
  // One chart per question; `p50` adds a dashed series per model beside the solid p99.
  const CHARTS = [
    { id: "batch", title: "Sequences in each forward step", unit: "mean per step", value: (s, i) => s.batch[i] },
    { id: "running", title: "Requests running", unit: "in the engine's batch", value: (s, i) => s.running[i] },
    { id: "waiting", title: "Requests waiting", unit: "engine queue + Triton's queue",
      value: (s, i) => sum(s.waiting[i], s.queued_in_triton[i]) },
    { id: "kv", title: "KV blocks used", unit: "% of the model's pool", max: 100,
      value: (s, i) => pct(s.kv_used[i], s.kv_total[i]) },
    { id: "tok_s", title: "Output tokens/s", unit: "over 5 s: counted as each request ends",
      value: (s, i) => s.tok_s[i] },
    { id: "ttft", title: "TTFT, clients", unit: "ms, p99 solid, p50 dashed", client: true,
      value: (s, i) => s.ttft_p99[i], p50: (s, i) => s.ttft_p50[i] },
    { id: "tpot", title: "TPOT, clients", unit: "ms, p99 solid, p50 dashed", client: true,
      value: (s, i) => s.tpot_p99[i], p50: (s, i) => s.tpot_p50[i] },
  ];
  // Per priority level (the server's *_by_priority series): a line per model and level, the model's colour, the
  // level's dash. `key` is the series' name before its "@<level>".
  const LEVEL_CHARTS = [
    { id: "level-queue", key: "queue_ms", title: "Queue time by priority level", unit: "ms, mean over the last " },
    { id: "level-ttft", key: "ttft_ms", title: "TTFT by priority level, server", unit: "ms, mean over the last " },
    { id: "level-tpot", key: "tpot_ms", title: "TPOT by priority level, server", unit: "ms, mean over the last " },
    { id: "level-preempt", key: "preempt", title: "Preemptions by priority level",
      unit: "counted as each preempted request ends, over the last " },
  ];
  const LEVEL_DASH = { 1: undefined, 2: [6, 4], 3: [2, 3] };
  const levelDash = (level) => (level in LEVEL_DASH ? LEVEL_DASH[level] : [10, 3, 2, 3]);
  const state = { t: [], underLoad: [], series: {}, models: [], colors: {}, charts: [], windowS: 300, now: 0,
    lastData: null, levels: {}, latencyWindowS: 20 };

  if (EMBED) document.body.classList.add("embed");

  function merge(d) {
    const held = state.t.length;
    for (const model of d.models) {
      // A model seen later, or a priority level a model shows later: empty before.
      state.series[model] = state.series[model] || {};
      for (const key of Object.keys(d.series[model])) {
        if (!state.series[model][key]) state.series[model][key] = new Array(held).fill(null);
      }
    }
    for (const [model, series] of Object.entries(state.series)) {
      for (const key of Object.keys(series)) {
        const fresh = d.series[model] ? d.series[model][key] : null;
        for (let i = 0; i < d.t.length; i++) series[key].push(fresh ? fresh[i] : null);
      }
    }
    state.t.push(...d.t);
    state.underLoad.push(...(d.under_load || d.t.map(() => [])));
    state.windowS = d.window_s;
    state.now = d.now;
    let drop = 0;
    while (drop < state.t.length && state.t[drop] < d.now - d.window_s) drop++;
    if (drop) {
      state.t.splice(0, drop);
      state.underLoad.splice(0, drop);
      for (const series of Object.values(state.series)) {
        for (const key of Object.keys(series)) series[key].splice(0, drop);
      }
    }
    Object.assign(state.colors, d.colors);
    state.latencyWindowS = d.latency_window_s;
  }

  // From the first point (at least a minute back) to now, at most the server's window.
  function xRange() {
    const first = state.t.length ? state.t[0] : state.now;
    return [Math.max(state.now - state.windowS, Math.min(first, state.now - 60)), state.now];
  }

  const clock = (u, splits) => splits.map((t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false }));

  function chartWidth(el) {
    return Math.max(300, el.clientWidth);
  }

  // Every line of a chart: [label, uPlot series options, the column's values at point i].
  function lines(spec) {
    const out = [];
    for (const model of state.models) {
      const s = state.series[model];
      const stroke = state.colors[model];
      if (spec.levelKey) {
        for (const level of Object.keys(state.levels)) {
          const values = s[`${spec.levelKey}@${level}`];
          if (!values) continue;
          out.push({ name: `${model}/${level}`, values: (i) => values[i],
            options: { label: `${model} ${state.levels[level]}`, stroke, width: 2, dash: levelDash(level) } });
        }
        continue;
      }
      out.push({ name: model, values: (i) => spec.value(s, i),
        options: { label: spec.p50 ? `${model} p99` : model, stroke, width: 2 } });
      if (spec.p50) {
        out.push({ name: `${model}-p50`, values: (i) => spec.p50(s, i), p50: true,
          options: { label: `${model} p50`, stroke, width: 1.5, dash: [6, 4] } });
      }
    }
    return out;
  }

  function buildCharts() {
    const root = document.getElementById("charts");
    const byLevel = document.getElementById("level-charts");
    for (const chart of state.charts) chart.plot.destroy();
    root.innerHTML = "";
    byLevel.innerHTML = "";
    const specs = [...CHARTS, ...LEVEL_CHARTS.map((spec) => ({ ...spec, levelKey: spec.key,
      unit: `${spec.unit}${state.latencyWindowS} s; line per model and level` }))];
    state.charts = specs.map((spec) => {
      const el = document.createElement("section");
      el.className = "chart";
      el.id = `chart-${spec.id}`;
      el.innerHTML = `<h3>${spec.title} <span class="unit">(${spec.unit})</span></h3>` +
        `<div class="plot"><div class="nodata"></div></div>`;
      (spec.levelKey ? byLevel : root).appendChild(el);
      const chartLines = lines(spec);
      const series = [{}, ...chartLines.map((line) => line.options)];
      const plotEl = el.querySelector(".plot");
      const plot = new uPlot({
        width: chartWidth(plotEl),
        height: 170,
        legend: { show: false },
        cursor: { sync: { key: "llm-live" }, drag: { x: false, y: false } },
        scales: {
          x: { time: true, range: xRange },
          y: { range: (u, min, max) => [0, spec.max || Math.max(1, (max || 0) * 1.1)] },
        },
        axes: [
          { stroke: "#555", grid: { stroke: "#eee" }, ticks: { stroke: "#ddd" }, values: clock },
          { stroke: "#555", grid: { stroke: "#eee" }, ticks: { stroke: "#ddd" }, size: 52 },
        ],
        series,
      }, [[]], plotEl);
      return { spec, el, plot, lines: chartLines };
    });
  }

  function columns(chartLines) {
    return [state.t, ...chartLines.map((line) => state.t.map((_, i) => line.values(i)))];
  }

  // Why a chart has nothing to draw (null: it has). Server charts say so whenever the metrics port does not answer.
  function emptyReason(spec, d, counts) {
    if (!spec.client && d.metrics.ok === false) return `No data: cannot reach the metrics port (${d.metrics.url}).`;
    if (!spec.client && d.metrics.ok == null) return "No data yet: waiting for the server to start.";
    if (Object.values(counts).every((n) => n === 0)) {
      if (spec.levelKey) return `No request has ended in the last ${state.latencyWindowS} s at any priority level.`;
      return spec.client ? "No request has finished in the window yet." : "No data yet from the metrics port.";
    }
    return null;
  }

  function drawCharts(d) {
    for (const { spec, el, plot, lines: chartLines } of state.charts) {
      const data = columns(chartLines);
      plot.setData(data);
      const counts = {};
      chartLines.forEach((line, i) => {
        if (!line.p50) counts[line.name] = data[1 + i].filter((v) => v != null).length;
      });
      el.dataset.points = Object.entries(counts).map(([model, n]) => `${model}:${n}`).join(" ");
      const reason = emptyReason(spec, d, counts);
      el.classList.toggle("empty", reason !== null);
      el.querySelector(".nodata").textContent = reason || "";
    }
  }

  function drawLegend() {
    document.getElementById("legend").innerHTML = state.models
      .map((m) => `<span><span class="swatch" style="background:${state.colors[m]}"></span>${m}</span>`).join("");
    document.getElementById("level-legend").innerHTML = Object.entries(state.levels).map(([level, name]) => {
      const dash = levelDash(level);
      return `<span data-level="${level}"><svg class="dash" width="30" height="6"><line x1="0" y1="3" x2="30" y2="3" ` +
        `stroke="#333" stroke-width="2"${dash ? ` stroke-dasharray="${dash.join(" ")}"` : ""}/></svg>` +
        `${name} (level ${level})</span>`;
    }).join("");
  }

  function drawBanner(d) {
    const banner = document.getElementById("banner");
    const m = d.metrics;
    const at = (t) => (t ? new Date(t * 1000).toLocaleTimeString([], { hour12: false }) : "never");
    let text, cls, pageState;
    if (m.ok === false) {
      text = `Cannot reach the metrics port at ${m.url} (since ${at(m.since)}; last answer ${at(m.last_ok)}): ` +
        `${m.error}. The server charts show nothing until it answers.`;
      cls = "bad"; pageState = "unreachable";
    } else if (m.ok == null) {
      text = m.error || "Waiting for the server."; cls = ""; pageState = "waiting";
    } else if (!state.models.length) {
      text = `The metrics port at ${m.url} answers, but no model exports llm_* series yet.`;
      cls = "bad"; pageState = "no-models";
    } else {
      text = `Live: ${state.models.length} model${state.models.length > 1 ? "s" : ""} from ${m.url}, ` +
        `${state.t.length} points; last read ${at(m.last_ok)}.`;
      cls = "ok"; pageState = "live";
      text += " " + sharingText();
    }
    banner.textContent = text;
    banner.className = cls;
    document.body.dataset.state = pageState;
  }

  // Models under load in the same second share the cores: each one's latencies then include the others' load.
  function sharingText() {
    const now = state.underLoad.length ? state.underLoad[state.underLoad.length - 1] : [];
    const shared = state.underLoad.filter((models) => models.length > 1).length;
    document.body.dataset.sharing = now.length > 1 ? "now" : shared ? "earlier" : "none";
    if (now.length > 1) {
      return `${now.length} models under load at once now (${now.join(", ")}): their engines share the cores, ` +
        "so each one's steps and latencies include the others' load.";
    }
    if (shared) return `More than one model was under load at once for ${shared} s of the window shown.`;
    return now.length ? `One model under load (${now[0]}).` : "No model under load.";
  }

  const fmt = (v, digits = 0) => (v == null ? "–" : Number(v).toFixed(digits));
  const latest = (values) => {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] != null) return values[i];
    return null;
  };

  function drawTable(d) {
    const rows = Object.fromEntries(d.summary.filter((r) => !r.class).map((r) => [r.model, r]));
    // The mixed workload's classes, under their model's row: the clients' figures of each class's requests.
    const clientCells = (r) => [
      fmt(r.requests), fmt(r.failures), r.slo_met_pct == null ? "–" : `${fmt(r.slo_met_pct)} %`,
      fmt(r.ttft_p50_ms), fmt(r.ttft_p99_ms), fmt(r.tpot_p50_ms, 1), fmt(r.tpot_p99_ms, 1),
      fmt(r.itl_max_p99_ms), fmt(r.e2e_p50_ms), fmt(r.e2e_p99_ms),
    ];
    const classRows = (model) => d.summary.filter((r) => r.model === model && r.class).map((r) =>
      `<tr class="class-row" data-model="${model}" data-class="${r.class}"><td>&nbsp;&nbsp;${r.class}</td>` +
      `<td colspan="5"></td>${clientCells(r).map((c) => `<td>${c}</td>`).join("")}</tr>`).join("");
    const head = `<tr><th></th><th class="group" colspan="5">now (server)</th>` +
      `<th class="group" colspan="10">every request so far (clients), ms</th></tr>` +
      "<tr><th>model</th><th>batch</th><th>running</th><th>waiting</th><th>KV used</th><th>tok/s</th>" +
      "<th>requests</th><th>failed</th><th>SLO met</th><th>TTFT p50</th><th>TTFT p99</th><th>TPOT p50</th>" +
      "<th>TPOT p99</th><th>ITL max p99</th><th>E2E p50</th><th>E2E p99</th></tr>";
    const body = state.models.map((model) => {
      const s = state.series[model];
      const r = rows[model] || {};
      const used = latest(s.kv_used), total = latest(s.kv_total);
      const cells = [
        fmt(latest(s.batch), 2), fmt(latest(s.running)), fmt(sum(latest(s.waiting), latest(s.queued_in_triton))),
        used == null ? "–" : `${fmt(used)} / ${fmt(total)}`, fmt(latest(s.tok_s)), ...clientCells(r),
      ];
      const name = `<span class="swatch" style="background:${state.colors[model]}"></span>${model}`;
      return `<tr data-model="${model}"><td>${name}</td>${cells.map((c) => `<td>${c}</td>`).join("")}</tr>` +
        classRows(model);
    }).join("");
    document.getElementById("summary").innerHTML = head + body;
    drawLevelTable();
    document.getElementById("slo-ttft").textContent = fmt(d.slo.ttft_ms);
    document.getElementById("slo-tpot").textContent = fmt(d.slo.tpot_ms);
    document.getElementById("latency-window").textContent = fmt(d.latency_window_s);
  }

  // Per model and priority level: the requests of the level that have ended and their preemptions (the server's
  // counters), and the means over the last point's window.
  function drawLevelTable() {
    const head = `<tr><th></th><th></th><th class="group" colspan="2">so far (server)</th>` +
      `<th class="group" colspan="4">the last ${fmt(state.latencyWindowS)} s (server)</th></tr>` +
      "<tr><th>model</th><th>priority level</th><th>requests ended</th><th>preemptions</th>" +
      "<th>queue time, ms</th><th>TTFT, ms</th><th>TPOT, ms</th><th>preemptions</th></tr>";
    const rows = [];
    for (const model of state.models) {
      const s = state.series[model];
      for (const [level, name] of Object.entries(state.levels)) {
        if (!s[`ended_total@${level}`]) continue;
        // NOTE: the counters as last read; the window's means as of the last point (none ended there: a dash).
        const total = (key) => latest(s[`${key}@${level}`]);
        const last = (key) => s[`${key}@${level}`][state.t.length - 1];
        const cells = [fmt(total("ended_total")), fmt(total("preempt_total")), fmt(last("queue_ms")),
          fmt(last("ttft_ms")), fmt(last("tpot_ms"), 1), fmt(last("preempt"))];
        const label = `<span class="swatch" style="background:${state.colors[model]}"></span>${model}`;
        rows.push(`<tr data-model="${model}" data-level="${level}"><td>${label}</td><td>${name} (${level})</td>` +
          `${cells.map((c) => `<td>${c}</td>`).join("")}</tr>`);
      }
    }
    document.getElementById("levels").innerHTML = head + rows.join("");
  }

  function render(d) {
    const models = [...new Set([...state.models, ...d.models])];  // a model seen later goes last
    const levels = { ...state.levels, ...d.levels };
    if (models.length !== state.models.length || Object.keys(levels).length !== Object.keys(state.levels).length) {
      state.models = models;
      state.levels = levels;
      buildCharts();
      drawLegend();
    }
    drawCharts(d);
    drawBanner(d);
    drawTable(d);
  }

  async function poll() {
    const since = state.t.length ? `?since=${state.t[state.t.length - 1]}` : "";
    try {
      const response = await fetch(`data${since}`, { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const d = await response.json();
      merge(d);
      render(d);
    } catch (error) {
      const banner = document.getElementById("banner");
      banner.textContent = `Lost the load-test process's web server (${error.message}): the load has probably ended.`;
      banner.className = "bad";
      document.body.dataset.state = "disconnected";
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  window.addEventListener("resize", () => {
    for (const { el, plot } of state.charts) {
      plot.setSize({ width: chartWidth(el.querySelector(".plot")), height: 170 });
    }
  });
  poll();
})();
