"""Models with several inputs over HTTP, against a real uvicorn process: a tiny Hugging Face BERT masked LM and GPT-2
(built from configs, no download; default settings: sdpa attention, tied embeddings) registered with
``register_module(input_shape={...}, input_dtype={...})``, their kernels over HTTP (JSON and safetensors bodies)
against the float64 per-example reference of the ORIGINAL modules; every bad named input a 422 naming the leaf;
hostile safetensors bodies a 4xx.

Tolerance: the server computes in float64 (``dtype="float64"``) on the exported graph, the reference in float64 on
the original module; both are the same float64 arithmetic up to operation order, so 1e-9 relative to the kernel's
largest entry (assert_matches) holds with margin (measured agreement ~1e-15).
"""

from __future__ import annotations

import json
import struct
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service import wire
from ntk_service.client import Client
from ntk_service.errors import InvalidInput
from tests.conftest import LiveServer
from tests.reference import assert_matches, reference_ntk

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),  # SDPA under vmap
]

VOCAB, T = 30, 5
SHAPES = {"input_ids": (T,), "attention_mask": (T,)}
DTYPES = {"input_ids": "int64", "attention_mask": "int64"}


def _quiet(build: Any) -> Any:  # transformers warns about config ids outside a tiny vocabulary; -W error fails it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build()


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    return _quiet(lambda: transformers.BertForMaskedLM(config)).eval()  # type: ignore[no-any-return]


def _gpt2() -> nn.Module:
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=16, use_cache=False)
    return _quiet(lambda: transformers.GPT2LMHeadModel(config)).eval()  # type: ignore[no-any-return]


def _tokens(n: int, seed: int, *, padded: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((n, T), dtype=np.int64)
    if padded:
        mask[0, 3:] = 0  # example 0 is padded
    return {"input_ids": rng.integers(0, VOCAB, (n, T)).astype(np.int64), "attention_mask": mask}


def _torch(x: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(value) for key, value in x.items()}


@pytest.fixture(scope="module")
def models(live_server: LiveServer) -> Iterator[dict[str, tuple[str, nn.Module]]]:
    out = {}
    with Client(live_server.url, api_key=live_server.write_key) as client:
        for kind, build in (("bert", _bert), ("gpt2", _gpt2)):
            module = build()
            name = f"hf-{kind}-{uuid.uuid4().hex[:6]}"
            record = _quiet(
                lambda m=module, n=name: client.register_module(n, m, input_shape=SHAPES, input_dtype=DTYPES)
            )
            assert record["architecture"]["family"] == "exported"
            assert record["inputs"] == {
                "kind": "mapping",
                "leaves": [
                    {"name": "input_ids", "shape": [T], "dtype": "int64", "vocab_size": VOCAB},
                    {"name": "attention_mask", "shape": [T], "dtype": "int64", "vocab_size": None},
                ],
            }
            assert record["architecture"]["outputs"] == {"logits": [T, VOCAB]}
            assert record["num_params"] == sum(p.numel() for p in module.parameters())  # tied embeddings once
            assert [p["name"] for p in record["parameters"]][:3] == [n for n, _ in module.named_parameters()][:3]
            assert client.get_model(name)["inputs"] == record["inputs"]  # GET /v1/models/{name} shows it
            out[kind] = (name, module)
    yield out


@pytest.mark.parametrize("transport", ["json", "safetensors"])
def test_bert_with_an_attention_mask_at_the_mask_position(
    live_server: LiveServer, models: dict[str, tuple[str, nn.Module]], transport: str
) -> None:
    name, bert = models["bert"]
    x1, x2 = _tokens(3, 1, padded=True), _tokens(2, 2, padded=False)
    expected = reference_ntk(bert, _torch(x1), _torch(x2), output=lambda out: out.logits[:, 2, :4])
    with Client(live_server.url, api_key=live_server.read_key, transport_format=transport) as client:  # type: ignore[arg-type]
        result = client.ntk_result(name, x1, x2, output="logits[:, 2, :4]", dtype="float64")
        assert result.theta.shape == (3, 2, 4, 4)
        assert_matches(torch.from_numpy(np.asarray(result.theta)), expected, 1e-9)
        # torch tensors as the values, x2 = x1, trace of the label-word logits
        trace = client.ntk(name, _torch(x1), output="logits[:, 2, :4]", mode="trace", dtype="float64")
        assert_matches(
            torch.from_numpy(trace),
            reference_ntk(bert, _torch(x1), mode="trace", output=lambda out: out.logits[:, 2, :4]),
            1e-9,
        )


def test_bert_whole_logits_and_gpt2_last_position(
    live_server: LiveServer, models: dict[str, tuple[str, nn.Module]]
) -> None:
    bert_name, bert = models["bert"]
    gpt_name, gpt2 = models["gpt2"]
    x1 = _tokens(2, 3, padded=True)
    with Client(live_server.url, api_key=live_server.read_key) as client:
        theta = client.ntk(bert_name, x1, output="logits", mode="trace", dtype="float64")
        assert_matches(
            torch.from_numpy(theta), reference_ntk(bert, _torch(x1), mode="trace", output=lambda o: o.logits), 1e-9
        )
        x2 = _tokens(3, 4, padded=False)
        theta = client.ntk(gpt_name, x1, x2, output="logits[:, -1, :5]", dtype="float64")
        expected = reference_ntk(gpt2, _torch(x1), _torch(x2), output=lambda o: o.logits[:, -1, :5])
        assert_matches(torch.from_numpy(theta), expected, 1e-9)


def _post(live_server: LiveServer, name: str, body: dict[str, Any]) -> tuple[int, str]:
    with live_server.client("read") as http:
        response = http.post(
            f"/v1/models/{name}/ntk", content=wire.json_dumps(body), headers={"Content-Type": wire.MEDIA_JSON}
        )
    return response.status_code, response.json()["error"]["message"] if response.status_code >= 400 else ""


def _named_json(x: dict[str, np.ndarray]) -> dict[str, Any]:
    return {key: wire.tensor_to_json(value) for key, value in x.items()}


def test_bad_named_inputs_are_a_422_naming_the_leaf(
    live_server: LiveServer, models: dict[str, tuple[str, nn.Module]]
) -> None:
    name = models["bert"][0]
    good = _tokens(2, 5, padded=False)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input_ids": good["input_ids"]}, "missing ['attention_mask']"),
        ({**good, "token_type_ids": good["input_ids"]}, "unexpected ['token_type_ids']"),
        ({**good, "attention_mask": good["attention_mask"][:1]}, "x1['attention_mask'] has 1 examples"),
        ({**good, "input_ids": good["input_ids"].astype(np.float32)}, "x1['input_ids'] has dtype float32"),
        ({**good, "input_ids": good["input_ids"] + VOCAB - 1}, "x1['input_ids'] has token ids in"),
        ({**good, "input_ids": good["input_ids"][:, :3]}, "x1['input_ids'] has per-example shape (3,)"),
    ]
    for x1, needle in cases:
        status, message = _post(live_server, name, {"x1": _named_json(x1), "output": "logits[:, 0]"})
        assert status == 422 and needle in message, (needle, status, message)
    # ids beyond the vocabulary in the LAST example only: every example is checked
    late = {**good, "input_ids": good["input_ids"].copy()}
    late["input_ids"][-1, -1] = VOCAB
    status, message = _post(live_server, name, {"x1": _named_json(late), "output": "logits[:, 0]"})
    assert status == 422 and f"x1['input_ids'] has token ids in [{late['input_ids'].min()}, {VOCAB}]" in message
    # one tensor for a model with named inputs; an output path that does not exist
    status, message = _post(live_server, name, {"x1": wire.tensor_to_json(good["input_ids"])})
    assert status == 422 and "takes the named inputs ['input_ids', 'attention_mask']" in message
    status, message = _post(live_server, name, {"x1": _named_json(good), "output": "hidden[:, 0]"})
    assert status == 422 and "hidden" in message
    status, message = _post(live_server, name, {"x1": {"input ids": wire.tensor_to_json(good["input_ids"])}})
    assert status == 422 and "is not an identifier" in message


def test_named_inputs_and_output_for_a_model_taking_one_tensor(live_server: LiveServer) -> None:
    name = f"one-{uuid.uuid4().hex[:6]}"
    with Client(live_server.url, api_key=live_server.write_key) as client:
        arch = {"family": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 2}
        client.register_model(name, arch, seed=0)
        x = np.zeros((2, 3), dtype=np.float32)
        with pytest.raises(InvalidInput, match="takes one tensor x"):
            client.ntk(name, {"x": x})
        with pytest.raises(InvalidInput, match="returns one tensor; drop output"):
            client.ntk(name, x, output="logits")
        assert client.ntk(name, x).shape == (2, 2, 2, 2)  # the plain path is unchanged


def _safetensors(header: dict[str, Any], data: bytes, *, declared: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if declared is None else declared) + raw + data


def test_hostile_safetensors_bodies_are_a_4xx(
    live_server: LiveServer, models: dict[str, tuple[str, nn.Module]]
) -> None:
    name = models["bert"][0]
    good = _tokens(2, 6, padded=False)
    lying = _safetensors({"x1.input_ids": {"dtype": "I64", "shape": [2, T], "data_offsets": [0, 10**6]}}, b"\0" * 80)
    huge = _safetensors({}, b"", declared=2**40)
    odd = wire.encode_safetensors({"x1.input ids": good["input_ids"], "x1.attention_mask": good["attention_mask"]})
    climb = wire.encode_safetensors({"x1.../x": good["input_ids"]})
    stray = wire.encode_safetensors({"x1.input_ids": good["input_ids"], "x3": good["input_ids"]})
    both = wire.encode_safetensors({"x1": good["input_ids"], "x1.input_ids": good["input_ids"]})
    with live_server.client("read") as http:
        for body, needle in (
            (lying, "safetensors"),
            (huge, "safetensors"),
            (odd, "'x1.input ids'"),
            (climb, "'x1.../x'"),
            (stray, "'x3'"),
            (both, "both"),
        ):
            response = http.post(
                f"/v1/models/{name}/ntk",
                content=body,
                headers={"Content-Type": wire.MEDIA_SAFETENSORS},
                params={"output": "logits[:, 0]"},
            )
            assert 400 <= response.status_code < 500, (needle, response.status_code, response.text)
            assert needle in response.json()["error"]["message"], (needle, response.text)
        assert http.get("/healthz").status_code == 200


class _MaskedBag(nn.Module):
    """Token ids and a mask as keyword arguments, a tensor out: mean of the unmasked embeddings, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        weights = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        pooled = (self.embed(input_ids) * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(torch.tanh(pooled))


def test_named_inputs_through_the_analysis_and_kernel_family_routes(live_server: LiveServer) -> None:
    torch.manual_seed(3)
    module = _MaskedBag().eval()
    name = f"bag-{uuid.uuid4().hex[:6]}"
    x = _tokens(4, 7, padded=True)
    with Client(live_server.url, api_key=live_server.write_key) as client:
        record = client.register_module(name, module, input_shape=SHAPES, input_dtype=DTYPES)
        assert record["inputs"]["kind"] == "mapping" and "outputs" not in record["architecture"]
        theta = client.ntk(name, x, dtype="float64")  # no output: the model returns a tensor
        assert_matches(torch.from_numpy(theta), reference_ntk(module.double(), _torch(x)), 1e-9)
        # spectrum of the (N k, N k) kernel against numpy's eigenvalues of the reference
        reference = reference_ntk(module, _torch(x)).permute(0, 2, 1, 3).reshape(8, 8).numpy()  # (N k, N k)
        spectrum = client.spectrum(name, {key: torch.from_numpy(v) for key, v in x.items()})
        expected = np.sort(np.linalg.eigvalsh(reference))[::-1]
        np.testing.assert_allclose(np.sort(spectrum.eigenvalues)[::-1], expected, rtol=1e-6, atol=1e-9 * expected[0])
        # the kernel family's operator route takes the named sides as the kernel route does
        v = np.random.default_rng(0).standard_normal((4, 2))
        product = client.matvec(name, x, v=v, dtype="float64")
        np.testing.assert_allclose(np.asarray(product).reshape(-1), reference @ v.reshape(-1), rtol=1e-9, atol=1e-12)
        bad = {"input_ids": x["input_ids"]}
        with pytest.raises(InvalidInput, match=r"missing \['attention_mask'\]"):
            client.spectrum(name, bad)
        with pytest.raises(InvalidInput, match=r"missing \['attention_mask'\]"):
            client.nngp(name, bad)


def test_bert_kernels_and_jobs_over_named_data_sets(
    live_server: LiveServer, models: dict[str, tuple[str, nn.Module]]
) -> None:
    """A named data set uploaded once, referenced by rows in a kernel request and in a job, with ``output``."""
    name, bert = models["bert"]
    x1, x2 = _tokens(4, 5, padded=True), _tokens(3, 6, padded=False)
    label_words = lambda out: out.logits[:, 2, :4]  # noqa: E731
    with Client(live_server.url, api_key=live_server.write_key) as client:
        d1, d2 = client.upload_dataset(x1), client.upload_dataset(x2)
        rows = {"dataset": d1["id"], "start": 1, "stop": 4}
        theta = client.ntk(name, rows, {"dataset": d2["id"]}, output="logits[:, 2, :4]", dtype="float64")
        sliced = {key: value[1:4] for key, value in x1.items()}
        expected_rows = reference_ntk(bert, _torch(sliced), _torch(x2), output=label_words)
        assert_matches(torch.from_numpy(theta), expected_rows, 1e-9)
        job = client.submit_job(name, d1["id"], d2["id"], output="logits[:, 2, :4]", mode="trace", dtype="float64")
        done = client.wait(job, progress=False, timeout=180)
        assert done["status"] == "succeeded", done["error"]
        trace = client.job_result(done["id"])
        missing = {"input_ids": x1["input_ids"]}  # the model's spec also names attention_mask
        d3 = client.upload_dataset(missing)
        with pytest.raises(InvalidInput, match="attention_mask"):
            client.ntk(name, {"dataset": d3["id"]}, output="logits[:, 2, :4]")
        with pytest.raises(InvalidInput, match="attention_mask"):
            client.submit_job(name, d3["id"], output="logits[:, 2, :4]")
    expected = reference_ntk(bert, _torch(x1), _torch(x2), mode="trace", output=label_words)
    assert_matches(torch.from_numpy(np.asarray(trace)), expected, 1e-9)


def test_output_through_the_analysis_and_kernel_family_routes(
    live_server: LiveServer, models: dict[str, tuple[str, nn.Module]]
) -> None:
    """``output`` on /spectrum, /predict and /operator/matvec of a model returning a ModelOutput (k from the
    selection, before any compute), against the float64 reference of the original BERT."""
    name, bert = models["bert"]
    x = _tokens(3, 8, padded=True)
    label_words = lambda out: out.logits[:, 2, :4]  # noqa: E731
    reference = reference_ntk(bert, _torch(x), output=label_words).permute(0, 2, 1, 3).reshape(12, 12).numpy()
    with Client(live_server.url, api_key=live_server.read_key) as client:
        spectrum = client.spectrum(name, x, output="logits[:, 2, :4]")
        expected = np.sort(np.linalg.eigvalsh(reference))[::-1]
        np.testing.assert_allclose(np.sort(spectrum.eigenvalues)[::-1], expected, rtol=1e-6, atol=1e-9 * expected[0])
        v = np.random.default_rng(1).standard_normal((3, 4))
        product = client.matvec(name, x, v=v, dtype="float64", output="logits[:, 2, :4]")
        np.testing.assert_allclose(np.asarray(product).reshape(-1), reference @ v.reshape(-1), rtol=1e-9, atol=1e-12)
        y = np.random.default_rng(2).standard_normal((3, 4))
        predicted = client.predict(name, x, y, times=[0.0], learning_rate=0.1, output="logits[:, 2, :4]")
        with torch.no_grad():
            f0 = label_words(bert.double()(**_torch(x))).numpy()
        np.testing.assert_allclose(predicted.f0_train, f0, rtol=1e-9, atol=1e-12)  # f is the selected logits
        with pytest.raises(InvalidInput, match="nope"):
            client.spectrum(name, x, output="nope")
        with pytest.raises(InvalidInput, match="y_train"):  # k = 4 from the selection, known before computing
            client.predict(name, x, y[:, :3], times=[0.0], learning_rate=0.1, output="logits[:, 2, :4]")


def test_a_vision_transformer_over_http(live_server: LiveServer) -> None:
    """A tiny Hugging Face ViT (one keyword input ``pixel_values``, a ModelOutput) registered from the client, its
    kernel over HTTP (JSON and safetensors) against the float64 reference of the original module."""
    torch.manual_seed(2)
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        num_labels=3,
    )
    vit = _quiet(lambda: transformers.ViTForImageClassification(config)).eval()
    name = f"hf-vit-{uuid.uuid4().hex[:6]}"
    rng = np.random.default_rng(4)
    x1, x2 = ({"pixel_values": rng.standard_normal((n, 3, 8, 8)).astype(np.float32)} for n in (3, 2))
    expected = reference_ntk(vit, _torch(x1), _torch(x2), output=lambda out: out.logits)
    with Client(live_server.url, api_key=live_server.write_key) as client:
        record = _quiet(
            lambda: client.register_module(
                name, vit, input_shape={"pixel_values": (3, 8, 8)}, input_dtype={"pixel_values": "float32"}
            )
        )
        assert record["architecture"]["outputs"] == {"logits": [3]}
        for transport in ("json", "safetensors"):
            client.transport_format = transport  # type: ignore[assignment]
            theta = client.ntk(name, x1, x2, output="logits", dtype="float64")
            assert_matches(torch.from_numpy(theta), expected, 1e-9)
