// The dashboard: fellows, loads, recent requests and a model's performance, refreshed every few seconds.
"use strict";

(() => {
  const { json, el, fmt } = Swarm;
  const $ = (id) => document.getElementById(id);
  const perfSelect = $("perf-model");
  const MODEL_KEY = "swarm.model";
  const SPLIT_NAMES = { stage0_ms: "stage 0", link_ms: "link", prefill_ms: "prefill" };

  const cell = (text, attrs) => el("td", attrs || {}, text);
  const badge = (state) => el("span", { class: "badge " + state }, state);

  function fill(tableId, rows, empty) {
    const body = $(tableId).tBodies[0];
    const cols = $(tableId).tHead.rows[0].cells.length;
    body.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: cols, class: "muted" }, empty))]));
  }

  // A drained fellow (its replies failed other fellows' checks): placement gives it no new stage.
  function drained(t) {
    if (!t || t.drained_at === null) return [];
    const when = new Date(t.drained_at * 1000).toISOString();
    return [" ", el("span", { class: "badge drained", title: `drained at ${when}` }, "drained"),
      el("div", { class: "drained-why" }, `${t.reason || "no reason given"} · ${fmt.ago(t.drained_at)}`)];
  }

  function checks(t) {
    if (!t || !t.checks) return "none yet";
    return el("span", { title: t.failed_by.length ? "failed in checks by " + t.failed_by.join(", ") : "" },
      `${fmt.num(t.checks, 0)} checked · ${fmt.num(t.failed, 0)} failed`);
  }

  function fellows(data) {
    fill("fellows-table", data.map((f) => el("tr", { "data-fellow": f.id, "data-drained": String(!!f.trust && f.trust.drained_at !== null) },
      el("th", { scope: "row" }, f.id, el("div", { class: "muted" }, `${f.hostname} · v${f.version}`)),
      cell([badge(f.status), ...drained(f.trust)]),
      cell(f.gpus.length ? f.gpus.map((g) => el("div", {}, `#${g.index} ${g.name} · ${fmt.bytes(g.free_bytes)} free of ${fmt.bytes(g.total_bytes)}`)) : "none (CPU)"),
      cell(`${fmt.bytes(f.memory_free_bytes)} free of ${fmt.bytes(f.memory_total_bytes)}`),
      cell(el("div", { class: "caps" }, f.capabilities.map((c) => el("code", {}, c)))),
      cell(f.loaded_models.length ? f.loaded_models.map((m) => el("div", {}, `${m.model_id} s${m.stage} · ${m.state}`)) : "—"),
      cell(checks(f.trust), { class: "checks" }),
      cell(fmt.ago(f.last_heartbeat_at)),
    )), "No fellow has joined yet. Start one with `swarm fellow`.");
  }

  function loads(data) {
    fill("loads-table", data.map((l) => el("tr", { "data-load": l.load_id },
      el("th", { scope: "row" }, l.model_id), cell(el("code", {}, l.load_id)), cell(badge(l.state)),
      cell(l.stages.map((s) => el("div", {}, `${s.stage}: ${s.fellow_id} · ${s.layers[0]}–${s.layers[1] - 1} · ${s.state}`))),
      cell(l.stages.map((s) => el("div", {}, `${(s.metrics || {}).in_flight ?? 0} of ${s.max_in_flight}` + ((s.metrics || {}).waiting ? ` (+${s.metrics.waiting} waiting)` : "")))),
      cell(l.stages.map((s) => el("div", {}, `${fmt.num(s.kv_tokens, 0)} tokens` + (s.kv_tokens_planned && s.kv_tokens_planned !== s.kv_tokens ? ` (planned ${fmt.num(s.kv_tokens_planned, 0)})` : "")))),
      cell(fmt.num((l.metrics || {}).tokens_per_s), { class: "num" }),
    )), "Nothing loaded. Load a model from the Chat page.");
  }

  function requests(data) {
    fill("requests-table", data.map((r) => {
      const status = r.status === "finished" && r.finish_reason === "cancelled" ? "cancelled" : r.status;
      return el("tr", { "data-request-id": r.id, "data-status": status },
        cell(fmt.clock(r.accepted_at), { title: new Date(r.accepted_at * 1000).toISOString() }), cell(r.model_id), cell(badge(status)),
        cell(fmt.num(r.prompt_tokens, 0), { class: "num" }), cell(fmt.num(r.completion_tokens, 0), { class: "num" }),
        cell(r.ttft_s === null ? "—" : fmt.ms(r.ttft_s * 1000), { class: "num" }),
        cell(r.tokens_per_s ? fmt.num(r.tokens_per_s) : "—", { class: "num" }),
        cell(r.finish_reason || "—"), cell(r.error_code ? el("span", { title: r.error_message || "" }, r.error_code) : "—"),
        cell(el("code", {}, r.id)));
    }), "No requests yet.");
  }

  function card(key, label, value, sub) {
    return el("div", { class: "card", "data-key": key }, el("div", { class: "label" }, label),
      el("div", { class: "value" }, value), el("div", { class: "sub muted" }, sub || ""));
  }

  function performance(p) {
    const t = p.totals;
    $("perf-cards").replaceChildren(
      card("requests", "Requests", fmt.num(t.requests, 0), `${t.finished} finished · ${t.cancelled} cancelled · ${t.failed + t.too_long} failed`),
      card("tokens", "Tokens generated", fmt.num(t.completion_tokens, 0), `${fmt.num(t.prompt_tokens, 0)} prompt tokens read`),
      card("throughput", "Throughput", fmt.num(t.tokens_per_s, 2) + " tok/s", "averaged over the window"),
      card("decode", "Decode speed", t.decode_tokens_per_s === null ? "—" : fmt.num(t.decode_tokens_per_s) + " tok/s", "per request, token-weighted"),
      card("spec", "Drafts accepted", t.spec_acceptance === null ? "—" : fmt.num(100 * t.spec_acceptance, 1) + " %",
        t.spec_tokens_per_pass === null ? "no speculative decoding" : fmt.num(t.spec_tokens_per_pass, 2) + " tokens per pass with drafts"),
      card("ttft", "Time to first token", fmt.ms(t.ttft_ms), `p50 ${fmt.ms(t.ttft_ms_p50)} · p95 ${fmt.ms(t.ttft_ms_p95)}`),
      card("prefix", "Prefix cache hits", t.prefix_hit_rate === null ? "—" : fmt.num(t.prefix_hit_rate * 100, 1) + " %",
        `${fmt.num(t.cached_tokens, 0)} prompt tokens reused`),
      card("per-token", "Time per token", fmt.ms(t.per_token_ms),
        Object.entries(t.split_ms).map(([k, v]) => `${SPLIT_NAMES[k] || k.replace("_ms", "")} ${fmt.ms(v)}`).join(" · ") || "no timing yet"),
    );
    const b = p.buckets;
    Charts.bars($("chart-throughput"), b.map((x) => ({ t: x.t, value: x.tokens_per_s })), { label: "Tokens per second", unit: "tok/s" });
    const outcome = ["finished", "cancelled", "failed"];
    Charts.stacked($("chart-requests"), b.map((x) => ({ t: x.t, parts: { finished: x.finished, cancelled: x.cancelled, failed: x.failed + x.too_long } })),
      outcome, { label: "Requests per minute", unit: "req", classes: [0, 3, 4] });
    Charts.legend($("legend-requests"), outcome, [0, 3, 4]);
    Charts.line($("chart-ttft"), b.map((x) => ({ t: x.t, value: x.ttft_ms })), { label: "Time to first token", unit: "ms" });
    Charts.line($("chart-prefix"), b.map((x) => ({ t: x.t, value: x.prefix_hit_rate === null ? null : x.prefix_hit_rate * 100 })),
      { label: "Prompt tokens from the prefix cache", unit: "%" });
    const keys = [...new Set([...Object.keys(t.split_ms), ...b.flatMap((x) => Object.keys(x.split_ms))])];
    Charts.stacked($("chart-split"), b.map((x) => ({ t: x.t, parts: x.split_ms })), keys,
      { label: "Time per token", unit: "ms", names: SPLIT_NAMES, classes: keys.map((k, i) => (k === "link_ms" ? 2 : i === 0 ? 1 : 5 + i)) });
    Charts.legend($("legend-split"), keys.map((k) => SPLIT_NAMES[k] || k), keys.map((k, i) => (k === "link_ms" ? 2 : i === 0 ? 1 : 5 + i)));
    Charts.ring($("ring"), p.load);
    $("performance").dataset.requests = String(t.requests);
    $("performance").dataset.completionTokens = String(t.completion_tokens);
  }

  let modelIds = "";
  async function models() {
    const data = (await json("/api/v1/models")).data;
    const ids = data.map((m) => m.id).join("\n");
    if (ids !== modelIds) {  // rebuild only when the catalog changed, so an open dropdown stays open
      modelIds = ids;
      const keep = perfSelect.value || localStorage.getItem(MODEL_KEY);
      perfSelect.replaceChildren(...data.map((m) => el("option", { value: m.id }, m.id)));
      const pick = data.find((m) => m.id === keep) || data.find((m) => m.load_state === "ready") || data[0];
      if (pick) perfSelect.value = pick.id;
    }
  }

  async function refresh() {
    await models();
    const model = perfSelect.value;
    const [f, l, r, p] = await Promise.all([
      json("/api/v1/fellows"), json("/api/v1/loads"), json("/api/v1/requests?limit=25"),
      model ? json(`/api/v1/models/${encodeURIComponent(model)}/performance`) : null,
    ]);
    fellows(f.data);
    loads(l.data);
    requests(r.data);
    if (p) performance(p);
    $("refreshed").textContent = "updated " + fmt.clock(Date.now() / 1000);
    document.body.dataset.refreshed = String(Date.now());
  }

  const now = Swarm.every(3000, async () => {
    try {
      await refresh();
    } catch (e) {
      $("refreshed").textContent = "could not refresh: " + e.message;
    }
  });
  perfSelect.addEventListener("change", () => { localStorage.setItem(MODEL_KEY, perfSelect.value); now(); });
  document.addEventListener("swarm:token", now);
})();
