// What every page shares: the tab's session (the role of the envhub it talks to, which
// navigation is current), the API calls with the kept key, and drawing into the view.

import { append, clear } from "./dom.js";

export const KEY = "envhub.apiKey";

// generation is bumped on every navigation: a drawing started for an older one draws
// nothing, so a slow answer for the page left never lands on the page on screen.
export const session = { role: null, generation: 0 };

export class NeedsKey extends Error {}

export async function api(path) {
  const headers = { Accept: "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) headers["X-API-Key"] = key;
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401 || response.status === 403) {
    const body = await response.json().catch(() => ({}));
    throw new NeedsKey(body.error || `HTTP ${response.status}`);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error((body && body.error) || `HTTP ${response.status}`);
  return body;
}

export function askForKey(reason) {
  const form = document.getElementById("key-form");
  document.getElementById("key-reason").textContent =
    `${reason}. Enter an API key; it is kept in this browser tab only (sessionStorage).`;
  form.hidden = false;
  document.getElementById("key-input").focus();
}

export function setStatus(text, bad) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("bad", !!bad);
}

// Replace the view's content in one go, so a poll never shows a half-drawn page; unless
// the person went elsewhere meanwhile (frame.mine is not the current generation).
export function show(frame, ...children) {
  if (frame.mine !== session.generation) return;
  const view = document.getElementById("view");
  const scroll = window.scrollY;
  clear(view);
  append(view, children);
  window.scrollTo(0, scroll);
}
