"""The lab console (``GET /``) in a real headless Chromium against a real server: the seeded models (two versions of
one), data sets and jobs show after the page's scripts ran; a job that finishes while the page is open changes
status without a reload; plots, downloads, cancel and delete work with a write key and not with a read key; no
request leaves the server and the key never goes in a URL. The screenshots are written to ``SCREENSHOT_DIR``.

Without Chromium (and without root to ``apt-get install chromium``) the browser tests skip, saying why; the header
and asset checks run anyway.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.torch
import torch

from ntk_service import wire
from ntk_service.client import Client
from ntk_service.registry import build_model
from ntk_service.server.routes.console import ASSETS, GENERATED
from ntk_service.vocabulary import MODES
from tests.browser import Browser, Page, require_chromium
from tests.conftest import REPO_ROOT, LiveServer, start_live_server
from tests.server.support import TINY_ARCHITECTURES, submit_slow_job

SCREENSHOT_DIR = Path(tempfile.gettempdir()) / "ntk-service-console"
"""Where the screenshots are copied for a person to look at (console.png: a laptop screen; console-full.png)."""

DELAY_S = 0.6
"""The slow model's sleep per forward call once its gate opens: a tile's side takes this long, so a server stopped
at once leaves tiles to resume."""

LOADED = "document.body.dataset.loaded"


SEQUENTIAL = {
    "family": "sequential",
    "input_shape": [4],
    "layers": [
        {"type": "Linear", "in_features": 4, "out_features": 8},
        {"type": "Tanh"},
        {"type": "Linear", "in_features": 8, "out_features": 3},
    ],
}


def _wait_for_status(client: httpx.Client, job_id: str, status: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] == status:
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} not {status} after {timeout_s} s: {job}")


def _submit(client: httpx.Client, model: str, dataset: str, **options: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", json={"model": model, "x1": {"dataset": dataset}, **options})
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


DISK_BUDGET = 64 * 2**20
"""The module server's NTK_JOB_DISK_BUDGET_BYTES: the jobs header shows the results' use against it."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_live_server(tmp_path_factory.mktemp("console") / "data", job_disk_budget_bytes=str(DISK_BUDGET))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def seeded(server: LiveServer) -> dict[str, Any]:
    """Two models (mlp-a with versions 1 and 2, labelled; seq-b, a sequential one), a data set, a finished FULL job
    on mlp-a v2 and a finished TRACE job to delete."""
    mlp = TINY_ARCHITECTURES["mlp"]
    with server.client() as client:
        body = {"name": "mlp-a", "architecture": mlp, "seed": 0, "label": "init"}
        assert client.post("/v1/models", json=body).status_code == 201
        trained, _ = build_model(mlp, seed=1)
        weights = safetensors.torch.save({k: v.contiguous() for k, v in trained.state_dict().items()})
        upload = client.post(
            "/v1/models/mlp-a/versions",
            content=weights,
            params={"label": "epoch 3"},
            headers={"Content-Type": wire.MEDIA_SAFETENSORS},
        )
        assert upload.status_code == 201, upload.text
        assert (
            client.post("/v1/models", json={"name": "seq-b", "architecture": SEQUENTIAL, "seed": 2}).status_code == 201
        )
        x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
        dataset = client.post(
            "/v1/datasets",
            content=wire.encode_npy(x),
            params={"name": "probe inputs"},
            headers={"Content-Type": wire.MEDIA_NPY},
        ).json()
        full = _submit(client, "mlp-a", dataset["id"], tile_size=4)
        trace = _submit(client, "mlp-a", dataset["id"], mode="trace", tile_size=4)
        _wait_for_status(client, full["id"], "succeeded")
        _wait_for_status(client, trace["id"], "succeeded")
    return {"dataset": dataset, "full": full, "trace": trace}


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    executable = require_chromium()
    with Browser(tmp_path_factory.mktemp("chromium"), executable=executable) as started:
        yield started


def _enter_key(page: Page, key: str) -> None:
    """Type ``key`` into the prompt and submit it; returns once the page has loaded everything with it."""
    page.wait_until("!document.getElementById('key-form').hidden", what="the key prompt shown")
    loads = page.evaluate(f"Number({LOADED} || 0)")
    page.evaluate(
        f"document.getElementById('key-input').value = {json.dumps(key)};"
        "document.getElementById('key-form').requestSubmit(); true"
    )
    page.wait_until(f"Number({LOADED} || 0) > {loads}", what="the console loaded after the key")


def _texts(page: Page, selector: str) -> list[str]:
    value: list[str] = page.evaluate(
        f"[...document.querySelectorAll({json.dumps(selector)})].map((e) => e.textContent.trim())"
    )
    return value


def _row_status(page: Page, job_id: str) -> str | None:
    value: str | None = page.evaluate(f"document.querySelector('tr[data-job=\"{job_id}\"]')?.dataset.status ?? null")
    return value


def _authorization(request: dict[str, Any]) -> str | None:
    """The request's Authorization header (fetch() sends header names in lower case)."""
    return next((v for k, v in request["headers"].items() if k.lower() == "authorization"), None)


def _wait_for_stream(page: Page, job_id: str, timeout_s: float = 30.0) -> None:
    """Until the page has asked for the job's event stream (the request seen by the browser's network domain)."""
    deadline = time.monotonic() + timeout_s
    while not any(r["url"].endswith(f"/v1/jobs/{job_id}/events") for r in page.requests):
        assert time.monotonic() < deadline, f"no event stream for job {job_id} after {timeout_s} s"
        page.evaluate("1")  # reads the events that arrived meanwhile
        time.sleep(0.1)


def _check_requests_stayed_home(page: Page, server: LiveServer, *, keys: tuple[str, ...]) -> None:
    assert page.requests, "the page made no request"
    for request in page.requests:
        url = request["url"]
        assert url.startswith(f"{server.url}/") or url.startswith(f"blob:{server.url}/"), f"left the server: {url}"
        assert not any(key in url for key in keys), f"a key in a URL: {url}"
    problems = [line for line in page.log if "Content Security Policy" in line or line.startswith("exception")]
    assert not problems, problems


def test_console_page_is_static_and_locked_down(server: LiveServer) -> None:
    with server.client(None) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        for directive in ("default-src 'self'", "script-src 'self'", "connect-src 'self'", "img-src 'self' blob:"):
            assert directive in csp, csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        html = page.text
        assert not re.search(r"https?://", html), "the page references another host"
        assert not re.search(r"<script(?![^>]*\bsrc=)", html), "inline script"
        assert not re.search(r"\sstyle=|<style|\son\w+=", html), "inline style or handler"
        referenced = re.findall(r'(?:src|href)="console/([^"]+)"', html)
        assert set(referenced) == {"console.css", "console.js"}
        for name, media in ASSETS.items():
            asset = client.get(f"/console/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"] == media, name
            assert asset.headers["content-security-policy"] == csp
            assert not re.search(r"https?://(?!www\.w3\.org)", asset.text), f"{name} references another host"
            assert "innerHTML" not in asset.text and "eval(" not in asset.text, name
        imports = {m for name in ASSETS for m in re.findall(r'from "\./([\w.]+)"', client.get(f"/console/{name}").text)}
        assert imports <= set(ASSETS), imports - set(ASSETS)
        modes = client.get("/console/modes.js").text.split("export const MODES = ", 1)[1].rstrip().rstrip(";")
        assert json.loads(modes) == {
            name: {"shape": list(s.shape), "pairs": s.pairs, "outputs": s.outputs.value, "matrix": s.is_matrix}
            for name, s in MODES.items()
        }
        missing = client.get("/console/..%2Fconfig.py")
        assert missing.status_code == 404
        assert client.get("/console/index.html").status_code == 404  # the page is only at /
        unknown = client.get("/console/secrets.txt")
        assert unknown.status_code == 404 and "console.js" in unknown.json()["error"]["message"]
        assert client.get("/v1/whoami").status_code == 401
        assert client.post("/").status_code == 405
        assert "/" not in client.get("/openapi.json").json()["paths"]
    for key, scope in (("read", "read"), ("write", "write")):
        with server.client(key) as client:
            who = client.get("/v1/whoami").json()
            assert who["scope"] == scope and who["open"] is False and len(who["key_id"]) == 8


def test_every_console_file_is_package_data() -> None:
    # a wheel install ships exactly what [tool.setuptools.package-data] matches: every file the console serves
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["ntk_service"]
    package = REPO_ROOT / "ntk_service"
    shipped = {path.name for pattern in globs for path in package.glob(pattern) if path.parent.name == "console"}
    on_disk = {path.name for path in (package / "server" / "console").iterdir()}
    assert shipped == on_disk == (set(ASSETS) - set(GENERATED)) | {"index.html"}


@pytest.mark.slow
def test_console_with_a_write_key(server: LiveServer, seeded: dict[str, Any], browser: Browser, tmp_path: Path) -> None:
    with server.client() as client:
        slow = submit_slow_job(client, delay_s=DELAY_S, gate=tmp_path / "gate")  # held until the page has looked
        queued = submit_slow_job(client, delay_s=0.0, gate=tmp_path / "held", model="held")  # held, to cancel
    page = browser.new_page()
    page.navigate(f"{server.url}/")
    _enter_key(page, server.write_key)
    page.evaluate("window.__sameDocument = true")
    page.wait_until("document.querySelectorAll('#jobs tbody tr').length === 4", what="four jobs listed")

    # what is registered: the models, mlp-a's two versions with their labels, P, the architecture; the data set
    assert sorted(_texts(page, "#models tbody th")) == ["held", "mlp-a", "seq-b", "slow"]
    versions = _texts(page, 'tr[data-model="mlp-a"] ul.versions li')
    assert len(versions) == 2 and "v1" in versions[0] and "init" in versions[0] and "epoch 3" in versions[1]
    mlp_row = _texts(page, 'tr[data-model="mlp-a"] td')
    assert "67" in mlp_row and any(cell.startswith("mlp: input_dim 4") for cell in mlp_row), mlp_row
    assert _texts(page, 'tr[data-model="seq-b"] td.arch > span') == ["sequential: Linear 4→8 → Tanh → Linear 8→3"]
    # what the kernel engine does with each layer (the record's parameter_paths)
    assert _texts(page, 'tr[data-model="seq-b"] details.paths summary') == [
        "Kernel paths: auto → structured at N = 64 · all structured"
    ]
    seq_paths = _texts(page, 'tr[data-model="seq-b"] details.paths li[data-path="structured"]')
    assert len(seq_paths) == 2 and all(" weight, bias factored (linear): " in text for text in seq_paths), seq_paths
    assert _texts(page, 'tr[data-model="slow"] td.arch > span')[0].startswith(
        "factory tests.server.slow_factory:build("
    )
    dataset_row = _texts(page, f'tr[data-dataset="{seeded["dataset"]["id"]}"] td')
    assert dataset_row[:3] == ["probe inputs", "(8, 4)", "float32"], dataset_row
    assert _row_status(page, seeded["full"]["id"]) == "succeeded"

    # live progress: the slow job is unfinished now and succeeds without a reload, over the event stream
    assert _row_status(page, slow["id"]) in ("queued", "running"), "the slow job ended before the page loaded"
    (tmp_path / "gate").touch()
    page.wait_until(
        f"(() => {{ const row = document.querySelector('tr[data-job=\"{slow['id']}\"]');"
        " return row.dataset.status === 'succeeded'"
        " || /^ETA \\d/.test(row.querySelector('.time-cell .eta')?.textContent); })()",
        timeout_s=120,
        what="the slow job's ETA shown",
    )
    running_shot = page.screenshot(tmp_path / "console-running.png")
    page.wait_until(
        f"document.querySelector('tr[data-job=\"{slow['id']}\"]').dataset.status === 'succeeded'",
        timeout_s=120,
        what="the slow job shown as succeeded",
    )
    assert page.evaluate("window.__sameDocument === true") and page.navigations == 1
    assert _texts(page, f'tr[data-job="{slow["id"]}"] .tiles') == ["10 / 10 tiles"]
    streams = [r for r in page.requests if r["url"].endswith(f"/v1/jobs/{slow['id']}/events")]
    assert streams and all(_authorization(r) == f"Bearer {server.write_key}" for r in streams)

    # cancel (write key): the queued job becomes cancelled
    page.evaluate(f"document.querySelector('tr[data-job=\"{queued['id']}\"] [data-action=cancel]')?.click(); true")
    page.wait_until(
        f"document.querySelector('tr[data-job=\"{queued['id']}\"]').dataset.status === 'cancelled'",
        timeout_s=60,
        what="the cancelled job shown",
    )
    (tmp_path / "held").touch()  # its running tile ends (a cancelled job starts no other)

    # a finished job's detail: its spectrum and a corner of Θ, through object URLs
    full_id = seeded["full"]["id"]
    page.evaluate(f"document.querySelector('tr[data-job=\"{full_id}\"] [data-action=details]').click(); true")
    page.wait_until(
        "[...document.querySelectorAll('#job-detail figure img')].filter((i) => i.complete && i.naturalWidth > 0"
        " && i.src.startsWith('blob:')).length === 2",
        what="the spectrum and the heatmap drawn",
    )
    with server.client() as client:
        theta = wire.decode_npy(client.get(f"/v1/jobs/{full_id}/result", headers={"Accept": wire.MEDIA_NPY}).content)
    n, _, k, _ = theta.shape
    matrix = theta.astype(np.float64).transpose(0, 2, 1, 3).reshape(n * k, n * k)
    caption = _texts(page, "#spectrum-figure figcaption")[0]
    shown = float(re.search(r"λ_max = ([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)", caption).group(1))  # type: ignore[union-attr]
    np.testing.assert_allclose(shown, np.linalg.eigvalsh(matrix).max(), rtol=1e-3)

    # the heatmap's layout (row n·k + a, column m·k + b) against numpy's transpose, on a hand-made (2, 3, 2, 2) block
    block = np.arange(24, dtype=np.float64).reshape(2, 3, 2, 2)
    drawn = page.evaluate(
        "import(new URL('console/plots.js', document.baseURI)).then((plots) => {"
        f"  const m = plots.kernelMatrix({{shape: [2, 3, 2, 2], data: {json.dumps(block.reshape(-1).tolist())}}});"
        "  return Array.from({length: m.rows}, (_, i) => Array.from({length: m.cols}, (_, j) => m.at(i, j)));"
        "})"
    )
    np.testing.assert_array_equal(np.array(drawn), block.transpose(0, 2, 1, 3).reshape(4, 6))

    # a download needing the header: fetch + Blob + object URL, the same bytes as the API's
    downloads = tmp_path / "downloads"
    page.allow_downloads(downloads)
    page.evaluate("document.querySelector('[data-download=npy]').click(); true")
    target = downloads / f"{full_id}.npy"
    deadline = time.monotonic() + 30
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert target.exists(), list(downloads.iterdir())
    np.testing.assert_array_equal(np.load(target), theta)

    # the screenshot a person looks at: the laptop screen with the detail open, and the whole page
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    page.evaluate("window.scrollTo(0, 0); true")
    shot = page.screenshot(tmp_path / "console.png")
    full = page.screenshot(tmp_path / "console-full.png", full_page=True)
    for path in (shot, full, running_shot):
        shutil.copy(path, SCREENSHOT_DIR / path.name)
        assert path.stat().st_size > 20_000
    print(f"\nconsole screenshots: {', '.join(str(SCREENSHOT_DIR / p.name) for p in (shot, full, running_shot))}")

    # labels: every control and picture has a name a screen reader can say
    unnamed = page.evaluate(
        "[...document.querySelectorAll('button, input, img, progress')].filter((e) =>"
        " e.tagName === 'IMG' ? !e.alt : e.tagName === 'INPUT' ? !e.labels.length"
        " : !(e.getAttribute('aria-label') || e.textContent.trim())).map((e) => e.outerHTML)"
    )
    assert unnamed == [], unnamed

    # the keyboard: Escape closes the detail and focus returns to its row's Details button; Enter opens it again
    page.press("Escape")
    assert page.evaluate("document.getElementById('job-detail').hidden") is True
    focused = f"document.activeElement.closest('tr')?.dataset.job === '{full_id}'"
    assert page.evaluate(f"{focused} && document.activeElement.dataset.action === 'details'")
    page.press("Enter")
    page.wait_until("!document.getElementById('job-detail').hidden", what="the detail reopened with Enter")
    assert page.evaluate("document.activeElement.id") == "job-detail-title"

    # the key lives in this tab's sessionStorage only
    assert page.evaluate("sessionStorage.getItem('ntk-console-key')") == server.write_key
    assert page.evaluate("localStorage.length") == 0 and server.write_key not in page.evaluate("document.cookie")

    # delete (write key), in two steps: the row goes, and so does the job
    trace_id = seeded["trace"]["id"]
    button = f"document.querySelector('tr[data-job=\"{trace_id}\"] [data-action=delete]')"
    page.evaluate(f"{button}.click(); true")
    assert page.evaluate(f"{button}.textContent") == "Confirm delete"
    page.evaluate(f"{button}.click(); true")
    page.wait_until(f"!document.querySelector('tr[data-job=\"{trace_id}\"]')", what="the deleted job's row gone")
    with server.client() as client:
        assert client.get(f"/v1/jobs/{trace_id}").status_code == 404

    _check_requests_stayed_home(page, server, keys=(server.write_key, server.read_key))
    api = [r for r in page.requests if "/v1/" in r["url"]]
    without_key = [r["url"] for r in api if _authorization(r) is None]
    assert without_key == [f"{server.url}/v1/whoami"], without_key  # the first look, before the prompt


@pytest.mark.slow
def test_console_with_a_read_key_changes_nothing(server: LiveServer, seeded: dict[str, Any], browser: Browser) -> None:
    page = browser.new_page()
    page.navigate(f"{server.url}/")
    _enter_key(page, server.read_key)
    assert page.evaluate("document.getElementById('access-status').dataset.scope") == "read"
    page.wait_until("!!document.querySelector('#jobs tbody tr')", what="jobs listed")
    assert set(_texts(page, "#models tbody th")) >= {"mlp-a", "seq-b"}
    assert _row_status(page, seeded["full"]["id"]) == "succeeded"
    buttons = page.evaluate(
        "[...document.querySelectorAll('[data-action=cancel], [data-action=delete]')].map((b) => b.disabled)"
    )
    assert buttons and all(buttons), buttons
    # forced past the disabled button, the server refuses and the page says so
    full_id = seeded["full"]["id"]
    button = f"document.querySelector('tr[data-job=\"{full_id}\"] [data-action=delete]')"
    page.evaluate(f"{button}.disabled = false; {button}.click(); {button}.click(); true")
    message = page.wait_until(
        "!document.getElementById('message').hidden && document.getElementById('message').textContent",
        what="the refusal shown",
    )
    assert "refused, this key may only read" in message and "'write' scope" in message, message
    with server.client() as client:
        assert client.get(f"/v1/jobs/{full_id}").status_code == 200
    _check_requests_stayed_home(page, server, keys=(server.write_key, server.read_key))


@pytest.mark.slow
def test_console_on_an_open_server_needs_no_key(
    start_server: Callable[..., LiveServer], browser: Browser, tmp_path: Path
) -> None:
    server = start_server(tmp_path / "open", keys=False)
    with server.client(None) as client:
        assert client.get("/v1/whoami").json() == {"scope": "write", "open": True, "key_id": "open"}
        assert (
            client.post("/v1/models", json={"name": "m", "architecture": TINY_ARCHITECTURES["mlp"]}).status_code == 201
        )
    page = browser.new_page()
    page.navigate(f"{server.url}/")
    page.wait_until(LOADED, what="the console loaded")
    assert page.evaluate("document.getElementById('key-form').hidden") is True
    assert page.evaluate("document.getElementById('access-status').dataset.scope") == "open"
    assert _texts(page, "#models tbody th") == ["m"]
    # Tab on a fresh page reaches the skip link first, then the navigation
    page.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip-link"
    page.press("Tab")
    assert page.evaluate("document.activeElement.getAttribute('href')") == "#jobs"
    _check_requests_stayed_home(page, server, keys=())
    assert not [r for r in page.requests if _authorization(r) is not None]


@pytest.mark.slow
def test_console_follows_a_job_across_a_server_restart(browser: Browser, tmp_path: Path) -> None:
    # the event stream ends when the server stops; the page reconnects to the restarted server (same URL) and sees
    # the resumed job finish, without a reload
    first = start_live_server(tmp_path / "data")
    try:
        with first.client() as client:
            slow = submit_slow_job(client, delay_s=DELAY_S, gate=tmp_path / "gate")  # held until the stop
        page = browser.new_page()
        page.navigate(f"{first.url}/")
        _enter_key(page, first.write_key)
        page.wait_until(f"!!document.querySelector('tr[data-job=\"{slow['id']}\"]')", what="the slow job listed")
        assert _row_status(page, slow["id"]) in ("queued", "running"), "the slow job ended before the page loaded"
        # Forget key: the streams stop and the prompt comes back (no retry storm of 401s); a key resumes them
        _wait_for_stream(page, slow["id"])
        page.evaluate("document.getElementById('key-forget').click(); true")
        page.wait_until("!document.getElementById('key-form').hidden", what="the prompt after forgetting the key")
        before = len(page.requests)
        time.sleep(2.0)
        page.evaluate("1")  # drain the events of those 2 s
        assert len(page.requests) - before <= 2, [r["url"] for r in page.requests[before:]]
        _enter_key(page, first.write_key)
    finally:
        (tmp_path / "gate").touch()
        first.stop()  # the running tile finishes and is recorded; the rest resume at the next start
    port = int(first.url.rsplit(":", 1)[1])
    second = start_live_server(tmp_path / "data", port=port)
    try:
        page.wait_until(
            f"document.querySelector('tr[data-job=\"{slow['id']}\"]').dataset.status === 'succeeded'",
            timeout_s=120,
            what="the resumed job shown as succeeded",
        )
        assert page.navigations == 1
        assert _texts(page, f'tr[data-job="{slow["id"]}"] .tiles') == ["10 / 10 tiles"]
        streams = [r for r in page.requests if r["url"].endswith(f"/v1/jobs/{slow['id']}/events")]
        assert len(streams) >= 3, "the page did not open its event stream again (key, restart)"
        _check_requests_stayed_home(page, second, keys=(second.write_key, second.read_key))
    finally:
        second.stop()


class _TwoHeads(torch.nn.Module):
    """An exported model returning a dict (a token model's ``output=``): logits and an auxiliary head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 6)
        self.gate = torch.nn.Parameter(torch.tensor(0.5))
        self.logits = torch.nn.Linear(6, 3)
        self.aux = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = x + self.gate * torch.tanh(self.body(x)).sum(-1, keepdim=True)
        h = torch.relu(self.body(h))
        return {"logits": self.logits(h), "aux": self.aux(h)}


class _Pair(torch.nn.Module):
    """A model taking two tensors by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(2, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(a) * torch.sigmoid(self.b(b))
        return out


def _kernel(client: httpx.Client, job_id: str) -> np.ndarray:
    return wire.decode_npy(client.get(f"/v1/jobs/{job_id}/result", headers={"Accept": wire.MEDIA_NPY}).content)


@pytest.mark.slow
def test_console_shows_what_a_lab_reads(
    server: LiveServer, seeded: dict[str, Any], browser: Browser, tmp_path: Path
) -> None:
    """Issue 41: an exported model as a class and a short operator summary, both inputs of a two-input model, job
    time, throughput, size and the disk against the budget, output= of a job on a dict-returning model, a
    sequential heatmap with a scale for a non-negative kernel, the spectrum's progress, checkpoint comparison."""
    torch.manual_seed(0)
    dataset = seeded["dataset"]["id"]
    with Client(server.url, api_key=server.write_key) as remote:
        remote.register_module("two-heads", _TwoHeads(), input_shape=(4,))
        remote.register_module("pair", _Pair(), input_shape={"a": (3,), "b": (2,)})
    with server.client() as client:
        older = _submit(client, "mlp-a", dataset, version=1, tile_size=4)  # the seeded full job's rows, on v1
        heads = _submit(client, "two-heads", dataset, mode="trace", output="logits", tile_size=4)
        rng = np.random.default_rng(7)
        wide = client.post(
            "/v1/datasets",
            content=wire.encode_npy(rng.standard_normal((1500, 4)).astype(np.float32)),
            params={"name": "wide"},
            headers={"Content-Type": wire.MEDIA_NPY},
        ).json()
        big = _submit(client, "mlp-a", wide["id"], mode="trace", tile_size=500)  # a 1500 x 1500 trace kernel
        for job in (older, heads, big):
            _wait_for_status(client, job["id"], "succeeded", timeout_s=180)
        jobs = client.get("/v1/jobs").json()["data"]
        new = _kernel(client, seeded["full"]["id"])
        old = _kernel(client, older["id"])
        corner = _kernel(client, heads["id"])
    page = browser.new_page()
    page.navigate(f"{server.url}/")
    _enter_key(page, server.write_key)
    page.wait_until(f"!!document.querySelector('tr[data-job=\"{big['id']}\"]')", what="the new jobs listed")

    # the exported model: "exported <class>: <layer ops> + <the rest>", not a sha256 and a list of ATen names
    arch = _texts(page, 'tr[data-model="two-heads"] td.arch > span')[0]
    assert arch == "exported _TwoHeads: linear + add, mul, relu, sum, tanh", arch  # the class recorded at export
    assert "torch.ops" not in arch and not re.search(r"[0-9a-f]{16}", arch)
    assert _texts(page, 'tr[data-model="two-heads"] td.arch details.operators summary') == ["6 operators"]
    row_height = page.evaluate("document.querySelector('tr[data-model=\"two-heads\"]').getBoundingClientRect().height")
    assert row_height < 80, row_height  # one line and two closed summaries, not 25-30 lines of operator names
    with_class = page.evaluate(
        "import(new URL('console/format.js', document.baseURI)).then((fmt) => fmt.architecture({family: 'exported',"
        " class_name: 'GPT2LMHeadModel', operators: ['torch.ops.aten.linear.default',"
        " 'torch.ops.aten.scaled_dot_product_attention.default', 'torch.ops.aten.embedding.default',"
        " 'torch.ops.aten.layer_norm.default', 'torch.ops.aten.add.Tensor', 'torch.ops.aten.view.default',"
        " 'torch.ops.aten.gelu.default', 'torch.ops.aten.mul.Tensor', 'torch.ops.aten.permute.default',"
        " 'torch.ops.aten.softmax.int']}))"
    )
    assert with_class == (
        "exported GPT2LMHeadModel: embedding, layer_norm, linear, scaled_dot_product_attention"
        " + 6 elementwise and shape ops"
    )
    # a two-input model shows both inputs
    assert _texts(page, 'tr[data-model="pair"] td.inputs div') == ["a (3) float32", "b (2) float32"]

    # jobs: output= of the dict model's job; duration and throughput; the size on disk; the disk against the budget
    assert _texts(page, f'tr[data-job="{heads["id"]}"] .output') == ["output=logits"]
    time_cell = _texts(page, f'tr[data-job="{older["id"]}"] td.time-cell')[0]
    assert re.fullmatch(r"\d+\.\d s[0-9.,]+ tiles/s", time_cell), time_cell  # tenths: a small job is quick
    size = _texts(page, f'tr[data-job="{older["id"]}"] td.size-cell')[0]
    assert size == "1.7 KiB", size  # 8 x 8 x 3 x 3 float32 in 3 upper tiles of 4: 3 x 576 B
    used = sum(j["estimate_bytes"] for j in jobs if not j["result_deleted_at"])
    page.wait_until(f"document.getElementById('jobs-disk').dataset.used === '{used}'", what="the disk use shown")
    assert _texts(page, "#jobs-disk")[0].endswith(f"of the 64.0 MiB budget ({round(100 * used / DISK_BUDGET)} %)")

    # a trace kernel's corner: every entry > 0, drawn with a sequential colour map and its scale
    assert corner.min() > 0
    page.evaluate(f"document.querySelector('tr[data-job=\"{heads['id']}\"] [data-action=details]').click(); true")
    page.wait_until("document.getElementById('heatmap-figure').dataset.colours", what="the heatmap drawn")
    assert page.evaluate("document.getElementById('heatmap-figure').dataset.colours") == "sequential"
    caption = _texts(page, "#heatmap-figure figcaption")[0]
    assert f"viridis from {corner.min():.3g} (dark) to {corner.max():.3g} (light)" in caption.replace("e+", "e+"), (
        caption
    )
    page.wait_until("!!document.querySelector('#spectrum-figure img')", what="the spectrum drawn")
    heads_shot = page.screenshot(tmp_path / "console-heatmap.png")

    # the spectrum of a larger kernel: its progress shows at once (what, and the seconds so far), then the plot
    shown = page.evaluate(
        f"document.querySelector('tr[data-job=\"{big['id']}\"] [data-action=details]').click();"
        " document.querySelector('#spectrum-figure progress') !== null"
        " && document.querySelector('#spectrum-figure .progress-text').textContent"
    )
    assert shown.startswith("computing the top 20 eigenvalues of the 1500 × 1500 kernel") and shown.endswith(": 0 s")
    progress_shot = page.screenshot(tmp_path / "console-spectrum-progress.png")
    page.wait_until("!!document.querySelector('#spectrum-figure img')", timeout_s=120, what="the big spectrum drawn")
    assert re.search(r"Computed in [0-9.]+ s\.$", _texts(page, "#spectrum-figure figcaption")[0])

    # checkpoint comparison: the seeded full job (v2) against the same rows' kernel on v1, checked with numpy
    full_id = seeded["full"]["id"]
    page.evaluate(f"document.querySelector('tr[data-job=\"{full_id}\"] [data-action=details]').click(); true")
    page.wait_until(
        f"document.querySelector('#checkpoints tr[data-other=\"{older['id']}\"] .distance')?.textContent !== '—'"
        f" && !!document.querySelector('#checkpoints tr[data-other=\"{older['id']}\"] .distance')",
        what="the checkpoint distance",
    )
    a, b = new.astype(np.float64).ravel(), old.astype(np.float64).ravel()
    distance = 1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    change = np.linalg.norm(b - a) / np.linalg.norm(a)
    row = _texts(page, f'#checkpoints tr[data-other="{older["id"]}"] td')
    np.testing.assert_allclose(float(row[1]), distance, rtol=2e-3)
    np.testing.assert_allclose(float(row[2]), change, rtol=2e-3)
    assert _texts(page, f'#checkpoints tr[data-other="{older["id"]}"] th')[0] == "v1"
    # the colour map follows the signs: the full kernel's corner against numpy
    page.wait_until("document.getElementById('heatmap-figure').dataset.colours", what="the full heatmap drawn")
    k = new.shape[2]
    block = new[: 48 // k, : 48 // k]
    expected = "sequential" if block.min() >= 0 else "diverging"
    assert page.evaluate("document.getElementById('heatmap-figure').dataset.colours") == expected
    page.evaluate("document.getElementById('job-detail').scrollIntoView(); true")
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 0, f"the page is {overflow} px wider than a 1366 px screen"
    detail_shot = page.screenshot(tmp_path / "console-checkpoints.png")
    page.evaluate("window.scrollTo(0, 0); true")
    top_shot = page.screenshot(tmp_path / "console-lab.png")
    full_shot = page.screenshot(tmp_path / "console-lab-full.png", full_page=True)
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    for path in (heads_shot, progress_shot, detail_shot, top_shot, full_shot):
        shutil.copy(path, SCREENSHOT_DIR / path.name)
    print(f"\nconsole screenshots in {SCREENSHOT_DIR}")
    _check_requests_stayed_home(page, server, keys=(server.write_key, server.read_key))
