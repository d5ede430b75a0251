"""The safe loader of torch.export archives: researchers' models load with their names and their kernels equal the
float64 reference; hostile archives are refused with a message and nothing they carry runs (a payload that would
create a directory does not create it, while ``torch.export.load`` of the same archive does)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ntk_service.errors import InvalidInput, MalformedRequest, PayloadTooLarge, UnsupportedModel
from ntk_service.kernels.api import compute_ntk
from ntk_service.registry.archive import ArchiveLimits
from ntk_service.registry.exported import load_exported
from ntk_service.registry.op_allowlist import ALLOWED_ATEN_OPS
from tests.reference import assert_matches, reference_ntk
from tests.registry.archives import (
    export_archive,
    mkdir_payload,
    nodes,
    patch_declared_size,
    rewrite,
    torch_load_runs_it,
)
from tests.registry.exported_models import CASES, case

IMPLEMENTATIONS = ("structured", "jacobian_contraction", "ntk_vector_products", "auto")
OP = "register 'm'"


class WithConstant(nn.Module):
    """Linear, times a non-persistent buffer (stored as a constant), plus a lifted tensor constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x) * self.scale
        return out


@pytest.fixture(scope="module")
def archive() -> bytes:
    torch.manual_seed(0)
    return export_archive(WithConstant(), torch.randn(2, 3))


def _refused(data: bytes, error: type[Exception] = InvalidInput, **kwargs: Any) -> str:
    with pytest.raises(error) as info:
        load_exported(data, operation=OP, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{OP}: "), message
    return message


# ---------------------------------------------------------------- researchers' models


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # SDPA under vmap (attention)
@pytest.mark.parametrize("name", CASES)
def test_models_load_with_their_names_and_kernels_equal_the_reference(name: str) -> None:
    module, example = case(name)
    program = load_exported(export_archive(module, example), operation=OP)
    assert [n for n, _ in program.module.named_parameters()] == [n for n, _ in module.named_parameters()]
    assert sorted(program.state_dict) == sorted(module.state_dict())
    for key, tensor in module.state_dict().items():
        assert torch.equal(program.state_dict[key], tensor), key
    assert program.input_shape == tuple(example.shape[1:]) and program.input_dtype == "float32"
    generator = torch.Generator().manual_seed(7)
    x1 = torch.randn(2, *example.shape[1:], generator=generator)
    x2 = torch.randn(3, *example.shape[1:], generator=generator)  # another batch size: the dimension is dynamic
    expected = reference_ntk(module, x1, x2)
    for implementation in IMPLEMENTATIONS:
        theta = compute_ntk(program.module, x1, x2, implementation=implementation, dtype=torch.float64).theta
        assert_matches(theta, expected)


def test_the_graph_of_a_loaded_archive_calls_only_allowed_ops(archive: bytes) -> None:
    program = load_exported(archive, operation=OP)
    assert program.targets == {"torch.ops.aten.linear.default", "torch.ops.aten.mul.Tensor"}
    assert sorted(program.constants) == ["scale"] and torch.equal(program.constants["scale"], torch.tensor([2.0, 3.0]))
    assert {"linear", "conv2d", "batch_norm", "layer_norm", "scaled_dot_product_attention"} <= ALLOWED_ATEN_OPS
    assert not {"add_", "copy_", "rand", "randn", "bernoulli", "native_dropout", "empty"} & ALLOWED_ATEN_OPS


# ---------------------------------------------------------------- pickles: refused, never run


def _use_pickle(kind: str, fqn: str) -> Any:
    def edit(config: Any) -> None:
        config["config"][fqn]["use_pickle"] = True

    return edit


def test_a_pickled_weight_is_refused_and_not_run(archive: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "weight-ran"
    hostile = rewrite(
        archive,
        {"data/weights/weight_0": mkdir_payload(marker)},
        edit_json={"data/weights/model_weights_config.json": _use_pickle("weights", "fc.weight")},
    )
    torch_load_runs_it(hostile, marker)
    message = _refused(hostile)
    assert "weight 'fc.weight' is marked use_pickle" in message and "never unpickles" in message
    assert not marker.exists()


def test_a_pickled_constant_and_an_opaque_object_are_refused_and_not_run(archive: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "constant-ran"
    hostile = rewrite(
        archive,
        {"data/constants/tensor_0": mkdir_payload(marker)},
        edit_json={"data/constants/model_constants_config.json": _use_pickle("constants", "scale")},
    )
    torch_load_runs_it(hostile, marker)
    assert "constant 'scale' is marked use_pickle" in _refused(hostile)
    assert not marker.exists()

    def opaque(kind: str, use_pickle: bool) -> Any:  # torch.export.load would pickle.loads / _pickle_load_obj it
        def edit(config: Any) -> None:
            entry = {"path_name": f"{kind}_0", "is_param": False, "use_pickle": use_pickle, "tensor_meta": None}
            config["config"]["scale"] = entry

        return edit

    hostile = rewrite(
        archive,
        edit_json={"data/constants/model_constants_config.json": opaque("opaque_obj", True)},
        add={"archive/data/constants/opaque_obj_0": mkdir_payload(marker)},
    )
    torch_load_runs_it(hostile, marker)
    assert "constant 'scale' is marked use_pickle" in _refused(hostile)
    assert not marker.exists()
    hostile = rewrite(
        archive,
        edit_json={"data/constants/model_constants_config.json": opaque("custom_obj", False)},
        add={"archive/data/constants/custom_obj_0": mkdir_payload(marker)},
    )
    message = _refused(hostile)
    assert "constant 'scale' points at payload 'custom_obj_0'" in message and "custom and opaque objects" in message
    assert not marker.exists()


def test_pickled_sample_inputs_are_never_read(archive: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "inputs-ran"
    hostile = rewrite(archive, {"data/sample_inputs/model.pt": mkdir_payload(marker)})
    torch_load_runs_it(hostile, marker)  # weights_only=True fails, torch retries with weights_only=False
    program = load_exported(hostile, operation=OP)  # sample inputs are ignored: the program loads
    assert program.targets and not marker.exists()


def test_code_in_guards_sizes_or_tree_specs_never_runs(archive: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"

    def guards(program: Any) -> None:  # ExportedProgram.module() exec's guards_code into its forward
        program["guards_code"] = [f"__import__('os').mkdir({str(marker)!r}) is None"]

    hostile = rewrite(archive, edit_json={"models/model.json": guards})
    torch_load_runs_it(hostile, marker, call_with=torch.randn(2, 3))
    load_exported(hostile, operation=OP)
    assert not marker.exists()

    def size(program: Any) -> None:  # sympy.sympify evaluates symbolic sizes
        values = program["graph_module"]["graph"]["tensor_values"]
        values["x"]["sizes"][0] = {"as_expr": {"expr_str": f"__import__('os').mkdir({str(marker)!r})"}}

    message = _refused(rewrite(archive, edit_json={"models/model.json": size}))
    assert "the graph has the symbolic size \"__import__('os')" in message
    assert not marker.exists()

    def spec(program: Any) -> None:  # treespec_loads imports the module an __enum__ names
        signature = program["graph_module"]["module_call_graph"][0]["signature"]
        signature["out_spec"] = '[1, {"type": "builtins.dict", "context": "{\\"__enum__\\": 1}", "children_spec": []}]'

    assert "the program's out_spec holds ['?']" in _refused(rewrite(archive, edit_json={"models/model.json": spec}))


# ---------------------------------------------------------------- the zip itself


@pytest.mark.parametrize("name", ["archive/../evil", "../evil", "/abs/evil", "archive/data/../../evil", "C:/evil"])
def test_entry_names_that_climb_out_are_refused(archive: bytes, name: str, tmp_path: Path) -> None:
    message = _refused(rewrite(archive, add={name: b"x"}))
    assert f"the archive has an entry named {name!r}" in message and "extracts nothing by name" in message


def test_a_zip_bomb_and_too_many_entries_are_refused(archive: bytes) -> None:
    bomb = rewrite(archive, add={"archive/extra/zeros": bytes(8 << 20)}, compression=zipfile.ZIP_DEFLATED)
    message = _refused(bomb, PayloadTooLarge)
    assert "entry archive/extra/zeros expands" in message and "refused as a zip bomb" in message
    assert "more than the limit of 5" in _refused(archive, PayloadTooLarge, limits=ArchiveLimits(max_entries=5))
    assert "declares 8,388,608 bytes uncompressed" in _refused(
        rewrite(archive, add={"archive/extra/zeros": bytes(8 << 20)}),
        PayloadTooLarge,
        limits=ArchiveLimits(max_entry_bytes=1 << 20),
    )
    assert "is not a zip archive" in _refused(b"PK\x03\x04 not really", MalformedRequest)


# ---------------------------------------------------------------- declared tensors against their bytes


def test_declared_sizes_that_do_not_match_the_bytes_are_refused(archive: bytes) -> None:
    def bigger(config: Any) -> None:
        config["config"]["fc.weight"]["tensor_meta"]["sizes"][0] = {"as_int": 20}

    message = _refused(rewrite(archive, edit_json={"data/weights/model_weights_config.json": bigger}))
    assert "weight 'fc.weight' declares sizes [20, 3], strides [3, 1] and offset 0, which need 240 bytes" in message
    assert "its payload has 24" in message
    message = _refused(rewrite(archive, {"data/weights/weight_0": bytes(7)}))
    assert "weight 'fc.weight': its payload has 7 bytes, not a multiple of the 4-byte float32" in message

    # the zip's own header lying about an entry's size: fewer bytes declared than stored fail the CRC, more are
    # not there
    message = _refused(patch_declared_size(archive, "data/weights/weight_0", 8))
    assert "entry archive/data/weights/weight_0 of the archive is corrupt" in message
    message = _refused(patch_declared_size(archive, "data/weights/weight_0", 4000))
    assert "entry archive/data/weights/weight_0 declares 4000 bytes but holds 24" in message

    def pickled_dtype(config: Any) -> None:
        config["config"]["fc.weight"]["tensor_meta"]["dtype"] = 10  # complex64

    assert "has dtype code 10" in _refused(
        rewrite(archive, edit_json={"data/weights/model_weights_config.json": pickled_dtype})
    )


# ---------------------------------------------------------------- operators


def test_an_op_outside_the_allow_list_is_refused_naming_it(archive: bytes) -> None:
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)

    message = _refused(export_archive(Noisy(), torch.randn(2, 3)), UnsupportedModel)
    assert "the graph calls torch.ops.aten.rand_like.default, an ATen operator outside the service's allow-list" in (
        message
    )

    def target(new: str) -> bytes:
        def edit(program: Any) -> None:
            nodes(program)[-1]["target"] = new

        return rewrite(archive, edit_json={"models/model.json": edit})

    assert "a custom operator (namespace 'mylib')" in _refused(target("torch.ops.mylib.evil.default"), UnsupportedModel)
    assert "the graph calls torch.ops.aten.mul_.Tensor, an ATen operator outside" in _refused(
        target("torch.ops.aten.mul_.Tensor"), UnsupportedModel
    )
    assert "calls builtins.eval, which is not a torch operator" in _refused(target("builtins.eval"), UnsupportedModel)


def test_batchnorm_in_training_mode_is_refused() -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    program = torch.export.export(module.train(), (torch.randn(4, 3),))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    # trained mode counts batches in place (num_batches_tracked.add_) before it normalises with batch statistics
    message = _refused(buffer.getvalue(), UnsupportedModel)
    assert "the graph calls torch.ops.aten.add_.Tensor, an ATen operator outside" in message

    def training(program: Any) -> None:
        for node in nodes(program):
            for argument in node["inputs"]:
                if argument["name"] == "training":
                    argument["arg"] = {"as_bool": True}

    eval_archive = export_archive(*case("conv_bn"))
    message = _refused(rewrite(eval_archive, edit_json={"models/model.json": training}), UnsupportedModel)
    assert "calls torch.ops.aten.batch_norm.default, with training=True (training mode)" in message
    assert "export the module in eval mode" in message


def test_an_archive_of_two_programs_or_another_format_is_refused(archive: bytes) -> None:
    assert "expected a torch.export.save archive" in _refused(rewrite(archive, {"archive_format": b"zip"}))


def test_names_that_torch_fx_would_paste_into_code_are_refused(archive: bytes) -> None:
    # fx writes getattr(self, "<name>") into the forward it generates and execs: a quote would end the string
    evil = 'fc.w"), __import__("os").getcwd(), getattr(self, "w'

    def config(tree: Any) -> None:
        tree["config"][evil] = tree["config"].pop("fc.weight")

    def signature(program: Any) -> None:
        for spec in program["graph_module"]["signature"]["input_specs"]:
            if spec.get("parameter", {}).get("parameter_name") == "fc.weight":
                spec["parameter"]["parameter_name"] = evil

    hostile = rewrite(
        archive, edit_json={"models/model.json": signature, "data/weights/model_weights_config.json": config}
    )
    message = _refused(hostile)
    assert f"the program names a parameter, buffer or submodule {evil!r}; names must be dotted identifiers" in message

    def arguments(program: Any) -> None:  # fx writes def forward(self, <forward_arg_names>)
        program["graph_module"]["module_call_graph"][0]["signature"]["forward_arg_names"] = ["x=print('hi')"]

    message = _refused(rewrite(archive, edit_json={"models/model.json": arguments}))
    assert "the program's forward arguments are [\"x=print('hi')\"]; they must be identifiers" in message
