/**
 * The page: connects, opens or creates a document, edits it (pin, mask, gap, window, text), undo/redo, and wires
 * generation (generate.js) to the controls. `window.dcanvas` is this App, for poking at it from the console.
 *
 * Invariants: every edit is sent against the version on screen (`base_v = doc.v`), and a `doc.state` older than
 * the one on screen is ignored (replies and broadcasts can cross). After a reconnect the open document is read
 * again, since edits may have happened while the page was away. A deleted document (here or by another session)
 * leaves the screen at once.
 */

import { ERROR_CODE, EVENT, OP, REQUEST, SPAN_KIND } from "./protocol.js";
import { Connection, ConnectionError, ProtocolError, defaultUrl } from "./connection.js";
import { DocView, cpLength } from "./docview.js";
import { Banners } from "./banners.js";
import { Generator } from "./generate.js";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "dcanvas.token";
const SAMPLE_TEXT =
  "The cat sat on the mat and watched the rain. A dog ran past the open door, and the cat did not move.";

class App {
  constructor() {
    this.banners = new Banners($("banners"));
    this.docView = new DocView($("doc-view"));
    this.doc = null;
    this.everConnected = false;
    $("conn-url").value = defaultUrl();
    $("conn-token").value = sessionStorage.getItem(TOKEN_KEY) || "";
    this.conn = this._makeConnection();
    this.gen = new Generator(this);
    this._wire();
    this.conn.connect().catch(() => {}); // failures are reported by the close event's banner
  }

  // -- connection ----------------------------------------------------------------------------------------------

  _makeConnection() {
    const conn = new Connection({ url: $("conn-url").value, token: $("conn-token").value || null });
    conn.addEventListener("status", (ev) => this._showStatus(ev.detail));
    conn.addEventListener("ready", (ev) => this._onReady(ev.detail));
    conn.addEventListener("closed", (ev) => this._onClosed(ev.detail));
    conn.addEventListener("message", (ev) => this._onMessage(ev.detail));
    return conn;
  }

  reconnect() {
    const url = $("conn-url").value.trim() || defaultUrl();
    const token = $("conn-token").value;
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    else sessionStorage.removeItem(TOKEN_KEY);
    $("conn-url").value = url;
    this.gen.interrupted("reconnecting"); // generations belong to the connection that started them
    if (url !== this.conn.url || (token || null) !== this.conn.token) {
      this.conn.close();
      this.conn = this._makeConnection();
    }
    this.conn.connect().catch(() => {});
  }

  _showStatus({ state, detail, rttMs }) {
    const pill = $("conn-status");
    pill.dataset.state = state;
    const rtt = state === "open" && rttMs !== null ? ` · ${rttMs.toFixed(0)} ms` : "";
    const words = { idle: "not connected", connecting: "connecting…", open: "connected", closed: "disconnected" };
    pill.textContent = `${words[state] || state}${rtt}`;
    pill.title = detail || "";
    document.body.dataset.conn = state;
    this.refreshControls();
  }

  async _onReady(welcome) {
    this.banners.dismiss("conn");
    if (this.everConnected) this.banners.show({ kind: "info", title: "Reconnected.", key: "conn-ok", timeoutMs: 3000 });
    this.everConnected = true;
    const m = welcome.model;
    $("model-info").textContent = `${m.name} · canvas ${m.canvas_length} tokens · ${welcome.server.name} ${welcome.server.version}`;
    $("gap-tokens").max = String(welcome.limits.max_gap_tokens);
    this.gen.setLabels(m.labels);
    this.gen.setModes(m.modes, m.default_modes);
    this.gen.setDefaults(m.defaults);
    this.refreshList();
    const wanted = this.doc ? this.doc.doc_id : docFromHash();
    if (!wanted || !(await this.open(wanted))) this.showNewForm(true);
  }

  _onClosed({ code, reason, fatal, retryIn }) {
    this.gen.interrupted(reason);
    const actions = [{ label: fatal ? "Reconnect" : "Reconnect now", onClick: () => this.reconnect() }];
    const message = fatal
      ? `${reason} (code ${code}). Check the server address and token under Connection, then reconnect.`
      : `${reason} (code ${code}). Trying again in ${(retryIn / 1000).toFixed(1)} s.`;
    this.banners.show({ kind: "error", title: "Disconnected:", message, key: "conn", actions });
  }

  _onMessage(msg) {
    switch (msg.type) {
      case EVENT.DOC_STATE:
        this.setDoc(msg);
        break;
      case EVENT.DOC_DELETED:
        this.docGone(msg.doc_id, true);
        break;
      case EVENT.GEN_PROGRESS:
        this.gen.onProgress(msg);
        break;
      case EVENT.GEN_DONE:
        this.gen.onDone(msg);
        break;
      case EVENT.ERROR:
        this.reportError(new ProtocolError(msg), "The server reported an error");
        break;
      default:
        break; // unknown or unsolicited types are skipped, as the protocol asks
    }
  }

  /** A banner for a failed request. */
  reportError(err, what) {
    if (err instanceof ProtocolError) {
      const retry = err.retryable ? " (you can retry)" : "";
      this.banners.show({ title: `${what}: ${err.code}.`, message: `${err.message}${retry}`, key: `err-${what}` });
    } else if (err instanceof ConnectionError) {
      this.banners.show({ title: `${what}:`, message: err.message, key: `err-${what}` });
    } else {
      this.banners.show({ title: `${what}: page error.`, message: String(err && err.message ? err.message : err) });
      console.error(err);
    }
  }

  /** Run a request; on failure show a banner and return null. A stale version re-reads the document. */
  async call(what, type, fields) {
    try {
      return await this.conn.request(type, fields);
    } catch (err) {
      this.reportError(err, what);
      if (err instanceof ProtocolError && err.code === ERROR_CODE.STALE_VERSION && this.doc) this.open(this.doc.doc_id);
      return null;
    }
  }

  // -- documents -----------------------------------------------------------------------------------------------

  async refreshList() {
    const listing = await this.call("Listing documents", REQUEST.DOC_LIST, {});
    if (!listing) return;
    const select = $("doc-select");
    const current = this.doc ? this.doc.doc_id : select.value;
    select.replaceChildren();
    const docs = [...listing.docs].sort((a, b) => b.updated - a.updated);
    for (const d of docs) {
      const opt = document.createElement("option");
      opt.value = d.doc_id;
      const when = new Date(d.updated * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
      opt.textContent = `${d.name || "untitled"} · ${d.doc_id.slice(0, 8)} · ${when}`;
      select.append(opt);
    }
    if (current) select.value = current;
    this.refreshControls();
  }

  /** Open document `docId`; resolves with whether it is now on screen. */
  async open(docId) {
    const previous = this.doc;
    const state = await this.call("Opening the document", REQUEST.DOC_OPEN, { doc_id: docId });
    if (!state) return false;
    if (previous && previous.doc_id !== docId) {
      this.gen.reset();
      this.call("Closing the previous document", REQUEST.DOC_CLOSE, { doc_id: previous.doc_id });
      this.doc = null;
    }
    this.setDoc(state, { force: true });
    this.showNewForm(false);
    if (!previous || previous.doc_id !== docId) this.refreshList();
    return true;
  }

  async create(text, name) {
    const fields = { text };
    if (name) fields.name = name;
    const previous = this.doc;
    const state = await this.call("Creating the document", REQUEST.DOC_OPEN, fields);
    if (!state) return;
    if (previous) {
      this.gen.reset();
      this.call("Closing the previous document", REQUEST.DOC_CLOSE, { doc_id: previous.doc_id });
    }
    this.doc = null;
    this.setDoc(state, { force: true });
    this.showNewForm(false);
    this.refreshList();
  }

  /** Delete the document on screen, if it is still the version on screen (a newer one is shown instead). */
  async deleteDoc() {
    if (!this.doc) return;
    const { doc_id: docId, name, v } = this.doc;
    if (!window.confirm(`Delete "${name || "untitled"}" for good? Its text, history and proposals go with it.`)) return;
    const gone = await this.call("Deleting the document", REQUEST.DOC_DELETE, { doc_id: docId, base_v: v });
    if (gone) this.docGone(docId, false);
  }

  /** Document `docId` no longer exists: if it is on screen, clear the screen and say so. */
  docGone(docId, elsewhere) {
    if (this.doc && this.doc.doc_id === docId) {
      this.gen.documentGone();
      this.toggleEditor(false);
      this.doc = null;
      this.docView.clear();
      $("doc-meta").textContent = "No document open.";
      $("doc-view").dataset.v = "";
      if (location.hash) history.replaceState(null, "", location.pathname + location.search);
      this.banners.show(
        elsewhere
          ? { kind: "warn", title: "This document was deleted", message: "by another session.", key: "doc-gone" }
          : { kind: "info", title: "Document deleted.", key: "doc-gone", timeoutMs: 4000 },
      );
      this.showNewForm(true);
    }
    this.refreshList();
  }

  /** Show a doc.state, unless it is for another document or older than the one on screen. */
  setDoc(state, { force = false } = {}) {
    if (!force && (!this.doc || state.doc_id !== this.doc.doc_id)) return;
    if (!force && state.v < this.doc.v) return;
    this.doc = state;
    this.docView.render(state);
    const slots = state.spans.reduce((n, s) => n + s.slots, 0);
    const free = state.spans.filter((s) => s.kind === SPAN_KIND.FREE).reduce((n, s) => n + s.slots, 0);
    $("doc-meta").textContent =
      `${state.name || "untitled"} · v${state.v} · ${cpLength(state.text)} characters · ` +
      `window ${state.window.start}–${state.window.end} · ${slots} slots, ${free} free` +
      (state.gen ? ` · generating (${state.gen})` : "");
    $("doc-view").dataset.v = String(state.v);
    if (location.hash !== `#doc=${state.doc_id}`) history.replaceState(null, "", `#doc=${state.doc_id}`);
    this._clampRange();
    this.refreshControls();
  }

  showNewForm(show) {
    const form = $("new-doc-form");
    form.hidden = !show;
    $("doc-new-btn").setAttribute("aria-expanded", String(show));
    if (show) {
      if (!$("new-doc-text").value) $("new-doc-text").value = SAMPLE_TEXT;
      $("new-doc-text").focus();
    }
  }

  /** Apply edit ops to the document on screen. */
  async edit(ops, what = "Editing") {
    if (!this.doc) return null;
    const state = await this.call(what, REQUEST.DOC_EDIT, { doc_id: this.doc.doc_id, base_v: this.doc.v, ops });
    if (state) this.setDoc(state);
    return state;
  }

  range() {
    const a = Number($("sel-start").value);
    const b = Number($("sel-end").value);
    return { start: Math.min(a, b), end: Math.max(a, b) };
  }

  async rangeOp(op) {
    const { start, end } = this.range();
    if (start === end) {
      this.banners.show({
        kind: "warn",
        title: "Select some text first",
        message: "(drag over the document, or type offsets in From and To).",
        key: "need-range",
        timeoutMs: 5000,
      });
      return;
    }
    this.banners.dismiss("need-range");
    await this.edit([{ op, start, end }], `${op[0].toUpperCase()}${op.slice(1)}`);
  }

  async insertGap() {
    const at = this.range().start;
    const n = Number($("gap-tokens").value);
    await this.edit([{ op: OP.INSERT_GAP, at, n_tokens: n }], "Inserting a gap");
  }

  async moveWindow() {
    await this.edit([{ op: OP.MOVE_WINDOW, start: this.range().start }], "Moving the window");
  }

  async history(type) {
    if (!this.doc) return;
    const state = await this.call(type === REQUEST.HISTORY_UNDO ? "Undo" : "Redo", type, { doc_id: this.doc.doc_id });
    if (state) this.setDoc(state);
  }

  toggleEditor(on) {
    const editor = $("doc-editor");
    editor.hidden = !on;
    $("doc-view").hidden = on;
    $("edit-btn").setAttribute("aria-pressed", String(on));
    $("edit-save").hidden = !on;
    $("edit-cancel").hidden = !on;
    if (on && this.doc) {
      editor.value = this.doc.text;
      editor.focus();
    }
  }

  /** Send the text editor's change as one `replace` of the span between the common prefix and suffix. */
  async saveText() {
    if (!this.doc) return;
    const old = Array.from(this.doc.text);
    const neu = Array.from($("doc-editor").value);
    let p = 0;
    while (p < old.length && p < neu.length && old[p] === neu[p]) p++;
    let s = 0;
    while (s < old.length - p && s < neu.length - p && old[old.length - 1 - s] === neu[neu.length - 1 - s]) s++;
    if (p === old.length && p === neu.length) {
      this.toggleEditor(false);
      return;
    }
    const op = { op: OP.REPLACE, start: p, end: old.length - s, text: neu.slice(p, neu.length - s).join("") };
    if (await this.edit([op], "Saving the text")) this.toggleEditor(false);
  }

  // -- controls ------------------------------------------------------------------------------------------------

  _clampRange() {
    const n = this.doc ? cpLength(this.doc.text) : 0;
    for (const id of ["sel-start", "sel-end"]) {
      const input = $(id);
      input.max = String(n);
      if (Number(input.value) > n) input.value = String(n);
    }
    const { start, end } = this.range();
    this.docView.highlight(start, end);
  }

  refreshControls() {
    const on = this.conn.connected;
    const hasDoc = on && this.doc !== null;
    for (const b of document.querySelectorAll("[data-needs=doc]")) b.disabled = !hasDoc;
    $("undo-btn").disabled = !hasDoc || !this.doc.can_undo;
    $("redo-btn").disabled = !hasDoc || !this.doc.can_redo;
    $("doc-open-btn").disabled = !on || $("doc-select").options.length === 0;
    $("new-doc-create").disabled = !on;
    this.gen.refreshControls(hasDoc);
  }

  _wire() {
    $("conn-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.reconnect();
    });
    $("doc-open-btn").addEventListener("click", () => $("doc-select").value && this.open($("doc-select").value));
    $("doc-new-btn").addEventListener("click", () => this.showNewForm($("new-doc-form").hidden));
    $("doc-delete-btn").addEventListener("click", () => this.deleteDoc());
    $("new-doc-cancel").addEventListener("click", () => this.showNewForm(false));
    $("new-doc-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.create($("new-doc-text").value, $("new-doc-name").value.trim());
    });
    for (const b of document.querySelectorAll("button[data-op]")) {
      b.addEventListener("click", () => this.rangeOp(b.dataset.op));
    }
    $("gap-btn").addEventListener("click", () => this.insertGap());
    $("window-btn").addEventListener("click", () => this.moveWindow());
    $("undo-btn").addEventListener("click", () => this.history(REQUEST.HISTORY_UNDO));
    $("redo-btn").addEventListener("click", () => this.history(REQUEST.HISTORY_REDO));
    $("edit-btn").addEventListener("click", () => this.toggleEditor($("doc-editor").hidden));
    $("edit-save").addEventListener("click", () => this.saveText());
    $("edit-cancel").addEventListener("click", () => this.toggleEditor(false));
    for (const id of ["sel-start", "sel-end"]) $(id).addEventListener("input", () => this._clampRange());

    const view = $("doc-view");
    // The view is contenteditable only so that a keyboard can move a caret and select; typing never edits it.
    view.addEventListener("beforeinput", (ev) => ev.preventDefault());
    view.addEventListener("drop", (ev) => ev.preventDefault());
    document.addEventListener("selectionchange", () => {
      const sel = this.docView.selection();
      if (!sel) return;
      $("sel-start").value = String(sel.start);
      $("sel-end").value = String(sel.end);
    });
    view.addEventListener("keydown", (ev) => this._viewKey(ev));
    document.addEventListener("keydown", (ev) => this._globalKey(ev));
    window.addEventListener("hashchange", () => {
      const id = docFromHash();
      if (id && (!this.doc || id !== this.doc.doc_id) && this.conn.connected) this.open(id);
    });
    window.addEventListener("error", (ev) => this.reportError(ev.error || ev.message, "Page error"));
    window.addEventListener("unhandledrejection", (ev) => this.reportError(ev.reason, "Page error"));
  }

  _viewKey(ev) {
    if (ev.ctrlKey || ev.metaKey || ev.altKey) return;
    const keys = { m: OP.MASK, M: OP.UNMASK, p: OP.PIN, P: OP.UNPIN };
    if (keys[ev.key]) {
      ev.preventDefault();
      this.rangeOp(keys[ev.key]);
    } else if (ev.key === "g") {
      ev.preventDefault();
      this.insertGap();
    } else if (ev.key === "w") {
      ev.preventDefault();
      this.moveWindow();
    }
  }

  _globalKey(ev) {
    const mod = ev.ctrlKey || ev.metaKey;
    const t = ev.target;
    const typing = t instanceof HTMLInputElement || t instanceof HTMLTextAreaElement || t instanceof HTMLSelectElement;
    if (mod && ev.key === "Enter") {
      ev.preventDefault();
      this.gen.generate();
    } else if (ev.key === "Escape" && this.gen.running) {
      ev.preventDefault();
      this.gen.cancel();
    } else if (mod && !typing && (ev.key === "z" || ev.key === "Z")) {
      ev.preventDefault();
      this.history(ev.shiftKey ? REQUEST.HISTORY_REDO : REQUEST.HISTORY_UNDO);
    } else if (mod && !typing && ev.key === "y") {
      ev.preventDefault();
      this.history(REQUEST.HISTORY_REDO);
    }
  }
}

function docFromHash() {
  const m = /^#doc=([A-Za-z0-9][A-Za-z0-9._-]{0,63})$/.exec(location.hash);
  return m ? m[1] : null;
}

window.dcanvas = new App();
