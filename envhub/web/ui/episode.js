// One episode (#/trials/<trial>/<instance>): the instance, its trajectory in order from
// the trial log (the first observation, each action and observation, each evaluation,
// how it ended), a whole rollout's summary and conversation, a verifier's files. What the
// episode wrote is shown by values.js, by its shape, the same way for every environment.

import { el, fmtReward, fmtSeconds, fmtTime, fold, trialHref } from "./dom.js";
import { api, show } from "./page.js";
import { isPlainObject, kvTable, messageList, renderValue, repeats } from "./values.js";

// The instance's facts, leaving out those it does not have.
function facts(rows) {
  return kvTable(rows.filter(([, v]) => v !== null && v !== undefined && v !== "").map(([k, v]) => [k, v instanceof Node ? v : String(v)]));
}

// An observation: its main output (``content``) first, then its other fields, leaving out
// those that only repeat text already shown (a traceback that is both the output and the
// ``exception``, say), named in one line so that nothing is silently dropped.
function observationBlock(observation) {
  if (observation === null || observation === undefined) return el("p", { class: "muted" }, "none");
  if (!isPlainObject(observation)) return renderValue(observation);
  const shown = [];
  const content = observation.content;
  if (typeof content === "string") shown.push(content);
  const rest = {};
  const repeated = [];
  for (const [k, v] of Object.entries(observation)) {
    if (k === "content" || v === null || v === undefined || v === false || v === "") continue;
    if (repeats(v, shown)) repeated.push(k);
    else {
      rest[k] = v;
      if (typeof v === "string") shown.push(v);
    }
  }
  return el(
    "div",
    { class: "observation" },
    content === undefined ? null : typeof content === "string" ? fold(content, "text output") : renderValue(content),
    Object.keys(rest).length ? renderValue(rest) : null,
    repeated.length ? el("p", { class: "muted repeated", "data-testid": "repeated" }, `Not shown again, the same text as above: ${repeated.join(", ")}`) : null
  );
}

function actionBlock(action) {
  if (!action) return null;
  const args = isPlainObject(action.arguments) ? action.arguments : {};
  return el(
    "div",
    { class: "action" },
    el("div", { class: "tool" }, el("span", { class: "muted" }, "tool "), el("code", {}, action.tool)),
    Object.entries(args).map(([k, v]) => el("div", { class: "field" }, el("div", { class: "field-name" }, k), typeof v === "string" ? fold(v, "code") : renderValue(v)))
  );
}

function evaluationBlock(event, live) {
  const details = event.details;
  const rewards = isPlainObject(event.rewards) ? Object.entries(event.rewards) : [];
  // A grade with no verdict (the grader could not decide) has no reward: its 0.0 is no failed solution.
  const head = event.verdict === false
    ? el("div", {}, el("strong", { "data-testid": "evaluation-reward" }, "no verdict"), el("span", { class: "muted" }, " (the grader could not decide)"))
    : el(
        "div",
        {},
        "reward ",
        el("strong", { "data-testid": "evaluation-reward" }, fmtReward(event.reward)),
        rewards.length ? el("span", { class: "muted" }, ` (${rewards.map(([k, v]) => `${k} ${typeof v === "number" ? fmtReward(v) : v}`).join(" · ")})`) : null
      );
  if (live && typeof details === "string") {
    return el("div", { class: "evaluation" }, head, el("p", { class: "muted", "data-testid": "evaluation-hidden" }, `Per-test details are ${details}.`));
  }
  if (details === undefined || details === null) return el("div", { class: "evaluation" }, head);
  const shown = el("div", { class: "details", "data-testid": "evaluation-details" }, renderValue(details));
  for (const table of shown.querySelectorAll('table[data-kind="tests"]')) table.setAttribute("data-testid", "evaluation-tests");
  return el("div", { class: "evaluation" }, head, shown);
}

function stepBlock(e, head) {
  const info = isPlainObject(e.info) ? Object.entries(e.info) : [];
  return el(
    "li",
    { class: "event step", "data-event": "step", "data-step": e.step, "data-testid": "step" },
    head(`step ${e.step}`),
    el("div", { class: "label" }, "action"),
    actionBlock(e.action),
    el("div", { class: "label" }, "observation"),
    observationBlock(e.observation),
    el("div", { class: "muted" }, `reward ${fmtReward(e.reward)}`, e.done ? " · done" : "", info.length ? ` · ${info.map(([k, v]) => `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ")}` : "")
  );
}

function eventBlock(e, live, at) {
  const head = (title) =>
    el("div", { class: "event-head" }, el("span", { class: "event-name" }, title), el("span", { class: "muted" }, ` ${at(e)}`), e.duration_s !== undefined ? el("span", { class: "muted" }, ` · took ${fmtSeconds(e.duration_s)}`) : null);
  if (e.event === "created") {
    return el("li", { class: "event created", "data-event": "created" }, head("created: the observation the model saw"), observationBlock(e.observation));
  }
  if (e.event === "step") return stepBlock(e, head);
  if (e.event === "evaluation") {
    return el("li", { class: "event evaluation", "data-event": "evaluation" }, head("evaluation"), evaluationBlock(e, live));
  }
  const rest = Object.fromEntries(Object.entries(e).filter(([k]) => k !== "event" && k !== "time"));
  return el("li", { class: `event other ${e.event}`, "data-event": e.event }, head(e.event), Object.keys(rest).length ? renderValue(rest) : null);
}

function conversationBlock(conversation) {
  const messages = (conversation && Array.isArray(conversation.messages) && conversation.messages) || [];
  if (!messages.length) return null;
  return [el("h2", {}, `Conversation with the model (${messages.length} messages)`), messageList(messages, "conversation")];
}

function rolloutBlock(runInfo) {
  if (!runInfo) return null;
  const summary = runInfo.agent_summary || {};
  const error = runInfo.error_info;
  return [
    el("h2", {}, "Rollout"),
    facts([
      ["agent", summary.agent],
      ["termination", summary.termination_reason],
      ["model calls", summary.model_calls],
      ["tokens", summary.tokens],
      ["error", error && error.error_message ? `${error.stage}: ${error.error_message}` : ""],
    ]),
    el("h3", {}, "Timings"),
    facts(Object.entries(runInfo.timings || {}).map(([k, v]) => [k, fmtSeconds(v)])),
  ];
}

export async function drawEpisode(view, trial, id) {
  const d = await api(`/trials/${encodeURIComponent(trial)}/episodes/${encodeURIComponent(id)}`);
  const inst = d.instance;
  const t0 = (d.events.find((e) => e.event === "created") || d.events[0] || {}).time;
  const at = (e) => (t0 && e.time ? `+${fmtSeconds(e.time - t0)}` : "");
  show(
    view,
    el("p", { class: "crumbs" }, el("a", { href: "#/trials" }, "Trials"), " / ", el("a", { href: trialHref(trial) }, trial), " / ", el("span", {}, id)),
    el("h1", {}, "Episode ", el("span", { "data-testid": "episode-id" }, id)),
    d.live ? el("p", { class: "warn", "data-testid": "live-note" }, "This episode is live: it updates itself, and its evaluation's details are shown once it has ended.") : null,
    facts([
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
    rolloutBlock(d.run_info),
    el("h2", {}, "Trajectory"),
    d.events.length
      ? el("ol", { class: "timeline", "data-testid": "timeline" }, d.events.map((e) => eventBlock(e, d.live, at)))
      : el("p", { class: "muted" }, "The trial log has no event for this episode (yet)."),
    d.events_cut ? el("p", { class: "warn" }, "The log is longer than the viewer reads; the rest is on the node.") : null,
    conversationBlock(d.conversation),
    d.verifier && d.verifier.length
      ? [el("h2", {}, "Verifier output"), d.verifier.map((f) => el("div", { class: "field" }, el("div", { class: "field-name" }, `${f.name} (${f.size} bytes${f.cut ? ", cut" : ""})`), fold(f.text)))]
      : null
  );
  return d.live;
}
