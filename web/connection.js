/**
 * One dcanvas/1 connection: the websocket, the hello handshake, requests matched to replies by `re`, and
 * reconnection with backoff.
 *
 * Contract:
 * - `request(type, fields)` resolves with the one direct reply to the request, or rejects with a `ProtocolError`
 *   (an `error` reply) or a `ConnectionError` (the socket closed first, or no reply in time).
 * - Every other frame (`gen.progress`, `gen.done`, broadcasts, errors without a pending request) is dispatched as
 *   a `message` event. `gen.progress`/`gen.done` carry the `re` of their `gen.start`, so they never complete a
 *   request: the request was already completed by `gen.accepted`, which the server sends first.
 * - Events: `status` ({state, detail}), `ready` (the welcome), `message`, `closed` ({code, reason, fatal, retryIn}).
 * - After an unexpected close it reconnects with exponential backoff, except after a fatal close (a wrong token,
 *   an unsupported protocol), where only `connect()` (the Reconnect button) tries again.
 * - The token travels as a websocket subprotocol (`tokenSubprotocol`), next to `dcanvas.v1`, not in `hello`: that is
 *   the one part of the handshake a page can set. The server selects only `dcanvas.v1`.
 */

import {
  CLOSE_CODE,
  ERROR_CODE,
  EVENT,
  FATAL_CLOSE,
  PROTOCOL,
  REQUEST,
  SUBPROTOCOL,
  TOKEN_SUBPROTOCOL_PREFIX,
} from "./protocol.js";

const REQUEST_TIMEOUT_MS = 30000;
const PING_EVERY_MS = 15000;
const BACKOFF_MS = [500, 1000, 2000, 4000, 8000];
// Events that carry the `re` of an earlier request but are not its reply.
const NOT_A_REPLY = new Set([EVENT.GEN_PROGRESS, EVENT.GEN_DONE]);

/** An `error` reply from the server. */
export class ProtocolError extends Error {
  constructor(reply) {
    super(reply.message || reply.code);
    this.name = "ProtocolError";
    this.code = reply.code;
    this.retryable = Boolean(reply.retryable);
    this.data = reply.data || null;
  }
}

/** The connection closed (or never answered) before the reply came. */
export class ConnectionError extends Error {
  constructor(message) {
    super(message);
    this.name = "ConnectionError";
  }
}

/** The subprotocol that carries `token`: its UTF-8 in base64url without padding, after the prefix. */
export function tokenSubprotocol(token) {
  let binary = "";
  for (const byte of new TextEncoder().encode(token)) binary += String.fromCharCode(byte);
  const b64 = btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  return TOKEN_SUBPROTOCOL_PREFIX + b64;
}

/** The websocket URL of the server that served this page. */
export function defaultUrl(loc = window.location) {
  const scheme = loc.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${loc.host}/ws`;
}

export class Connection extends EventTarget {
  /** @param {{url: string, token?: string|null, clientName?: string, clientVersion?: string}} options */
  constructor({ url, token = null, clientName = "dcanvas-web", clientVersion = "1" }) {
    super();
    this.url = url;
    this.token = token;
    this.client = { name: clientName, version: clientVersion };
    this.state = "idle"; // idle | connecting | open | closed
    this.welcome = null;
    this.rttMs = null;
    this._ws = null;
    this._nextId = 1;
    this._pending = new Map(); // id -> {resolve, reject, timer, type}
    this._attempt = 0;
    this._retryTimer = null;
    this._pingTimer = null;
  }

  /** Open the socket (closing any earlier one) and say hello. Resolves with the welcome. */
  connect() {
    clearTimeout(this._retryTimer);
    this._retryTimer = null;
    if (this._ws) {
      this._drop(this._ws);
      this._failPending("the page reconnected");
    }
    this._setState("connecting", this._attempt ? `attempt ${this._attempt + 1}` : "");
    let ws;
    try {
      const protocols = [SUBPROTOCOL];
      if (this.token) protocols.push(tokenSubprotocol(this.token));
      ws = new WebSocket(this.url, protocols);
    } catch (err) {
      this._onClose(null, { code: 0, reason: String(err.message || err), wasClean: false });
      return Promise.reject(new ConnectionError(`cannot open ${this.url}: ${err.message || err}`));
    }
    this._ws = ws;
    return new Promise((resolve, reject) => {
      ws.addEventListener("open", async () => {
        try {
          const fields = { protocol: PROTOCOL, client: this.client }; // the token went as a subprotocol
          const welcome = await this.request(REQUEST.HELLO, fields);
          this.welcome = welcome;
          this._attempt = 0;
          this._setState("open", welcome.model ? welcome.model.name : "");
          this._startPings();
          this.dispatchEvent(new CustomEvent("ready", { detail: welcome }));
          resolve(welcome);
        } catch (err) {
          reject(err);
        }
      });
      ws.addEventListener("message", (ev) => this._onMessage(ev));
      ws.addEventListener("close", (ev) => {
        this._onClose(ws, ev);
        reject(new ConnectionError(`connection closed (${ev.code}${ev.reason ? ": " + ev.reason : ""})`));
      });
    });
  }

  /** Close for good (no reconnect). */
  close() {
    clearTimeout(this._retryTimer);
    this._retryTimer = null;
    if (this._ws) {
      const ws = this._ws;
      this._drop(ws);
      this._failPending("the connection was closed");
      this._setState("closed", "closed by the page");
    }
  }

  /** Send one request; resolves with its reply. */
  request(type, fields = {}) {
    const ws = this._ws;
    if (!ws || ws.readyState !== WebSocket.OPEN) {
      return Promise.reject(new ConnectionError("not connected"));
    }
    const id = this._nextId++;
    const frame = JSON.stringify({ type, id, ...fields });
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this._pending.delete(id);
        reject(new ConnectionError(`no reply to ${type} within ${REQUEST_TIMEOUT_MS / 1000} s`));
      }, REQUEST_TIMEOUT_MS);
      this._pending.set(id, { resolve, reject, timer, type });
      ws.send(frame);
    });
  }

  get connected() {
    return this.state === "open";
  }

  // -- internals ---------------------------------------------------------------------------------------------

  _onMessage(ev) {
    let msg;
    try {
      msg = JSON.parse(ev.data);
    } catch (err) {
      this._emitMessage({ type: EVENT.ERROR, code: ERROR_CODE.INVALID_MESSAGE, message: `the server sent bad JSON: ${err}` });
      return;
    }
    if (msg === null || typeof msg !== "object" || typeof msg.type !== "string") return;
    const waiting = msg.re !== undefined && msg.re !== null ? this._pending.get(msg.re) : undefined;
    if (waiting && !NOT_A_REPLY.has(msg.type)) {
      this._pending.delete(msg.re);
      clearTimeout(waiting.timer);
      if (msg.type === EVENT.ERROR) waiting.reject(new ProtocolError(msg));
      else waiting.resolve(msg);
      return;
    }
    this._emitMessage(msg);
  }

  _emitMessage(msg) {
    this.dispatchEvent(new CustomEvent("message", { detail: msg }));
  }

  _onClose(ws, ev) {
    if (ws !== null && ws !== this._ws) return; // an old socket we already dropped
    this._ws = null;
    this._stopPings();
    this._failPending(`the connection closed (${ev.code})`);
    const fatal = FATAL_CLOSE.includes(ev.code);
    let retryIn = null;
    if (!fatal && this.state !== "closed") {
      retryIn = BACKOFF_MS[Math.min(this._attempt, BACKOFF_MS.length - 1)];
      this._attempt += 1;
      this._retryTimer = setTimeout(() => {
        this.connect().catch(() => {}); // a failed attempt schedules the next one through its close event
      }, retryIn);
    }
    this._setState("closed", ev.reason || describeClose(ev.code));
    this.dispatchEvent(
      new CustomEvent("closed", { detail: { code: ev.code, reason: ev.reason || describeClose(ev.code), fatal, retryIn } }),
    );
  }

  _drop(ws) {
    // Forget the socket before closing it, so its close event does not schedule a reconnect.
    if (this._ws === ws) this._ws = null;
    this._stopPings();
    try {
      ws.close(CLOSE_CODE.NORMAL);
    } catch {
      /* already closed */
    }
  }

  _failPending(why) {
    for (const [id, p] of this._pending) {
      clearTimeout(p.timer);
      p.reject(new ConnectionError(`${p.type}: ${why}`));
      this._pending.delete(id);
    }
  }

  _startPings() {
    this._stopPings();
    const ping = async () => {
      const t0 = performance.now();
      try {
        await this.request(REQUEST.PING);
        this.rttMs = performance.now() - t0;
        this._setState("open", this.state === "open" ? this._detail : "");
      } catch {
        /* a close is reported by the close event */
      }
    };
    ping();
    this._pingTimer = setInterval(ping, PING_EVERY_MS);
  }

  _stopPings() {
    clearInterval(this._pingTimer);
    this._pingTimer = null;
  }

  _setState(state, detail) {
    this.state = state;
    this._detail = detail;
    this.dispatchEvent(new CustomEvent("status", { detail: { state, detail, rttMs: this.rttMs } }));
  }
}

/** A readable sentence for a websocket close code. */
export function describeClose(code) {
  switch (code) {
    case CLOSE_CODE.NORMAL:
      return "closed normally";
    case CLOSE_CODE.POLICY:
      return "refused by the server (wrong token, or too many sessions)";
    case CLOSE_CODE.TOO_BIG:
      return "a message was too large";
    case CLOSE_CODE.INTERNAL:
      return "the server hit an internal error";
    case CLOSE_CODE.UNSUPPORTED_PROTOCOL:
      return `the server does not speak ${PROTOCOL}`;
    case 1006:
      return "the connection dropped (is the server running?)";
    default:
      return `closed with code ${code}`;
  }
}
