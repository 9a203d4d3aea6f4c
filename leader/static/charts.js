// Small inline-SVG charts for the dashboard: per-minute bars, stacked bars, a line, and the ring of stages.
"use strict";

const Charts = (() => {
  const { el, fmt } = Swarm;
  const W = 480, H = 200, M = { l: 46, r: 10, t: 24, b: 24 };

  // 0.8 -> 1, 13 -> 20, 240 -> 250: a round top for the axis.
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const step of [1, 2, 2.5, 5, 10]) if (v <= step * p) return step * p;
    return 10 * p;
  }

  function frame(container, label, top, unit, points) {
    const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label, class: "plot" });
    const iw = W - M.l - M.r, ih = H - M.t - M.b;
    for (let i = 0; i <= 4; i++) {
      const y = M.t + ih - (ih * i) / 4;
      svg.append(el("svg:line", { x1: M.l, x2: W - M.r, y1: y, y2: y, class: i ? "grid" : "axis" }));
      svg.append(el("svg:text", { x: M.l - 6, y: y + 4, class: "tick", "text-anchor": "end" }, fmt.num((top * i) / 4, 2)));
    }
    if (unit) svg.append(el("svg:text", { x: M.l - 6, y: 11, class: "unit", "text-anchor": "end" }, unit));
    const bw = iw / Math.max(1, points.length);
    points.forEach((p, i) => {
      if (i % 5 === 0 || i === points.length - 1) {
        svg.append(el("svg:text", { x: M.l + bw * (i + 0.5), y: H - 6, class: "tick", "text-anchor": "middle" },
          i === points.length - 1 ? "now" : fmt.clock(p.t).slice(0, 5)));
      }
    });
    container.replaceChildren(svg);
    return { svg, iw, ih, bw, y: (v) => M.t + ih - (ih * v) / top, x: (i) => M.l + bw * i };
  }

  // points: [{t, parts: {key: value}}]; keys in stacking order. One bar per minute.
  function stacked(container, points, keys, opts) {
    const totals = points.map((p) => keys.reduce((s, k) => s + (p.parts[k] || 0), 0));
    const top = niceMax(Math.max(...totals, 0));
    const label = `${opts.label}: ${keys.length > 1 ? "stacked " : ""}bars per minute, highest ${fmt.num(Math.max(...totals, 0))} ${opts.unit || ""}`;
    const f = frame(container, label, top, opts.unit, points);
    points.forEach((p, i) => {
      let base = 0;
      const g = el("svg:g", { class: "bar" });
      keys.forEach((k, ki) => {
        const v = p.parts[k] || 0;
        if (v <= 0) return;
        const y0 = f.y(base), y1 = f.y(base + v);
        g.append(el("svg:rect", { x: f.x(i) + f.bw * 0.15, y: y1, width: f.bw * 0.7, height: Math.max(0.5, y0 - y1),
          rx: 2, class: "s" + ((opts.classes && opts.classes[ki]) ?? ki) }));
        base += v;
      });
      const lines = keys.filter((k) => p.parts[k]).map((k, ki) => `${(opts.names || {})[k] || k}: ${fmt.num(p.parts[k], 2)}`);
      g.append(el("svg:title", {}, `${fmt.clock(p.t)} — ${lines.join(", ") || "nothing"}`));
      f.svg.append(g);
    });
    return f.svg;
  }

  function bars(container, points, opts) {
    return stacked(container, points.map((p) => ({ t: p.t, parts: { v: p.value || 0 } })), ["v"],
      Object.assign({ names: { v: opts.label } }, opts));
  }

  // A line over the minutes that have a value; gaps stay gaps.
  function line(container, points, opts) {
    const values = points.map((p) => p.value).filter((v) => v !== null && v !== undefined);
    const top = niceMax(Math.max(...values, 0));
    const f = frame(container, `${opts.label}: ${values.length ? "average " + fmt.num(values.reduce((a, b) => a + b, 0) / values.length) : "no data"} ${opts.unit || ""}`, top, opts.unit, points);
    let d = "", pen = false;
    points.forEach((p, i) => {
      if (p.value === null || p.value === undefined) { pen = false; return; }
      const x = f.x(i) + f.bw / 2, y = f.y(p.value);
      d += `${pen ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)} `;
      pen = true;
      f.svg.append(el("svg:circle", { cx: x, cy: y, r: 3.5, class: "dot" }, el("svg:title", {}, `${fmt.clock(p.t)} — ${fmt.num(p.value, 1)} ${opts.unit || ""}`)));
    });
    if (d) f.svg.prepend(el("svg:path", { d, class: "line" }));
    f.svg.append(...[...f.svg.querySelectorAll("circle")]);  // dots above the line
    return f.svg;
  }

  function legend(target, names, classes) {
    target.replaceChildren(...names.map((n, i) => el("span", { class: "key" }, el("i", { class: "s" + (classes ? classes[i] : i) }), n)));
  }

  // "2 × NVIDIA RTX 4090 24 GB": a fellow's cards, alike ones counted once.
  function gpuSummary(gpus) {
    const counts = new Map();
    for (const g of gpus) {
      const key = `${g.name.replace(/^NVIDIA (GeForce )?/, "")} ${fmt.bytes(g.total_bytes)}`;
      counts.set(key, (counts.get(key) || 0) + 1);
    }
    return [...counts].map(([k, c]) => (c > 1 ? `${c} × ${k}` : k)).join(", ");
  }

  // The load's stages as boxes (fellow, GPUs, layers, KV budget, ms per token), hidden states flowing
  // right, the sampled token returning from the last stage to stage 0.
  function ring(container, load) {
    if (!load) { container.replaceChildren(el("p", { class: "muted" }, "Not loaded: no stages to show.")); return; }
    const n = load.stages.length, bw = 224, gap = 70, bh = 128, top = 14;
    const width = Math.max(W, n * bw + (n - 1) * gap + 40), height = bh + top + 56;
    const svg = el("svg:svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img", class: "ring",
      "aria-label": `Load ${load.load_id}: ${n} stage${n === 1 ? "" : "s"} — ` + load.stages.map((s) => `stage ${s.stage} on ${s.fellow_id}`).join(", ") });
    svg.append(el("svg:defs", {}, el("svg:marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
      el("svg:path", { d: "M0,0 L10,5 L0,10 z", class: "arrowhead" }))));
    const x0 = (width - (n * bw + (n - 1) * gap)) / 2;
    load.stages.forEach((s, i) => {
      const x = x0 + i * (bw + gap);
      const gpus = s.gpus.length ? gpuSummary(s.gpus) : `CPU · ${fmt.bytes(s.memory_total_bytes)} RAM`;
      const g = el("svg:g", { class: "stage " + s.state });
      g.append(el("svg:rect", { x, y: top, width: bw, height: bh, rx: 10 }));
      const moved = (s.replaced || []).map((r) => r.from).join(", ");
      const rows = [[`Stage ${s.stage}`, "title"], [`${s.fellow_id}${s.hostname ? " · " + s.hostname : ""}${moved ? " (re-placed from " + moved + ")" : ""}`, "sub"],
        [gpus.length > 32 ? gpus.slice(0, 31) + "…" : gpus, "sub"], [`layers ${s.layers[0]}–${s.layers[1] - 1} · ${s.state}`, "sub"],
        [`KV ${fmt.num(s.kv_tokens, 0)} tokens · ${s.max_in_flight} in flight`, "sub"],
        [s.ms_per_token !== null && s.ms_per_token !== undefined ? `${fmt.num(s.ms_per_token, 2)} ms / token` : "no tokens yet", "big"]];
      rows.forEach(([text, cls], r) => g.append(el("svg:text", { x: x + 12, y: top + 22 + r * 19, class: cls }, text)));
      g.append(el("svg:title", {}, gpus));
      svg.append(g);
      if (i < n - 1) {
        const ax = x + bw, ay = top + bh / 2;
        svg.append(el("svg:line", { x1: ax + 4, y1: ay, x2: ax + gap - 4, y2: ay, class: "link", "marker-end": "url(#arrow)" }));
        svg.append(el("svg:text", { x: ax + gap / 2, y: ay - 8, class: "tick", "text-anchor": "middle" }, "hidden"));
        const link = (load.links || [])[i];
        if (link && link.frames) {
          svg.append(el("svg:text", { x: ax + gap / 2, y: ay + 16, class: "tick", "text-anchor": "middle" },
            fmt.bytes(link.bytes / link.frames) + "/frame", el("svg:title", {}, `${fmt.num(link.frames, 0)} frames, ${fmt.bytes(link.bytes)}`)));
        }
      }
    });
    const first = x0 + bw / 2, last = x0 + (n - 1) * (bw + gap) + bw / 2, by = top + bh;
    const back = n === 1
      ? `M${first + 40},${by + 2} C${first + 40},${by + 40} ${first - 40},${by + 40} ${first - 40},${by + 2}`
      : `M${last},${by + 2} C${last},${by + 44} ${first},${by + 44} ${first},${by + 2}`;
    svg.append(el("svg:path", { d: back, class: "link back", "marker-end": "url(#arrow)" }));
    const linkMs = load.link_ms !== null && load.link_ms !== undefined ? ` · link ${fmt.num(load.link_ms, 2)} ms / token` : "";
    svg.append(el("svg:text", { x: (first + last) / 2, y: by + 48, class: "tick", "text-anchor": "middle" },
      n === 1 ? "one-stage ring: each token stays on its fellow" : `sampled token back to stage 0${linkMs}`));
    container.replaceChildren(svg);
  }

  return { stacked, bars, line, legend, ring };
})();
