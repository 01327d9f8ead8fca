// The trial pages: every trial (#/trials), and one trial (#/trials/<trial>) with its
// reward plot, outcome counts, filters and episodes.

import { episodeTable } from "./dashboard.js";
import { el, fmtReward, fmtTime, svg, trialHref } from "./dom.js";
import { api, session, show } from "./page.js";

const OUTCOMES = ["live", "error", "unscored", "passed", "failed"];

function unreachable(list) {
  return list && list.length ? el("p", { class: "warn" }, `Not answering, so left out: ${list.join(", ")}`) : null;
}

export async function drawTrials(view) {
  const d = await api("/trials");
  show(
    view,
    el("h1", {}, "Trials"),
    unreachable(d.unreachable),
    d.trials.length === 0
      ? el("p", { class: "muted" }, "No trial yet.")
      : el(
          "table",
          { "data-testid": "trials-table" },
          el("thead", {}, el("tr", {}, ["trial", "episodes", "first", "newest"].concat(session.role === "scheduler" ? ["nodes"] : []).map((x) => el("th", {}, x)))),
          el(
            "tbody",
            {},
            d.trials
              .slice()
              .reverse()
              .map((t) =>
                el(
                  "tr",
                  {},
                  el("td", {}, el("a", { href: trialHref(t.name) }, t.name)),
                  el("td", { class: "num" }, t.instances),
                  el("td", {}, fmtTime(t.created_at)),
                  el("td", {}, fmtTime(t.last_created_at)),
                  session.role === "scheduler" ? el("td", {}, (t.nodes || []).join(", ")) : null
                )
              )
          )
        )
  );
  return false; // a list of trials changes slowly: drawn again on navigation
}

// The reward histogram as an SVG bar chart: one bar per tenth of [0, 1].
function rewardPlot(rewards) {
  const bins = rewards.bins || [];
  const W = 420, H = 170, left = 34, bottom = 26, top = 12;
  const plotW = W - left - 8, plotH = H - bottom - top;
  const max = Math.max(1, ...bins);
  const bw = plotW / Math.max(1, bins.length);
  const chart = svg("svg", {
    viewBox: `0 0 ${W} ${H}`,
    width: W,
    height: H,
    class: "plot",
    role: "img",
    "data-testid": "reward-plot",
    "aria-label": `reward distribution of ${rewards.scored} scored episodes`,
  });
  chart.append(svg("line", { x1: left, y1: top + plotH, x2: left + plotW, y2: top + plotH, class: "axis" }));
  chart.append(svg("line", { x1: left, y1: top, x2: left, y2: top + plotH, class: "axis" }));
  chart.append(svg("text", { x: left - 4, y: top + 4, class: "tick", "text-anchor": "end" }, String(max)));
  chart.append(svg("text", { x: left - 4, y: top + plotH, class: "tick", "text-anchor": "end" }, "0"));
  bins.forEach((n, i) => {
    const h = (plotH * n) / max;
    const lo = (i / bins.length).toFixed(1);
    const hi = ((i + 1) / bins.length).toFixed(1);
    chart.append(
      svg(
        "rect",
        { x: left + i * bw + 2, y: top + plotH - h, width: bw - 4, height: h, class: "bar-rect", "data-count": n, "data-bin": i },
        svg("title", {}, `reward ${lo}-${hi}${i === bins.length - 1 ? " (incl. 1.0)" : ""}: ${n}`)
      )
    );
    if (n) chart.append(svg("text", { x: left + i * bw + bw / 2, y: top + plotH - h - 2, class: "tick", "text-anchor": "middle" }, String(n)));
  });
  for (let i = 0; i <= bins.length; i += 2) {
    chart.append(svg("text", { x: left + i * bw, y: H - 8, class: "tick", "text-anchor": "middle" }, (i / bins.length).toFixed(1)));
  }
  return chart;
}

// An outcome and its count. The badge takes its outcome's colour only when the count is
// above zero: "error 0" or "failed 0" is no alarm, and red that is always there is
// soon not seen.
function outcomeRow(outcome, count, href) {
  return el(
    "tr",
    { "data-outcome": outcome },
    el("td", {}, el("a", { href }, el("span", { class: `badge ${count > 0 ? outcome : "zero"}`, "data-testid": `outcome-badge-${outcome}` }, outcome))),
    el("td", { class: "num", "data-testid": `outcome-${outcome}` }, count)
  );
}

export async function drawTrial(view, trial, params) {
  const filters = { task: params.get("task") || "", outcome: params.get("outcome") || "" };
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(filters)) if (v) query.set(k, v);
  const limit = Number(params.get("limit") || 100);
  const [summary, page] = await Promise.all([
    api(`/trials/${encodeURIComponent(trial)}?${query}`),
    api(`/trials/${encodeURIComponent(trial)}/episodes?${query}&limit=${limit}`),
  ]);
  // The task list comes unfiltered by task, so that another task can be picked.
  const all = filters.task ? await api(`/trials/${encodeURIComponent(trial)}?${new URLSearchParams(filters.outcome ? { outcome: filters.outcome } : {})}`) : summary;
  const go = (change) => (location.hash = trialHref(trial, { ...filters, ...change }));
  const taskSelect = el(
    "select",
    { id: "task-filter", "data-testid": "task-filter", onchange: (e) => go({ task: e.target.value }) },
    el("option", { value: "" }, `all tasks (${all.tasks.length})`),
    all.tasks.map((t) => el("option", { value: t.task_id, selected: t.task_id === filters.task }, `${t.task_id} (${t.episodes})`))
  );
  const outcomeSelect = el(
    "select",
    { id: "outcome-filter", "data-testid": "outcome-filter", onchange: (e) => go({ outcome: e.target.value }) },
    el("option", { value: "" }, "all outcomes"),
    OUTCOMES.map((o) => el("option", { value: o, selected: o === filters.outcome }, o))
  );
  const mean = summary.rewards.mean;
  show(
    view,
    el("p", { class: "crumbs" }, el("a", { href: "#/trials" }, "Trials"), " / ", el("span", {}, trial)),
    el("h1", {}, "Trial ", el("span", { "data-testid": "trial-name" }, trial)),
    unreachable(summary.unreachable),
    el("div", { class: "filters" }, el("label", {}, "Task ", taskSelect), el("label", {}, "Outcome ", outcomeSelect)),
    el(
      "div",
      { class: "summary" },
      el(
        "div",
        {},
        el("h2", {}, "Reward distribution"),
        rewardPlot(summary.rewards),
        el("p", { class: "muted", "data-testid": "reward-summary" }, `${summary.rewards.scored} scored` + (mean === null || mean === undefined ? "" : `, mean ${fmtReward(mean)}`))
      ),
      el(
        "div",
        {},
        el("h2", {}, "Outcomes"),
        el(
          "table",
          { "data-testid": "outcomes-table" },
          el("tbody", {}, OUTCOMES.map((o) => outcomeRow(o, summary.outcomes[o] || 0, trialHref(trial, { ...filters, outcome: o }))))
        )
      )
    ),
    el("h2", {}, `Episodes (${page.total})`),
    episodeTable(page.episodes, { nodeColumn: session.role === "scheduler", testid: "episodes-table" }),
    page.total > page.episodes.length
      ? el("button", { type: "button", onclick: () => (location.hash = trialHref(trial, { ...filters, limit: String(Math.min(1000, limit * 2)) })) }, `show more (${page.episodes.length} of ${page.total})`)
      : null
  );
  return summary.outcomes.live > 0; // follows the trial while it has live episodes
}
