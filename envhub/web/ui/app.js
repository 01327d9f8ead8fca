// envhub's dashboard and trial viewer: the page's one script, an ES module that imports
// one module per page (dashboard.js, trials.js, episode.js) and what they share (dom.js,
// page.js, values.js). Plain JavaScript, no build step, nothing loaded from elsewhere.
// Every piece of text that comes from the API (observations, actions, program output,
// errors, names) is put on the page with textContent or as an attribute value, never
// parsed as HTML: an episode's output is untrusted.
//
// Here: which page a URL's fragment names, drawing it (and again while it asks to be
// followed), the key form, and the start.

import { drawFleet, drawNode } from "./dashboard.js";
import { el } from "./dom.js";
import { drawEpisode } from "./episode.js";
import { askForKey, KEY, NeedsKey, session, setStatus, show } from "./page.js";
import { drawTrial, drawTrials } from "./trials.js";

const POLL_MS = 2000;

let timer = null; // the pending poll of the view on screen

// The page a fragment names, as [nav section, draw]; a fragment that names none (or
// cannot be decoded) gets a page that says so, never the page that was on screen.
function pageFor(hash) {
  const [path, query] = (hash.replace(/^#/, "") || "/").split("?");
  let parts;
  try {
    parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  } catch {
    parts = null; // a malformed %-escape
  }
  const params = new URLSearchParams(query || "");
  if (parts && parts.length === 0) return ["dashboard", (view) => (session.role === "scheduler" ? drawFleet(view) : drawNode(view))];
  if (parts && parts[0] === "trials") {
    if (parts.length === 1) return ["trials", (view) => drawTrials(view)];
    if (parts.length === 2) return ["trials", (view) => drawTrial(view, parts[1], params)];
    if (parts.length === 3) return ["trials", (view) => drawEpisode(view, parts[1], parts[2])];
  }
  return [null, (view) => drawNoSuchPage(view, hash)];
}

async function drawNoSuchPage(view, hash) {
  show(
    view,
    el("h1", { "data-testid": "no-such-page" }, "No such page"),
    el("p", {}, "Nothing is at ", el("code", { "data-testid": "no-such-page-path" }, hash || "#"), ". Go to the ", el("a", { href: "#/" }, "dashboard"), " or the ", el("a", { href: "#/trials" }, "trials"), ".")
  );
  return false;
}

async function route() {
  clearTimeout(timer);
  const mine = ++session.generation;
  const [section, draw] = pageFor(location.hash);
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.nav === section);
  // What a drawing of this page may draw into: nothing, once the page has changed.
  const view = { mine };
  await run(() => draw(view), mine);
}

// Draw the view, then again while it is on screen and asks for it: every POLL_MS, or ten
// times as long as the last drawing took (a summary of a very large trial costs its node
// real work; a page left open must not cost it more than a tenth of its time).
async function run(draw, mine) {
  let again = false;
  const began = performance.now();
  try {
    again = await draw();
    if (mine !== session.generation) return;
    document.getElementById("key-form").hidden = true;
    setStatus(`updated ${new Date().toLocaleTimeString()}`);
  } catch (e) {
    if (mine !== session.generation) return;
    if (e instanceof NeedsKey) {
      askForKey(e.message);
      setStatus("needs an API key", true);
      return;
    }
    setStatus(`error: ${e.message}`, true);
    again = true;
  }
  const wait = Math.max(POLL_MS, 10 * (performance.now() - began));
  if (again && mine === session.generation) timer = setTimeout(() => run(draw, mine), wait);
}

async function start() {
  document.getElementById("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, document.getElementById("key-input").value);
    document.getElementById("key-input").value = "";
    document.getElementById("forget-key").hidden = false;
    route();
  });
  const forget = document.getElementById("forget-key");
  forget.hidden = !sessionStorage.getItem(KEY);
  forget.addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    forget.hidden = true;
    route();
  });
  window.addEventListener("hashchange", route);
  try {
    const health = await (await fetch("/health", { cache: "no-store" })).json();
    session.role = health.role;
    document.getElementById("role").textContent = session.role === "scheduler" ? "scheduler" : `node ${health.node_id || ""}`;
    document.title = `envhub ${session.role}`;
  } catch (e) {
    setStatus(`cannot reach envhub: ${e.message}`, true);
  }
  route();
}

start();
