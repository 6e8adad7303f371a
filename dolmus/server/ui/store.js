// Conversations, kept in the browser (IndexedDB): nothing of a chat is stored on the server.
// A conversation: {id, title, created, updated, model, system, messages: [{role, content, stats}]}.

const DB_NAME = "dolmus";
const STORE = "conversations";

let dbPromise = null;

function db() {
  if (!dbPromise) {
    dbPromise = new Promise((resolve, reject) => {
      const open = indexedDB.open(DB_NAME, 1);
      open.onupgradeneeded = () => open.result.createObjectStore(STORE, { keyPath: "id" });
      open.onsuccess = () => resolve(open.result);
      open.onerror = () => reject(open.error);
    });
  }
  return dbPromise;
}

async function run(mode, work) {
  const database = await db();
  return new Promise((resolve, reject) => {
    const tx = database.transaction(STORE, mode);
    const request = work(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(request?.result);
    tx.onerror = () => reject(tx.error);
  });
}

export function newConversation(model, system) {
  const now = Date.now();
  return {
    id: `c-${now.toString(36)}-${Math.random().toString(36).slice(2, 8)}`,
    title: "New chat",
    created: now,
    updated: now,
    model,
    system,
    messages: [],
  };
}

export async function listConversations() {
  const all = await run("readonly", (s) => s.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

export function saveConversation(conversation) {
  conversation.updated = Date.now();
  return run("readwrite", (s) => s.put(conversation));
}

export function deleteConversation(id) {
  return run("readwrite", (s) => s.delete(id));
}

export async function exportAll() {
  return { format: "dolmus-conversations", version: 1, conversations: await listConversations() };
}

// Adds (or replaces, by id) the conversations of an export; returns how many were read.
export async function importAll(data) {
  const list = Array.isArray(data) ? data : data?.conversations;
  if (!Array.isArray(list)) throw new Error("not a dolmus conversations export");
  for (const c of list) {
    if (typeof c?.id !== "string" || !Array.isArray(c.messages)) throw new Error("a conversation lacks id or messages");
    await run("readwrite", (s) => s.put(c));
  }
  return list.length;
}
