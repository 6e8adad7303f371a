// The page's shell: server info, the API-key prompt, the model picker, the two views.

import { KeyNeeded, apiKey, getJSON, setApiKey } from "./api.js";
import { ChatView } from "./chat.js";
import { Dashboard } from "./dashboard.js";

const $ = (id) => document.getElementById(id);

class App {
  constructor() {
    this.info = null;
    this.chat = new ChatView(this);
    this.dashboard = new Dashboard(this);
    for (const tab of document.querySelectorAll(".tab")) {
      tab.addEventListener("click", () => this.show(tab.dataset.view));
    }
    $("key-button").addEventListener("click", () => this.askKey());
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const save = event.submitter?.value !== "cancel";
      if (save) setApiKey($("key-input").value.trim());
      $("key-dialog").close();
      if (save) this.start();
    });
  }

  async start() {
    try {
      this.info = await getJSON("/info");
    } catch (error) {
      this.status(`server not ready: ${error.message}`, true);
      setTimeout(() => this.start(), 2000);
      return;
    }
    if (this.info.api_key_required && !apiKey()) {
      this.askKey();
      return;
    }
    try {
      const models = await getJSON("/v1/models");
      this.fillModels(models.data.map((m) => m.id));
    } catch (error) {
      if (error instanceof KeyNeeded) {
        this.askKey(error.message);
        return;
      }
      this.status(error.message, true);
      return;
    }
    this.status(`context ${this.info.max_model_len} tokens · dolmus ${this.info.version}`);
    await this.chat.start();
    if (!$("view-dashboard").hidden) this.dashboard.start();
  }

  fillModels(ids) {
    const select = $("model");
    const current = select.value;
    select.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (ids.includes(current)) select.value = current;
  }

  get model() {
    return $("model").value || this.info?.model;
  }

  askKey(message) {
    $("key-error").hidden = !message;
    $("key-error").textContent = message || "";
    $("key-input").value = apiKey();
    if (!$("key-dialog").open) $("key-dialog").showModal();
  }

  status(text, bad = false) {
    $("server-status").textContent = text;
    $("server-status").classList.toggle("bad", bad);
  }

  show(view) {
    for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
    $("view-chat").hidden = view !== "chat";
    $("view-dashboard").hidden = view !== "dashboard";
    if (view === "dashboard") this.dashboard.start();
    else this.dashboard.stop();
  }
}

const app = new App();
window.dolmusApp = app; // for the browser tests and the console
app.start();
