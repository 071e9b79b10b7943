/**
 * One generation on screen: its token grid, live statistics (step, tokens per forward, tok/s), a replay slider,
 * an AR infill's K drafts side by side as they grow (then the one chosen, and what was kept of it), and the
 * proposal as a diff with Accept / Reject / Regenerate, with what wrote it.
 *
 * A RunView outlives its generations: `begin` resets it for a new one. It never talks to the server itself; the
 * buttons call the handlers the page passes in. Live "tokens per forward" and "tok/s" count settled slots so far
 * (an estimate while running); once `gen.done` arrives they are the server's own figures from `stats`.
 */

import { DIFF_OP, GEN_STATUS } from "./protocol.js";
import { TokenGrid, visible } from "./grid.js";

const REPLAY_MS = 150;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-") || k.startsWith("aria-") || k === "role" || k === "for") node.setAttribute(k, v);
    else node[k] = v;
  }
  node.append(...children);
  return node;
}

/** Split diff segments into runs: equal segments stay single, each maximal run of changes is one hunk. */
export function hunks(diff) {
  const out = [];
  for (const seg of diff) {
    if (seg.op === DIFF_OP.EQUAL) out.push({ equal: seg.text });
    else if (out.length && out[out.length - 1].changes) out[out.length - 1].changes.push(seg);
    else out.push({ changes: [seg] });
  }
  return out;
}

export class RunView {
  /**
   * @param {HTMLElement} root an empty element to fill
   * @param {{key: string, title: string, onAccept: Function, onReject: Function, onRegenerate: Function,
   *          label: Function}} opts `label(mode)` names a mode or what wrote a text (`welcome.model.labels`)
   */
  constructor(root, { key, title, onAccept, onReject, onRegenerate, label }) {
    this.root = root;
    this.key = key;
    this.label = label || ((mode) => mode);
    this.handlers = { onAccept, onReject, onRegenerate };
    this.gen = null;
    this.params = null;
    this.proposal = null;
    this.finished = false;
    this.lastSeq = 0;
    this._timer = null;

    const id = (name) => `${key}-${name}`;
    this.heading = el("h3", { id: id("title"), text: title });
    this.statusLine = el("p", { class: "run-status", role: "status", "aria-live": "polite", text: "idle" });
    this.stats = {};
    const dl = el("dl", { class: "stats" });
    for (const [name, label] of [
      ["step", "Step"],
      ["accepted", "Accepted this step"],
      ["settled", "Settled"],
      ["tpf", "Tokens / forward"],
      ["toks", "tok/s"],
      ["elapsed", "Elapsed"],
      ["writer", "Written by"],
    ]) {
      const dd = el("dd", { "data-stat": name, text: "–" });
      this.stats[name] = dd;
      dl.append(el("div", {}, el("dt", { text: label }), dd));
    }
    this.gridEl = el("div", {
      class: "grid",
      role: "img",
      "aria-label": "canvas token grid",
      "data-frame": "0",
    });
    this.grid = new TokenGrid(this.gridEl);

    this.slider = el("input", { type: "range", id: id("replay"), min: "0", max: "0", value: "0", disabled: true });
    this.slider.addEventListener("input", () => this._showFrame(Number(this.slider.value)));
    this.replayLabel = el("output", { for: id("replay"), class: "replay-label", text: "" });
    this.playBtn = el("button", { type: "button", class: "play", text: "▶ Replay", disabled: true });
    this.playBtn.addEventListener("click", () => this._togglePlay());
    const replay = el(
      "div",
      { class: "replay" },
      el("label", { for: id("replay"), text: "Replay frame" }),
      this.slider,
      this.replayLabel,
      this.playBtn,
    );

    // An AR infill's drafts: one row each, growing together; the likeliest is marked while they grow, the chosen
    // one when the gap is scored (its kept text, and the cut tail struck through).
    this.draftsList = el("ol", { class: "draft-rows" });
    this.draftsNote = el("p", { class: "muted drafts-note", text: "" });
    this.draftsEl = el(
      "section",
      { class: "drafts", "aria-label": "AR drafts side by side", hidden: true },
      el("h4", { text: "Drafts" }),
      this.draftsNote,
      this.draftsList,
    );

    this.diffEl = el("div", { class: "diff", "aria-label": "proposal diff", "aria-live": "polite" });
    this.acceptBtn = el("button", { type: "button", class: "accept primary", text: "Accept", disabled: true });
    this.rejectBtn = el("button", { type: "button", class: "reject", text: "Reject", disabled: true });
    this.regenBtn = el("button", { type: "button", class: "regenerate", text: "Regenerate", disabled: true });
    this.acceptBtn.addEventListener("click", () => this.handlers.onAccept(this, this.chosenHunks()));
    this.rejectBtn.addEventListener("click", () => this.handlers.onReject(this));
    this.regenBtn.addEventListener("click", () => this.handlers.onRegenerate(this));
    const actions = el("div", { class: "actions" }, this.acceptBtn, this.rejectBtn, this.regenBtn);
    const proposal = el("section", { class: "proposal", "aria-label": `${title} proposal` }, this.diffEl, actions);

    root.classList.add("run");
    root.setAttribute("aria-labelledby", id("title"));
    root.replaceChildren(this.heading, this.statusLine, dl, this.gridEl, this.draftsEl, replay, proposal);
  }

  setTitle(title) {
    this.heading.textContent = title;
  }

  /** A new generation `accepted` (a gen.accepted reply) over document state `doc` starts here. */
  begin(doc, accepted) {
    this._stopPlay();
    this.gen = accepted.gen;
    this.params = accepted.params;
    this.proposal = null;
    this.finished = false;
    this.lastSeq = 0;
    this.grid.layout(doc);
    this.gridEl.classList.remove("final");
    this.root.dataset.gen = accepted.gen;
    this.root.dataset.state = "running";
    for (const dd of Object.values(this.stats)) dd.textContent = "–";
    this.stats.step.textContent = `0 / ${accepted.params.max_steps}`;
    this.stats.settled.textContent = `0 / ${this.grid.freeSlots}`;
    this.slider.disabled = true;
    this.slider.max = "0";
    this.slider.value = "0";
    this.replayLabel.textContent = "";
    this.playBtn.disabled = true;
    this.diffEl.replaceChildren();
    this.draftsEl.hidden = true;
    this.draftsList.replaceChildren();
    this.draftsNote.textContent = "";
    this._buttons(false);
    this.setStatus(`${accepted.params.mode}: running (seed ${accepted.params.seed})`);
  }

  /** Apply a gen.progress frame. Returns false when a frame was lost (a `seq` gap): the page must resync. */
  progress(msg) {
    const inOrder = msg.seq === this.lastSeq + 1;
    this.lastSeq = msg.seq;
    const settled = this.grid.apply(msg);
    const forwards = Math.max(msg.step, 1);
    this.stats.step.textContent = `${msg.step} / ${msg.max_steps}`;
    this.stats.accepted.textContent = String(msg.accepted);
    this.stats.settled.textContent = `${settled} / ${msg.free}`;
    this.stats.tpf.textContent = `≈ ${(settled / forwards).toFixed(2)}`;
    this.stats.toks.textContent = msg.elapsed_s > 0 ? `≈ ${(settled / msg.elapsed_s).toFixed(1)}` : "–";
    this.stats.elapsed.textContent = `${msg.elapsed_s.toFixed(2)} s`;
    this.slider.max = String(this.grid.history.length - 1);
    this.slider.value = this.slider.max;
    if (msg.drafts) this._showDrafts(msg.drafts);
    return inOrder;
  }

  /** The generation ended (a gen.done event). */
  done(msg) {
    this.finished = true;
    const s = msg.stats;
    // AR decoding is not bounded by max_steps (one forward per token), so the final count stands alone.
    this.stats.step.textContent = `${s.steps}`;
    this.stats.tpf.textContent = s.tokens_per_forward.toFixed(3);
    this.stats.toks.textContent = s.tok_s.toFixed(1);
    this.stats.elapsed.textContent = `${s.wall_s.toFixed(2)} s`;
    if (s.mode) this.stats.writer.textContent = this.label(s.mode); // diffusion, ar or ar-infill, named
    this.root.dataset.state = msg.status;
    const n = this.grid.history.length;
    if (n > 0) {
      this.slider.disabled = false;
      this.slider.max = String(n - 1);
      this.slider.value = String(n - 1);
      this.playBtn.disabled = n < 2;
      this._labelFrame(n - 1);
    }
    if (msg.status === GEN_STATUS.COMPLETED && msg.proposal) {
      // The last step commits every free slot, whatever the sampler accepted at it.
      this.stats.settled.textContent = `${this.grid.freeSlots} / ${this.grid.freeSlots}`;
      this.gridEl.classList.add("final");
      this.proposal = msg.proposal;
      this._renderDiff(msg.proposal);
      this._buttons(true);
      this.setStatus(`${this._mode()}: done in ${s.steps} steps, ${s.wall_s.toFixed(2)} s; review the proposal`);
    } else {
      this.diffEl.replaceChildren(el("p", { class: "muted", text: "No proposal." }));
      this.regenBtn.disabled = false;
      const why = msg.message ? `: ${msg.message}` : "";
      this.setStatus(`${this._mode()}: ${msg.status}${why}`);
    }
  }

  /** The proposal was accepted or rejected (by this page). */
  resolved(outcome) {
    this._buttons(false);
    this.regenBtn.disabled = false;
    this.root.dataset.state = outcome;
    this.setStatus(`${this._mode()}: proposal ${outcome}`);
  }

  /** The connection dropped while this generation ran. */
  interrupted(why) {
    if (this.finished || !this.gen) return;
    this.finished = true;
    this.root.dataset.state = "interrupted";
    this._buttons(false);
    this.regenBtn.disabled = false;
    this.setStatus(`${this._mode()}: interrupted (${why})`);
  }

  get pending() {
    return this.proposal !== null && this.acceptBtn.disabled === false;
  }

  /** The hunk indexes ticked in the diff, or undefined when all are (accept everything). */
  chosenHunks() {
    const boxes = Array.from(this.diffEl.querySelectorAll("input[data-hunk]"));
    if (boxes.every((b) => b.checked)) return undefined;
    return boxes.filter((b) => b.checked).map((b) => Number(b.dataset.hunk));
  }

  setStatus(text) {
    this.statusLine.textContent = text;
  }

  // -- internals ---------------------------------------------------------------------------------------------

  _mode() {
    return this.params ? this.params.mode : "generation";
  }

  /** Show `gen.progress.drafts`: whole state, so the rows are redrawn from it. */
  _showDrafts(d) {
    this.draftsEl.hidden = false;
    const chosen = d.chosen === null || d.chosen === undefined ? null : d.chosen;
    this.draftsEl.dataset.state = chosen === null ? "growing" : "chosen";
    this.draftsNote.textContent =
      chosen === null
        ? `${d.texts.length} drafts, ${d.tokens} tokens each so far; ★ marks the likeliest`
        : `draft ${chosen + 1} of ${d.texts.length} joins the text after the gap best: ${d.kept.length} of its ` +
          `${d.texts[chosen].length} characters were kept`;
    const rows = d.texts.map((text, k) => {
      const li = el("li", { "data-draft": String(k) });
      li.classList.toggle("lead", chosen === null && k === d.lead);
      li.classList.toggle("chosen", k === chosen);
      li.classList.toggle("dropped", chosen !== null && k !== chosen);
      if (k === chosen && d.kept !== null && text.startsWith(d.kept)) {
        li.append(el("mark", { text: visible(d.kept, { spaces: false }) }));
        const cut = text.slice(d.kept.length);
        if (cut) li.append(el("s", { text: visible(cut, { spaces: false }), title: "cut: after the chosen ending" }));
      } else {
        li.append(el("span", { text: visible(text, { spaces: false }) || "…" }));
      }
      return li;
    });
    this.draftsList.replaceChildren(...rows);
  }

  _buttons(on) {
    this.acceptBtn.disabled = !on;
    this.rejectBtn.disabled = !on;
    this.regenBtn.disabled = !on;
  }

  _renderDiff(proposal) {
    const parts = hunks(proposal.diff);
    const nHunks = parts.filter((p) => p.changes).length;
    const body = el("div", { class: "diff-text" });
    let k = 0;
    for (const part of parts) {
      if (part.equal !== undefined) {
        body.append(el("span", { class: "eq", text: visible(part.equal, { spaces: false }) }));
        continue;
      }
      const hunk = el("span", { class: "hunk", "data-hunk": String(k) });
      if (nHunks > 1) {
        const box = el("input", { type: "checkbox", checked: true, id: `${this.key}-hunk-${k}` });
        box.dataset.hunk = String(k);
        box.setAttribute("aria-label", `apply change ${k + 1} of ${nHunks}`);
        hunk.append(box);
      }
      for (const seg of part.changes) {
        const tag = seg.op === DIFF_OP.INSERT ? "ins" : "del";
        hunk.append(el(tag, { text: visible(seg.text, { spaces: false }) || "∅" }));
      }
      body.append(hunk);
      k += 1;
    }
    const summary = el("p", {
      class: "muted",
      text: nHunks ? `${nHunks} change${nHunks === 1 ? "" : "s"}` : "The proposal changes nothing.",
    });
    this.diffEl.replaceChildren(summary, body);
  }

  _showFrame(k) {
    const h = this.grid.show(k);
    if (h) this._labelFrame(k);
    // Only the last frame of a completed run shows the committed canvas; earlier ones show what the sampler had.
    const last = k === this.grid.history.length - 1;
    this.gridEl.classList.toggle("final", last && this.root.dataset.state !== "running" && this.proposal !== null);
  }

  _labelFrame(k) {
    const h = this.grid.history[k];
    if (!h) return;
    this.replayLabel.textContent = `frame ${k + 1} of ${this.grid.history.length}: step ${h.step}, ${h.settled} settled`;
  }

  _togglePlay() {
    if (this._timer) {
      this._stopPlay();
      return;
    }
    let k = Number(this.slider.value) >= this.grid.history.length - 1 ? 0 : Number(this.slider.value);
    this.playBtn.textContent = "⏸ Pause";
    const tick = () => {
      this.slider.value = String(k);
      this._showFrame(k);
      k += 1;
      if (k >= this.grid.history.length) this._stopPlay();
    };
    tick();
    this._timer = setInterval(tick, REPLAY_MS);
  }

  _stopPlay() {
    clearInterval(this._timer);
    this._timer = null;
    this.playBtn.textContent = "▶ Replay";
  }
}
