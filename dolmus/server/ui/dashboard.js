// The dashboard: the server's counters (the same numbers /metrics gives) and charts over the
// last minutes from /stats, polled once a second while the view is open; the engine's
// request list from /requests.

/* global uPlot */

import { KeyNeeded, getJSON } from "./api.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const MAX_POINTS = 600;

const CHARTS = {
  throughput: [
    ["output tok/s", (p) => p.generation_tps, "#2f7ed8"],
    ["prompt tok/s", (p) => p.prompt_tps, "#8bbc21"],
  ],
  requests: [
    ["running", (p) => p.running, "#2f7ed8"],
    ["waiting", (p) => p.waiting, "#f28f43"],
    ["preemptions", (p) => p.preemptions, "#c42525"],
  ],
  ttft: [
    ["p50", (p) => ms(p.ttft_p50), "#2f7ed8"],
    ["p95", (p) => ms(p.ttft_p95), "#f28f43"],
    ["p99", (p) => ms(p.ttft_p99), "#c42525"],
  ],
  itl: [
    ["p50", (p) => ms(p.itl_p50), "#2f7ed8"],
    ["p95", (p) => ms(p.itl_p95), "#f28f43"],
    ["p99", (p) => ms(p.itl_p99), "#c42525"],
  ],
  kv: [
    ["KV used", (p) => p.kv_usage * 100, "#2f7ed8"],
    ["prefix hits", (p) => (p.prefix_hit_rate === null ? null : p.prefix_hit_rate * 100), "#8bbc21"],
  ],
};

function ms(seconds) {
  return seconds === null || seconds === undefined ? null : seconds * 1000;
}

function num(value, digits = 0) {
  if (value === null || value === undefined) return "–";
  return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function triple(p, name) {
  const parts = [50, 95, 99].map((q) => p[`${name}_p${q}`]);
  if (parts.every((v) => v === null)) return "–";
  return parts.map((v) => `${num(ms(v))}`).join(" / ") + " ms";
}

export class Dashboard {
  constructor(app) {
    this.app = app;
    this.timer = null;
    this.points = [];
    this.last = 0;
    this.plots = {};
  }

  start() {
    if (this.timer || !this.app.info) return;
    this.poll();
    this.timer = setInterval(() => this.poll(), POLL_MS);
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
  }

  async poll() {
    let data;
    try {
      data = await getJSON(`/stats?since=${this.last}`);
    } catch (error) {
      this.app.status(`stats: ${error.message}`, true);
      return;
    }
    this.points.push(...data.samples);
    if (this.points.length > MAX_POINTS) this.points.splice(0, this.points.length - MAX_POINTS);
    if (data.samples.length) this.last = data.samples.at(-1).t;
    this.showTotals(data.totals);
    this.showLatest(this.points.at(-1));
    this.draw();
    this.showRequests();
  }

  showTotals(t) {
    const text = {
      running: num(t.running),
      waiting: num(t.waiting),
      kv_usage: `${num(t.kv_usage * 100, 1)}% of ${num(t.kv_capacity_tokens)} tokens`,
      prefix_cache_hit_rate: `${num(t.prefix_cache_hit_rate * 100, 1)}%`,
      preemptions: num(t.preemptions),
      prompt_tokens: num(t.prompt_tokens),
      generation_tokens: num(t.generation_tokens),
      finished: `${num(t.finished.stop)} / ${num(t.finished.length)} / ${num(t.finished.abort)}`,
      cost_per_million_generation_tokens: num(t.cost_per_million_generation_tokens, 4),
    };
    for (const node of document.querySelectorAll("[data-total]")) {
      const name = node.dataset.total;
      if (name in text) node.textContent = text[name];
      // the raw value, for anyone (and the tests) comparing with /metrics
      node.dataset.value = typeof t[name] === "object" ? JSON.stringify(t[name]) : String(t[name]);
    }
    const cost = document.querySelector("[data-cost]");
    if (cost) cost.hidden = t.cost_per_million_generation_tokens === undefined;
  }

  showLatest(p) {
    if (!p) return;
    const text = {
      generation_tps: num(p.generation_tps, 1),
      prompt_tps: num(p.prompt_tps, 1),
      ttft: triple(p, "ttft"),
      itl: triple(p, "itl"),
    };
    for (const node of document.querySelectorAll("[data-sample]")) node.textContent = text[node.dataset.sample];
  }

  draw() {
    const xs = this.points.map((p) => p.t);
    for (const [name, series] of Object.entries(CHARTS)) {
      const data = [xs, ...series.map(([, pick]) => this.points.map(pick))];
      const holder = $(`chart-${name}`);
      if (!this.plots[name]) {
        const width = Math.max(280, holder.clientWidth || 420);
        this.plots[name] = new uPlot(
          {
            width,
            height: 180,
            series: [{}, ...series.map(([label, , stroke]) => ({ label, stroke, width: 1.5, spanGaps: true }))],
            axes: [{}, { size: 56 }],
            legend: { live: false },
          },
          data,
          holder,
        );
      } else {
        this.plots[name].setData(data);
      }
    }
  }

  async showRequests() {
    const note = $("requests-note");
    let rows;
    try {
      rows = (await getJSON("/requests")).data;
    } catch (error) {
      note.hidden = false;
      note.textContent = error instanceof KeyNeeded ? "the request list needs the API key" : error.message;
      return;
    }
    note.hidden = rows.length > 0;
    note.textContent = "no requests in the engine";
    const body = $("requests").tBodies[0];
    body.replaceChildren(
      ...rows.map((r) => {
        const tr = document.createElement("tr");
        const cells = [
          r.request_id,
          r.state,
          r.tier,
          r.prompt_tokens,
          r.cached_tokens,
          r.computed_tokens,
          r.output_tokens,
          r.blocks,
          `${num(r.age_s, 1)} s`,
          r.num_preemptions,
        ];
        for (const value of cells) {
          const td = document.createElement("td");
          td.textContent = String(value);
          tr.append(td);
        }
        return tr;
      }),
    );
  }
}
