// The status page: fetches /status.json every REFRESH_MS and redraws. Text goes in with textContent only (partition
// ids, task names and error messages come from users). Cells carry data-* attributes so tests can read them.
"use strict";
const REFRESH_MS = 2000;
const CURVES = [["reward", "mean reward"], ["loss", "loss"]];
const charts = {};

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function bar(done, total) {
  const outer = el("span", null, { class: "bar" });
  const inner = el("span");
  inner.style.width = total > 0 ? `${Math.min(100, (100 * done) / total)}%` : "0%";
  outer.appendChild(inner);
  return outer;
}

function fillTable(table, headers, rows) {
  table.replaceChildren();
  const head = el("tr");
  headers.forEach((h) => head.appendChild(el("th", h)));
  table.appendChild(head);
  rows.forEach((cells) => {
    const tr = el("tr");
    cells.forEach((c) => tr.appendChild(c instanceof Node ? c : el("td", c)));
    table.appendChild(tr);
  });
  if (!rows.length) {
    const tr = el("tr");
    tr.appendChild(el("td", "none", { colspan: headers.length, class: "muted" }));
    table.appendChild(tr);
  }
}

function card(key, value, id) {
  const c = el("div", null, { class: "card" });
  c.appendChild(el("div", value, { class: "v", id: `card-${id}`, "data-value": value }));
  c.appendChild(el("div", key, { class: "k" }));
  return c;
}

// replicas=2: the blocks copied back onto restarted units, which units are being refilled, and what they wait for
function refillLabel(storage) {
  const refilling = storage.refilling || [];
  if (!refilling.length) return "blocks copied back";
  const waiting = Object.entries(storage.refill_waiting || {}).map(([u, src]) => `unit ${u} waits for unit ${src}`);
  return `blocks copied back (refilling unit ${refilling.join(", ")}${waiting.length ? "; " + waiting.join(", ") : ""})`;
}

// replicas=2: the copies of units lost for good moved onto other units: which are being moved, which cannot be and why
function rereplicaLabel(storage) {
  const moving = storage.rereplicating || [];
  const cannot = Object.entries(storage.cannot_rereplicate || {}).map(([u, why]) => `unit ${u}: ${why}`);
  const doing = moving.length ? `moving the copies of unit ${moving.join(", ")}` : "";
  const notes = [doing, ...cannot].filter((x) => x);
  return `blocks re-replicated${notes.length ? " (" + notes.join("; ") + ")" : ""}`;
}

function drawCards(s) {
  const cards = document.getElementById("cards");
  cards.replaceChildren(
    card("live partitions", s.partitions_live, "partitions-live"),
    card("closed partitions", s.partitions_closed, "partitions-closed"),
    card("rows committed", s.rows_committed, "rows-committed"),
    card("rows in flight", s.rows_in_flight, "rows-in-flight"),
    card("get_meta waiting", s.waiting_get_meta, "waiting-get-meta"),
    card("puts waiting", s.waiting_puts, "waiting-puts"),
    card("clients connected", s.clients, "clients"),
    card(`held of ${fmtBytes(s.storage.budget)}`, fmtBytes(s.storage.bytes_held), "bytes-held"),
    ...(s.storage.replicas > 1  // replicas=2: blocks left with one live copy (a unit down or restarted empty)
      ? [card(`blocks with one copy of ${s.storage.replicas}`, s.storage.blocks_single_copy, "blocks-single-copy"),
         card(refillLabel(s.storage), s.storage.blocks_refilled, "blocks-refilled"),
         card(rereplicaLabel(s.storage), s.storage.blocks_rereplicated || 0, "blocks-rereplicated")]
      : []),
  );
}

function drawPartitions(s) {
  const rows = s.partitions.map((p) => {
    const pid = String(p.partition_id);
    const progress = el("td");
    for (const [task, c] of Object.entries(p.tasks)) {
      const line = el("div", null, { "data-partition": pid, "data-task": task, "data-acknowledged": c.acknowledged,
        "data-leased": c.leased, "data-ready": c.ready, "data-dead-lettered": c.dead_lettered });
      line.appendChild(bar(c.acknowledged, p.rows));
      line.appendChild(document.createTextNode(
        `${task}: ${c.acknowledged}/${p.rows} acknowledged` + (c.leased ? `, ${c.leased} leased` : "") +
        (c.dead_lettered ? `, ${c.dead_lettered} dead-lettered` : "")));
      progress.appendChild(line);
    }
    const produced = el("td");
    for (const [field, n] of Object.entries(p.fields)) {
      const line = el("div", null, { "data-partition": pid, "data-field": field, "data-produced": n });
      line.appendChild(bar(n, p.capacity || p.rows));
      line.appendChild(document.createTextNode(`${field}: ${n}`));
      produced.appendChild(line);
    }
    const rowsCell = el("td", `${p.rows}/${p.capacity === null ? "∞" : p.capacity}`,
      { "data-partition": pid, "data-rows": p.rows });
    return [el("td", pid), rowsCell, p.rows_in_flight, p.closed ? "yes" : "no", fmtBytes(p.bytes), produced, progress];
  });
  const omitted = s.partitions_omitted || { count: 0 };
  if (omitted.count) {  // the summary details only the most recent partitions (QueueConfig.status_partitions)
    rows.push([el("td", `+${omitted.count} older`, { class: "muted", "data-omitted": omitted.count }),
      `${omitted.rows} rows`, "", `${omitted.closed} closed`, fmtBytes(omitted.bytes),
      el("td", `not detailed: at most ${s.partitions_limit} partitions are`, { colspan: 2, class: "muted" })]);
  }
  fillTable(document.getElementById("partitions"),
    ["partition", "rows", "in flight", "closed", "bytes", "produced per field", "consumption per task"], rows);
}

function drawTasks(s) {
  const states = ["ready", "leased", "acknowledged", "dead_lettered"];
  const rows = Object.entries(s.tasks).map(([task, c]) =>
    [el("td", task), ...states.map((k) => el("td", c[k], { "data-task": task, "data-state": k }))]);
  fillTable(document.getElementById("tasks"), ["task", ...states.map((k) => k.replace("_", "-"))], rows);
}

function drawStorage(s) {
  const rows = s.storage.units.map((u) => {
    const used = el("td", null, { "data-unit": u.unit, "data-bytes": u.bytes });
    used.appendChild(bar(u.bytes, u.budget));
    used.appendChild(document.createTextNode(fmtBytes(u.bytes)));
    const health = el("td", u.up ? "up" : "DOWN", { class: u.up ? "up" : "down", "data-unit-health": u.unit });
    return [String(u.unit), used, fmtBytes(u.budget), health];
  });
  const metrics = (s.endpoints.storage_units || []);
  rows.forEach((r, i) => r.push(metrics[i] || "-"));
  fillTable(document.getElementById("storage"), ["unit", "committed bytes", "budget", "health", "metrics"], rows);
}

function drawErrors(s) {
  const rows = s.errors.recent.slice().reverse().map((e) =>
    [new Date(e.time * 1000).toLocaleTimeString(), e.kind, e.type, e.message]);
  fillTable(document.getElementById("errors"), ["time", "request", "type", "message"], rows);
}

function drawRun(s) {
  const history = s.run.history || [];
  const box = document.getElementById("charts");
  if (!history.length) return;
  const none = document.getElementById("no-run");
  if (none) none.remove();
  for (const [key, label] of CURVES) {
    const points = history.filter((r) => r.step !== undefined && r[key] !== undefined);
    if (!points.length) continue;
    const data = [points.map((r) => r.step), points.map((r) => r[key])];
    if (charts[key]) { charts[key].setData(data); continue; }
    const holder = el("div", null, { class: "chart", id: `chart-${key}`, "data-points": points.length });
    box.appendChild(holder);
    charts[key] = new uPlot({
      title: label, width: 460, height: 220,
      scales: { x: { time: false } },
      series: [{ label: "step" }, { label: key, stroke: key === "reward" ? "#2a7" : "#c52", width: 1.5 }],
    }, data, holder);
  }
  for (const [key] of CURVES) {
    const holder = document.getElementById(`chart-${key}`);
    if (holder) holder.setAttribute("data-points", history.filter((r) => r[key] !== undefined).length);
  }
}

async function refresh() {
  try {
    const response = await fetch("/status.json", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const s = await response.json();
    drawCards(s); drawPartitions(s); drawTasks(s); drawStorage(s); drawRun(s); drawErrors(s);
    document.getElementById("error").textContent = "";
    const updated = document.getElementById("updated");
    updated.textContent = `updated ${new Date(s.time * 1000).toLocaleTimeString()} (every ${REFRESH_MS / 1000} s)`;
    updated.setAttribute("data-time", s.time);
  } catch (err) {
    document.getElementById("error").textContent = `could not load /status.json: ${err}`;
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
