// The attribution section: the attribution jobs and the stored training sides (features jobs), and a job's
// explorer: pick a test example and see its top training examples, proponents and opponents, with their scores,
// drawn as images when one input is image-shaped (64 = 8 × 8, 784 = 28 × 28, (C, H, W), ...).

import * as api from "./api.js";
import * as fmt from "./format.js";
import { el, FINISHED } from "./views.js";

const POLL_MS = 2000; // unfinished jobs are polled (no event stream: the kernel jobs keep the browser's few connections)
const PIXELS = 84; // an image's side on screen, in CSS pixels (8 × 8 digits at 10.5 px per pixel)

const state = { jobs: [], features: [], open: null, index: 0, urls: [], timer: null, ctx: null };

const $ = (id) => document.getElementById(id);

// ---- image-shaped inputs ----

// [channels, height, width, layout] of one input's shape when it looks like an image, else null: a perfect square
// (64 = 8 × 8, 784 = 28 × 28), 3 × a square (CIFAR's 3072), (H, W), (C, H, W) or (H, W, C) with 1 or 3 channels.
export function imageShape(shape) {
  if (!Array.isArray(shape)) return null;
  if (shape.length === 1) {
    const side = Math.round(Math.sqrt(shape[0]));
    if (side >= 4 && side * side === shape[0]) return [1, side, side, "chw"];
    const rgb = Math.round(Math.sqrt(shape[0] / 3));
    if (rgb >= 4 && 3 * rgb * rgb === shape[0]) return [3, rgb, rgb, "chw"];
    return null;
  }
  if (shape.length === 2 && Math.min(...shape) >= 4) return [1, shape[0], shape[1], "chw"];
  if (shape.length === 3) {
    const [a, b, c] = shape;
    if ((a === 1 || a === 3) && Math.min(b, c) >= 4) return [a, b, c, "chw"];
    if ((c === 1 || c === 3) && Math.min(a, b) >= 4) return [c, a, b, "hwc"];
  }
  return null;
}

// An input drawn on a canvas (grey levels, or RGB; scaled to its own range) and handed back as a PNG blob.
export function drawImage(tensor, image) {
  const [channels, height, width, layout] = image;
  const data = tensor.data;
  let low = Infinity;
  let high = -Infinity;
  for (const v of data) {
    low = Math.min(low, v);
    high = Math.max(high, v);
  }
  const span = high - low || 1;
  const small = document.createElement("canvas");
  small.width = width;
  small.height = height;
  const ctx = small.getContext("2d");
  const pixels = ctx.createImageData(width, height);
  const at = (c, y, x) => (layout === "chw" ? data[(c * height + y) * width + x] : data[(y * width + x) * channels + c]);
  for (let y = 0; y < height; y++) {
    for (let x = 0; x < width; x++) {
      const o = 4 * (y * width + x);
      for (let c = 0; c < 3; c++) pixels.data[o + c] = Math.round((255 * (at(channels === 3 ? c : 0, y, x) - low)) / span);
      pixels.data[o + 3] = 255;
    }
  }
  ctx.putImageData(pixels, 0, 0);
  const big = document.createElement("canvas");
  const scale = Math.max(1, Math.floor(PIXELS / Math.max(width, height)));
  big.width = width * scale;
  big.height = height * scale;
  const out = big.getContext("2d");
  out.imageSmoothingEnabled = false; // pixels stay pixels
  out.drawImage(small, 0, 0, big.width, big.height);
  return new Promise((resolve, reject) =>
    big.toBlob((blob) => (blob ? resolve(blob) : reject(new Error("the browser could not draw the image"))), "image/png"),
  );
}

function numbers(tensor) {
  const shown = tensor.data.slice(0, 8).map((v) => (Number.isInteger(v) ? String(v) : v.toPrecision(3)));
  return `${fmt.shape(tensor.shape)}: [${shown.join(", ")}${tensor.data.length > 8 ? ", …" : ""}]`;
}

// ---- the tables ----

function unix(t) {
  return t ? fmt.when(t * 1000) : "—";
}

function progressText(job) {
  const p = job.progress;
  if (!p) return job.status;
  if (job.job === "attribution-features") return `${p.rows_done} / ${p.rows_total} rows`;
  return `${p.stage}: ${p.units_done} / ${p.units_total} units`;
}

// D of the checkpoints' sketches (one number when they share it); nothing for exact features (D is each rank).
function dims(spec) {
  if (spec.feature_kind === "exact") return "";
  return ` D=${[...new Set(spec.dims)].join("/")}`;
}

function checkpoints(spec) {
  return spec.models.map((model, c) => `${model} v${spec.versions[c]}`).join(", ");
}

function jobActions(job, kind) {
  const { access } = state.ctx;
  const denied = access.canWrite ? null : "needs a write key";
  const short = fmt.shortId(job.id);
  const route = kind === "attribution" ? "v1/attribution-jobs" : "v1/attribution-features";
  const buttons = [];
  if (kind === "attribution" && job.status === "succeeded" && job.spec.top_k > 0) {
    buttons.push(
      el("button", { type: "button", "data-action": "explore", "aria-label": `Explore (job ${short})`, onclick: () => explore(job.id) }, "Explore"),
    );
  }
  const act = async (method, verb) => {
    try {
      await api.remove(`${route}/${encodeURIComponent(job.id)}${method === "cancel" ? "?cancel_only=true" : ""}`);
      if (state.open === job.id && method === "delete") close();
      state.ctx.showMessage(`${kind === "attribution" ? "Attribution" : "Features"} job ${job.id}: ${verb}.`, "info");
      await load(state.ctx);
    } catch (error) {
      state.ctx.explain(error, `${method} job ${job.id}`);
    }
  };
  if (!FINISHED.has(job.status)) {
    buttons.push(el("button", { type: "button", "data-action": "cancel", disabled: !access.canWrite, title: denied,
      "aria-label": `Cancel (job ${short})`, onclick: () => act("cancel", "cancel requested") }, "Cancel"));
  } else {
    buttons.push(el("button", { type: "button", "data-action": "delete", class: "danger", disabled: !access.canWrite,
      title: denied, "aria-label": `Delete (job ${short})`, onclick: () => act("delete", "deleted") }, "Delete"));
  }
  return buttons;
}

function status(job) {
  return [
    el("span", { class: `status status-${job.status}` }, job.status),
    job.error ? el("div", { class: "error-text" }, job.error) : null,
  ];
}

function jobsTable(jobs) {
  if (!jobs.length) return el("p", { class: "muted empty" }, "No attribution jobs yet (POST /v1/attribution-jobs, or ntk-service attribution run).");
  const rows = jobs.map((job) => {
    const s = job.spec;
    const answers = job.result ? job.result.answers.join(", ") : [s.top_k ? `top ${s.top_k}` : null, s.store_scores ? "scores" : null, s.total_influence ? "total" : null, s.self_influence ? "self" : null].filter(Boolean).join(", ");
    return el(
      "tr",
      { "data-attribution": job.id, "data-status": job.status },
      el("th", { scope: "row" }, el("code", { title: job.id }, fmt.shortId(job.id))),
      el("td", {}, checkpoints(s)),
      el("td", { class: "num" }, `${s.n} × ${s.m}`),
      el("td", {}, `${s.loss} / ${s.feature_kind}${dims(s)} / ridge ${s.ridge}`),
      el("td", { class: "status-cell" }, status(job)),
      el("td", { class: "progress-cell" }, progressText(job)),
      el("td", {}, answers),
      el("td", { class: "when" }, unix(job.created_at)),
      el("td", { class: "actions" }, jobActions(job, "attribution")),
    );
  });
  return el(
    "table",
    {},
    el("caption", { class: "visually-hidden" }, "Attribution jobs, newest first"),
    el("thead", {}, el("tr", {}, ["Job", "Checkpoints", "Train × test", "Loss / features / ridge", "Status", "Progress", "Answers", "Submitted", "Actions"].map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows),
  );
}

function featuresTable(jobs) {
  if (!jobs.length) return el("p", { class: "muted empty" }, "No training sides stored yet (POST /v1/attribution-features).");
  const rows = jobs.map((job) => {
    const s = job.spec;
    return el(
      "tr",
      { "data-features": job.id, "data-status": job.status },
      el("th", { scope: "row" }, el("code", { title: job.id }, fmt.shortId(job.id))),
      el("td", {}, `${s.model} v${s.version}`),
      el("td", { class: "num" }, String(s.n)),
      el("td", {}, `${s.loss} / ${s.features}${s.features === "exact" ? "" : ` D=${s.dim} seed ${s.seed}`}`),
      el("td", { class: "status-cell" }, status(job)),
      el("td", { class: "progress-cell" }, progressText(job)),
      el("td", { class: "when" }, unix(job.created_at)),
      el("td", { class: "actions" }, jobActions(job, "features")),
    );
  });
  return el(
    "table",
    {},
    el("caption", { class: "visually-hidden" }, "Stored training sides (attribution features jobs), newest first"),
    el("thead", {}, el("tr", {}, ["Features job", "Checkpoint", "N", "Loss / features", "Status", "Progress", "Submitted", "Actions"].map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows),
  );
}

// ctx: {access, showMessage, explain} from the console's controller
export async function load(ctx) {
  state.ctx = ctx;
  const [jobs, features] = await Promise.all([api.getJson("v1/attribution-jobs"), api.getJson("v1/attribution-features")]);
  state.jobs = jobs.data;
  state.features = features.data;
  $("attribution-count").textContent = `${state.jobs.length} attribution job(s), ${state.features.length} stored training side(s)`;
  $("attribution-body").replaceChildren(jobsTable(state.jobs));
  $("attribution-features-body").replaceChildren(featuresTable(state.features));
  clearTimeout(state.timer);
  const unfinished = [...state.jobs, ...state.features].some((j) => !FINISHED.has(j.status));
  if (unfinished) state.timer = setTimeout(() => load(ctx).catch((error) => ctx.explain(error, "refreshing attribution")), POLL_MS);
}

// ---- the explorer ----

function revoke() {
  state.urls.forEach((url) => URL.revokeObjectURL(url));
  state.urls = [];
}

function close() {
  const id = state.open;
  state.open = null;
  revoke();
  $("attribution-detail").hidden = true;
  if (id) document.querySelector(`tr[data-attribution="${CSS.escape(id)}"] [data-action="explore"]`)?.focus();
}

function explore(id) {
  const job = state.jobs.find((j) => j.id === id);
  if (!job) return;
  state.open = id;
  state.index = 0;
  const s = job.spec;
  $("attribution-detail").hidden = false;
  $("attribution-detail-title").textContent = `Attribution job ${id}`;
  const picker = el("input", { id: "attribution-index", type: "number", min: 0, max: s.m - 1, value: 0, inputmode: "numeric" });
  const go = (delta) => {
    const next = Math.min(s.m - 1, Math.max(0, Number(picker.value || 0) + delta));
    picker.value = String(next);
    showExample(job, next);
  };
  picker.addEventListener("change", () => go(0));
  const facts = el(
    "p",
    { class: "muted" },
    `${checkpoints(s)}: ${s.n} training and ${s.m} test examples, ${s.loss}, ${s.feature_kind}${dims(s)}, ridge ${s.ridge}, ensemble ${s.ensemble}. `,
    "A proponent's training raised this test example's ",
    s.loss === "cross_entropy" ? "margin at its label" : "fit (lowered its squared error)",
    "; an opponent's lowered it. Scores are τ(x*, x_n), TRAK's first-order estimate.",
  );
  const controls = el(
    "div",
    { class: "example-picker" },
    el("label", { for: "attribution-index" }, `Test example (0 to ${s.m - 1}) `),
    picker,
    el("button", { type: "button", "data-action": "previous", onclick: () => go(-1) }, "Previous"),
    el("button", { type: "button", "data-action": "next", onclick: () => go(1) }, "Next"),
  );
  $("attribution-detail-body").replaceChildren(facts, controls, el("div", { id: "attribution-example", "aria-live": "polite" }));
  $("attribution-detail").scrollIntoView({ block: "start" });
  $("attribution-detail-title").focus();
  showExample(job, 0);
}

async function picture(input, shape, alt) {
  const tensor = input && input.data ? input : null;
  const image = tensor ? imageShape(shape) : null;
  if (!image) {
    const text = tensor ? numbers(tensor) : Object.entries(input).map(([name, t]) => `${name} ${numbers(t)}`).join("; ");
    return el("code", { class: "example-values" }, text);
  }
  const url = URL.createObjectURL(await drawImage(tensor, image));
  state.urls.push(url);
  return el("img", { src: url, alt, class: "example-image" });
}

function label(value) {
  if (value === null || value === undefined) return "no label";
  return `label ${Array.isArray(value) ? fmt.shape(value.map((v) => Number(v).toPrecision(3))) : value}`;
}

async function card(item, shape, kind, largest) {
  const width = largest > 0 ? Math.max(2, Math.round((100 * Math.abs(item.score)) / largest)) : 0;
  const alt = `training example ${item.index}, ${label(item.label)}, score ${item.score.toPrecision(3)}`;
  const bar = el("span", { class: `score-bar score-${kind}` });
  bar.style.width = `${width}%`; // through the CSSOM: the page's policy allows no inline style attribute
  return el(
    "figure",
    { class: `example-card example-${kind}`, "data-index": item.index, "data-score": item.score },
    await picture(item.input, shape, alt),
    el(
      "figcaption",
      {},
      el("span", { class: "score" }, `${item.score >= 0 ? "+" : ""}${item.score.toPrecision(3)}`),
      el("span", { class: "score-track" }, bar),
      el("span", {}, `train #${item.index}`),
      el("span", { class: "muted" }, label(item.label)),
    ),
  );
}

async function showExample(job, index) {
  state.index = index;
  const target = $("attribution-example");
  target.replaceChildren(el("p", { class: "muted", role: "status" }, `loading test example ${index}…`));
  let example;
  try {
    example = await api.getJson(`v1/attribution-jobs/${encodeURIComponent(job.id)}/examples/${index}`);
  } catch (error) {
    target.replaceChildren(el("p", { class: "error-text" }, `example ${index}: ${error.message}`));
    return;
  }
  if (state.open !== job.id || state.index !== index) return; // another job or example was picked meanwhile
  revoke();
  const shape = example.example_shape;
  const largest = Math.max(...[...example.proponents, ...example.opponents].map((e) => Math.abs(e.score)), 0);
  const side = async (items, kind, title, note) =>
    el(
      "section",
      { class: "example-side", "data-side": kind, "aria-label": title },
      el("h3", {}, title, el("span", { class: "muted" }, ` ${note}`)),
      el("div", { class: "example-grid" }, await Promise.all(items.map((item) => card(item, shape, kind, largest)))),
    );
  // without test labels a cross-entropy job measures the margin of the predicted class (the server's rule)
  const unlabelled = job.spec.loss === "cross_entropy" ? "no label: its predicted class" : "no label";
  const testLabel = example.test.label === null ? unlabelled : label(example.test.label);
  const test = el(
    "figure",
    { class: "example-card example-test", "data-index": index },
    await picture(example.test.input, shape, `test example ${index}, ${testLabel}`),
    el("figcaption", {}, el("strong", {}, `test #${index}`), el("span", {}, testLabel)),
  );
  const drawn = imageShape(shape) ? `drawn as ${imageShape(shape).slice(0, 3).join(" × ")} images` : "inputs shown as values";
  target.replaceChildren(
    el("div", { class: "example-row" }, test, el("p", { class: "muted" }, `One input: ${fmt.shape(Array.isArray(shape) ? shape : Object.keys(shape))}, ${drawn}.`)),
    await side(example.proponents, "proponents", "Proponents", "(largest scores first)"),
    await side(example.opponents, "opponents", "Opponents", "(most negative first)"),
  );
  target.dataset.shown = String(index);
}

export function start() {
  $("attribution-detail-close").addEventListener("click", close);
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.open && $("key-form").hidden) close();
  });
}
