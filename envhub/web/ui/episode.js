// One episode (#/trials/<trial>/<instance>): the instance, its trajectory in order from
// the trial log, a whole rollout's summary and conversation, a verifier's files.

import { asText, el, fmtReward, fmtSeconds, fmtTime, fold, trialHref } from "./dom.js";
import { api, show } from "./page.js";

function kv(rows) {
  return el(
    "table",
    { class: "kv" },
    el("tbody", {}, rows.filter(([, v]) => v !== null && v !== undefined && v !== "").map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v instanceof Node ? v : String(v)))))
  );
}

function observationBlock(observation) {
  if (observation === null || observation === undefined) return el("p", { class: "muted" }, "none");
  if (typeof observation !== "object") return fold(observation);
  const main = observation.content !== undefined ? "content" : null;
  return el(
    "div",
    { class: "observation" },
    main ? fold(observation.content, "text output") : null,
    Object.entries(observation)
      .filter(([k, v]) => k !== main && v !== null && v !== false && v !== "")
      .map(([k, v]) => el("div", { class: "field" }, el("div", { class: "field-name" }, k), fold(v)))
  );
}

function actionBlock(action) {
  if (!action) return null;
  const args = action.arguments || {};
  return el(
    "div",
    { class: "action" },
    el("div", { class: "tool" }, el("span", { class: "muted" }, "tool "), el("code", {}, action.tool)),
    Object.entries(args).map(([k, v]) => el("div", { class: "field" }, el("div", { class: "field-name" }, k), fold(v, typeof v === "string" ? "code" : "text")))
  );
}

function evaluationBlock(event) {
  const details = event.details;
  const parts = [el("div", {}, "reward ", el("strong", { "data-testid": "evaluation-reward" }, fmtReward(event.reward)))];
  if (typeof details === "string") {
    parts.push(el("p", { class: "muted", "data-testid": "evaluation-hidden" }, `Per-test details are ${details}.`));
  } else if (details && Array.isArray(details.tests)) {
    const rest = Object.fromEntries(Object.entries(details).filter(([k]) => k !== "tests"));
    parts.push(kv(Object.entries(rest).map(([k, v]) => [k, typeof v === "object" ? asText(v) : v])));
    parts.push(
      el(
        "table",
        { class: "tests", "data-testid": "evaluation-tests" },
        el("thead", {}, el("tr", {}, el("th", {}, "test"), el("th", {}, "status"), el("th", {}, "detail"))),
        el(
          "tbody",
          {},
          details.tests.map((t, i) => {
            const test = typeof t === "object" && t !== null ? t : { test: i, status: t };
            const extra = Object.fromEntries(Object.entries(test).filter(([k]) => k !== "test" && k !== "status"));
            return el(
              "tr",
              {},
              el("td", {}, fold(test.test ?? test.name ?? String(i), "code")),
              el("td", {}, el("span", { class: `badge ${test.status === "passed" ? "passed" : "failed"}` }, test.status)),
              el("td", {}, Object.keys(extra).length ? fold(Object.keys(extra).length === 1 && extra.error ? extra.error : extra) : "")
            );
          })
        )
      )
    );
  } else if (details && typeof details.tests === "object") {
    parts.push(kv(Object.entries(details.tests).map(([k, v]) => [k, v])));
    const rest = Object.fromEntries(Object.entries(details).filter(([k]) => k !== "tests"));
    if (Object.keys(rest).length) parts.push(fold(rest));
  } else if (details !== undefined) {
    parts.push(fold(details));
  }
  return el("div", { class: "evaluation" }, parts);
}

function conversationBlock(conversation) {
  const messages = (conversation && conversation.messages) || [];
  if (!messages.length) return null;
  return [
    el("h2", {}, `Conversation with the model (${messages.length} messages)`),
    el(
      "ol",
      { class: "conversation", "data-testid": "conversation" },
      messages.map((m) =>
        el(
          "li",
          { class: `message role-${m.role}` },
          el("div", { class: "message-role" }, m.role, m.name ? ` (${m.name})` : "", m.tool_call_id ? ` · ${m.tool_call_id}` : ""),
          m.content !== null && m.content !== undefined && m.content !== "" ? fold(m.content) : null,
          (m.tool_calls || []).map((c) =>
            el("div", { class: "tool-call" }, el("code", {}, (c.function && c.function.name) || c.type || "call"), fold((c.function && c.function.arguments) || c, "code"))
          )
        )
      )
    ),
  ];
}

export async function drawEpisode(view, trial, id) {
  const d = await api(`/trials/${encodeURIComponent(trial)}/episodes/${encodeURIComponent(id)}`);
  const inst = d.instance;
  const t0 = (d.events.find((e) => e.event === "created") || d.events[0] || {}).time;
  const at = (e) => (t0 && e.time ? `+${fmtSeconds(e.time - t0)}` : "");
  const timeline = d.events.map((e) => {
    const head = (title) =>
      el("div", { class: "event-head" }, el("span", { class: "event-name" }, title), el("span", { class: "muted" }, ` ${at(e)}`), e.duration_s !== undefined ? el("span", { class: "muted" }, ` · took ${fmtSeconds(e.duration_s)}`) : null);
    if (e.event === "created") {
      return el("li", { class: "event created", "data-event": "created" }, head("created: the observation the model saw"), observationBlock(e.observation));
    }
    if (e.event === "step") {
      return el(
        "li",
        { class: "event step", "data-event": "step", "data-step": e.step, "data-testid": "step" },
        head(`step ${e.step}`),
        el("div", { class: "label" }, "action"),
        actionBlock(e.action),
        el("div", { class: "label" }, "observation"),
        observationBlock(e.observation),
        el("div", { class: "muted" }, `reward ${fmtReward(e.reward)}`, e.done ? " · done" : "", e.info && Object.keys(e.info).length ? ` · info ${JSON.stringify(e.info)}` : "")
      );
    }
    if (e.event === "evaluation") {
      return el("li", { class: "event evaluation", "data-event": "evaluation" }, head("evaluation"), evaluationBlock(e));
    }
    const rest = Object.fromEntries(Object.entries(e).filter(([k]) => k !== "event" && k !== "time"));
    return el("li", { class: `event other ${e.event}`, "data-event": e.event }, head(e.event), Object.keys(rest).length ? fold(rest) : null);
  });
  const runInfo = d.run_info;
  show(
    view,
    el("p", { class: "crumbs" }, el("a", { href: "#/trials" }, "Trials"), " / ", el("a", { href: trialHref(trial) }, trial), " / ", el("span", {}, id)),
    el("h1", {}, "Episode ", el("span", { "data-testid": "episode-id" }, id)),
    d.live ? el("p", { class: "warn", "data-testid": "live-note" }, "This episode is live: it updates itself, and its evaluation's details are shown once it has ended.") : null,
    kv([
      ["environment", inst.environment],
      ["task", inst.task_id],
      ["trial", inst.trial],
      ["node", inst.node_id],
      ["state", inst.state],
      ["reward", fmtReward(inst.reward)],
      ["steps", inst.step_count],
      ["created", fmtTime(inst.created_at)],
      ["ended", fmtTime(inst.ended_at)],
      ["duration", inst.ended_at ? fmtSeconds(inst.ended_at - inst.created_at) : ""],
      ["params", Object.keys(inst.params || {}).length ? JSON.stringify(inst.params) : ""],
      ["error", inst.error],
    ]),
    runInfo
      ? [
          el("h2", {}, "Rollout"),
          kv([
            ["agent", runInfo.agent_summary && runInfo.agent_summary.agent],
            ["termination", runInfo.agent_summary && runInfo.agent_summary.termination_reason],
            ["model calls", runInfo.agent_summary && runInfo.agent_summary.model_calls],
            ["tokens", runInfo.agent_summary && runInfo.agent_summary.tokens],
            ["error", runInfo.error_info && runInfo.error_info.error_message ? `${runInfo.error_info.stage}: ${runInfo.error_info.error_message}` : ""],
          ]),
          el("h3", {}, "Timings"),
          kv(Object.entries(runInfo.timings || {}).map(([k, v]) => [k, fmtSeconds(v)])),
        ]
      : null,
    el("h2", {}, "Trajectory"),
    d.events.length ? el("ol", { class: "timeline", "data-testid": "timeline" }, timeline) : el("p", { class: "muted" }, "The trial log has no event for this episode (yet)."),
    d.events_cut ? el("p", { class: "warn" }, "The log is longer than the viewer reads; the rest is on the node.") : null,
    conversationBlock(d.conversation),
    d.verifier && d.verifier.length
      ? [el("h2", {}, "Verifier output"), d.verifier.map((f) => el("div", { class: "field" }, el("div", { class: "field-name" }, `${f.name} (${f.size} bytes${f.cut ? ", cut" : ""})`), fold(f.text)))]
      : null
  );
  return d.live;
}
