"""The console's attribution view in a real headless Chromium against a real server: the attribution jobs and the
stored training sides are listed; exploring a job shows a test example and its top proponents and opponents, drawn
as 8 × 8 images (digits' 64 pixels) with the scores and labels the API gives, and other examples are picked with
the keyboard-reachable controls; inputs that are not image-shaped are shown as values. The screenshot is written to
``SCREENSHOT_DIR`` for a person to look at.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ntk_service.client import Client
from tests.browser import Browser, Page, require_chromium
from tests.conftest import LiveServer, start_live_server
from tests.jobs.conftest import TINY_MLP
from tests.server.digits import digits, register_digits
from tests.server.test_console import SCREENSHOT_DIR, _check_requests_stayed_home, _enter_key, _texts

TOP_K = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_live_server(tmp_path_factory.mktemp("console-attribution") / "data")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def seeded(server: LiveServer) -> dict[str, Any]:
    """An attribution job over the digits' three checkpoints, and one over a model of 4 inputs (not an image)."""
    problem = digits()
    rng = np.random.default_rng(0)
    with Client(server.url, api_key=server.write_key) as client:
        ids = register_digits(client, "digits", problem)
        result = client.attribute(
            "digits", train=ids.x_train, labels=ids.y_train, test=ids.x_test, test_labels=ids.y_test,
            versions=ids.versions, dim=256, top_k=TOP_K, progress=None,
        )  # fmt: skip
        client.register_model("tiny", TINY_MLP, seed=0)
        x, y = client.upload_dataset(rng.standard_normal((10, 4)).astype(np.float32)), client.upload_dataset(
            rng.integers(0, 3, 10))  # fmt: skip
        flat = client.attribute("tiny", train=x["id"], labels=y["id"], test=x["id"], dim=32, top_k=2, progress=None)
        examples = {i: client.attribution_example(result.job, i) for i in (0, 1, 39)}
    return {"digits": result.job, "tiny": flat.job, "examples": examples, "problem": problem}


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    executable = require_chromium()
    with Browser(tmp_path_factory.mktemp("chromium"), executable=executable) as started:
        yield started


def _explore(page: Page, job_id: str) -> None:
    page.evaluate(f"document.querySelector('tr[data-attribution=\"{job_id}\"] [data-action=explore]').click(); true")
    _shown(page, 0)


def _shown(page: Page, index: int) -> None:
    page.wait_until(
        f"document.getElementById('attribution-example')?.dataset.shown === '{index}'"
        " && [...document.querySelectorAll('#attribution-example img')].every((i) => i.complete)",
        what=f"test example {index} drawn",
    )


def _cards(page: Page, side: str) -> list[dict[str, Any]]:
    value: list[dict[str, Any]] = page.evaluate(
        f"[...document.querySelectorAll('[data-side={side}] figure')].map((f) => ({{index: Number(f.dataset.index),"
        " score: Number(f.dataset.score), caption: f.querySelector('figcaption').textContent,"
        " drawn: !!f.querySelector('img') && f.querySelector('img').naturalWidth > 0"
        " && f.querySelector('img').src.startsWith('blob:')}))"
    )
    return value


@pytest.mark.slow
def test_the_attribution_view_shows_a_test_examples_top_training_examples_as_images(
    server: LiveServer, seeded: dict[str, Any], browser: Browser, tmp_path: Path
) -> None:
    page = browser.new_page()
    page.navigate(f"{server.url}/")
    _enter_key(page, server.write_key)
    job = seeded["digits"]
    page.wait_until(f"!!document.querySelector('tr[data-attribution=\"{job}\"]')", what="the attribution job listed")
    assert page.evaluate(f"document.querySelector('tr[data-attribution=\"{job}\"]').dataset.status") == "succeeded"
    assert len(_texts(page, "#attribution-features-body tbody tr")) == 4  # the digits' 3 checkpoints and the tiny one
    row = _texts(page, f'tr[data-attribution="{job}"] td')
    assert row[0] == "digits v2, digits v3, digits v4" and row[1] == "200 × 40", row

    _explore(page, job)
    problem = seeded["problem"]
    for index in (0, 1, 39):
        if index == 1:
            page.evaluate("document.querySelector('[data-action=next]').click(); true")
        elif index == 39:
            page.evaluate(
                "const i = document.getElementById('attribution-index'); i.value = '39';"
                " i.dispatchEvent(new Event('change')); true"
            )
        _shown(page, index)
        expected = seeded["examples"][index]
        for side in ("proponents", "opponents"):
            cards = _cards(page, side)
            assert [c["index"] for c in cards] == [e.index for e in getattr(expected, side)]
            np.testing.assert_allclose([c["score"] for c in cards], [e.score for e in getattr(expected, side)])
            assert all(c["drawn"] for c in cards), cards
            assert all(f"label {problem.y_train[c['index']]}" in c["caption"] for c in cards)
        test_caption = _texts(page, "#attribution-example .example-test figcaption")[0]
        assert test_caption == f"test #{index}label {problem.y_test[index]}", test_caption
        assert page.evaluate("document.querySelectorAll('#attribution-example img').length") == 1 + 2 * TOP_K
    assert "drawn as 1 × 8 × 8 images" in _texts(page, "#attribution-example .example-row p")[0]

    # the images are the inputs: digits' 64 pixels laid out 8 × 8, each scaled to its own range, 10 px per pixel
    pixels = page.evaluate(
        "(async () => { const img = document.querySelector('#attribution-example .example-test img');"
        " const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;"
        " const ctx = c.getContext('2d'); ctx.drawImage(img, 0, 0);"
        " const d = ctx.getImageData(0, 0, c.width, c.height);"
        " return {w: c.width, grey: Array.from({length: 8}, (_, y) => Array.from({length: 8},"
        " (_, x) => d.data[4 * ((10 * y + 5) * c.width + 10 * x + 5)]))}; })()"
    )
    image = problem.x_test[39].reshape(8, 8)
    expected_grey = np.round(255 * (image - image.min()) / (image.max() - image.min()))
    assert pixels["w"] == 80
    np.testing.assert_allclose(np.array(pixels["grey"]), expected_grey, atol=1)
    shapes = page.evaluate(
        "import(new URL('console/attribution.js', document.baseURI)).then((a) =>"
        " [[64], [784], [3072], [10], [28, 28], [3, 32, 32], [32, 32, 3], [2, 5], {a: [3]}].map(a.imageShape))"
    )
    assert shapes == [
        [1, 8, 8, "chw"], [1, 28, 28, "chw"], [3, 32, 32, "chw"], None, [1, 28, 28, "chw"], [3, 32, 32, "chw"],
        [3, 32, 32, "hwc"], None, None,
    ]  # fmt: skip

    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    page.evaluate("document.getElementById('attribution-detail').scrollIntoView(); true")
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 0, f"the page is {overflow} px wider than a 1366 px screen"
    shot = page.screenshot(tmp_path / "console-attribution.png")
    page.evaluate("document.getElementById('attribution').scrollIntoView(); true")
    listed = page.screenshot(tmp_path / "console-attribution-list.png")
    for path in (shot, listed):
        shutil.copy(path, SCREENSHOT_DIR / path.name)
    print(f"\nconsole screenshots: {SCREENSHOT_DIR / shot.name}, {SCREENSHOT_DIR / listed.name}")
    unnamed = page.evaluate(
        "[...document.querySelectorAll('#attribution button, #attribution-detail button, #attribution-detail input,"
        " #attribution-detail img')].filter((e) => e.tagName === 'IMG' ? !e.alt : e.tagName === 'INPUT'"
        " ? !e.labels.length : !(e.getAttribute('aria-label') || e.textContent.trim())).map((e) => e.outerHTML)"
    )
    assert unnamed == [], unnamed

    # a model of 4 inputs: not an image, its values are shown
    page.evaluate("document.getElementById('attribution-detail-close').click(); true")
    _explore(page, seeded["tiny"])
    assert page.evaluate("document.querySelectorAll('#attribution-example img').length") == 0
    values = _texts(page, "#attribution-example .example-test .example-values")
    assert values and values[0].startswith("(4): ["), values
    tiny_caption = _texts(page, "#attribution-example .example-test figcaption")[0]
    assert tiny_caption == "test #0no label: its predicted class", tiny_caption  # no test labels were given
    assert json.loads(page.evaluate("JSON.stringify(document.getElementById('attribution-detail').hidden)")) is False
    page.evaluate("document.getElementById('attribution-detail').scrollIntoView(); true")
    values_shot = page.screenshot(tmp_path / "console-attribution-values.png")
    shutil.copy(values_shot, SCREENSHOT_DIR / values_shot.name)
    _check_requests_stayed_home(page, server, keys=(server.write_key, server.read_key))
