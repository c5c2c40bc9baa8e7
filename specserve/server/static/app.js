/* The chat page (an ES module): streams /v1/chat/completions with specserve's token_sources extension, marks
   each token by how it was produced, and shows live figures for the reply and, from /metrics, the server.
   Same origin only (relative URLs); model text reaches the page as text nodes only (markdown.js). */
import { render as renderMarkdown } from "./markdown.js";

const KEY_STORAGE = "specserve-api-key"; // sessionStorage: the key lives as long as the tab
const SETTINGS_STORAGE = "specserve-settings"; // localStorage: settings persist
const METRICS_EVERY_MS = 1000;
const SOURCES = ["accepted", "bonus", "correction", "target"];
const SOURCE_TITLES = {
  accepted: "draft token accepted by the target",
  bonus: "target's own token after all drafts were accepted",
  correction: "target's own token in place of a rejected draft",
  target: "target's own token (no drafts this step)",
};

const $ = (id) => document.getElementById(id);
const conversation = []; // the conversation sent with each request: {role, content}
let chatNumber = 0; // "New chat" starts the next: a reply still ending belongs to the old one
let running = null; // {controller, reply} of the generation in flight

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ------------------------------------------------------------------------------------------ API access

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function errorOf(response) {
  let message = response.statusText;
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || message;
  } catch (_) { /* not JSON */ }
  return new HttpError(response.status, `${response.status}: ${message}`);
}

async function checkServer() {
  let response;
  try {
    response = await fetch("v1/models", { headers: authHeaders() });
  } catch (exc) {
    setConnection("unreachable", "error");
    return false;
  }
  if (response.status === 401) {
    setConnection("API key required", "error");
    return false;
  }
  if (!response.ok) {
    setConnection(`error ${response.status}`, "error");
    return false;
  }
  const models = await response.json();
  const model = models.data[0];
  $("model-name").textContent = model ? `${model.id} · ${model.max_model_len} tokens` : "";
  setConnection("ready", "ok");
  return true;
}

function setConnection(text, kind) {
  const el = $("connection");
  el.textContent = text;
  el.className = "status " + kind;
}

/* POSTs a streamed chat completion; calls onChunk(payload) per event until [DONE]. */
async function streamChat(body, signal, onChunk) {
  const response = await fetch("v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new Error(payload.error.message);
        onChunk(payload);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------ settings

const SETTING_IDS = ["system-prompt", "temperature", "top-p", "max-tokens", "seed", "speculation", "num-spec",
  "format", "schema", "show-marks"];

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
  } catch (_) { /* ignore a corrupt entry */ }
  for (const id of SETTING_IDS) {
    if (!(id in saved)) continue;
    const el = $(id);
    if (el.type === "checkbox") el.checked = Boolean(saved[id]);
    else el.value = String(saved[id]);
  }
  settingsChanged();
}

function settingsChanged() {
  const saved = {};
  for (const id of SETTING_IDS) saved[id] = $(id).type === "checkbox" ? $(id).checked : $(id).value;
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(saved));
  $("schema-label").hidden = $("format").value !== "json_schema";
  $("num-spec").disabled = !$("speculation").checked;
  document.body.classList.toggle("hide-marks", !$("show-marks").checked);
}

function numberSetting(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

/* The request body for the conversation so far, from the settings panel. */
function requestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true, include_token_sources: true },
    temperature: numberSetting("temperature"),
    top_p: numberSetting("top-p"),
    max_completion_tokens: numberSetting("max-tokens"),
    seed: numberSetting("seed"),
  };
  if (!$("speculation").checked) body.num_speculative_tokens = 0;
  else if (numberSetting("num-spec") !== undefined) body.num_speculative_tokens = numberSetting("num-spec");
  const format = $("format").value;
  if (format === "json_object") body.response_format = { type: "json_object" };
  if (format === "json_schema") {
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: JSON.parse($("schema").value) } };
  }
  return body;
}

// ------------------------------------------------------------------------------------------ messages

function addMessage(role, label) {
  $("empty-note").hidden = true;
  const el = document.createElement("div");
  el.className = "message " + role;
  const head = el.appendChild(document.createElement("div"));
  head.className = "role";
  head.textContent = label;
  const meta = head.appendChild(document.createElement("span"));
  meta.className = "meta";
  const content = el.appendChild(document.createElement("div"));
  content.className = "content";
  $("messages").appendChild(el);
  return el;
}

function scrollToEnd() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

/* One assistant reply: its text, its tokens with their sources, timings; rendered at most once a frame. */
class Reply {
  constructor() {
    this.el = addMessage("assistant", "Assistant");
    this.el.classList.add("streaming");
    this.text = "";
    this.tokens = [];
    this.start = performance.now();
    this.firstTokenAt = null;
    this.lastTokenAt = null;
    this.usage = null;
    this.finishReason = null;
    this.pending = false;
  }

  absorb(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      if (choice.index !== 0) continue;
      this.text += (choice.delta && choice.delta.content) || "";
      const tokens = choice.token_sources || [];
      if (tokens.length) {
        const now = performance.now();
        if (this.firstTokenAt === null) this.firstTokenAt = now;
        this.lastTokenAt = now;
        this.tokens.push(...tokens);
      }
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
    }
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.render();
    });
  }

  render() {
    const content = this.el.querySelector(".content");
    const fresh = document.createElement("div");
    fresh.className = "content markdown";
    renderMarkdown(this.text, fresh, tokenEmitter(this.text, this.tokens));
    content.replaceWith(fresh);
    const meta = this.el.querySelector(".meta");
    meta.textContent = `${this.tokens.length} tokens` + (this.finishReason ? ` · ${this.finishReason}` : "");
    showReplyFigures(this);
    scrollToEnd();
  }

  finish(state, message) {
    this.el.classList.remove("streaming");
    this.el.classList.add(state);
    this.render();
    if (message) {
      const note = this.el.appendChild(document.createElement("div"));
      note.className = "error";
      note.textContent = message;
    }
  }
}

/* emit(parent, start, end) for markdown.js: text[start:end] split at token boundaries, one span per token. */
function tokenEmitter(text, tokens) {
  const ends = [];
  let total = 0;
  for (const t of tokens) {
    total += t.text.length;
    ends.push(total);
  }
  return (parent, start, end) => {
    let lo = 0;
    let hi = ends.length;
    while (lo < hi) { // the first token ending after `start`
      const mid = (lo + hi) >> 1;
      if (ends[mid] <= start) lo = mid + 1;
      else hi = mid;
    }
    let pos = start;
    for (let k = lo; pos < end; k++) {
      if (k >= tokens.length) {
        parent.appendChild(document.createTextNode(text.slice(pos, end)));
        return;
      }
      const stop = Math.min(end, ends[k]);
      if (stop <= pos) continue;
      const span = parent.appendChild(document.createElement("span"));
      const t = tokens[k];
      span.className = "tok tok-" + (SOURCES.includes(t.source) ? t.source : "target");
      span.title = SOURCE_TITLES[t.source] + (t.drafter ? ` (drafter: ${t.drafter})` : "");
      if (t.drafter && t.source === "accepted") span.dataset.drafter = t.drafter;
      span.textContent = text.slice(pos, stop);
      pos = stop;
    }
  };
}

// ------------------------------------------------------------------------------------------ figures

/* Verification steps (a bonus or a correction closes one), accepted drafts per position, drafters. */
function speculationOf(tokens) {
  const counts = { accepted: 0, bonus: 0, correction: 0, target: 0 };
  const perPosition = [];
  const drafters = {};
  let run = 0;
  for (const t of tokens) {
    counts[t.source] = (counts[t.source] || 0) + 1;
    if (t.source === "accepted") {
      perPosition[run] = (perPosition[run] || 0) + 1;
      run++;
      if (t.drafter) drafters[t.drafter] = (drafters[t.drafter] || 0) + 1;
    } else {
      run = 0;
    }
  }
  const steps = counts.bonus + counts.correction;
  return {
    counts, drafters, steps,
    meanAcceptanceLength: steps ? 1 + counts.accepted / steps : null,
    perPosition: steps ? Array.from(perPosition, (n) => (n || 0) / steps) : [],
  };
}

function showReplyFigures(reply) {
  const spec = speculationOf(reply.tokens);
  for (const source of SOURCES) $("count-" + source).textContent = spec.counts[source];
  const drafters = $("drafters");
  drafters.replaceChildren(...Object.entries(spec.drafters).map(([name, n]) => {
    const li = document.createElement("li");
    li.title = `draft tokens ${name} proposed that the target accepted`;
    const sample = li.appendChild(document.createElement("span"));
    sample.className = "tok tok-accepted";
    sample.dataset.drafter = name;
    sample.textContent = name;
    li.appendChild(document.createTextNode(" "));
    const num = li.appendChild(document.createElement("span"));
    num.className = "num";
    num.textContent = n;
    return li;
  }));
  const decodeSeconds = reply.lastTokenAt !== null ? (reply.lastTokenAt - reply.firstTokenAt) / 1000 : 0;
  $("reply-tps").textContent = decodeSeconds > 0 ? `${((reply.tokens.length - 1) / decodeSeconds).toFixed(1)} tok/s` : "–";
  $("reply-mal").textContent = spec.meanAcceptanceLength !== null ? spec.meanAcceptanceLength.toFixed(2) : "–";
  $("reply-ttft").textContent = reply.firstTokenAt !== null ? `${Math.round(reply.firstTokenAt - reply.start)} ms` : "–";
  showBars($("reply-positions"), spec.perPosition);
}

function showBars(container, fractions) {
  container.replaceChildren(...fractions.map((f, i) => {
    const row = document.createElement("div");
    row.className = "bar";
    const label = row.appendChild(document.createElement("span"));
    label.textContent = String(i + 1);
    const track = row.appendChild(document.createElement("span"));
    track.className = "track";
    const fill = track.appendChild(document.createElement("span"));
    fill.style.width = `${Math.round(100 * Math.min(1, f))}%`;
    const value = row.appendChild(document.createElement("span"));
    value.textContent = `${Math.round(100 * f)}%`;
    return row;
  }));
  if (!fractions.length) container.textContent = "–";
}

// ------------------------------------------------------------------------------------------ /metrics

/* Prometheus text format to {name: [{labels, value}]}. */
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([^\s{]+)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    (m[2] || "").replace(/(\w+)="((?:[^"\\]|\\.)*)"/g, (_, k, v) => { labels[k] = v; });
    (out[m[1]] = out[m[1]] || []).push({ labels, value: Number(m[3]) });
  }
  return out;
}

const sum = (metrics, name) => (metrics["specserve:" + name] || []).reduce((a, s) => a + s.value, 0);
let previousScrape = null;

async function pollMetrics() {
  if (document.hidden) return;
  let metrics;
  try {
    const response = await fetch("metrics");
    if (!response.ok) return;
    metrics = parseMetrics(await response.text());
  } catch (_) {
    return;
  }
  const now = performance.now();
  const generated = sum(metrics, "generation_tokens_total");
  $("srv-running").textContent = sum(metrics, "num_requests_running");
  $("srv-waiting").textContent = sum(metrics, "num_requests_waiting");
  const kv = sum(metrics, "kv_cache_usage_perc");
  $("srv-kv").textContent = `${(100 * kv).toFixed(1)}%`;
  $("srv-kv-bar").style.width = `${Math.min(100, 100 * kv)}%`;
  if (previousScrape) {
    const seconds = (now - previousScrape.at) / 1000;
    $("srv-tps").textContent = `${((generated - previousScrape.generated) / seconds).toFixed(1)} tok/s`;
  }
  previousScrape = { at: now, generated };
  const drafts = sum(metrics, "spec_decode_num_drafts_total");
  const draftTokens = sum(metrics, "spec_decode_num_draft_tokens_total");
  const accepted = sum(metrics, "spec_decode_num_accepted_tokens_total");
  $("srv-drafts").textContent = drafts;
  $("srv-draft-tokens").textContent = draftTokens;
  $("srv-accepted").textContent = draftTokens ? `${accepted} (${(100 * accepted / draftTokens).toFixed(0)}%)` : "0";
  $("srv-mal").textContent = drafts ? (1 + accepted / drafts).toFixed(2) : "–";
  const perPosition = [];
  for (const s of metrics["specserve:spec_decode_num_accepted_tokens_per_pos_total"] || []) {
    const position = Number(s.labels.position);
    perPosition[position] = (perPosition[position] || 0) + s.value;
  }
  showBars($("srv-positions"), drafts ? Array.from(perPosition, (n) => (n || 0) / drafts) : []);
}

// ------------------------------------------------------------------------------------------ actions

async function send() {
  const prompt = $("prompt").value.trim();
  if (!prompt || running) return;
  let body;
  conversation.push({ role: "user", content: prompt });
  try {
    body = requestBody();
  } catch (exc) {
    conversation.pop();
    alert(`The JSON schema is not valid JSON: ${exc.message}`);
    return;
  }
  $("prompt").value = "";
  addMessage("user", "You").querySelector(".content").textContent = prompt;
  const reply = new Reply();
  const chat = chatNumber;
  running = { controller: new AbortController(), reply };
  setRunning(true);
  try {
    await streamChat(body, running.controller.signal, (chunk) => reply.absorb(chunk));
    reply.finish("done");
  } catch (exc) {
    if (exc.name === "AbortError") {
      reply.finish("stopped", "Stopped.");
    } else {
      reply.finish("failed", exc.message);
      if (exc.status === 401) {
        setConnection("API key required", "error");
        askForKey(exc.message);
      }
    }
  } finally {
    if (chat === chatNumber) { // unless "New chat" cleared the conversation meanwhile
      if (reply.text) conversation.push({ role: "assistant", content: reply.text });
      else conversation.pop(); // a failed turn is not part of the conversation
    }
    running = null;
    setRunning(false);
  }
}

function stop() {
  if (running) running.controller.abort();
}

function setRunning(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  document.body.classList.toggle("generating", on);
}

function newChat() {
  stop();
  chatNumber++;
  conversation.length = 0;
  $("messages").replaceChildren($("empty-note"));
  $("empty-note").hidden = false;
}

function askForKey(error) {
  $("key-error").textContent = error || "";
  $("key-input").value = "";
  $("key-dialog").returnValue = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("key-input").focus();
}

async function keyDialogClosed() {
  if ($("key-dialog").returnValue !== "save") return;
  const key = $("key-input").value.trim();
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  if (!(await checkServer())) askForKey("401: the server refused this key");
}

// ------------------------------------------------------------------------------------------ start

function start() {
  loadSettings();
  for (const id of SETTING_IDS) $(id).addEventListener("change", settingsChanged);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("key-button").addEventListener("click", () => askForKey(""));
  $("key-dialog").addEventListener("close", keyDialogClosed);
  checkServer().then((ok) => {
    if (!ok && $("connection").textContent === "API key required") askForKey("");
  });
  pollMetrics();
  setInterval(pollMetrics, METRICS_EVERY_MS);
}

start();
