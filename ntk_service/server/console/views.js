// DOM builders for the three tables and a job's detail. Everything the server sends is set as text
// (textContent), never parsed as HTML: model names, labels and error messages are other people's input.

import * as fmt from "./format.js";
import { MODES } from "./modes.js";

export const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === false || value === null || value === undefined) continue;
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(caption, headings, rows) {
  return el(
    "table",
    {},
    el("caption", { class: "visually-hidden" }, caption),
    el("thead", {}, el("tr", {}, headings.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows),
  );
}

function empty(text) {
  return el("p", { class: "muted empty" }, text);
}

function version(record) {
  const origin = record.seed === null || record.seed === undefined ? "uploaded weights" : `seed ${record.seed}`;
  return el(
    "li",
    { "data-version": record.version },
    el("strong", {}, `v${record.version}`),
    record.label ? el("span", { class: "label" }, record.label) : null,
    el("span", { class: "muted" }, ` ${origin} · ${fmt.when(record.created_at)}`),
  );
}

// A parameter: its name and shape, then whatever else the record says of it (e.g. the kernel path it takes).
function parameter(p) {
  const extra = Object.entries(p)
    .filter(([k, v]) => k !== "name" && k !== "shape" && v !== null && v !== undefined && typeof v !== "object")
    .map(([k, v]) => `${k} ${v}`);
  return el(
    "li",
    {},
    el("code", {}, p.name),
    ` ${fmt.shape(p.shape)}`,
    extra.length ? el("span", { class: "muted" }, ` · ${extra.join(" · ")}`) : null,
  );
}

function architectureCell(m) {
  const arch = m.architecture;
  const cells = [el("span", { title: arch.program_sha256 ? `program sha256 ${arch.program_sha256}` : null }, fmt.architecture(arch))];
  if (arch.family === "exported" && Array.isArray(arch.operators)) {
    const names = fmt.operatorSummary(arch).names;
    cells.push(
      el(
        "details",
        { class: "operators" },
        el("summary", {}, `${names.length} operators`),
        el("p", { class: "oplist" }, names.join(", ")),
      ),
    );
  }
  cells.push(
    el(
      "details",
      {},
      el("summary", {}, `${m.parameters.length} parameter tensors`),
      el("ul", { class: "params" }, m.parameters.map(parameter)),
    ),
  );
  return cells;
}

export function modelsTable(models, versions) {
  if (!models.length) return empty("No models registered yet (POST /v1/models, or client.register_module).");
  const rows = models.map((m) =>
    el(
      "tr",
      { "data-model": m.name },
      el("th", { scope: "row", class: "nowrap" }, m.name),
      el("td", {}, el("ul", { class: "versions" }, (versions.get(m.name) || [m]).map(version))),
      el("td", { class: "num" }, fmt.count(m.num_params)),
      el("td", { class: "inputs" }, fmt.inputs(m).map((text) => el("div", {}, text))),
      el("td", { class: "num" }, m.output_dim),
      el("td", { class: "arch" }, architectureCell(m), parameterPaths(m)),
    ),
  );
  return table("Registered models", ["Model", "Versions", "Parameters P", "Input", "Outputs k", "Architecture"], rows);
}

// What the kernel engine does with each parameter group (the record's parameter_paths, made at registration):
// structured (factored / J from its op's input and cotangents) or autograd (jacrev, an op without a rule), why,
// and what AUTO takes at the nominal size. Null for models registered before the report existed.
export function parameterPaths(model) {
  const paths = model.parameter_paths;
  if (!paths) return null;
  if (paths.error) {
    return el("details", { class: "paths" }, el("summary", {}, "Kernel paths: not available"), el("p", {}, paths.error));
  }
  const auto = paths.auto || {};
  const autograd = paths.jacrev_parameters
    ? ` · ${fmt.count(paths.jacrev_parameters)} by autograd`
    : " · all structured";
  const picked = auto.implementation ? `auto → ${auto.implementation} at N = ${auto.n}` : `auto: no plan fits at N = ${auto.n}`;
  const summary = `Kernel paths: ${picked}${autograd}`;
  const group = (g) =>
    el(
      "li",
      { "data-path": g.path },
      el("code", {}, g.group || "(root)"),
      ` ${g.parameters.join(", ")} `,
      el("strong", {}, g.form),
      ` (${g.ops.join(", ") || "no op"}): ${g.reason}`,
    );
  return el(
    "details",
    { class: "paths" },
    el("summary", {}, summary),
    el("p", { class: "muted" }, `capture: ${paths.capture}`),
    el("ul", { class: "params" }, (paths.groups || []).map(group)),
  );
}

export function datasetsTable(datasets) {
  if (!datasets.length) return empty("No data sets uploaded yet (POST /v1/datasets).");
  const rows = datasets.map((d) =>
    el(
      "tr",
      { "data-dataset": d.id },
      el("th", { scope: "row" }, el("code", {}, d.id)),
      el("td", {}, d.name || el("span", { class: "muted" }, "—")),
      el("td", {}, fmt.shape(d.shape)),
      el("td", {}, d.dtype),
      el("td", { class: "num" }, fmt.bytes(d.size_bytes)),
      el("td", { class: "when" }, fmt.when(d.created_at)),
    ),
  );
  return table("Data sets", ["Data set", "Name", "Shape", "dtype", "Size", "Uploaded"], rows);
}

function statusBadge(job) {
  return el("span", { class: `status status-${job.status}` }, job.status);
}

function progressCell(job) {
  return [
    el("progress", {
      max: Math.max(1, job.tiles_total),
      value: job.tiles_done,
      "aria-label": `progress of job ${job.id}`,
    }),
    el("span", { class: "tiles" }, ` ${job.tiles_done} / ${job.tiles_total} tiles`),
  ];
}

function actions(job, { access, handlers }) {
  const denied = access.canWrite ? null : "needs a write key";
  const short = fmt.shortId(job.id);
  const button = (action, text, extra = {}) =>
    el("button", { type: "button", "data-action": action, "aria-label": `${text} (job ${short})`, ...extra }, text);
  const buttons = [button("details", "Details", { onclick: () => handlers.details(job.id) })];
  if (!FINISHED.has(job.status)) {
    buttons.push(
      button("cancel", "Cancel", { disabled: !access.canWrite, title: denied, onclick: () => handlers.cancel(job.id) }),
    );
    return buttons;
  }
  const remove = button("delete", "Delete", { class: "danger", disabled: !access.canWrite, title: denied });
  // Two steps instead of window.confirm(): the same keys work, and nothing blocks the page.
  remove.addEventListener("click", () => {
    if (remove.dataset.armed) {
      handlers.remove(job.id);
      return;
    }
    remove.dataset.armed = "1";
    remove.textContent = "Confirm delete";
    remove.setAttribute("aria-label", `Confirm delete (job ${short})`);
    setTimeout(() => {
      delete remove.dataset.armed;
      remove.textContent = "Delete";
      remove.setAttribute("aria-label", `Delete (job ${short})`);
    }, 5000);
  });
  buttons.push(remove);
  return buttons;
}

// A side of a job by its data set's name (or a short id; the full id is the tooltip) and its rows.
function side(data, names) {
  const name = names.get(data.dataset) || fmt.shortId(data.dataset);
  return el("span", { title: data.dataset }, `${name} [${data.start}:${data.stop}]`);
}

// How long a job has run (or ran) and at what pace; the ETA while it runs.
export function timeCell(job) {
  const ran = fmt.seconds(job.started_at, FINISHED.has(job.status) ? job.finished_at : null);
  const pace = el("div", { class: "muted pace" }, fmt.rate(job.tiles_done, ran, "tiles"));
  if (FINISHED.has(job.status)) return [el("div", { class: "duration" }, fmt.elapsed(ran)), pace];
  if (job.status === "queued") return el("span", { class: "muted" }, "queued");
  return [el("div", { class: "eta" }, `ETA ${fmt.duration(job.eta_s)}`), el("div", { class: "muted" }, `${fmt.duration(ran)} so far`)];
}

// ctx: {access, handlers, names} (names: data set id -> name, for the Rows column)
export function jobRow(job, ctx) {
  const x2 = job.x2 ? [el("br"), "× ", side(job.x2, ctx.names)] : [el("span", { class: "muted" }, " (x2 = x1)")];
  return el(
    "tr",
    { "data-job": job.id, "data-status": job.status },
    el("th", { scope: "row" }, el("code", { title: job.id }, fmt.shortId(job.id))),
    el("td", { class: "nowrap" }, `${job.model} v${job.version}`),
    el("td", {}, side(job.x1, ctx.names), x2),
    el(
      "td",
      {},
      job.mode,
      job.output ? el("div", { class: "output" }, el("code", {}, `output=${job.output}`)) : null,
      el("div", { class: "muted" }, job.implementation_used.join(", ") || job.implementation),
    ),
    el("td", { class: "status-cell" }, statusBadge(job), job.error ? el("div", { class: "error-text" }, job.error) : null),
    el("td", { class: "progress-cell" }, progressCell(job)),
    el("td", { class: "time-cell num" }, timeCell(job)),
    el("td", { class: "size-cell num" }, job.result_deleted_at ? el("span", { class: "muted" }, "deleted") : fmt.bytes(job.estimate_bytes)),
    el("td", { class: "when" }, fmt.when(job.created_at)),
    el("td", { class: "actions" }, actions(job, ctx)),
  );
}

export function jobsTable(jobs, ctx) {
  if (!jobs.length) return empty("No jobs yet (POST /v1/jobs, or ntk-service jobs submit).");
  return table(
    "Batch jobs, newest first",
    ["Job", "Model", "Rows", "Mode", "Status", "Progress", "Time", "Result", "Submitted", "Actions"],
    jobs.map((job) => jobRow(job, ctx)),
  );
}

function named(data, names) {
  const name = names.get(data.dataset);
  return name ? `${name} (${fmt.rows(data)})` : fmt.rows(data);
}

function durationText(job) {
  const ran = fmt.seconds(job.started_at, FINISHED.has(job.status) ? job.finished_at : null);
  if (ran === null) return "not started";
  const [n, m] = job.result_shape;
  const entries = MODES[job.mode]?.pairs === false ? n : n * m; // a per-example mode has no x2 axis
  const done = entries * (job.tiles_done / Math.max(1, job.tiles_total));
  return `${fmt.elapsed(ran)}: ${fmt.rate(job.tiles_done, ran, "tiles")}, ${fmt.rate(done, ran, "kernel entries")}`;
}

export function jobDetail(job, { handlers, names }) {
  const facts = [
    ["Status", statusBadge(job)],
    ["Model", `${job.model} v${job.version}`],
    ["x1", named(job.x1, names)],
    ["x2", job.x2 ? named(job.x2, names) : "x1 (symmetric)"],
    ["Mode / dtype", `${job.mode} / ${job.dtype}`],
    job.output ? ["Output", el("code", {}, `output=${job.output}`)] : null,
    ["Implementation", job.implementation_used.join(", ") || job.implementation],
    ["Result", `${fmt.shape(job.result_shape)}, ${fmt.bytes(job.estimate_bytes)} on disk`],
    job.result_path ? ["On the server", el("code", {}, job.result_path)] : null,
    ["Tiles", `${job.tiles_done} / ${job.tiles_total} (tile size ${job.tile_size})`],
    ["Duration / throughput", durationText(job)],
    ["Executor", job.executor],
    ["Submitted / finished", `${fmt.when(job.created_at)} / ${fmt.when(job.finished_at)}`],
  ].filter(Boolean);
  const list = el("dl", { class: "facts" }, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const parts = [list];
  if (job.error) parts.push(el("p", { class: "error-text" }, job.error));
  if (job.status === "succeeded" && !job.result_deleted_at) {
    parts.push(
      el(
        "div",
        { class: "downloads", role: "group", "aria-label": "Download the result" },
        el("span", {}, "Download the kernel: "),
        el("button", { type: "button", "data-download": "npy", onclick: () => handlers.download(job, "npy") }, ".npy"),
        el(
          "button",
          { type: "button", "data-download": "safetensors", onclick: () => handlers.download(job, "safetensors") },
          ".safetensors",
        ),
        el(
          "span",
          { class: "muted" },
          ` (large kernels stream to a file: ntk-service jobs result ${job.id} -o theta.npy; -o kernel.zarr.zip for the Zarr group)`,
        ),
      ),
      el(
        "div",
        { class: "figures" },
        el("figure", { id: "spectrum-figure" }, el("p", { class: "muted" }, "computing the spectrum…")),
        el("figure", { id: "heatmap-figure" }, el("p", { class: "muted" }, "loading a corner of Θ…")),
      ),
      el("div", { id: "checkpoints", class: "checkpoints" }),
    );
  } else if (job.result_deleted_at) {
    parts.push(el("p", { class: "muted" }, `The result was deleted ${fmt.when(job.result_deleted_at)}.`));
  } else if (!FINISHED.has(job.status)) {
    parts.push(el("p", { class: "muted" }, "The spectrum and a heatmap appear here when the job has succeeded."));
  }
  return parts;
}

export function figure(id, blobUrl, alt, caption) {
  const target = document.getElementById(id);
  if (!target) return;
  target.replaceChildren(el("img", { src: blobUrl, alt }), el("figcaption", {}, caption));
}

export function figureError(id, message) {
  const target = document.getElementById(id);
  if (target) target.replaceChildren(el("p", { class: "error-text" }, message));
}

export function figureNote(id, text) {
  const target = document.getElementById(id);
  if (target) target.replaceChildren(el("p", { class: "muted" }, text));
}

export function figureAction(id, text, onclick) {
  const target = document.getElementById(id);
  if (target) target.replaceChildren(el("button", { type: "button", "data-action": "spectrum", onclick }, text));
}

// A spectrum being computed: what is computed, an indeterminate bar and the seconds so far (the server sends no
// progress for one request; the page shows that it is alive and how long it has taken).
export function figureProgress(id, text, startedMs) {
  const target = document.getElementById(id);
  if (!target) return;
  const elapsed = Math.round((Date.now() - startedMs) / 1000);
  const note = target.querySelector(".progress-text");
  if (note) {
    note.textContent = `${text}: ${elapsed} s`;
    return;
  }
  target.replaceChildren(
    el("progress", { "aria-label": text }),
    el("p", { class: "muted progress-text", role: "status" }, `${text}: ${elapsed} s`),
  );
}

// Checkpoint comparison: the other succeeded jobs of this model over the same rows and mode, another version each,
// with the kernel distance and relative change once computed. rows: [{job, result}] (result null: not yet).
export function checkpoints(job, rows, onCompare) {
  const target = document.getElementById("checkpoints");
  if (!target) return;
  if (!rows.length) {
    target.replaceChildren(
      el(
        "p",
        { class: "muted" },
        `Checkpoints: no other version of ${job.model} has a succeeded job over these rows in mode ${job.mode}; submit one to compare its kernel with this one.`,
      ),
    );
    return;
  }
  const body = rows.map(({ job: other, result, error }) =>
    el(
      "tr",
      { "data-other": other.id },
      el("th", { scope: "row" }, `v${other.version}`, other.version === job.version ? " (same version)" : ""),
      el("td", {}, el("code", { title: other.id }, fmt.shortId(other.id))),
      el("td", { class: "num distance" }, result ? result.distance.toPrecision(4) : "—"),
      el("td", { class: "num change" }, result ? result.relative_change.toPrecision(4) : "—"),
      el(
        "td",
        {},
        error
          ? el("span", { class: "error-text" }, error)
          : result
            ? el("span", { class: "muted" }, `${Math.round(result.analysis_ms)} ms`)
            : el(
                "button",
                { type: "button", "data-action": "compare", "aria-label": `Compare with v${other.version} (job ${fmt.shortId(other.id)})`, onclick: () => onCompare(other) },
                "Compare",
              ),
      ),
    ),
  );
  target.replaceChildren(
    el("h3", {}, `Checkpoints: this kernel (v${job.version}) against the other versions'`),
    table(
      "Kernel distance to the other versions' kernels over the same rows",
      ["Version", "Job", "Kernel distance", "Relative change", ""],
      body,
    ),
    el(
      "p",
      { class: "muted" },
      "Kernel distance 1 − ⟨Θ, Θ′⟩ / (‖Θ‖ ‖Θ′‖) (0: the same kernel up to scale); relative change ‖Θ′ − Θ‖ / ‖Θ‖.",
    ),
  );
}
