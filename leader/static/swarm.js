// Swarm pages: the API token (sessionStorage only), fetch with it, and small formatting helpers.
"use strict";

const Swarm = (() => {
  const KEY = "swarm.api_token";
  const form = document.getElementById("token-form");
  const input = document.getElementById("token-input");
  const note = document.getElementById("token-note");
  const toggle = document.getElementById("token-toggle");

  const token = () => sessionStorage.getItem(KEY) || "";

  function showTokenForm(message) {
    form.hidden = false;
    toggle.setAttribute("aria-expanded", "true");
    note.textContent = message || "";
    input.focus();
  }

  function hideTokenForm() {
    form.hidden = true;
    toggle.setAttribute("aria-expanded", "false");
  }

  function tokenState() {
    toggle.textContent = token() ? "API token ✓" : "API token";
  }

  toggle.addEventListener("click", () => (form.hidden ? showTokenForm("") : hideTokenForm()));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const value = input.value.trim();
    if (value) sessionStorage.setItem(KEY, value);
    input.value = "";
    tokenState();
    hideTokenForm();
    document.dispatchEvent(new CustomEvent("swarm:token"));
  });
  document.getElementById("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    tokenState();
    note.textContent = "Forgotten.";
    document.dispatchEvent(new CustomEvent("swarm:token"));
  });
  tokenState();

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (token()) h["Authorization"] = "Bearer " + token();
    return h;
  }

  // Every API call goes through here, so a 401/403 anywhere asks for a token.
  async function api(path, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const res = await fetch(path, opts);
    if (res.status === 401) showTokenForm(token() ? "That token was refused; enter another." : "This leader requires an API token.");
    if (res.status === 403) showTokenForm("This token lacks the scope for that; enter one that has it.");
    return res;
  }

  async function errorOf(res) {
    try {
      const body = await res.json();
      if (body && body.error) return body.error.message || body.error.code || res.statusText;
    } catch (_) { /* not JSON */ }
    return `${res.status} ${res.statusText}`;
  }

  async function json(path, options) {
    const res = await api(path, options);
    if (!res.ok) throw new Error(await errorOf(res));
    return res.json();
  }

  // el("td", {class: "num"}, "12") — text children are text nodes, never HTML.
  function el(tag, attrs, ...children) {
    const node = tag.includes(":") ? document.createElementNS("http://www.w3.org/2000/svg", tag.split(":")[1])
      : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  const fmt = {
    num(v, digits) {
      if (v === null || v === undefined || Number.isNaN(v)) return "—";
      return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 1 : digits });
    },
    ms(v) {
      if (v === null || v === undefined) return "—";
      return v >= 1000 ? fmt.num(v / 1000, 2) + " s" : fmt.num(v, v < 10 ? 2 : 1) + " ms";
    },
    bytes(v) {
      if (!v) return "—";
      const units = ["B", "KB", "MB", "GB", "TB"];
      let i = 0;
      while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
      return fmt.num(v, 1) + " " + units[i];
    },
    ago(epoch) {
      if (!epoch) return "—";
      const s = Math.max(0, Date.now() / 1000 - epoch);
      if (s < 60) return fmt.num(s, 1) + " s ago";
      if (s < 3600) return fmt.num(s / 60, 0) + " min ago";
      return fmt.num(s / 3600, 1) + " h ago";
    },
    clock(epoch) { return epoch ? new Date(epoch * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" }) : "—"; },
  };

  // Poll `fn` every `ms` while the tab is visible; returns a function that refreshes at once.
  function every(ms, fn) {
    let timer = null;
    let busy = false;
    const round = async () => {
      if (busy) return;  // the round in progress schedules the next one
      if (timer !== null) { clearTimeout(timer); timer = null; }
      if (document.hidden) return;
      busy = true;
      try { await fn(); } catch (e) { console.warn(e); } finally { busy = false; }
      if (!document.hidden && timer === null) timer = setTimeout(round, ms);
    };
    document.addEventListener("visibilitychange", () => { if (!document.hidden && timer === null) round(); });
    round();
    return round;
  }

  return { api, json, errorOf, headers, token, el, fmt, every, showTokenForm };
})();
