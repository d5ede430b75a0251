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

// One line per architecture: the family, then its settings (a sequential model: its layers in order).
export function architecture(arch) {
  const family = arch.family || "?";
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

// Ids are 24 to 32 hex digits: the first 8 tell jobs apart in a table (the full id is in the title and detail).
export function shortId(id) {
  return id.length > 12 ? `${id.slice(0, id.startsWith("ds_") ? 11 : 8)}…` : id;
}

export function rows(side) {
  if (!side) return "";
  return `${side.dataset} [${side.start}:${side.stop}]`;
}
