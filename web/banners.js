/**
 * Banners at the top of the page: protocol errors, disconnects, notices.
 *
 * Each banner has a key; showing a banner with a key already on screen replaces it, so a repeated error or the
 * reconnect countdown stays one banner. Errors stay until dismissed (or replaced); notices can time out.
 * The container is an ARIA live region, so screen readers announce new banners.
 */

export class Banners {
  /** @param {HTMLElement} root */
  constructor(root) {
    this.root = root;
    this.byKey = new Map();
    this._seq = 0;
  }

  /**
   * @param {{kind?: "error"|"warn"|"info", title: string, message?: string, key?: string,
   *          actions?: {label: string, onClick: Function}[], timeoutMs?: number}} b
   * @returns {string} the banner's key
   */
  show({ kind = "error", title, message = "", key, actions = [], timeoutMs = 0 }) {
    const k = key || `b${++this._seq}`;
    this.dismiss(k);
    const box = document.createElement("div");
    box.className = `banner ${kind}`;
    box.dataset.key = k;
    box.setAttribute("role", kind === "error" ? "alert" : "status");
    const text = document.createElement("p");
    const strong = document.createElement("strong");
    strong.textContent = title;
    text.append(strong);
    if (message) text.append(document.createTextNode(` ${message}`));
    box.append(text);
    const buttons = document.createElement("div");
    buttons.className = "banner-actions";
    for (const a of actions) {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = a.label;
      b.addEventListener("click", () => a.onClick());
      buttons.append(b);
    }
    const close = document.createElement("button");
    close.type = "button";
    close.className = "dismiss";
    close.textContent = "×";
    close.setAttribute("aria-label", `dismiss: ${title}`);
    close.addEventListener("click", () => this.dismiss(k));
    buttons.append(close);
    box.append(buttons);
    this.root.append(box);
    const entry = { box, timer: null };
    if (timeoutMs > 0) entry.timer = setTimeout(() => this.dismiss(k), timeoutMs);
    this.byKey.set(k, entry);
    return k;
  }

  dismiss(key) {
    const entry = this.byKey.get(key);
    if (!entry) return;
    clearTimeout(entry.timer);
    entry.box.remove();
    this.byKey.delete(key);
  }

  has(key) {
    return this.byKey.has(key);
  }
}
