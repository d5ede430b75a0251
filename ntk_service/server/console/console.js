// The console's controller: who is calling (whoami), the tables, live job progress over the event stream, a
// finished job's detail with its spectrum and a corner of Θ, and the attribution section (attribution.js).

import * as api from "./api.js";
import * as attribution from "./attribution.js";
import * as fmt from "./format.js";
import { MODES } from "./modes.js";
import * as plots from "./plots.js";
import * as views from "./views.js";

// Browsers open about 6 HTTP/1.1 connections per server: at most 3 event streams, so the page's own requests
// always find a free one; other unfinished jobs are updated by the periodic refresh.
const MAX_STREAMS = 3;
const REFRESH_MS = 10_000;
// A kernel matrix up to this side gets its spectrum when the detail opens; a larger one only on request, since
// Lanczos reads the whole stored kernel (several passes) and holds a compute slot meanwhile.
const AUTO_SPECTRUM_SIDE = 4096;
const HEATMAP_SIDE = 48; // rows (and columns) of the drawn matrix at most: 48 examples of a trace kernel, 48/k of a full one

// The modes whose kernel is a matrix (a spectrum and a heatmap are defined for them), and the outputs per example
// row of such a matrix: k where each entry is a k × k block, else 1.
const MATRIX_MODES = Object.keys(MODES).filter((name) => MODES[name].matrix);
const isMatrix = (job) => MODES[job.mode]?.matrix === true;
const outputsPerRow = (job) => (MODES[job.mode].outputs === "all" ? job.result_shape[job.result_shape.length - 1] : 1);

const state = {
  access: { scope: null, open: false, canWrite: false, keyId: null },
  jobs: new Map(),
  watchers: new Map(),
  detail: null,
  urls: [],
  names: new Map(), // data set id -> name, for the jobs' Rows column
  unwatchable: new Set(), // jobs whose stream answered a final error (deleted, ...): followed by the refresh only
};

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const handlers = { details: showDetail, cancel: cancelJob, remove: deleteJob, download: downloadResult };

let messageTimer = null;

function showMessage(text, kind = "error") {
  const box = $("message");
  clearTimeout(messageTimer);
  if (kind === "info" && text) messageTimer = setTimeout(() => (box.hidden = true), 8000); // errors stay
  delete box.dataset.what;
  box.textContent = text;
  box.className = `message message-${kind}`;
  box.setAttribute("role", kind === "error" ? "alert" : "status");
  box.hidden = !text;
}

function explain(error, what) {
  if (error instanceof api.ApiError && error.status === 401) {
    askForKey(api.getKey() ? `The key was refused: ${error.message}` : "This server needs an API key.");
  } else if (error instanceof api.ApiError && error.status === 403) {
    showMessage(`${what}: refused, this key may only read (${error.message})`);
  } else {
    showMessage(`${what}: ${error.message}`);
  }
}

function askForKey(hint) {
  state.access = { scope: null, open: false, canWrite: false, keyId: null };
  renderAccess();
  $("key-hint").textContent = hint;
  $("key-form").hidden = false;
  $("key-input").focus();
}

function renderAccess() {
  const { scope, open, keyId } = state.access;
  let text = "no access: enter a key";
  if (open) text = "open server (no keys configured): full access";
  else if (scope === "write") text = `write key ${keyId}: full access`;
  else if (scope === "read") text = `read key ${keyId}: viewing only, cancel and delete are disabled`;
  $("access-status").textContent = text;
  $("access-status").dataset.scope = open ? "open" : scope || "none";
  $("key-change").textContent = api.getKey() ? "Change key" : "Enter key";
  $("key-forget").hidden = !api.getKey();
}

async function checkAccess() {
  try {
    const who = await api.getJson("v1/whoami");
    state.access = { scope: who.scope, open: who.open, canWrite: who.scope === "write", keyId: who.key_id };
    renderAccess();
    return true;
  } catch (error) {
    explain(error, "checking access");
    return false;
  }
}

async function loadInfo() {
  const info = await api.getJson("v1/info");
  $("server-info").textContent = `v${info.version} · torch ${info.torch} · ${info.device} · ${info.executor} executor`;
}

async function loadModels() {
  const models = (await api.getJson("v1/models")).data;
  const versions = new Map(
    await Promise.all(
      models.map(async (m) => [m.name, (await api.getJson(`v1/models/${encodeURIComponent(m.name)}/versions`)).data]),
    ),
  );
  const total = [...versions.values()].reduce((n, v) => n + v.length, 0);
  $("models-count").textContent = `${models.length} model(s), ${total} version(s)`;
  $("models-body").replaceChildren(views.modelsTable(models, versions));
}

async function loadDatasets() {
  const datasets = (await api.getJson("v1/datasets")).data;
  state.names = new Map(datasets.filter((d) => d.name).map((d) => [d.id, d.name]));
  $("datasets-count").textContent = `${datasets.length} data set(s)`;
  $("datasets-body").replaceChildren(views.datasetsTable(datasets));
}

function context() {
  return { access: state.access, handlers, names: state.names };
}

function countJobs() {
  const all = [...state.jobs.values()];
  const active = all.filter((j) => !views.FINISHED.has(j.status)).length;
  $("jobs-count").textContent = `${all.length} job(s), ${active} queued or running`;
}

// The results' share of the disk, as the server counts it (every stored result, solve and features jobs' too):
// three gauges of GET /metrics (no key needed). A page that cannot read them says nothing about the disk.
async function loadDisk() {
  let text;
  try {
    text = await (await api.request("GET", "metrics", { accept: "text/plain" })).text();
  } catch {
    $("jobs-disk").textContent = "";
    return;
  }
  const gauge = (name) => {
    const match = text.match(new RegExp(`^${name} ([0-9.e+-]+)$`, "m"));
    return match ? Number(match[1]) : null;
  };
  const used = gauge("ntk_job_results_bytes");
  const budget = gauge("ntk_job_disk_budget_bytes");
  const available = gauge("ntk_job_disk_available_bytes");
  if (used === null) return;
  const node = $("jobs-disk");
  if (budget !== null && budget >= 0) {
    const share = budget > 0 ? ` (${Math.round((100 * used) / budget)} %)` : "";
    node.textContent = `disk: ${fmt.bytes(used)} of the ${fmt.bytes(budget)} budget${share}`;
    node.dataset.budget = String(budget);
  } else {
    const left = available === null ? "" : `, ${fmt.bytes(available)} more may be used`;
    node.textContent = `disk: ${fmt.bytes(used)} of results, no budget (90 % of the free space)${left}`;
    delete node.dataset.budget;
  }
  node.dataset.used = String(used);
}

async function loadJobs() {
  loadDisk();
  const jobs = (await api.getJson("v1/jobs")).data;
  const sameRows = jobs.length === state.jobs.size && jobs.every((j) => state.jobs.has(j.id));
  if (sameRows && document.querySelector("#jobs-body tbody")) {
    jobs.forEach(updateJob); // only changed rows are rebuilt: focus and a half-confirmed delete survive
  } else {
    state.jobs = new Map(jobs.map((j) => [j.id, j]));
    $("jobs-body").replaceChildren(views.jobsTable(jobs, context()));
  }
  countJobs();
  watchUnfinished();
}

function updateJob(job) {
  const before = state.jobs.get(job.id);
  state.jobs.set(job.id, job);
  const row = document.querySelector(`tr[data-job="${CSS.escape(job.id)}"]`);
  const changed =
    !before || before.status !== job.status || before.tiles_done !== job.tiles_done || before.eta_s !== job.eta_s;
  if (row && changed) {
    const focused = row.contains(document.activeElement) ? document.activeElement.dataset.action : null;
    const fresh = views.jobRow(job, context());
    row.replaceWith(fresh);
    if (focused) fresh.querySelector(`[data-action="${focused}"]`)?.focus();
  }
  countJobs();
  if (state.detail === job.id && changed) renderDetail(job);
}

function watchUnfinished() {
  if (!state.access.scope) return; // no valid key: the prompt is up, nothing to stream
  for (const job of state.jobs.values()) {
    if (state.watchers.size >= MAX_STREAMS) break;
    const watchable = !views.FINISHED.has(job.status) && !state.unwatchable.has(job.id);
    if (watchable && !state.watchers.has(job.id)) watch(job.id);
  }
}

async function watch(id) {
  const controller = new AbortController();
  state.watchers.set(id, controller);
  try {
    for (let attempt = 0; ; attempt++) {
      try {
        for await (const { event, data } of api.events(`v1/jobs/${encodeURIComponent(id)}/events`, controller.signal)) {
          attempt = 0;
          updateJob(data);
          if (event === "end") return;
        }
      } catch (error) {
        if (controller.signal.aborted) return;
        if (error instanceof api.ApiError && ![429, 503].includes(error.status)) {
          // 401: the key went (the prompt stops all streams); 404: the job was deleted; others: not retried
          state.unwatchable.add(id);
          if (error.status === 401) explain(error, "watching a job");
          return;
        }
      }
      // the stream ended before the job did (a restart, a proxy's timeout): reconnect, backing off
      await sleep(Math.min(10_000, 500 * 2 ** attempt));
    }
  } finally {
    state.watchers.delete(id);
    if (!controller.signal.aborted) watchUnfinished(); // an abort comes with a reload that restarts the streams
  }
}

function revokeUrls() {
  state.urls.forEach((url) => URL.revokeObjectURL(url));
  state.urls = [];
}

function showDetail(id) {
  const job = state.jobs.get(id);
  if (!job) return;
  state.detail = id;
  $("job-detail").hidden = false;
  renderDetail(job);
  $("job-detail").scrollIntoView({ block: "start" });
  $("job-detail-title").focus();
}

function closeDetail() {
  const id = state.detail;
  state.detail = null;
  revokeUrls();
  $("job-detail").hidden = true;
  if (id) document.querySelector(`tr[data-job="${CSS.escape(id)}"] [data-action="details"]`)?.focus();
}

function renderDetail(job) {
  revokeUrls();
  $("job-detail-title").textContent = `Job ${job.id}`;
  $("job-detail-body").replaceChildren(...views.jobDetail(job, context()));
  if (job.status === "succeeded" && !job.result_deleted_at) {
    drawSpectrum(job);
    drawHeatmap(job);
    showCheckpoints(job);
  }
}

// The other versions' kernels over the same rows: succeeded jobs of the same model, mode, rows and shape.
function comparable(job) {
  const same = (a, b) => (!a && !b) || (a && b && a.dataset === b.dataset && a.start === b.start && a.stop === b.stop);
  return [...state.jobs.values()]
    .filter(
      (o) =>
        o.id !== job.id &&
        o.model === job.model &&
        o.status === "succeeded" &&
        !o.result_deleted_at &&
        o.mode === job.mode &&
        o.output === job.output &&
        same(o.x1, job.x1) &&
        same(o.x2, job.x2) &&
        o.result_shape.join() === job.result_shape.join(),
    )
    .sort((a, b) => a.version - b.version || a.created_at.localeCompare(b.created_at));
}

function showCheckpoints(job) {
  const rows = comparable(job).map((other) => ({ job: other, result: null, error: null }));
  const render = () => state.detail === job.id && views.checkpoints(job, rows, compare);
  const compare = async (other) => {
    const row = rows.find((r) => r.job.id === other.id);
    try {
      row.result = await api.postJson(`v1/jobs/${encodeURIComponent(job.id)}/distance`, { other: other.id });
    } catch (error) {
      row.error = `distance: ${error.message}`;
    }
    render();
  };
  render();
  // small kernels are compared at once (a few streamed passes); large ones wait for the button
  const entries = job.result_shape.reduce((a, b) => a * b, 1);
  if (entries <= AUTO_SPECTRUM_SIDE * AUTO_SPECTRUM_SIDE) rows.slice(0, 3).forEach((r) => compare(r.job));
}

function publish(id, job, blob, alt, caption) {
  if (state.detail !== job.id) return; // another job was opened meanwhile
  const url = URL.createObjectURL(blob);
  state.urls.push(url);
  views.figure(id, url, alt, caption);
}

function drawSpectrum(job) {
  if (!isMatrix(job)) {
    views.figureError("spectrum-figure", `A spectrum needs a ${MATRIX_MODES.join(" or ")} kernel; this job stored ${job.mode}.`);
    return;
  }
  const side = job.result_shape[0] * outputsPerRow(job);
  if (side <= AUTO_SPECTRUM_SIDE) {
    computeSpectrum(job);
    return;
  }
  const text = `Compute the spectrum (top 20 of the ${side} × ${side} kernel: reads the whole stored kernel)`;
  views.figureAction("spectrum-figure", text, () => computeSpectrum(job));
}

async function computeSpectrum(job) {
  const side = job.result_shape[0] * outputsPerRow(job);
  const what = `computing the top 20 eigenvalues of the ${side} × ${side} kernel (Lanczos, reading the stored kernel)`;
  const started = Date.now();
  views.figureProgress("spectrum-figure", what, started);
  const ticker = setInterval(() => views.figureProgress("spectrum-figure", what, started), 1000);
  try {
    const s = await api.postJson(`v1/jobs/${encodeURIComponent(job.id)}/spectrum`, { top: 20 });
    clearInterval(ticker);
    const values = s.eigenvalues.data;
    const blob = await plots.spectrum(values, `spectrum of Θ (${s.method}, ${values.length} of ${s.n} eigenvalues)`);
    const condition = s.condition_number === null ? "" : `, condition number ${s.condition_number.toPrecision(3)}`;
    const alt = `Eigenvalues of the kernel of job ${job.id}, descending, log scale`;
    const caption = `Top eigenvalues of Θ: λ_max = ${s.lambda_max.toPrecision(4)}${condition}.`;
    const took = ` Computed in ${((Date.now() - started) / 1000).toFixed(1)} s.`;
    publish("spectrum-figure", job, blob, alt, caption + took);
  } catch (error) {
    views.figureError("spectrum-figure", `spectrum: ${error.message}`);
  } finally {
    clearInterval(ticker);
  }
}

async function drawHeatmap(job) {
  if (!isMatrix(job)) {
    views.figureError("heatmap-figure", `A heatmap needs a ${MATRIX_MODES.join(" or ")} kernel; this job stored ${job.mode}.`);
    return;
  }
  const [n, m] = job.result_shape;
  const k = outputsPerRow(job);
  const rows = Math.min(n, Math.max(1, Math.floor(HEATMAP_SIDE / k)));
  const cols = Math.min(m, Math.max(1, Math.floor(HEATMAP_SIDE / k)));
  try {
    const response = await api.request("GET", `v1/jobs/${encodeURIComponent(job.id)}/result?rows=0:${rows}&cols=0:${cols}`);
    const theta = (await response.json()).theta;
    const drawn = await plots.heatmap(theta, `Θ[0:${rows}, 0:${cols}]`);
    const layout = k > 1 ? `, drawn as the (${rows}·${k}) × (${cols}·${k}) matrix with row n·k + a` : "";
    const alt = `Heatmap of the corner rows 0 to ${rows}, columns 0 to ${cols} of Θ`;
    const colours =
      drawn.kind === "sequential"
        ? `every entry ≥ 0: viridis from ${drawn.low.toPrecision(3)} (dark) to ${drawn.high.toPrecision(3)} (light)`
        : "entries of both signs: blue negative, red positive, centred on 0";
    const caption = `The corner [0:${rows}, 0:${cols}] of the ${n} × ${m} kernel${layout}; ${colours}.`;
    publish("heatmap-figure", job, drawn.blob, alt, caption);
    document.getElementById("heatmap-figure")?.setAttribute("data-colours", drawn.kind);
  } catch (error) {
    views.figureError("heatmap-figure", `heatmap: ${error.message}`);
  }
}

async function cancelJob(id) {
  try {
    updateJob(await api.remove(`v1/jobs/${encodeURIComponent(id)}?cancel_only=true`));
    showMessage(`Job ${id}: cancel requested (running tiles finish first).`, "info");
  } catch (error) {
    explain(error, `cancel job ${id}`);
  }
}

async function deleteJob(id) {
  try {
    const deleted = await api.remove(`v1/jobs/${encodeURIComponent(id)}`);
    if (state.detail === id) closeDetail();
    showMessage(`Job ${id}: deleted, ${fmt.bytes(deleted.freed_bytes)} freed.`, "info");
    await loadJobs();
  } catch (error) {
    explain(error, `delete job ${id}`);
  }
}

async function downloadResult(job, kind) {
  const media = kind === "npy" ? "application/x-npy" : "application/x-safetensors";
  try {
    showMessage(`Downloading the result of job ${job.id}…`, "info");
    const size = await api.download(`v1/jobs/${encodeURIComponent(job.id)}/result`, media, `${job.id}.${kind}`);
    showMessage(`Downloaded ${job.id}.${kind} (${fmt.bytes(size)}).`, "info");
  } catch (error) {
    explain(error, `download job ${job.id}`);
  }
}

async function loadAll() {
  showMessage("");
  if (!(await checkAccess())) return;
  $("key-form").hidden = true;
  // data sets before jobs: the jobs table names their data sets
  const results = await Promise.allSettled([
    loadInfo(),
    loadModels(),
    loadDatasets().finally(loadJobs),
    attribution.load({ access: state.access, showMessage, explain }),
  ]);
  const failed = results.find((r) => r.status === "rejected");
  if (failed) explain(failed.reason, "loading");
  document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
}

// The periodic refresh: its failure (the server restarting) is shown until a later refresh succeeds.
async function refresh() {
  if (document.hidden || !state.access.scope) return;
  const what = "refreshing jobs";
  try {
    await Promise.all([loadJobs(), attribution.load({ access: state.access, showMessage, explain })]);
    if ($("message").dataset.what === what) showMessage("");
  } catch (error) {
    explain(error, what);
    $("message").dataset.what = what;
  }
}

function stopWatching() {
  state.watchers.forEach((controller) => controller.abort());
  state.unwatchable.clear(); // a new key may see them
}

function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    $("key-input").value = "";
    if (!key) return;
    api.setKey(key);
    stopWatching();
    loadAll();
  });
  $("key-cancel").addEventListener("click", () => ($("key-form").hidden = true));
  $("key-change").addEventListener("click", () => askForKey("Enter an API key from the operator."));
  $("key-forget").addEventListener("click", () => {
    api.clearKey();
    stopWatching();
    loadAll();
  });
  $("refresh").addEventListener("click", loadAll);
  $("job-detail-close").addEventListener("click", closeDetail);
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape") return;
    if (!$("key-form").hidden) $("key-form").hidden = true;
    else if (state.detail) closeDetail();
  });
  attribution.start();
  setInterval(refresh, REFRESH_MS);
  loadAll();
}

start();
