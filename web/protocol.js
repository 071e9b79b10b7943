/**
 * Every dcanvas/1 name the page uses: message types, edit ops, span kinds, generation statuses, diff ops, error
 * codes, generation parameters and close codes (docs/protocol.md).
 *
 * This is the only module that spells a protocol name; the others import these constants.
 * tests/web/test_protocol_names.py reads this file and checks every table against the server's JSON Schema
 * (`canvas.protocol.json_schema()`), so a renamed or added message breaks a test instead of the page. Keep the
 * tables in the plain `NAME: "value"` form that the test parses.
 */

export const PROTOCOL = "dcanvas/1";

/** The websocket subprotocol the server selects when a client offers it. */
export const SUBPROTOCOL = "dcanvas.v1";

/** A token offered as a subprotocol: this prefix, then the token's UTF-8 in unpadded base64url (never echoed). */
export const TOKEN_SUBPROTOCOL_PREFIX = "dcanvas.token.";

/** Client -> server requests. */
export const REQUEST = Object.freeze({
  HELLO: "hello",
  DOC_OPEN: "doc.open",
  DOC_CLOSE: "doc.close",
  DOC_DELETE: "doc.delete",
  DOC_EDIT: "doc.edit",
  DOC_LIST: "doc.list",
  GEN_START: "gen.start",
  GEN_CANCEL: "gen.cancel",
  PROPOSAL_ACCEPT: "proposal.accept",
  PROPOSAL_REJECT: "proposal.reject",
  HISTORY_UNDO: "history.undo",
  HISTORY_REDO: "history.redo",
  PING: "ping",
});

/** Server -> client replies and events. */
export const EVENT = Object.freeze({
  WELCOME: "welcome",
  DOC_STATE: "doc.state",
  DOC_DELETED: "doc.deleted",
  DOC_LISTING: "doc.listing",
  ACK: "ack",
  GEN_ACCEPTED: "gen.accepted",
  GEN_PROGRESS: "gen.progress",
  GEN_DONE: "gen.done",
  PONG: "pong",
  ERROR: "error",
});

/** `doc.edit` ops. */
export const OP = Object.freeze({
  REPLACE: "replace",
  PIN: "pin",
  UNPIN: "unpin",
  MASK: "mask",
  UNMASK: "unmask",
  INSERT_GAP: "insert_gap",
  MOVE_WINDOW: "move_window",
});

/** `doc.state.spans[].kind`. */
export const SPAN_KIND = Object.freeze({
  PINNED: "pinned",
  FREE: "free",
});

/** `gen.done.status`. */
export const GEN_STATUS = Object.freeze({
  COMPLETED: "completed",
  CANCELLED: "cancelled",
  SUPERSEDED: "superseded",
  STALE: "stale",
  FAILED: "failed",
  UNAVAILABLE: "unavailable",
});

/** `gen.done.proposal.diff[].op`. */
export const DIFF_OP = Object.freeze({
  EQUAL: "equal",
  INSERT: "insert",
  DELETE: "delete",
});

/** `params.mode`. */
export const MODE = Object.freeze({
  DIFFUSION: "diffusion",
  AR: "ar",
});

/** `error.code`. */
export const ERROR_CODE = Object.freeze({
  INVALID_MESSAGE: "invalid_message",
  UNKNOWN_TYPE: "unknown_type",
  INVALID_PARAMS: "invalid_params",
  UNSUPPORTED_PROTOCOL: "unsupported_protocol",
  UNAUTHORIZED: "unauthorized",
  NOT_FOUND: "not_found",
  STALE_VERSION: "stale_version",
  CONFLICT: "conflict",
  BUSY: "busy",
  TOO_LARGE: "too_large",
  RATE_LIMITED: "rate_limited",
  INTERNAL: "internal",
});

/** The fields of `gen.start.params`; index.html has one control per field, with id `param-<field>`. */
export const GEN_PARAM = Object.freeze({
  MODE: "mode",
  MAX_STEPS: "max_steps",
  ENTROPY_BOUND: "entropy_bound",
  T_MAX: "t_max",
  T_MIN: "t_min",
  SEED: "seed",
  STREAM_EVERY: "stream_every",
});

/** Websocket close codes the server uses (docs/protocol.md, "Close codes"). */
export const CLOSE_CODE = Object.freeze({
  NORMAL: 1000,
  POLICY: 1008,
  TOO_BIG: 1009,
  INTERNAL: 1011,
  UNSUPPORTED_PROTOCOL: 4409,
});

/** Closes after which reconnecting unchanged cannot help (a wrong token, a protocol mismatch). */
export const FATAL_CLOSE = Object.freeze([CLOSE_CODE.POLICY, CLOSE_CODE.UNSUPPORTED_PROTOCOL]);
