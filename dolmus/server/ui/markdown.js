// An answer's text as safe HTML: markdown (marked), sanitised (DOMPurify), code highlighted
// (highlight.js), `<think>` blocks folded into a collapsed <details>. Called on every streamed
// chunk, so an unclosed think block or code fence renders as far as it has come.

/* global marked, DOMPurify, hljs */

function splitThinking(text) {
  const parts = [];
  let rest = text;
  for (;;) {
    const open = rest.indexOf("<think>");
    if (open < 0) break;
    if (open > 0) parts.push({ think: false, text: rest.slice(0, open) });
    const close = rest.indexOf("</think>", open + 7);
    if (close < 0) {
      parts.push({ think: true, text: rest.slice(open + 7), open: true });
      return parts;
    }
    parts.push({ think: true, text: rest.slice(open + 7, close) });
    rest = rest.slice(close + 8);
  }
  if (rest) parts.push({ think: false, text: rest });
  return parts;
}

function toHTML(text) {
  return DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: false }));
}

export function renderMarkdown(element, text) {
  const html = splitThinking(text)
    .map((part) => {
      if (!part.think) return toHTML(part.text);
      const label = part.open ? "Thinking…" : "Thought";
      return `<details class="think"><summary>${label}</summary>${toHTML(part.text)}</details>`;
    })
    .join("");
  // keep a think block the reader opened open while the answer streams on
  const opened = [...element.querySelectorAll("details.think")].map((d) => d.open);
  element.innerHTML = html;
  element.querySelectorAll("details.think").forEach((d, i) => {
    d.open = Boolean(opened[i]);
  });
  element.querySelectorAll("pre code").forEach((block) => hljs.highlightElement(block));
  element.querySelectorAll("a[href]").forEach((a) => {
    a.rel = "noopener noreferrer";
    a.target = "_blank";
  });
}
