// The console's one door to the server: every request carries the key as an Authorization header (never in a
// URL), errors become ApiError with the server's own message, and downloads and event streams go through fetch()
// because a plain <a href> or EventSource cannot send a header.

const KEY_NAME = "ntk-console-key";

export class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

export function getKey() {
  return sessionStorage.getItem(KEY_NAME);
}

export function setKey(key) {
  sessionStorage.setItem(KEY_NAME, key);
}

export function clearKey() {
  sessionStorage.removeItem(KEY_NAME);
}

function headers(accept, extra = {}) {
  const h = new Headers({ Accept: accept, ...extra });
  const key = getKey();
  if (key) h.set("Authorization", `Bearer ${key}`);
  return h;
}

async function apiError(response) {
  let type = "http_error";
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) {
      type = body.error.type;
      message = body.error.message;
    }
  } catch {
    // not the JSON error body (a proxy's page): keep the status line
  }
  return new ApiError(response.status, type, message);
}

// Paths are relative ("v1/models"), so the page works behind a proxy that serves it under a prefix.
export async function request(method, path, { body, accept = "application/json", signal } = {}) {
  const init = { method, headers: headers(accept), cache: "no-store", signal };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers.set("Content-Type", "application/json");
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await apiError(response);
  return response;
}

export async function getJson(path) {
  return (await request("GET", path)).json();
}

export async function postJson(path, body) {
  return (await request("POST", path, { body })).json();
}

export async function remove(path) {
  const response = await request("DELETE", path);
  return response.status === 204 ? null : response.json();
}

// A file download that needs the header: fetch it, hold it as a Blob and hand the browser an object URL.
export async function download(path, accept, filename) {
  const blob = await (await request("GET", path, { accept })).blob();
  const url = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
  return blob.size;
}

// Server-Sent Events read from a fetch() body (EventSource cannot send the Authorization header): yields
// {event, data} with data parsed as JSON, until the server ends the stream or signal aborts it.
export async function* events(path, signal) {
  const response = await request("GET", path, { accept: "text/event-stream", signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        const message = parseEvent(block);
        if (message) yield message;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function parseEvent(block) {
  let event = "message";
  const data = [];
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith(":")) continue; // a keep-alive comment
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  return data.length ? { event, data: JSON.parse(data.join("\n")) } : null;
}
