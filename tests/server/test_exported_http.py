"""The ``exported`` family end to end against the real server: researchers' models registered with
``register_module`` (exported on the client, loaded without pickle on the server), two checkpoints each, kernels over
HTTP = ``compute_ntk`` on the original module = the float64 reference; hostile archives uploaded as curl would are
refused with a 4xx and a message, nothing they carry runs, and the server keeps serving."""

from __future__ import annotations

import copy
import uuid
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.client import Client
from ntk_service.client._export import multipart_body
from ntk_service.errors import InvalidInput, UnsupportedModel
from ntk_service.kernels.api import compute_ntk
from tests.conftest import LiveServer
from tests.reference import assert_matches, reference_ntk
from tests.registry.archives import export_archive, mkdir_payload, nodes, rewrite, torch_load_runs_it
from tests.registry.exported_models import CASES, case
from tests.registry.sequential_models import train_steps


def _batch(example: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, *example.shape[1:], generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # SDPA under vmap (attention)
@pytest.mark.parametrize("which", CASES)
def test_exported_models_two_checkpoints_kernels_equal_the_reference(live_server: LiveServer, which: str) -> None:
    module, example = case(which)
    epoch0 = copy.deepcopy(module)
    name = f"exp-{which.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    shape = tuple(example.shape[1:])
    with Client(live_server.url, api_key=live_server.write_key) as client:
        first = client.register_module(name, module, input_shape=shape, label="epoch 0")
        # a nested-Sequential ResNet is what the declarative family describes: sent as a spec, not exported
        family = "sequential" if which == "nested_resnet" else "exported"
        assert (first["version"], first["label"], first["architecture"]["family"]) == (1, "epoch 0", family)
        assert [p["name"] for p in first["parameters"]] == [n for n, _ in module.named_parameters()]
        assert first["num_params"] == sum(p.numel() for p in module.parameters())
        assert first["input_shape"] == list(shape) and first["output_dim"] == module(example).shape[1]
        # what the engine does with it: every parameter structured, on the program as on the module (issue 37)
        assert first["class_name"] == (None if family == "sequential" else type(module).__name__)
        groups = first["parameter_paths"]["groups"]
        assert {g["path"] for g in groups} == {"structured"} and first["parameter_paths"]["jacrev_parameters"] == 0
        assert client.get_model(name)["parameter_paths"] == first["parameter_paths"]

        train_steps(module, example, 1, seed=9)  # type: ignore[arg-type]  # the user's own state_dict, unchanged
        second = client.upload_weights(name, module.state_dict(), label="epoch 1")
        assert (second["version"], second["architecture"]) == (2, first["architecture"])
        downloaded = client.download_weights(name, 1, as_torch=True)
        assert sorted(downloaded) == sorted(epoch0.state_dict())
        for key, tensor in epoch0.state_dict().items():
            assert torch.equal(downloaded[key], tensor), key

        x1, x2 = _batch(example, 2, 3), _batch(example, 3, 4)
        thetas = []
        for version, local in ((1, epoch0), (2, module)):
            theta = client.ntk(name, x1.numpy(), x2.numpy(), dtype="float64", version=version, as_torch=True)
            here = compute_ntk(local, x1, x2, implementation="jacobian_contraction", dtype=torch.float64).theta
            assert_matches(theta, here.double())
            assert_matches(theta, reference_ntk(local, x1, x2))
            thetas.append(theta)
        assert (thetas[0] - thetas[1]).abs().max() > 1e-3 * thetas[0].abs().max()  # the versions differ


@pytest.mark.slow
def test_every_implementation_and_parameter_globs_by_the_original_names(live_server: LiveServer) -> None:
    module, example = case("gated_loop")
    name = f"exp-globs-{uuid.uuid4().hex[:6]}"
    x1, x2 = _batch(example, 2, 5), _batch(example, 2, 6)
    with Client(live_server.url, api_key=live_server.write_key) as client:
        client.register_module(name, module, input_shape=tuple(example.shape[1:]))
        for implementation in ("auto", "structured", "jacobian_contraction", "ntk_vector_products"):
            theta = client.ntk(name, x1, x2, dtype="float64", implementation=implementation, as_torch=True)
            assert_matches(theta, reference_ntk(module, x1, x2))
        # the gate and the second block only: Θ restricted to those parameters (the reference freezes the rest)
        theta = client.ntk(name, x1, x2, dtype="float64", params=["gate", "blocks.1.*"], as_torch=True)
        assert_matches(theta, reference_ntk(module, x1, x2, params=["gate", "blocks.1.weight", "blocks.1.bias"]))
        for mode in ("trace", "example_diagonal"):
            theta = client.ntk(name, x1, dtype="float64", mode=mode, as_torch=True)
            assert_matches(theta, reference_ntk(module, x1, mode=mode))
        # groups by the original names, and "modules": one group per module of the program (its attribute paths)
        groups = client.ntk_groups(name, x1, x2, groups={"gate": ["gate"]}, rest=True, dtype="float64", as_torch=True)
        assert_matches(groups.thetas["gate"], reference_ntk(module, x1, x2, params=["gate"]))
        rest = [n for n, _ in module.named_parameters() if n != "gate"]
        assert_matches(groups.thetas["rest"], reference_ntk(module, x1, x2, params=rest))
        per_module = client.ntk_groups(name, x1, x2, dtype="float64", as_torch=True)
        assert {"blocks.0", "head"} <= set(per_module.thetas)
        # a batch job over a data set: tiles through the same registry and engine
        dataset = client.upload_dataset(_batch(example, 5, 8).numpy())
        job = client.submit_job(name, dataset["id"], mode="trace", dtype="float64", tile_size=2)
        assert client.wait(job, progress=False)["status"] == "succeeded"
        expected = reference_ntk(module, _batch(example, 5, 8), mode="trace")
        assert_matches(torch.from_numpy(client.job_result(job["id"])), expected)

        # checkpoints are checked against the program's signature: every wrong name and shape named
        state = dict(module.state_dict())
        state["blocks.0.weight"] = torch.zeros(2, 2)
        del state["gate"]
        with pytest.raises(InvalidInput) as info:
            client.upload_weights(name, state)
        assert "missing tensors: gate" in info.value.message
        assert "blocks.0.weight (expected [5, 5] float32, got [2, 2] float32)" in info.value.message


@pytest.mark.slow
def test_the_kernel_family_on_an_exported_model_equals_products_written_out(live_server: LiveServer) -> None:
    module, example = case("residual_mlp")  # LayerNorm, GELU, residuals: k = 3 outputs
    name = f"exp-family-{uuid.uuid4().hex[:6]}"
    x1, x2 = _batch(example, 3, 11), _batch(example, 2, 12)
    with torch.no_grad():  # the NNGP's features are the outputs: f(x1) f(x2)ᵀ by hand, in float64
        f1, f2 = copy.deepcopy(module).double()(x1.double()), copy.deepcopy(module).double()(x2.double())
    full = reference_ntk(module, x1, x2)
    with Client(live_server.url, api_key=live_server.write_key) as client:
        assert client.register_module(name, module, input_shape=(4,))["architecture"]["family"] == "exported"
        nngp = client.nngp_result(name, x1, x2, dtype="float64", as_torch=True)
        assert (nngp.features, nngp.layer, nngp.version) == (3, None, 1)
        assert_matches(nngp.kernel, f1[:, None, :, None] * f2[None, :, None, :])
        assert_matches(client.nngp(name, x1, x2, mode="trace", dtype="float64", as_torch=True), f1 @ f2.T)

        # the pseudo-NTK (the full kernel summed over both output axes, over k) and the operator's products
        pseudo = client.ntk(name, x1, x2, mode="pseudo", dtype="float64", as_torch=True)
        assert_matches(pseudo, reference_ntk(module, x1, x2, mode="pseudo"))
        v = torch.randn(2, 3, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
        product = client.matvec(name, x1, x2, v=v, dtype="float64", as_torch=True)
        assert_matches(product, torch.einsum("nmab,mb->na", full, v))
        w = torch.randn(3, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
        back = client.matvec(name, x1, x2, v=w, mode="trace", transpose=True, dtype="float64", as_torch=True)
        assert_matches(back, torch.einsum("nm,n->m", full.diagonal(dim1=2, dim2=3).sum(-1), w))

        # an analysis route on the program: the top of Θ(x1, x1)'s spectrum (float32 on the server) = numpy's eigvalsh
        spectrum = client.spectrum(name, x1, top=4, method="eigh")
        matrix = reference_ntk(module, x1).permute(0, 2, 1, 3).reshape(9, 9).numpy()
        expected = np.linalg.eigvalsh(matrix)[::-1][:4]
        np.testing.assert_allclose(spectrum.eigenvalues, expected, rtol=1e-4, atol=1e-5 * expected[0])

        # what a program cannot give is refused with what to do instead: no initializer, no called submodules
        with pytest.raises(UnsupportedModel) as info:
            client.monte_carlo(name, x1, seeds=[0, 1], dtype="float64")
        assert info.value.http_status == 422
        assert "holds weights but no initializer" in info.value.message
        with pytest.raises(UnsupportedModel) as info:
            client.nngp(name, x1, layer="blocks.0")
        assert "layer 'blocks.0'" in info.value.message and "never its submodules" in info.value.message


def test_an_export_failure_reaches_the_user_with_torchs_message_and_what_to_do(live_server: LiveServer) -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(x) if x.sum() > 0 else -self.fc(x)  # data-dependent control flow
            return out

    with Client(live_server.url, api_key=live_server.write_key) as client:
        with pytest.raises(InvalidInput) as info:
            client.register_module("never-branchy", Branchy(), input_shape=(3,))
        message = info.value.message
        assert message.startswith("register_module: torch.export.export could not capture Branchy.forward")
        assert "data-dependent" in message.lower() and "torch.where instead of if" in message
        assert "never-branchy" not in {m["name"] for m in client.list_models()}


# ---------------------------------------------------------------- hostile uploads, as curl sends them


def _upload(live_server: LiveServer, name: str, data: bytes) -> Any:
    body, content_type = multipart_body({"name": name}, {"program": ("model.pt2", data)})
    with live_server.client("write") as http:
        return http.post("/v1/models/exported", content=body, headers={"Content-Type": content_type})


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x)
        return out


def test_hostile_archives_are_refused_nothing_runs_and_the_server_keeps_serving(
    live_server: LiveServer, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    archive = export_archive(_Small(), torch.randn(2, 3))
    marker = tmp_path / "ran"

    def pickled(config: Any) -> None:
        config["config"]["fc.weight"]["use_pickle"] = True

    def rand(program: Any) -> None:
        nodes(program)[-1]["target"] = "torch.ops.aten.rand_like.default"

    def bigger(config: Any) -> None:
        config["config"]["fc.weight"]["tensor_meta"]["sizes"][0] = {"as_int": 200}

    def pickled_constant(config: Any) -> None:  # a lifted tensor constant torch would torch.load
        entry = {"path_name": "tensor_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
        config["config"]["lifted_tensor_0"] = entry

    weights = "data/weights/model_weights_config.json"
    pickled_weight = rewrite(archive, {"data/weights/weight_0": mkdir_payload(marker)}, edit_json={weights: pickled})
    torch_load_runs_it(pickled_weight, marker)  # the control: torch's own loader runs it
    constants = "data/constants/model_constants_config.json"
    pickled_const = rewrite(
        archive, edit_json={constants: pickled_constant}, add={"archive/data/constants/tensor_0": mkdir_payload(marker)}
    )
    torch_load_runs_it(pickled_const, marker)
    cases = [
        (pickled_weight, 422, "weight 'fc.weight' is marked use_pickle"),
        (pickled_const, 422, "constant 'lifted_tensor_0' is marked use_pickle"),
        (
            rewrite(archive, add={"archive/../../escape": b"x"}),
            422,
            "the archive has an entry named 'archive/../../escape'",
        ),
        (
            rewrite(archive, add={"archive/extra/zeros": bytes(8 << 20)}, compression=zipfile.ZIP_DEFLATED),
            413,
            "refused as a zip bomb",
        ),
        (
            rewrite(archive, edit_json={"models/model.json": rand}),
            422,
            "the graph calls torch.ops.aten.rand_like.default",
        ),
        (rewrite(archive, edit_json={weights: bigger}), 422, "declares sizes [200, 3], strides [3, 1] and offset 0"),
        (b"not a zip", 400, "the upload is not a zip archive"),
    ]
    for i, (data, status, fragment) in enumerate(cases):
        response = _upload(live_server, f"hostile-{i}", data)
        assert response.status_code == status, (fragment, response.text)
        assert fragment in response.json()["error"]["message"], response.json()
        assert not marker.exists()
    # the sample inputs are never read: a pickle there does not run, and the program registers
    sample = rewrite(archive, {"data/sample_inputs/model.pt": mkdir_payload(marker)})
    name = f"sample-{uuid.uuid4().hex[:6]}"
    assert _upload(live_server, name, sample).status_code == 201
    assert not marker.exists() and not (Path(live_server.data_dir).parent / "escape").exists()
    with live_server.client("read") as http:
        assert http.get("/healthz").status_code == 200
        names = {m["name"] for m in http.get("/v1/models").json()["data"]}
    assert not any(n.startswith("hostile-") for n in names)
    with Client(live_server.url, api_key=live_server.read_key) as client:  # still computing kernels
        x = torch.randn(2, 3)
        theta = client.ntk(name, x, dtype="float64", as_torch=True)
        local = _Small()
        local.load_state_dict(client.download_weights(name, as_torch=True))
        assert_matches(theta, reference_ntk(local, x))


def test_the_upload_route_refuses_a_form_without_its_fields(live_server: LiveServer) -> None:
    body, content_type = multipart_body({"name": "m"}, {})
    with live_server.client("write") as http:
        response = http.post("/v1/models/exported", content=body, headers={"Content-Type": content_type})
        assert response.status_code == 422
        assert "the form needs a text field 'name' and a file field 'program'" in response.json()["error"]["message"]
        response = http.post("/v1/models/exported", content=b"{}", headers={"Content-Type": "application/json"})
        assert response.status_code == 415
    with live_server.client("read") as http:  # registering needs the write scope
        assert http.post("/v1/models/exported", content=body, headers={"Content-Type": content_type}).status_code == 403


def test_register_program_takes_a_saved_file_and_names_one_it_cannot_read(
    live_server: LiveServer, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    path = tmp_path / "small.pt2"
    path.write_bytes(export_archive(_Small(), torch.randn(2, 3)))
    name = f"program-file-{uuid.uuid4().hex[:6]}"
    with Client(live_server.url, api_key=live_server.write_key) as client:
        record = client.register_program(name, path, label="epoch 0")
        assert (record["architecture"]["family"], record["label"], record["num_params"]) == ("exported", "epoch 0", 8)
        with pytest.raises(InvalidInput) as info:
            client.register_program("never-registered", tmp_path)  # a directory, not an archive
        assert info.value.message.startswith(f"register_program: cannot read the program file {str(tmp_path)!r}")
        assert "never-registered" not in {m["name"] for m in client.list_models()}
