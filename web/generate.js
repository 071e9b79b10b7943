/**
 * Generation on the page: parameters, Generate / Cancel, routing `gen.progress` and `gen.done` to the RunView of
 * their generation, proposals (accept, reject, regenerate), and the side-by-side mode.
 *
 * Side by side runs the same request (same document version, parameters and seed) twice, diffusion first and
 * then autoregressive, one after the other: a second `gen.start` on a document would supersede a running one, and
 * running them apart keeps each one's timing its own. Both proposals stay pending until one is accepted (the other
 * is then rejected) or both are rejected.
 */

import { GEN_PARAM, MODE, REQUEST } from "./protocol.js";
import { RunView } from "./runview.js";

const $ = (id) => document.getElementById(id);
const TITLES = { [MODE.DIFFUSION]: "Diffusion", [MODE.AR]: "Autoregressive" };
// The mode select's labels: diffusion says what it is (the converted model's decoder is untrained for denoising).
const OPTION_LABELS = { [MODE.DIFFUSION]: "Diffusion (untrained decoder)", [MODE.AR]: "Autoregressive" };
const DEFAULT_MODE = ""; // the select's value for "the model's default" (`params.mode` left out)

export class Generator {
  constructor(app) {
    this.app = app;
    this.byGen = new Map(); // gen id -> {view, resolve}
    this.running = false;
    this.cancelRequested = false;
    this.labels = {}; // `welcome.model.labels`: how the server names modes and what wrote a text
    const handlers = {
      onAccept: (view, hunks) => this.accept(view, hunks),
      onReject: (view) => this.reject(view),
      onRegenerate: () => this.regenerate(),
      label: (mode) => this.labels[mode] || mode,
    };
    this.views = [
      new RunView($("run-a"), { key: "run-a", title: TITLES[MODE.DIFFUSION], ...handlers }),
      new RunView($("run-b"), { key: "run-b", title: TITLES[MODE.AR], ...handlers }),
    ];
    $("run-b").hidden = true;
    $("gen-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.generate();
    });
    $("cancel-btn").addEventListener("click", () => this.cancel());
    $("compare").addEventListener("change", () => this.refreshControls(this.app.doc !== null));
  }

  /** The server's labels for modes and writers (`welcome.model.labels`; none from servers that predate them). */
  setLabels(labels) {
    this.labels = { ...(labels || {}) };
  }

  /**
   * Offer the model's default (first: a request that names no mode gets the model's default for its kind, from
   * `welcome.model.default_modes`) and the modes the model has (`welcome.model.modes`).
   */
  setModes(modes, defaults) {
    const select = $(`param-${GEN_PARAM.MODE}`);
    const keep = select.value;
    select.replaceChildren();
    const name = (m) => (TITLES[m] || m).toLowerCase();
    const described = defaults
      ? ` (infill: ${name(defaults.infill)}, continuation: ${name(defaults.continuation)})`
      : "";
    const options = [[DEFAULT_MODE, `Model default${described}`], ...modes.map((m) => [m, OPTION_LABELS[m] || m])];
    for (const [value, label] of options) {
      const opt = document.createElement("option");
      opt.value = value;
      opt.textContent = label;
      select.append(opt);
    }
    if (keep === DEFAULT_MODE || modes.includes(keep)) select.value = keep;
    const both = modes.includes(MODE.DIFFUSION) && modes.includes(MODE.AR);
    $("compare").disabled = !both;
    if (!both) $("compare").checked = false;
  }

  /** Show the model's sampler defaults (`welcome.model.defaults`) as placeholders: a blank field takes them. */
  setDefaults(defaults) {
    for (const field of [GEN_PARAM.MAX_STEPS, GEN_PARAM.ENTROPY_BOUND, GEN_PARAM.T_MAX, GEN_PARAM.T_MIN]) {
      if (defaults && defaults[field] !== undefined) $(`param-${field}`).placeholder = `${defaults[field]} (model)`;
    }
  }

  /** The parameters in the form; a blank seed becomes a random one, so a side-by-side pair shares it. */
  readParams() {
    const params = {};
    const num = (field) => {
      const v = $(`param-${field}`).value.trim();
      return v === "" ? null : Number(v);
    };
    const mode = $(`param-${GEN_PARAM.MODE}`).value;
    if (mode !== DEFAULT_MODE) params[GEN_PARAM.MODE] = mode; // left out: the server resolves the model's default
    for (const field of [GEN_PARAM.MAX_STEPS, GEN_PARAM.ENTROPY_BOUND, GEN_PARAM.T_MAX, GEN_PARAM.T_MIN]) {
      const v = num(field);
      if (v !== null) params[field] = v;
    }
    const every = num(GEN_PARAM.STREAM_EVERY);
    if (every !== null) params[GEN_PARAM.STREAM_EVERY] = every;
    const seed = num(GEN_PARAM.SEED);
    // Below 2^53: larger integers do not survive a JavaScript number, and the seed must be echoed exactly.
    params[GEN_PARAM.SEED] = seed !== null ? seed : Math.floor(Math.random() * Number.MAX_SAFE_INTEGER);
    return params;
  }

  async generate() {
    const app = this.app;
    if (this.running || !app.doc || !app.conn.connected) return;
    if (!$("gen-form").reportValidity()) return;
    await this.rejectPending("dropped");
    const params = this.readParams();
    const compare = $("compare").checked;
    this.running = true;
    this.cancelRequested = false;
    $("compare-summary").textContent = "";
    $("runs").classList.toggle("compare", compare);
    $("run-b").hidden = !compare;
    this.refreshControls(true);
    try {
      if (compare) {
        this.views[0].setTitle(TITLES[MODE.DIFFUSION]);
        this.views[1].setTitle(TITLES[MODE.AR]);
        const first = await this.runOne(this.views[0], { ...params, [GEN_PARAM.MODE]: MODE.DIFFUSION });
        let second = null;
        if (first && !this.cancelRequested) {
          second = await this.runOne(this.views[1], { ...params, [GEN_PARAM.MODE]: MODE.AR });
        }
        if (first && second) this.summarise(first, second);
      } else {
        const mode = params[GEN_PARAM.MODE];
        this.views[0].setTitle(mode === undefined ? "Model default" : TITLES[mode] || mode);
        await this.runOne(this.views[0], params);
      }
    } finally {
      this.running = false;
      this.refreshControls(this.app.doc !== null);
    }
  }

  /** Start one generation on `view`; resolves with its gen.done (null if it could not start or was cut off). */
  async runOne(view, params) {
    const doc = this.app.doc;
    const accepted = await this.app.call("Starting the generation", REQUEST.GEN_START, {
      doc_id: doc.doc_id,
      base_v: doc.v,
      params,
    });
    if (!accepted) return null;
    view.begin(doc, accepted);
    return new Promise((resolve) => this.byGen.set(accepted.gen, { view, resolve }));
  }

  onProgress(msg) {
    const entry = this.byGen.get(msg.gen);
    if (!entry) return;
    if (!entry.view.progress(msg) && this.app.doc) {
      this.app.banners.show({
        kind: "warn",
        title: "A progress frame was lost;",
        message: "the grid may be inexact until the generation ends. The document was read again.",
        key: "seq-gap",
        timeoutMs: 8000,
      });
      this.app.open(this.app.doc.doc_id);
    }
  }

  onDone(msg) {
    const entry = this.byGen.get(msg.gen);
    if (!entry) return;
    this.byGen.delete(msg.gen);
    entry.view.done(msg);
    entry.resolve(msg);
  }

  cancel() {
    this.cancelRequested = true;
    for (const gen of this.byGen.keys()) {
      this.app.call("Cancelling", REQUEST.GEN_CANCEL, { gen });
    }
  }

  /** The connection dropped: every running generation is gone with it. A pending proposal is not: the server
   * keeps it (across a restart too), and once the page has reconnected it can still be accepted or rejected. */
  interrupted(reason) {
    this.cancelRequested = true;
    for (const [gen, entry] of this.byGen) {
      entry.view.interrupted(reason);
      entry.resolve(null);
      this.byGen.delete(gen);
    }
  }

  /** The document was deleted: the server cancelled its generation (a gen.done says so) and its proposals. */
  documentGone() {
    for (const view of this.views) if (view.pending) view.resolved("deleted");
  }

  /** Another document was opened: stop what runs on the old one and clear the views. */
  reset() {
    this.cancel();
    this.rejectPending("dropped");
  }

  async accept(view, hunks) {
    const app = this.app;
    if (!app.doc || !view.pending) return;
    if (hunks !== undefined && hunks.length === 0) {
      app.banners.show({ kind: "warn", title: "Tick at least one change to accept.", key: "hunks", timeoutMs: 5000 });
      return;
    }
    const fields = { gen: view.gen, base_v: app.doc.v };
    if (hunks !== undefined) fields.hunks = hunks;
    const state = await app.call("Accepting the proposal", REQUEST.PROPOSAL_ACCEPT, fields);
    if (!state) return;
    app.setDoc(state);
    view.resolved("accepted");
    for (const other of this.views) {
      if (other !== view && other.pending) this.reject(other, "dropped");
    }
  }

  async reject(view, outcome = "rejected") {
    if (!view.pending) return;
    view.resolved(outcome);
    await this.app.call("Rejecting the proposal", REQUEST.PROPOSAL_REJECT, { gen: view.gen });
  }

  async rejectPending(outcome) {
    await Promise.all(this.views.filter((v) => v.pending).map((v) => this.reject(v, outcome)));
  }

  /** Run the request again for a different sample: a seed given in the form moves on by one. */
  async regenerate() {
    const seed = $(`param-${GEN_PARAM.SEED}`);
    if (seed.value.trim() !== "") seed.value = String(Math.min(Number(seed.value) + 1, Number.MAX_SAFE_INTEGER));
    await this.generate();
  }

  summarise(diffusion, ar) {
    const a = diffusion.stats;
    const b = ar.stats;
    const faster = a.wall_s > 0 && b.wall_s > 0 ? ` Diffusion took ${(a.wall_s / b.wall_s).toFixed(2)}× the AR time.` : "";
    $("compare-summary").textContent =
      `Diffusion: ${a.steps} forwards, ${a.tokens_per_forward.toFixed(3)} tokens per forward, ${a.wall_s.toFixed(2)} s. ` +
      `Autoregressive: ${b.steps} forwards, ${b.tokens_per_forward.toFixed(3)} tokens per forward, ${b.wall_s.toFixed(2)} s.` +
      faster;
  }

  refreshControls(hasDoc) {
    $("generate-btn").disabled = !hasDoc || this.running;
    $("cancel-btn").disabled = !this.running;
    $("generate-btn").textContent = $("compare").checked ? "Generate both" : "Generate";
  }
}
