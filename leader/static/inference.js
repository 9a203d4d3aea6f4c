// The chat page: pick a model, load/unload it, chat with streamed tokens, copy API snippets.
"use strict";

(() => {
  const { api, json, errorOf, el, fmt } = Swarm;
  const $ = (id) => document.getElementById(id);
  const select = $("model-select"), stateLine = $("model-state"), progress = $("load-progress");
  const loadBtn = $("load-btn"), unloadBtn = $("unload-btn");
  const messagesEl = $("messages"), form = $("chat-form"), prompt = $("prompt");
  const sendBtn = $("send-btn"), stopBtn = $("stop-btn"), thinking = $("thinking");
  let streamingLi = null;  // the reply being streamed now
  const maxTokens = $("max-tokens"), temperature = $("temperature");
  const MODEL_KEY = "swarm.model";
  const BUSY = ["requested", "loading"];

  let models = [];
  let history = [];
  let controller = null;
  let watching = null;

  const current = () => models.find((m) => m.id === select.value);

  // --- models: catalog, state, load and unload ------------------------------------------------

  async function refreshModels() {
    try {
      models = (await json("/api/v1/models")).data;
    } catch (e) {
      stateLine.textContent = "Could not read the catalog: " + e.message;
      return;
    }
    const same = models.length && models.length === select.options.length
      && models.every((m, i) => select.options[i].value === m.id);
    if (same) {  // update in place, so an open dropdown stays open
      models.forEach((m, i) => {
        select.options[i].textContent = `${m.id} — ${m.available ? m.load_state : "not servable"}`;
        select.options[i].dataset.state = m.load_state;
      });
      showModel();
      return;
    }
    const keep = select.value || localStorage.getItem(MODEL_KEY) || "";
    select.replaceChildren(...(models.length ? models.map((m) => el("option", {
      value: m.id, disabled: !m.available, "data-state": m.load_state,
    }, `${m.id} — ${m.available ? m.load_state : "not servable"}`)) : [el("option", { value: "" }, "No servable models")]));
    const pick = models.find((m) => m.id === keep && m.available) || models.find((m) => m.load_state === "ready")
      || models.find((m) => m.available);
    if (pick) select.value = pick.id;
    showModel();
  }

  function showModel(status) {
    const m = current();
    renderSnippets();
    if (!m) {
      stateLine.textContent = "";
      loadBtn.disabled = unloadBtn.disabled = true;
      progress.hidden = true;
      return;
    }
    const state = status ? status.load_state : m.load_state;
    m.load_state = state;
    select.selectedOptions[0].textContent = `${m.id} — ${m.available ? state : "not servable"}`;
    select.selectedOptions[0].dataset.state = state;
    document.body.dataset.loadState = state;
    loadBtn.disabled = !m.available || state !== "unloaded";
    unloadBtn.disabled = !(BUSY.includes(state) || state === "ready");
    const layers = m.num_layers ? `${m.num_layers} layers, ` : "";
    const about = `${layers}${fmt.num(m.parameters / 1e6, 1)} M parameters`;
    if (!m.available) stateLine.textContent = "Not servable: " + (m.reason || "unknown reason");
    else if (state === "ready") stateLine.textContent = `Ready · ${about}`;
    else if (BUSY.includes(state)) stateLine.textContent = loadingText(status);
    else stateLine.textContent = `Not loaded · ${about}`;
    progress.hidden = !BUSY.includes(state);
    if (BUSY.includes(state)) {
      const stages = (status && status.load && status.load.stages) || [];
      const ready = stages.filter((s) => s.state === "ready").length;
      progress.max = 100;
      progress.value = state === "requested" ? 10 : 20 + (70 * ready) / Math.max(1, stages.length);
    }
  }

  function loadingText(status) {
    const load = status && status.load;
    if (!load || !load.stages.length) return "Placing the load…";
    return "Loading: " + load.stages.map((s) => `stage ${s.stage} on ${s.fellow_id} ${s.state}`).join(", ") + "…";
  }

  // Follow one model's status until its load settles (ready, failed or gone).
  async function watch(id) {
    const token = {};
    watching = token;
    while (watching === token) {
      let status;
      try {
        status = await json(`/api/v1/models/${encodeURIComponent(id)}/status`);
      } catch (e) {
        stateLine.textContent = e.message;
        break;
      }
      if (current() && current().id === id) showModel(status);
      if (!BUSY.includes(status.load_state)) {
        if (status.load_state !== "ready" && status.load && status.load.reason) stateLine.textContent = "Load ended: " + status.load.reason;
        break;
      }
      await new Promise((r) => setTimeout(r, 500));
    }
    if (watching === token) watching = null;
  }

  async function act(verb) {
    const m = current();
    if (!m) return;
    loadBtn.disabled = unloadBtn.disabled = true;
    const res = await api(`/api/v1/models/${encodeURIComponent(m.id)}/${verb}`, {
      method: "POST", headers: { "Content-Type": "application/json" }, body: "{}",
    });
    if (!res.ok) {
      stateLine.textContent = `${verb === "load" ? "Load" : "Unload"} refused: ${await errorOf(res)}`;
      showModel();
      return;
    }
    if (verb === "load") { m.load_state = "requested"; showModel(); }
    await watch(m.id);
    await refreshModels();
  }

  select.addEventListener("change", () => {
    localStorage.setItem(MODEL_KEY, select.value);
    showModel();
    if (current() && BUSY.includes(current().load_state)) watch(current().id);
  });
  loadBtn.addEventListener("click", () => act("load"));
  unloadBtn.addEventListener("click", () => act("unload"));

  // --- chat --------------------------------------------------------------------------------------

  function bubble(role, text) {
    $("chat-hint")?.remove();
    const body = el("div", { class: "body" });
    const li = el("li", { class: "msg " + role }, el("div", { class: "who" }, role === "user" ? "You" : "Model"), body);
    if (text) body.textContent = text;
    messagesEl.append(li);
    li.scrollIntoView({ block: "end" });
    return li;
  }

  // A thinking model's thought arrives apart (delta.reasoning_content): shown open while the model
  // thinks, folded away once the answer begins or the reply ends.
  function renderReply(li, thought, answer, done) {
    const body = li.querySelector(".body");
    if (!thought) { body.textContent = answer; return; }
    const folded = done || answer !== "";
    const details = el("details", { class: "thinking", open: !folded }, el("summary", {}, folded ? "Thought" : "Thinking…"),
      el("div", {}, thought));
    body.replaceChildren(details, el("div", { class: "answer" }, answer));
  }

  function footer(li, parts, cls) {
    li.append(el("div", { class: "meta" + (cls ? " " + cls : "") }, parts.filter(Boolean).join(" · ")));
  }

  function setBusy(busy) {
    sendBtn.disabled = busy;
    stopBtn.disabled = !busy;
    document.body.dataset.chat = busy ? "streaming" : "idle";
  }

  function requestBody(model) {
    const body = {
      model, messages: history, stream: true, stream_options: { include_usage: true },
      max_tokens: Math.max(1, parseInt(maxTokens.value, 10) || 512),
      chat_template_kwargs: { enable_thinking: thinking.checked },
    };
    if (temperature.value !== "") body.temperature = parseFloat(temperature.value);
    return body;
  }

  // Read SSE events off the body; each `data:` line is one chunk (or [DONE]).
  async function* sse(res) {
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          yield JSON.parse(data);
        }
      }
    }
  }

  async function send(text) {
    const m = current();
    if (!m) return;
    history.push({ role: "user", content: text });
    bubble("user", text);
    const li = bubble("assistant", "");
    streamingLi = li;
    li.classList.add("streaming");
    li.dataset.chunks = "0";
    controller = new AbortController();
    setBusy(true);
    const started = performance.now();
    let reply = "", thought = "", firstAt = null, finish = null, usage = null, timing = null, chunks = 0;
    try {
      const res = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(requestBody(m.id)), signal: controller.signal,
      });
      if (!res.ok) throw new Error(await errorOf(res));
      li.dataset.requestId = "";
      for await (const chunk of sse(res)) {
        if (chunk.error) throw new Error(chunk.error.message || chunk.error.code);
        if (chunk.id && !li.dataset.requestId) li.dataset.requestId = chunk.id.replace(/^chatcmpl-/, "");
        if (chunk.usage) usage = chunk.usage;
        if (chunk.swarm && chunk.swarm.timing) timing = chunk.swarm.timing;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        if (choice.finish_reason) finish = choice.finish_reason;
        const piece = choice.delta && choice.delta.content;
        const thinking = choice.delta && choice.delta.reasoning_content;
        if (piece || thinking) {
          if (firstAt === null) firstAt = performance.now();
          reply += piece || "";
          thought += thinking || "";
          chunks += 1;
          li.dataset.chunks = String(chunks);
          renderReply(li, thought, reply, false);
          li.scrollIntoView({ block: "end" });
        }
      }
      renderReply(li, thought, reply, true);
      li.dataset.finish = finish || "";
      if (usage) li.dataset.completionTokens = String(usage.completion_tokens);
      const seconds = (performance.now() - (firstAt || started)) / 1000;
      footer(li, [finish && `finish: ${finish}`, usage && `${usage.completion_tokens} tokens`,
        firstAt && `first token ${fmt.ms(firstAt - started)}`,
        timing && timing.tokens_per_s ? `${fmt.num(timing.tokens_per_s)} tokens/s`
          : usage && seconds > 0 && `${fmt.num(usage.completion_tokens / seconds)} tokens/s`]);
    } catch (e) {
      if (e.name === "AbortError") {
        li.dataset.finish = "stopped";
        footer(li, ["stopped", `${chunks} chunks received`], "stopped");
      } else {
        li.dataset.finish = "error";
        footer(li, ["Error: " + e.message], "error");
      }
    } finally {
      li.classList.remove("streaming");
      li.scrollIntoView({ block: "end" });
      if (reply) history.push({ role: "assistant", content: reply });
      controller = null;
      setBusy(false);
      prompt.focus();
    }
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = prompt.value.trim();
    if (!text || controller) return;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); form.requestSubmit(); }
  });
  // Stop: the request ends on its stage at once (a hang-up alone would wait out the resume grace).
  function stop() {
    if (!controller) return;
    const id = streamingLi && streamingLi.dataset.requestId;
    if (id) api(`/api/v1/requests/${encodeURIComponent(id)}/cancel`, { method: "POST" }).catch(() => {});
    controller.abort();
  }
  stopBtn.addEventListener("click", stop);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
  $("clear-btn").addEventListener("click", () => {
    stop();
    history = [];
    messagesEl.replaceChildren();
    prompt.focus();
  });

  // --- API snippets ------------------------------------------------------------------------------

  function renderSnippets() {
    const model = (current() && current().id) || "MODEL_ID";
    const think = thinking.checked;
    const quoted = JSON.stringify(model).replace(/'/g, "'\\''");  // inside the shell's single quotes
    $("snippet-curl").textContent = [
      `curl -N ${location.origin}/v1/chat/completions \\`,
      `  -H "Authorization: Bearer $SWARM_API_TOKEN" \\`,
      `  -H "Content-Type: application/json" \\`,
      `  -d '{"model": ${quoted}, "stream": true,`,
      `       "messages": [{"role": "user", "content": "Hello!"}],`,
      `       "chat_template_kwargs": {"enable_thinking": ${think}}}'`,
    ].join("\n");
    $("snippet-python").textContent = [
      "import os",
      "from openai import OpenAI",
      "",
      "client = OpenAI(",
      `    base_url="${location.origin}/v1",`,
      `    api_key=os.environ.get("SWARM_API_TOKEN", "none"),`,
      ")",
      "stream = client.chat.completions.create(",
      `    model=${JSON.stringify(model)},`,
      `    messages=[{"role": "user", "content": "Hello!"}],`,
      "    stream=True,",
      `    extra_body={"chat_template_kwargs": {"enable_thinking": ${think ? "True" : "False"}}},`,
      ")",
      "for chunk in stream:",
      "    if chunk.choices:",
      `        print(chunk.choices[0].delta.content or "", end="", flush=True)`,
    ].join("\n");
  }
  thinking.addEventListener("change", renderSnippets);

  document.querySelectorAll("button.copy").forEach((btn) => btn.addEventListener("click", async () => {
    const text = $(btn.dataset.copy).textContent;
    try {
      await navigator.clipboard.writeText(text);
    } catch (_) { // no clipboard permission: select it so Ctrl+C works
      const range = document.createRange();
      range.selectNodeContents($(btn.dataset.copy));
      getSelection().removeAllRanges();
      getSelection().addRange(range);
    }
    btn.textContent = "Copied";
    setTimeout(() => (btn.textContent = "Copy"), 1500);
  }));

  document.addEventListener("swarm:token", refreshModels);
  // Someone else may load or unload a model (CLI, another tab): keep the dropdown's states fresh.
  Swarm.every(5000, async () => {
    if (watching) return;
    await refreshModels();
    if (current() && BUSY.includes(current().load_state)) watch(current().id);
  });
})();
