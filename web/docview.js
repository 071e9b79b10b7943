/**
 * The document as text: context before the canvas window, the window itself (pinned runs, free runs that the
 * next generation rewrites, gaps of new slots), and the text after it. Turns a mouse selection into character
 * offsets and back.
 *
 * Invariant: the element's text content is exactly `doc.text`, character for character, so a DOM position maps to
 * an offset by counting the characters before it. Gaps add no text (their label is CSS generated content), and
 * offsets count code points, as the protocol does, not UTF-16 units.
 */

import { SPAN_KIND } from "./protocol.js";

/** Code points in a JS string (the protocol's offsets count code points, JS strings count UTF-16 units). */
export function cpLength(s) {
  let n = 0;
  for (const _ of s) n += 1;
  return n;
}

/** `s` sliced by code-point offsets. */
export function cpSlice(s, start, end) {
  return Array.from(s).slice(start, end).join("");
}

function piece(cls, text, start, title) {
  const el = document.createElement("span");
  el.className = cls;
  el.textContent = text;
  el.dataset.start = String(start);
  if (title) el.title = title;
  return el;
}

export class DocView {
  /** @param {HTMLElement} root the element that shows the text */
  constructor(root) {
    this.root = root;
    this.doc = null;
    this.chars = []; // doc.text as code points
  }

  /** Show no document. */
  clear() {
    this.doc = null;
    this.chars = [];
    this.root.replaceChildren();
  }

  /** Draw `doc` (a doc.state message). */
  render(doc) {
    this.doc = doc;
    this.chars = Array.from(doc.text);
    const text = (a, b) => this.chars.slice(a, b).join("");
    const root = this.root;
    root.replaceChildren();
    const { start: ws, end: we } = doc.window;
    if (ws > 0) root.append(piece("ctx", text(0, ws), 0, "context: the model reads this text but does not change it"));
    const win = document.createElement("span");
    win.className = "window";
    win.title = `canvas window: characters ${ws}-${we}`;
    if (!doc.spans.length) win.classList.add("empty");
    for (const span of doc.spans) {
      if (span.kind === SPAN_KIND.FREE && span.start === span.end) {
        const gap = document.createElement("span");
        gap.className = "gap";
        gap.dataset.slots = String(span.slots);
        gap.title = `gap: ${span.slots} new token${span.slots === 1 ? "" : "s"} at ${span.start}`;
        win.append(gap);
      } else if (span.kind === SPAN_KIND.FREE) {
        win.append(piece("free", text(span.start, span.end), span.start, `masked: ${span.slots} slots to rewrite`));
      } else {
        win.append(piece("pinned", text(span.start, span.end), span.start, `pinned: ${span.slots} slots kept`));
      }
    }
    root.append(win);
    if (we < this.chars.length) {
      root.append(piece("tail", text(we, this.chars.length), we, "after the window: carried along unchanged"));
    }
    root.classList.toggle("is-empty", this.chars.length === 0);
  }

  /** The selection inside the view as code-point offsets `{start, end}`, or null. */
  selection() {
    const sel = window.getSelection();
    if (!sel || sel.rangeCount === 0) return null;
    const r = sel.getRangeAt(0);
    if (!this.root.contains(r.startContainer) || !this.root.contains(r.endContainer)) return null;
    const a = this.offsetOf(r.startContainer, r.startOffset);
    const b = this.offsetOf(r.endContainer, r.endOffset);
    return { start: Math.min(a, b), end: Math.max(a, b) };
  }

  /** The code-point offset of a DOM position inside the view. */
  offsetOf(node, offset) {
    const range = document.createRange();
    range.selectNodeContents(this.root);
    range.setEnd(node, offset);
    return cpLength(range.toString());
  }

  /** A DOM Range covering code points `[start, end)`, or null when the view is empty. */
  rangeOf(start, end) {
    const walker = document.createTreeWalker(this.root, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    let seen = 0;
    let startSet = false;
    let last = null;
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const n = cpLength(node.data);
      if (!startSet && start <= seen + n) {
        range.setStart(node, unitOffset(node.data, start - seen));
        startSet = true;
      }
      if (startSet && end <= seen + n) {
        range.setEnd(node, unitOffset(node.data, end - seen));
        return range;
      }
      seen += n;
      last = node;
    }
    if (!startSet || !last) return null;
    range.setEnd(last, last.data.length);
    return range;
  }

  /** Show `[start, end)` as the working range (CSS Custom Highlight where the browser has it). */
  highlight(start, end) {
    if (!("highlights" in CSS) || typeof Highlight === "undefined") return;
    CSS.highlights.delete("dc-range");
    if (start === null || end === null || !this.doc) return;
    const r = this.rangeOf(start, Math.max(start, end));
    if (r) CSS.highlights.set("dc-range", new Highlight(r));
  }
}

/** The UTF-16 index of code point `cp` in `s`. */
function unitOffset(s, cp) {
  let units = 0;
  let i = 0;
  for (const ch of s) {
    if (i === cp) break;
    units += ch.length;
    i += 1;
  }
  return units;
}
