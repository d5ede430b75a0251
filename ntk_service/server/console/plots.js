// The finished job's pictures, drawn on a canvas and handed back as PNG blobs (shown through object URLs, so
// the Content-Security-Policy needs only img-src blob:). The heatmap lays a FULL kernel out as plot.py does
// (NOTE [layout]): the (r·k, c·k) matrix with row n·k + a and column m·k + b; a TRACE kernel is drawn as it is.

const FONT = "12px system-ui, sans-serif";
const INK = "#1f2933";
const GRID = "#d9dee3";

function canvas(width, height) {
  const c = document.createElement("canvas");
  c.width = width;
  c.height = height;
  const ctx = c.getContext("2d");
  ctx.fillStyle = "#ffffff";
  ctx.fillRect(0, 0, width, height);
  ctx.font = FONT;
  ctx.fillStyle = INK;
  return [c, ctx];
}

function toBlob(c) {
  return new Promise((resolve, reject) =>
    c.toBlob((blob) => (blob ? resolve(blob) : reject(new Error("the browser could not encode the plot"))), "image/png"),
  );
}

// Sequential viridis (perceptually uniform, dark to light), for kernels whose entries are all ≥ 0: a trace kernel's
// entries are positive and close to each other, which a diverging map centred on 0 draws as one flat colour.
const VIRIDIS = [
  [68, 1, 84],
  [72, 40, 120],
  [62, 74, 137],
  [49, 104, 142],
  [38, 130, 142],
  [31, 158, 137],
  [53, 183, 121],
  [109, 205, 89],
  [180, 222, 44],
  [253, 231, 37],
];

export function sequential(t) {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const u = x - i;
  const mix = VIRIDIS[i].map((a, c) => Math.round(a + (VIRIDIS[i + 1][c] - a) * u));
  return `rgb(${mix[0]}, ${mix[1]}, ${mix[2]})`;
}

// Diverging blue - white - red, centred on 0, as RdBu_r: for kernels with entries of both signs.
export function diverging(t) {
  const blue = [33, 102, 172];
  const white = [247, 247, 247];
  const red = [178, 24, 43];
  const [from, to, u] = t < 0 ? [white, blue, -t] : [white, red, t];
  const mix = from.map((f, i) => Math.round(f + (to[i] - f) * Math.min(1, u)));
  return `rgb(${mix[0]}, ${mix[1]}, ${mix[2]})`;
}

function label(value) {
  const a = Math.abs(value);
  return a !== 0 && (a < 1e-2 || a >= 1e4) ? value.toExponential(1) : value.toPrecision(3);
}

// The matrix of a kernel block: theta {shape, data} (flat, row-major) -> {rows, cols, at(i, j)}.
export function kernelMatrix(theta) {
  const [r, c, k] = theta.shape;
  const data = theta.data;
  if (theta.shape.length === 2) return { rows: r, cols: c, at: (i, j) => data[i * c + j] };
  if (theta.shape.length === 4) {
    return {
      rows: r * k,
      cols: c * k,
      at: (i, j) => data[((Math.floor(i / k) * c + Math.floor(j / k)) * k + (i % k)) * k + (j % k)],
    };
  }
  throw new Error(`a heatmap needs a full (N, M, k, k) or trace (N, M) kernel, not shape (${theta.shape})`);
}

export function heatmap(theta, title) {
  const m = kernelMatrix(theta);
  const cell = Math.max(2, Math.min(24, Math.floor(360 / Math.max(m.rows, m.cols))));
  const left = 48;
  const top = 34;
  const width = Math.max(320, left + m.cols * cell + 110);
  const height = top + m.rows * cell + 40;
  const [c, ctx] = canvas(width, height);
  const scale = colourScale(m);
  for (let i = 0; i < m.rows; i++) {
    for (let j = 0; j < m.cols; j++) {
      ctx.fillStyle = scale.colour(m.at(i, j));
      ctx.fillRect(left + j * cell, top + i * cell, cell, cell);
    }
  }
  ctx.fillStyle = INK;
  ctx.fillText(`${title} as the ${m.rows} × ${m.cols} matrix`, left, 20);
  // axes: first and last index at the ends, the name in the middle
  const right = left + m.cols * cell;
  const bottom = top + m.rows * cell;
  ctx.textAlign = "right";
  ctx.fillText("0", left - 6, top + 10);
  ctx.fillText(String(m.rows - 1), left - 6, bottom);
  ctx.fillText("row", left - 6, (top + bottom) / 2 + 4);
  ctx.textAlign = "center";
  ctx.fillText("0", left + cell / 2, bottom + 16);
  ctx.fillText(String(m.cols - 1), right - cell / 2, bottom + 16);
  ctx.fillText("column", (left + right) / 2, bottom + 16);
  ctx.textAlign = "left";
  // colour bar: the scale's top, middle and bottom values beside it
  const barX = left + m.cols * cell + 20;
  const barH = Math.max(80, m.rows * cell);
  for (let y = 0; y < barH; y++) {
    ctx.fillStyle = scale.colour(scale.high - ((scale.high - scale.low) * y) / (barH - 1));
    ctx.fillRect(barX, top + y, 14, 1);
  }
  ctx.strokeStyle = INK;
  ctx.strokeRect(barX, top, 14, barH);
  ctx.fillStyle = INK;
  ctx.fillText(label(scale.high), barX + 20, top + 10);
  ctx.fillText(label((scale.high + scale.low) / 2), barX + 20, top + barH / 2 + 4);
  ctx.fillText(label(scale.low), barX + 20, top + barH);
  ctx.fillText("Θ", barX + 2, top - 8);
  return toBlob(c).then((blob) => ({ blob, kind: scale.kind, low: scale.low, high: scale.high }));
}

// How values become colours: sequential from the smallest to the largest entry when none is negative (the scale
// shows where they lie), diverging and centred on 0 when the signs differ.
export function colourScale(m) {
  let low = Infinity;
  let high = -Infinity;
  for (let i = 0; i < m.rows; i++) {
    for (let j = 0; j < m.cols; j++) {
      low = Math.min(low, m.at(i, j));
      high = Math.max(high, m.at(i, j));
    }
  }
  if (low >= 0) {
    const span = high - low || 1;
    return { kind: "sequential", low, high, colour: (v) => sequential((v - low) / span) };
  }
  const bound = Math.max(Math.abs(low), Math.abs(high)) || 1;
  return { kind: "diverging", low: -bound, high: bound, colour: (v) => diverging(v / bound) };
}

export function spectrum(eigenvalues, title) {
  const values = [...eigenvalues].sort((a, b) => b - a);
  const positive = values.filter((v) => v > 0);
  const [c, ctx] = canvas(520, 340);
  const box = { left: 70, top: 34, right: 500, bottom: 290 };
  ctx.fillText(title, box.left, 20);
  if (!positive.length) {
    ctx.fillText("no positive eigenvalue to draw on a log scale", box.left, 150);
    return toBlob(c);
  }
  let lo = Math.floor(Math.log10(positive[positive.length - 1]));
  let hi = Math.ceil(Math.log10(positive[0]));
  if (hi === lo) hi = lo + 1;
  const x = (i) => box.left + ((box.right - box.left) * (positive.length === 1 ? 0.5 : i / (positive.length - 1)));
  const y = (v) => box.bottom - ((box.bottom - box.top) * (Math.log10(v) - lo)) / (hi - lo);
  ctx.strokeStyle = GRID;
  ctx.lineWidth = 1;
  const step = Math.max(1, Math.ceil((hi - lo) / 8));
  for (let e = lo; e <= hi; e += step) {
    ctx.beginPath();
    ctx.moveTo(box.left, y(10 ** e));
    ctx.lineTo(box.right, y(10 ** e));
    ctx.stroke();
    ctx.fillText(`1e${e}`, 28, y(10 ** e) + 4);
  }
  ctx.strokeStyle = INK;
  ctx.strokeRect(box.left, box.top, box.right - box.left, box.bottom - box.top);
  ctx.strokeStyle = "#2166ac";
  ctx.fillStyle = "#2166ac";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  positive.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
  ctx.stroke();
  positive.forEach((v, i) => {
    ctx.beginPath();
    ctx.arc(x(i), y(v), 3, 0, 2 * Math.PI);
    ctx.fill();
  });
  ctx.fillStyle = INK;
  ctx.fillText("1", box.left - 3, box.bottom + 16);
  ctx.fillText(String(positive.length), box.right - 10, box.bottom + 16);
  ctx.fillText("index i (descending)", (box.left + box.right) / 2 - 50, box.bottom + 34);
  const dropped = values.length - positive.length;
  if (dropped) ctx.fillText(`${dropped} eigenvalue(s) ≤ 0 not shown`, box.right - 200, box.top + 16);
  ctx.save();
  ctx.translate(16, (box.top + box.bottom) / 2 + 40);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText("eigenvalue λ_i", 0, 0);
  ctx.restore();
  return toBlob(c);
}
