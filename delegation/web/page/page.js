// The page of `delegation web`: plain JavaScript, no build step.
// Everything a child wrote is put in the page as text (textContent), never as HTML.
"use strict";

const MAX_EVENTS = 2000; // rows kept in the events list; older ones are dropped
const $ = (id) => document.getElementById(id);
let serverOffset = 0; // the server's clock minus this browser's, in seconds
let following = null; // the EventSource of the chosen child's events
let refreshing = null; // the lists' refresh in flight, and whether another is due
let refreshAgain = false;
let followed = null; // the execution whose events and steps are shown: {conversationId, runId}

function age(seconds) {
  let left = Math.max(0, Math.floor(seconds));
  const units = [["d", 86400], ["h", 3600], ["m", 60], ["s", 1]];
  const parts = [];
  for (const [unit, size] of units) {
    if (left >= size || (unit === "s" && parts.length === 0)) {
      parts.push(Math.floor(left / size) + unit);
      left %= size;
    }
  }
  return parts.slice(0, 2).join(" ");
}

function since(timestamp) {
  // null: a time stored as no number (the server sends it as null)
  if (typeof timestamp !== "number" || !Number.isFinite(timestamp)) return "unreadable";
  return age(Date.now() / 1000 + serverOffset - timestamp);
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (className) td.className = className;
  if (td.textContent) td.title = td.textContent; // whole, where the cell cuts it
  return td;
}

function link(text, onClick) {
  const a = document.createElement("a");
  a.href = "#";
  a.textContent = text;
  a.addEventListener("click", (event) => {
    event.preventDefault();
    onClick();
  });
  return a;
}

// A child pinned to the runner version that ran it (design §34): it waits for a host of
// that version, or for `delegation unpin`.
function pinnedBadge(version) {
  const badge = document.createElement("span");
  badge.className = "badge pinned";
  badge.textContent = "pinned " + version;
  badge.title = "pinned to runner version " + version
    + ": a host of it runs it, or `delegation unpin` lets the current code";
  return badge;
}

function ageCell(row, createdAt) {
  const td = cell(row, since(createdAt), "age");
  td.dataset.created = String(createdAt);
}

function renderAges() {
  for (const td of document.querySelectorAll("td.age")) {
    td.textContent = since(Number(td.dataset.created));
  }
}

// --- where we are: filters and the chosen child live in the address ---------------

function place() {
  return new URLSearchParams(location.search);
}

function remember(changes) {
  const query = place();
  for (const [key, value] of Object.entries(changes)) {
    if (value) query.set(key, value);
    else query.delete(key);
  }
  const search = query.toString();
  history.replaceState(null, "", search ? "?" + search : location.pathname);
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  serverOffset = body.now - Date.now() / 1000;
  return body;
}

// --- children ------------------------------------------------------------------------

async function loadChildren() {
  const query = new URLSearchParams();
  for (const key of ["state", "lease"]) if (place().get(key)) query.set(key, place().get(key));
  const body = await getJSON("api/children?" + query.toString());
  const rows = $("children").tBodies[0];
  rows.replaceChildren();
  const chosen = place().get("child");
  for (const child of body.children) {
    const row = rows.insertRow();
    row.dataset.conversation = child.conversationId;
    row.dataset.state = child.state;
    if (child.conversationId === chosen) row.className = "chosen";
    cell(row, "", "id").append(link(child.conversationId, () => choose(child)));
    row.cells[0].title = child.conversationId;
    cell(row, child.runId, "id");
    // A queued child shows its place in the queue (1: next).
    const state = child.queuePosition ? child.state + " #" + child.queuePosition : child.state;
    const stateCell = cell(row, state, "state " + child.state);
    if (child.pinnedVersion) stateCell.append(pinnedBadge(child.pinnedVersion));
    cell(row, child.profile);
    cell(row, child.parentRunId, "id");
    cell(row, child.leaseId, "id");
    ageCell(row, child.createdAt);
    cell(row, child.error || child.output, child.error ? "error clip" : "clip");
  }
  $("children-count").textContent = body.children.length + " shown";
}

// --- leases --------------------------------------------------------------------------

async function loadLeases() {
  const body = await getJSON("api/leases");
  const rows = $("leases").tBodies[0];
  rows.replaceChildren();
  const known = new Set();
  for (const lease of body.leases) {
    known.add(lease.leaseId);
    const row = rows.insertRow();
    row.dataset.lease = lease.leaseId;
    cell(row, "", "id").append(link(lease.leaseId, () => filterLease(lease.leaseId)));
    row.cells[0].title = lease.leaseId;
    cell(row, lease.runnerId, "id");
    cell(row, lease.extensionId);
    cell(row, lease.runId, "id");
    cell(row, lease.children, "number");
    ageCell(row, lease.createdAt);
    cell(row, lease.status, lease.revokedAt ? "revoked" : "live");
  }
  const wanted = place().get("lease");
  if (wanted) known.add(wanted);
  // Drawn again only when the leases changed: an open drop-down stays open.
  const select = $("lease-filter");
  const ids = ["", ...[...known].sort()];
  if (ids.join("\n") !== [...select.options].map((option) => option.value).join("\n")) {
    select.replaceChildren(...ids.map((id) => new Option(id || "any", id)));
  }
  select.value = wanted || "";
}

function filterLease(leaseId) {
  $("lease-filter").value = leaseId;
  remember({ lease: leaseId });
  refresh();
}

// --- one child's steps (name, size, when; never a value) ------------------------------

function byteSize(size) {
  if (size < 1024) return size + " B";
  if (size < 1024 * 1024) return (size / 1024).toFixed(1) + " KiB";
  return (size / (1024 * 1024)).toFixed(1) + " MiB";
}

// The followed child's "steps" or "inputs", or null: no child followed, no such child
// (the events pane says so), or another child chosen meanwhile.
async function followedJSON(what) {
  const shown = followed;
  if (!shown) return null;
  const query = shown.runId ? "?run=" + encodeURIComponent(shown.runId) : "";
  let body;
  try {
    body = await getJSON(
      "api/children/" + encodeURIComponent(shown.conversationId) + "/" + what + query);
  } catch (error) {
    return null;
  }
  return shown === followed ? body : null;
}

async function loadSteps() {
  const body = await followedJSON("steps");
  if (!body) return;
  const rows = $("steps").tBodies[0];
  rows.replaceChildren();
  for (const step of body.steps) {
    const row = rows.insertRow();
    row.dataset.ordinal = String(step.ordinal);
    cell(row, step.ordinal, "number");
    cell(row, step.name);
    cell(row, byteSize(step.size), "number");
    ageCell(row, step.recordedAt);
    if (typeof step.recordedAt === "number") {
      row.cells[3].title = new Date(step.recordedAt * 1000).toISOString();
    }
  }
  const more = body.stepCount - body.steps.length;
  $("steps-count").textContent = body.stepCount === 0 ? "(none recorded)"
    : more > 0 ? "(the last " + body.steps.length + " of " + body.stepCount + ")"
      : "(" + body.stepCount + ")";
  $("steps-pane").hidden = false;
}

// --- what one child asks (design §21: an input request, an approval) -----------------

async function loadInputs() {
  const body = await followedJSON("inputs");
  if (!body) return;
  const list = $("inputs");
  list.replaceChildren();
  for (const [inputId, ask] of Object.entries(body.inputRequests)) {
    const item = document.createElement("li");
    item.dataset.input = inputId;
    let said = ask.kind + " " + inputId + ": " + ask.prompt;
    if (ask.options && ask.options.length) said += " (" + ask.options.join(" / ") + ")";
    if (ask.toolName) said += " — tool " + ask.toolName;
    if (ask.input) said += " " + ask.input;
    if (ask.expiresAt) said += " — until " + ask.expiresAt;
    item.textContent = said;
    list.append(item);
  }
  $("inputs-pane").hidden = list.children.length === 0;
}

// Both lists again, one refresh at a time (a burst of commits is one more refresh).
async function refresh() {
  if (refreshing) {
    refreshAgain = true;
    return;
  }
  refreshing = Promise.all([loadLeases(), loadChildren(), loadSteps(), loadInputs()]);
  try {
    await refreshing;
  } catch (error) {
    $("status").textContent = "error: " + error.message;
  } finally {
    refreshing = null;
    if (refreshAgain) {
      refreshAgain = false;
      refresh();
    }
  }
}

// --- one child's events, live --------------------------------------------------------

function showChild(child) {
  $("child-title").textContent = child.conversationId + " / " + child.runId;
  const detail = $("child-detail");
  detail.replaceChildren();
  const fields = [
    ["state", child.state], ["profile", child.profile], ["parent", child.parentConversationId],
    ["lease", child.leaseId], ["error", child.error], ["output", child.output],
  ];
  for (const [name, value] of fields) {
    if (!value) continue;
    const term = document.createElement("dt");
    term.textContent = name;
    const text = document.createElement("dd");
    text.textContent = value;
    text.className = name;
    detail.append(term, text);
  }
  if (child.pinnedVersion) {
    const term = document.createElement("dt");
    term.textContent = "version";
    const text = document.createElement("dd");
    text.append(pinnedBadge(child.pinnedVersion));
    detail.append(term, text);
  }
}

function addEvent(event) {
  const list = $("events");
  const item = document.createElement("li");
  item.className = "event kind-" + String(event.kind).replace(/[^a-z0-9_-]/gi, "_");
  item.dataset.sequence = String(event.sequence);
  const head = document.createElement("span");
  head.className = "head";
  head.textContent = event.sequence + " " + event.kind;
  item.append(head);
  const parts = [["text", ""], ["toolName", "tool "], ["input", "input "],
    ["toolOutput", "output "], ["error", "error "]];
  for (const [field, label] of parts) {
    if (!event[field]) continue;
    const body = document.createElement("pre");
    body.className = field;
    if (label) {
      const name = document.createElement("span");
      name.className = "label";
      name.textContent = label;
      body.append(name);
    }
    body.append(document.createTextNode(event[field]));
    item.append(body);
  }
  if (event.success !== undefined) {
    const outcome = document.createElement("span");
    outcome.className = event.success ? "ok" : "failed";
    outcome.textContent = event.success ? "ok" : "failed";
    item.append(outcome);
  }
  const atBottom = list.scrollTop + list.clientHeight >= list.scrollHeight - 4;
  list.append(item);
  while (list.children.length > MAX_EVENTS) list.firstElementChild.remove();
  if (atBottom) list.scrollTop = list.scrollHeight;
}

function choose(child) {
  remember({ child: child.conversationId, run: child.runId });
  for (const row of $("children").tBodies[0].rows) {
    row.className = row.dataset.conversation === child.conversationId ? "chosen" : "";
  }
  follow(child.conversationId, child.runId);
}

function follow(conversationId, runId) {
  if (following) following.close();
  $("events").replaceChildren();
  $("child-detail").replaceChildren();
  $("steps").tBodies[0].replaceChildren();
  $("steps-count").textContent = "";
  $("inputs").replaceChildren();
  $("inputs-pane").hidden = true;
  $("events-end").textContent = "following…";
  followed = { conversationId, runId };
  loadSteps();
  loadInputs();
  const query = runId ? "?run=" + encodeURIComponent(runId) : "";
  const source = new EventSource(
    "api/children/" + encodeURIComponent(conversationId) + "/events" + query);
  following = source;
  source.addEventListener("child", (message) => {
    const child = JSON.parse(message.data);
    // Opened without a run: the stream's execution is the newest one, and so are its steps.
    if (followed && followed.conversationId === child.conversationId && !followed.runId) {
      followed.runId = child.runId;
    }
    showChild(child);
  });
  source.addEventListener("message", (message) => addEvent(JSON.parse(message.data)));
  source.addEventListener("end", (message) => {
    source.close();
    loadSteps(); // the last ones, committed with the last events
    loadInputs();
    const child = JSON.parse(message.data);
    if (!child) {
      $("events-end").textContent = "this child is gone (purged)";
      return;
    }
    showChild(child);
    // An error often names the state already ("cancelled: lease released").
    let how = child.state;
    if (child.error) {
      how = child.error.startsWith(child.state) ? child.error : how + ": " + child.error;
    }
    $("events-end").textContent = "ended " + how;
  });
  source.addEventListener("error", () => {
    if (source !== following) return;
    $("events-end").textContent = source.readyState === EventSource.CLOSED
      ? "no such child" : "reconnecting…";
  });
}

// --- start ---------------------------------------------------------------------------

function watchChanges() {
  const changes = new EventSource("api/changes");
  changes.addEventListener("open", () => {
    $("status").textContent = "live";
    $("status").className = "status live";
    refresh(); // whatever happened while we were away
  });
  changes.addEventListener("changed", () => refresh());
  changes.addEventListener("error", () => {
    $("status").textContent = "reconnecting…";
    $("status").className = "status down";
  });
}

function start() {
  // The server has set its token as a cookie: off the address bar, history and bookmarks.
  if (place().has("token")) remember({ token: null });
  const here = place();
  $("state-filter").value = here.get("state") || "";
  if (here.get("lease")) {
    $("lease-filter").append(new Option(here.get("lease"), here.get("lease")));
    $("lease-filter").value = here.get("lease");
  }
  $("state-filter").addEventListener("change", () => {
    remember({ state: $("state-filter").value });
    refresh();
  });
  $("lease-filter").addEventListener("change", () => {
    remember({ lease: $("lease-filter").value });
    refresh();
  });
  if (here.get("child")) follow(here.get("child"), here.get("run"));
  refresh();
  watchChanges();
  setInterval(renderAges, 1000);
}

start();
