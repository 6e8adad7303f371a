// The chat view: conversations, streaming answers, stop / regenerate / edit, settings, and
// under each answer what the engine did for it (from the final chunk's `timings`).

import { KeyNeeded, getJSON, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const SETTINGS_STORAGE = "dolmus.sampling";
const FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];
const PROGRESS_POLL_MS = 500;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(n, digits = 0) {
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

// One line under an answer: what the engine did for it.
export // An answer as the page shows it: the server's reasoning (`reasoning_content`, from a
// --reasoning-parser) as a <think> block that renderMarkdown folds, open while it streams.
function shownText(message, finished) {
  if (!message.reasoning) return message.content;
  const closed = finished || message.content ? "</think>" : "";
  return `<think>${message.reasoning}${closed}${message.content}`;
}

function statsLine(t) {
  if (!t) return "";
  const parts = [
    `TTFT ${fmt(t.ttft_ms)} ms`,
    `${fmt(t.predicted_per_second, 1)} tok/s`,
    `${t.predicted_n} tokens`,
    `queue ${fmt(t.queue_ms)} ms`,
    `prompt ${t.prompt_n + t.cache_n} tokens, ${t.cache_n} from cache`,
  ];
  if (t.preemptions) parts.push(`preempted ${t.preemptions}×`);
  if (t.draft_n) parts.push(`drafts ${t.draft_n_accepted}/${t.draft_n} accepted`);
  if (t.cost !== undefined) parts.push(`cost ${t.cost.toPrecision(3)}`);
  return parts.join(" · ");
}

export class ChatView {
  constructor(app) {
    this.app = app;
    this.conversation = null;
    this.controller = null; // the running answer's AbortController
    // The page can take a message before the saved conversations are read from IndexedDB:
    // sending waits for start() to have opened one, rather than finding none.
    this.ready = new Promise((resolve) => {
      this.markReady = resolve;
    });
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => this.open(null));
    $("system").addEventListener("change", () => {
      if (!this.conversation) return;
      this.conversation.system = $("system").value;
      store.saveConversation(this.conversation);
    });
    for (const name of FIELDS) $(`set-${name}`).addEventListener("change", () => this.saveSettings());
    $("reset-settings").addEventListener("click", () => {
      localStorage.removeItem(SETTINGS_STORAGE);
      this.loadSettings();
    });
    $("export").addEventListener("click", () => this.exportAll());
    $("import").addEventListener("change", (event) => this.importFile(event.target.files[0]));
  }

  async start() {
    this.loadSettings();
    let list = [];
    try {
      list = await store.listConversations();
    } catch (error) {
      this.showError(`saved conversations could not be read: ${error.message}`);
    }
    await this.open(list[0] || null);
    this.markReady();
  }

  // -- settings ---------------------------------------------------------------------

  loadSettings() {
    const defaults = this.app.info?.sampling_defaults || {};
    const saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
    for (const name of FIELDS) {
      const value = name in saved ? saved[name] : defaults[name];
      $(`set-${name}`).value = value === null || value === undefined ? "" : value;
    }
  }

  saveSettings() {
    const saved = {};
    for (const name of FIELDS) {
      const raw = $(`set-${name}`).value;
      saved[name] = raw === "" ? null : Number(raw);
    }
    localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(saved));
  }

  sampling() {
    const body = {};
    for (const name of FIELDS) {
      const raw = $(`set-${name}`).value;
      if (raw !== "") body[name] = Number(raw);
    }
    return body;
  }

  // -- conversations ------------------------------------------------------------------

  async open(conversation) {
    if (this.controller) this.stop();
    this.conversation = conversation || store.newConversation(this.app.model, "");
    $("system").value = this.conversation.system || "";
    this.renderMessages();
    await this.renderList();
    $("input").focus();
  }

  async renderList() {
    const list = await store.listConversations();
    const items = list.map((c) => {
      const item = el("li", c.id === this.conversation?.id ? "active" : "");
      item.dataset.id = c.id;
      const title = el("button", "title plain", c.title);
      title.addEventListener("click", () => this.open(c));
      const rename = el("button", "plain icon", "✎");
      rename.title = "Rename";
      rename.addEventListener("click", () => this.rename(item, c));
      const remove = el("button", "plain icon", "×");
      remove.title = "Delete";
      remove.addEventListener("click", async () => {
        await store.deleteConversation(c.id);
        if (c.id === this.conversation?.id) await this.open(null);
        else await this.renderList();
      });
      item.append(title, rename, remove);
      return item;
    });
    $("conversations").replaceChildren(...items);
  }

  rename(item, conversation) {
    const input = el("input", "rename");
    input.value = conversation.title;
    item.replaceChildren(input);
    input.focus();
    input.select();
    let done = false;
    const finish = async (save) => {
      if (done) return;
      done = true;
      if (save && input.value.trim()) {
        conversation.title = input.value.trim();
        if (conversation.id === this.conversation?.id) this.conversation.title = conversation.title;
        await store.saveConversation(conversation);
      }
      await this.renderList();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") finish(true);
      if (event.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
  }

  async exportAll() {
    const data = await store.exportAll();
    const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
    const link = el("a");
    link.href = URL.createObjectURL(blob);
    link.download = `dolmus-conversations-${new Date().toISOString().slice(0, 10)}.json`;
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 1000);
  }

  async importFile(file) {
    if (!file) return;
    try {
      const count = await store.importAll(JSON.parse(await file.text()));
      this.showError(`imported ${count} conversations`, false);
      await this.renderList();
    } catch (error) {
      this.showError(`import failed: ${error.message}`);
    }
    $("import").value = "";
  }

  // -- messages -----------------------------------------------------------------------

  renderMessages() {
    const nodes = this.conversation.messages.map((m, i) => this.messageNode(m, i));
    $("messages").replaceChildren(...nodes);
    $("messages").scrollTop = $("messages").scrollHeight;
  }

  messageNode(message, index) {
    const node = el("div", `msg ${message.role}`);
    node.dataset.index = index;
    const body = el("div", "body");
    if (message.role === "assistant") renderMarkdown(body, shownText(message, true));
    else body.textContent = message.content;
    node.append(body);
    const meta = el("div", "meta");
    if (message.role === "assistant") {
      if (message.stopped) meta.append(el("span", "stopped", "stopped"));
      if (message.stats) meta.append(el("span", "stats", statsLine(message.stats)));
      if (index === this.conversation.messages.length - 1 && !this.controller) {
        const again = el("button", "plain regenerate", "Regenerate");
        again.addEventListener("click", () => this.regenerate());
        meta.append(again);
      }
    } else if (message.role === "user" && !this.controller) {
      const edit = el("button", "plain edit", "Edit");
      edit.addEventListener("click", () => this.edit(node, index));
      meta.append(edit);
    }
    node.append(meta);
    return node;
  }

  edit(node, index) {
    const message = this.conversation.messages[index];
    const area = el("textarea", "edit-area");
    area.value = message.content;
    area.rows = Math.min(10, message.content.split("\n").length + 1);
    const save = el("button", "", "Save and send");
    const cancel = el("button", "plain", "Cancel");
    save.addEventListener("click", () => {
      if (!area.value.trim()) return;
      this.conversation.messages = this.conversation.messages.slice(0, index);
      this.conversation.messages.push({ role: "user", content: area.value });
      this.answer();
    });
    cancel.addEventListener("click", () => this.renderMessages());
    node.replaceChildren(area, el("div", "meta"));
    node.lastChild.append(save, cancel);
    area.focus();
  }

  async send() {
    await this.ready;
    const text = $("input").value;
    if (!text.trim() || this.controller) return;
    $("input").value = "";
    const c = this.conversation;
    if (!c.messages.length) c.title = text.trim().split("\n")[0].slice(0, 48);
    c.messages.push({ role: "user", content: text });
    this.answer();
  }

  regenerate() {
    const messages = this.conversation.messages;
    if (messages.at(-1)?.role === "assistant") messages.pop();
    this.answer();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  async answer() {
    const c = this.conversation;
    c.model = this.app.model;
    c.system = $("system").value;
    const history = c.messages.map(({ role, content }) => ({ role, content }));
    if (c.system.trim()) history.unshift({ role: "system", content: c.system });
    const reply = { role: "assistant", content: "" };
    c.messages.push(reply);
    this.controller = new AbortController();
    this.setBusy(true);
    this.renderMessages();
    await store.saveConversation(c);
    this.renderList();
    const node = $("messages").lastChild;
    const body = node.querySelector(".body");
    const progress = el("div", "progress", "waiting for the engine…");
    node.insertBefore(progress, node.querySelector(".meta"));
    let requestId = null;
    let drawn = false;
    const draw = () => {
      drawn = false;
      renderMarkdown(body, shownText(reply, false));
      $("messages").scrollTop = $("messages").scrollHeight;
    };
    const poller = setInterval(() => this.pollProgress(requestId, progress), PROGRESS_POLL_MS);
    try {
      await streamChat({ model: c.model, messages: history, ...this.sampling() }, this.controller.signal, (event) => {
        requestId = requestId || event.id;
        const choice = event.choices?.[0];
        const reasoning = choice?.delta?.reasoning_content;
        if (reasoning) reply.reasoning = (reply.reasoning || "") + reasoning;
        if (choice?.delta?.content) reply.content += choice.delta.content;
        if (choice?.delta?.content || reasoning) {
          if (progress.isConnected) progress.remove();
          if (!drawn) {
            drawn = true;
            requestAnimationFrame(draw);
          }
        }
        if (event.timings) reply.stats = event.timings;
      });
    } catch (error) {
      if (error.name === "AbortError") reply.stopped = true;
      else if (error instanceof KeyNeeded) this.app.askKey(error.message);
      else this.showError(error.message);
    } finally {
      clearInterval(poller);
      this.controller = null;
      this.setBusy(false);
      if (!reply.content && !reply.reasoning && !reply.stopped) c.messages.pop();
      await store.saveConversation(c);
      this.renderMessages();
      this.renderList();
    }
  }

  // While the prompt is prefilled (before the first token), show how far the engine is.
  async pollProgress(requestId, line) {
    if (!requestId || !line.isConnected) return;
    let rows;
    try {
      rows = (await getJSON("/requests")).data;
    } catch {
      return; // the list is a nicety; the answer goes on without it
    }
    const row = rows.find((r) => r.request_id === `${requestId}-0` || r.request_id.startsWith(`${requestId}-0#`));
    if (!row || !line.isConnected) return;
    if (row.state !== "running") line.textContent = `${row.state}: in the queue for ${fmt(row.age_s, 1)} s`;
    else {
      const done = Math.min(row.computed_tokens, row.prompt_tokens);
      line.textContent = `reading the prompt: ${done} / ${row.prompt_tokens} tokens (${row.cached_tokens} from cache)`;
    }
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    if (!busy) $("input").focus();
  }

  showError(message, bad = true) {
    const box = $("chat-error");
    box.textContent = message;
    box.classList.toggle("info", !bad);
    box.hidden = false;
    clearTimeout(this.errorTimer);
    this.errorTimer = setTimeout(() => (box.hidden = true), 8000);
  }
}
