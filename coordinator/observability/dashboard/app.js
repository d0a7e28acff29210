"use strict";
// The epochmesh dashboard: polls the coordinator's JSON API every second (read-only).

const POLL_MS = 1000;
const MAX_EVENTS = 200;
const state = { lastEvent: 0, job: null, points: [], lastRound: 0, failures: 0 };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) node.append(child);
  return node;
}

function fmtNum(x, digits = 1) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "-";
  if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(digits) + "M";
  if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(digits) + "k";
  return x.toFixed(digits);
}

function fmtSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "-";
  if (s < 60) return s.toFixed(1) + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(Math.round(s % 60)).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
}

function fmtCredits(micro) {
  if (micro === null || micro === undefined) return "-";
  return (micro / 1e6).toFixed(micro % 1e6 === 0 ? 0 : 2);
}

function stateBadge(name) {
  return el("span", { class: "state " + name, text: name });
}

function bar(fraction) {
  const fill = el("span");
  fill.style.width = Math.max(0, Math.min(1, fraction)) * 100 + "%";
  return el("span", { class: "bar" }, fill);
}

async function getJSON(url) {
  const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (response.status === 401) {
    window.location.replace("/login");
    throw new Error("login required");
  }
  if (!response.ok) throw new Error(`${url}: ${response.status}`);
  return response.json();
}

function showViewer(viewer) {
  const who = viewer.principal ? `${viewer.role} ${viewer.principal}` : "operator (local)";
  document.getElementById("whoami").textContent = who;
  document.getElementById("whoami").dataset.role = viewer.role;
  document.getElementById("whoami").dataset.principal = viewer.principal;
  document.getElementById("logout").hidden = !viewer.principal;
}

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function renderOverview(data) {
  showViewer(data.viewer);
  const states = Object.entries(data.nodes_by_state).map(([k, v]) => `${v} ${k.toLowerCase()}`);
  document.getElementById("summary").textContent =
    `${data.nodes.length} nodes (${states.join(", ") || "none"}), ` +
    `${fmtNum(data.samples_per_second)} samples/s (on jobs, else reference benchmark)`;
  replaceRows(document.querySelector("#nodes tbody"), data.nodes.map((n) => {
    const rep = n.reputation;
    const repText = rep.failed_total ? `fail ${rep.failed_total}, ok ${rep.verified_total}`
      : `${rep.verified_in_a_row} in a row`;
    const job = n.current_job && n.current_job !== "other"
      ? el("a", { href: "/jobs/" + n.current_job, text: n.current_job }) : (n.current_job || "-");
    return el("tr", { "data-node-id": n.node_id },
      el("td", { title: n.node_id, text: n.name || n.node_id }),
      el("td", {}, stateBadge(n.state)),
      el("td", { text: n.device || "-" }),
      el("td", { class: "num", text: fmtNum(n.samples_per_second) }),
      el("td", {}, job),
      el("td", { class: "num", text: n.price_micro_per_hour ? fmtCredits(n.price_micro_per_hour) : "donated" }),
      el("td", { text: repText }),
      el("td", { class: "num", text: String(n.strikes) }));
  }));
  replaceRows(document.querySelector("#jobs tbody"), data.jobs.map((j) => {
    const cost = j.spent_micro || j.budget_micro !== null ? fmtCredits(j.spent_micro) : "-";
    return el("tr", { "data-job-id": j.job_id },
      el("td", {}, el("a", { href: "/jobs/" + j.job_id, text: j.name || j.job_id })),
      el("td", {}, stateBadge(j.state)),
      el("td", { text: j.owner }),
      el("td", {}, bar(j.progress), " " + (j.progress * 100).toFixed(0) + "%"),
      el("td", { class: "num", text: fmtNum(j.last_loss, 4) }),
      el("td", { class: "num", text: fmtSeconds(j.eta_seconds) }),
      el("td", { class: "num", text: cost }),
      el("td", { class: "num", text: j.nodes_held === null ? "-" : String(j.nodes_held) }));
  }));
}

function drawChart(canvas, points, key, color) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 42;
  ctx.clearRect(0, 0, w, h);
  const values = points.map((p) => p[key]).filter((v) => v !== null && Number.isFinite(v));
  canvas.dataset.points = String(values.length);
  ctx.strokeStyle = "#dde2e6";
  ctx.strokeRect(pad, 8, w - pad - 8, h - pad);
  ctx.fillStyle = "#66707a";
  ctx.font = "11px system-ui, sans-serif";
  if (values.length === 0) {
    ctx.fillText("waiting for rounds…", pad + 10, h / 2);
    return;
  }
  let lo = Math.min(...values), hi = Math.max(...values);
  if (hi === lo) { hi += Math.abs(hi) * 0.05 || 1; lo -= Math.abs(lo) * 0.05 || 0; }
  const r0 = points[0].round, r1 = points[points.length - 1].round;
  const xs = (r) => pad + (r1 === r0 ? 0.5 : (r - r0) / (r1 - r0)) * (w - pad - 8);
  const ys = (v) => 8 + (1 - (v - lo) / (hi - lo)) * (h - pad);
  ctx.fillText(fmtNum(hi, 3), 2, 16);
  ctx.fillText(fmtNum(lo, 3), 2, h - pad + 8);
  ctx.fillText("round " + r0, pad, h - pad + 22);
  const label = "round " + r1;
  ctx.fillText(label, w - 8 - ctx.measureText(label).width, h - pad + 22);
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.6;
  ctx.beginPath();
  let started = false;
  for (const p of points) {
    const v = p[key];
    if (v === null || !Number.isFinite(v)) continue;
    if (started) ctx.lineTo(xs(p.round), ys(v)); else { ctx.moveTo(xs(p.round), ys(v)); started = true; }
  }
  ctx.stroke();
}

function renderJob(data) {
  showViewer(data.viewer);
  const j = data.job;
  document.getElementById("job-name").textContent = j.name || j.job_id;
  const badge = document.getElementById("job-state");
  badge.textContent = j.state;
  badge.className = "state " + j.state;
  const facts = [
    j.job_id, `owner ${j.owner}`, `epoch ${j.epoch + 1}/${j.epochs}`, `round ${j.round}`,
    `${j.samples_done}/${j.samples_total} samples`, `loss ${fmtNum(j.last_loss, 4)}`,
    `ETA ${fmtSeconds(j.eta_seconds)}`,
    `cost ${fmtCredits(j.spent_micro)}` + (j.escrow_micro ? ` (escrow ${fmtCredits(j.escrow_micro)})` : ""),
  ];
  if (j.message) facts.push(j.message);
  if (j.reason) facts.push(j.reason);
  document.getElementById("job-facts").textContent = facts.join(" · ");
  document.getElementById("job-progress").style.width = (j.progress * 100).toFixed(1) + "%";
  for (const p of data.points) {
    if (p.round > state.lastRound) { state.points.push(p); state.lastRound = p.round; }
  }
  if (state.points.length > 2000) state.points.splice(0, state.points.length - 2000);
  drawChart(document.getElementById("loss-chart"), state.points, "loss", "#2866c9");
  drawChart(document.getElementById("throughput-chart"), state.points, "samples_per_second", "#1d7a46");
  replaceRows(document.querySelector("#job-nodes tbody"), data.nodes.map((n) => {
    const total = n.compute_seconds + n.communicate_seconds;
    const split = el("span", { class: "split" });
    const compute = el("span", { class: "compute" });
    const communicate = el("span", { class: "communicate" });
    compute.style.width = total > 0 ? (n.compute_seconds / total) * 100 + "%" : "0";
    communicate.style.width = total > 0 ? (n.communicate_seconds / total) * 100 + "%" : "0";
    split.append(compute, communicate);
    const share = n.live ? n.live.share : n.share;
    return el("tr", { "data-node-id": n.node_id },
      el("td", { title: n.node_id, text: n.name || n.node_id }),
      el("td", { class: "num", text: (share * 100).toFixed(1) + "%" }),
      el("td", { class: "num", text: String(n.samples) }),
      el("td", { class: "num", text: n.compute_seconds.toFixed(2) }),
      el("td", { class: "num", text: n.communicate_seconds.toFixed(2) }),
      el("td", {}, split, total > 0 ? ` ${((n.compute_seconds / total) * 100).toFixed(0)}% computing` : ""),
      el("td", { class: "num", text: `${n.parts_applied} / ${n.parts_failed}` }));
  }));
}

function renderEvents(data) {
  const list = document.getElementById("events");
  for (const e of data.events) {
    const when = new Date(e.time_ms).toLocaleTimeString();
    const link = e.job_id ? el("a", { href: "/jobs/" + e.job_id, text: " " + e.job_id }) : "";
    list.prepend(el("li", { "data-event-id": String(e.id) },
      el("time", { text: when }), el("span", { class: "kind", text: e.kind }), e.message, link));
  }
  while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
  state.lastEvent = Math.max(state.lastEvent, data.last_id);
}

async function tick() {
  const status = document.getElementById("status");
  try {
    if (state.job) {
      renderJob(await getJSON(`/api/jobs/${encodeURIComponent(state.job)}?since_round=${state.lastRound}`));
    } else {
      renderOverview(await getJSON("/api/overview"));
    }
    renderEvents(await getJSON(`/api/events?since=${state.lastEvent}&limit=50`));
    state.failures = 0;
    status.textContent = "updated " + new Date().toLocaleTimeString();
    status.dataset.updatedMs = String(Date.now());
  } catch (error) {
    state.failures += 1;
    status.textContent = "coordinator unreachable, retrying (" + error.message + ")";
  }
  setTimeout(tick, POLL_MS);
}

function start() {
  const match = window.location.pathname.match(/^\/jobs\/([^/]+)$/);
  state.job = match ? decodeURIComponent(match[1]) : null;
  document.getElementById(state.job ? "job" : "overview").hidden = false;
  document.getElementById("logout").addEventListener("click", async () => {
    await fetch("/api/logout", { method: "POST", credentials: "same-origin" });
    window.location.replace("/login");
  });
  tick();
}

start();
