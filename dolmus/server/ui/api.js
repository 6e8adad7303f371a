// Talking to the server: the API key, JSON calls, and chat completions streamed as SSE.
// Every URL is relative to the page's own origin (the page's CSP allows nothing else).

const KEY_STORAGE = "dolmus.apiKey";

export class KeyNeeded extends Error {}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}`, ...extra } : extra;
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers() });
  if (response.status === 401) throw new KeyNeeded(await errorOf(response));
  if (!response.ok) throw new Error(await errorOf(response));
  return response.json();
}

// Streams one chat completion. `onEvent` gets each parsed SSE event (a chunk object);
// resolves when the stream ends; rejects with AbortError when `signal` aborts (the closed
// connection is what makes the server abort the request in the engine).
export async function streamChat(body, signal, onEvent) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (response.status === 401) throw new KeyNeeded(await errorOf(response));
  if (!response.ok) throw new Error(await errorOf(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message || "the server reported an error");
        onEvent(event);
      }
    }
  }
}
