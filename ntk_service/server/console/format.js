// Plain text for numbers, sizes, times and architectures (no DOM here).

export function shape(dims) {
  return `(${dims.join(", ")})`;
}

export function count(n) {
  return Number(n).toLocaleString("en-US");
}

export function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(n);
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(1)} ${units[unit]}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

// A measured duration: tenths below 10 s (a small job takes a fraction of a second), else as duration().
export function elapsed(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  return seconds < 10 ? `${seconds.toFixed(1)} s` : duration(seconds);
}

export function when(iso) {
  if (!iso) return "—";
  const date = new Date(iso);
  return date.toLocaleString("en-GB", { dateStyle: "medium", timeStyle: "short" });
}

function value(v) {
  if (Array.isArray(v)) return `[${v.map(value).join(", ")}]`;
  if (v && typeof v === "object") return "{…}";
  return String(v);
}

// A layer by its type and sizes only (the validated spec also lists every default).
function layer(spec) {
  const size = (a, b) => (spec[a] === undefined ? "" : ` ${value(spec[a])}→${value(spec[b])}`);
  if (spec.type === "Residual") {
    const shortcut = spec.shortcut ? spec.shortcut.map(layer).join(" → ") : "identity";
    return `Residual(${(spec.body || []).map(layer).join(" → ")} + ${shortcut})`;
  }
  if (spec.type === "Linear") return `Linear${size("in_features", "out_features")}`;
  if (String(spec.type).startsWith("Conv")) {
    const kernel = spec.kernel_size === undefined ? "" : ` k${value(spec.kernel_size)}`;
    return `${spec.type}${size("in_channels", "out_channels")}${kernel}`;
  }
  if (spec.type === "Embedding") return `Embedding${size("num_embeddings", "embedding_dim")}`;
  return String(spec.type);
}

// The class of an exported model's module, where the record names it (older records do not: null then).
const CLASS_KEYS = ["class_name", "module_class", "class"];

export function className(arch) {
  const key = CLASS_KEYS.find((k) => typeof arch[k] === "string" && arch[k]);
  return key ? arch[key] : null;
}

// "torch.ops.aten.linear.default" -> "linear"; "_operator.mul" -> "mul"
export function opName(target) {
  const parts = String(target).split(".");
  const i = parts.indexOf("aten");
  return i >= 0 && parts.length > i + 1 ? parts[i + 1] : parts[parts.length - 1];
}

// The operators that carry a model's parameters or its structure; the rest (elementwise, shapes) are counted.
const LAYER_OPS = /^(linear|conv|embedding|layer_norm|native_layer_norm|batch_norm|group_norm|rms_norm|scaled_dot_product_attention|matmul|mm|bmm|addmm|baddbmm|einsum|max_pool|avg_pool|adaptive_avg_pool)/;

// An exported program in a line: its class (when recorded), its layer operators and how many others.
export function operatorSummary(arch) {
  const names = [...new Set((arch.operators || []).map(opName))].sort();
  const layers = names.filter((n) => LAYER_OPS.test(n));
  const rest = names.filter((n) => !LAYER_OPS.test(n));
  const others = rest.length <= 5 ? rest.join(", ") : `${rest.length} elementwise and shape ops`;
  const parts = [layers.join(", "), others].filter(Boolean);
  return { names, text: parts.join(" + ") || "no operators" };
}

// One line per architecture: the family, then its settings (a sequential model: its layers in order).
export function architecture(arch) {
  const family = arch.family || "?";
  if (family === "exported") {
    const cls = className(arch);
    return `exported ${cls || "program"}: ${operatorSummary(arch).text}`;
  }
  if (Array.isArray(arch.layers)) return `${family}: ${arch.layers.map(layer).join(" → ")}`;
  if (family === "factory") {
    const kwargs = Object.entries(arch.kwargs || {}).map(([k, v]) => `${k}=${value(v)}`);
    return `factory ${arch.factory}(${kwargs.join(", ")})`;
  }
  const settings = Object.entries(arch)
    .filter(([k, v]) => k !== "family" && v !== null && typeof v !== "object")
    .concat(Object.entries(arch).filter(([k, v]) => k !== "family" && Array.isArray(v)))
    .map(([k, v]) => `${k} ${value(v)}`);
  return settings.length ? `${family}: ${settings.join(", ")}` : family;
}

// A model's input(s): "(4) float32", or one "name (shape) dtype" per input of a model taking several.
export function inputs(model) {
  const leaves = model.inputs && Array.isArray(model.inputs.leaves) ? model.inputs.leaves : null;
  if (!leaves) return [`${shape(model.input_shape)} ${model.input_dtype}`];
  return leaves.map((leaf) => {
    const vocab = leaf.vocab_size ? ` < ${count(leaf.vocab_size)}` : "";
    return `${leaf.name} ${shape(leaf.shape)} ${leaf.dtype}${vocab}`;
  });
}

// Seconds between two ISO times (the second: now when null), or null before the first.
export function seconds(startIso, endIso) {
  if (!startIso) return null;
  const end = endIso ? Date.parse(endIso) : Date.now();
  return Math.max(0, (end - Date.parse(startIso)) / 1000);
}

// A rate with a unit per second, three significant digits: "12.3 tiles/s".
export function rate(amount, secondsTaken, unit) {
  if (secondsTaken === null || !(secondsTaken > 0)) return "—";
  const r = amount / secondsTaken;
  const text = r >= 100 ? Math.round(r).toLocaleString("en-US") : r.toPrecision(3);
  return `${text} ${unit}/s`;
}

// Ids are 24 to 32 hex digits: the first 8 tell jobs apart in a table (the full id is in the title and detail).
export function shortId(id) {
  return id.length > 12 ? `${id.slice(0, id.startsWith("ds_") ? 11 : 8)}…` : id;
}

export function rows(side) {
  if (!side) return "";
  return `${side.dataset} [${side.start}:${side.stop}]`;
}
