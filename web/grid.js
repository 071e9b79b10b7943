/**
 * The canvas as a grid of token cells, updated from `gen.progress` deltas, with a history for replay.
 *
 * Layout comes from the document's spans when the generation starts: a pinned run is one cell holding its text
 * (the model keeps it), and every free slot (a masked run or a gap) is its own cell, numbered by its slot index in
 * the window, which is the `i` of `gen.progress.slots`.
 *
 * A free cell is "noise" (drawn flickering) until the sampler accepts it; it "settles" when accepted and stays
 * settled while its token does not change (the entropy-bound sampler may still redraw an accepted slot at a later
 * step, which unsettles it). Colour is the slot's entropy in nats. Each applied frame is recorded, so
 * `show(k)` redraws the canvas exactly as it was after frame k.
 *
 * A slot sent with `written: false` (an AR row's slot its writer has not reached) is "unwritten": its token is the
 * canvas's initial noise, not a guess of the model, so its text is never drawn, only a blank (`▁`), until a frame
 * writes it. Diffusion rows never send it (their noise is the point of the picture); older servers omit the field,
 * which counts as written.
 */

import { SPAN_KIND } from "./protocol.js";
import { cpSlice } from "./docview.js";

/** What a cell shows before any frame reached its slot, and while an AR writer has not reached it. */
export const BLANK_GLYPH = "░";
export const UNWRITTEN_GLYPH = "▁";

/** Entropy (nats) drawn as the reddest colour; anything above is clamped to it. */
export const ENTROPY_SCALE = 3.0;

/**
 * Text of a token with control characters made visible; with `spaces` (the default, for cells) also spaces,
 * newlines and tabs, which a cell would otherwise show as nothing.
 */
export function visible(text, { spaces = true } = {}) {
  if (text === "" && spaces) return "∅";
  let out = "";
  for (const ch of text) {
    const c = ch.codePointAt(0);
    if (!spaces && (ch === " " || ch === "\n" || ch === "\t")) out += ch;
    else if (ch === " ") out += "·";
    else if (ch === "\n") out += "⏎";
    else if (ch === "\t") out += "⇥";
    else if (c < 0x20 || c === 0x7f) out += `\\x${c.toString(16).padStart(2, "0")}`; // not U+2400+c: few fonts draw those
    else out += ch;
  }
  return out;
}

/** The background colour of a slot with entropy `e` (null: not known). Green is sure, red is unsure. */
export function entropyColour(e) {
  if (e === null || e === undefined) return "";
  const x = Math.min(Math.max(e / ENTROPY_SCALE, 0), 1);
  const hue = Math.round(130 * (1 - x));
  return `hsl(${hue} 70% 84%)`;
}

export class TokenGrid {
  /** @param {HTMLElement} root */
  constructor(root) {
    this.root = root;
    this.cells = new Map(); // slot index -> element
    this.slots = new Map(); // slot index -> {token, text, entropy, accepted, settled}
    this.history = []; // [{seq, step, elapsed_s, accepted, slots: [[i, slot], ...]}]
    this.freeSlots = 0;
    this.viewing = -1; // the history index on screen; -1 follows the live state
  }

  /** Build the cells for a document state (its spans at the generation's base version). */
  layout(doc) {
    this.cells.clear();
    this.slots.clear();
    this.history = [];
    this.viewing = -1;
    this.root.replaceChildren();
    let slot = 0;
    let free = 0;
    for (const span of doc.spans) {
      if (span.kind === SPAN_KIND.PINNED) {
        const el = document.createElement("span");
        el.className = "cell pin";
        const text = cpSlice(doc.text, span.start, span.end);
        el.textContent = visible(text);
        el.title = `pinned slots ${slot}-${slot + span.slots - 1}: ${JSON.stringify(text)}`;
        this.root.append(el);
        slot += span.slots;
        continue;
      }
      for (let k = 0; k < span.slots; k++, slot++, free++) {
        const el = document.createElement("span");
        el.className = "cell free noise blank";
        el.textContent = BLANK_GLYPH;
        el.dataset.i = String(slot);
        el.title = `slot ${slot}: not drawn yet`;
        this.cells.set(slot, el);
        this.slots.set(slot, { token: null, text: "", entropy: null, accepted: false, settled: false, written: true });
        this.root.append(el);
      }
    }
    this.freeSlots = free;
    this.root.dataset.frame = "0";
    this.root.dataset.step = "";
  }

  /** Apply one gen.progress frame (a delta) and record the result. Returns the number of settled slots. */
  apply(frame) {
    for (const u of frame.slots) {
      const prev = this.slots.get(u.i);
      if (!prev) continue; // not a free slot of this layout: ignore rather than guess
      if (u.written === false) {
        // Not reached by the AR writer: keep nothing of the noise token it holds.
        this.slots.set(u.i, { token: null, text: "", entropy: null, accepted: false, settled: false, written: false });
        continue;
      }
      const same = prev.token === u.token;
      this.slots.set(u.i, {
        token: u.token,
        text: u.text,
        entropy: u.entropy ?? null,
        accepted: u.accepted,
        settled: u.accepted || (same && prev.settled),
        written: true,
      });
    }
    const settled = this.settledCount();
    this.history.push({
      seq: frame.seq,
      step: frame.step,
      max_steps: frame.max_steps,
      elapsed_s: frame.elapsed_s,
      accepted: frame.accepted,
      settled,
      slots: Array.from(this.slots, ([i, s]) => [i, { ...s }]),
    });
    if (this.viewing === -1) this._draw(this.slots, this.history.length);
    return settled;
  }

  settledCount() {
    let n = 0;
    for (const s of this.slots.values()) if (s.settled) n += 1;
    return n;
  }

  /** Show the canvas as it was after history entry `k` (0-based); `k = -1` follows the live state again. */
  show(k) {
    if (k < 0 || k >= this.history.length) {
      this.viewing = -1;
      this._draw(this.slots, this.history.length);
      return null;
    }
    this.viewing = k;
    const h = this.history[k];
    this._draw(new Map(h.slots), k + 1);
    return h;
  }

  /** The cell texts in slot order, for tests and the replay label. */
  snapshot() {
    return Array.from(this.cells.values(), (el) => el.textContent).join("|");
  }

  _draw(slots, frameNo) {
    for (const [i, s] of slots) {
      const el = this.cells.get(i);
      if (!el) continue;
      const unwritten = s.written === false;
      const drawn = s.token !== null && !unwritten;
      el.textContent = drawn ? visible(s.text) : unwritten ? UNWRITTEN_GLYPH : BLANK_GLYPH;
      el.classList.toggle("blank", !drawn && !unwritten);
      el.classList.toggle("unwritten", unwritten);
      el.classList.toggle("settled", s.settled);
      el.classList.toggle("noise", !s.settled && !unwritten);
      el.style.backgroundColor = entropyColour(s.entropy);
      const ent = s.entropy === null ? "?" : s.entropy.toFixed(2);
      el.title = drawn
        ? `slot ${i}: ${JSON.stringify(s.text)} (token ${s.token}), entropy ${ent} nats, ${s.settled ? "settled" : "noise"}`
        : unwritten
          ? `slot ${i}: not written yet (the left-to-right writer has not reached it)`
          : `slot ${i}: not drawn yet`;
    }
    this.root.dataset.frame = String(frameNo);
  }
}
