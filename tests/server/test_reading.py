"""``server/reading.py`` and the schema's mode: each option validated once, and the moved names of
``server/kernel_inputs.py`` resolving with a DeprecationWarning."""

from __future__ import annotations

import importlib

import pytest
import torch

from ntk_service.config import Settings
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded
from ntk_service.kernels import DerivedMode, KernelMode, NtkImplementation
from ntk_service.server import computing, media, reading
from ntk_service.server.schemas import KernelModeValue, KernelOptions, NngpOptions, validate_body
from ntk_service.vocabulary import MODE_NAMES


def test_mode_is_validated_once_and_held_as_its_enum() -> None:
    assert KernelOptions().mode is KernelMode.FULL
    assert validate_body(KernelOptions, {"mode": "pseudo"}, operation="op").mode is DerivedMode.PSEUDO
    assert validate_body(NngpOptions, {"mode": "trace"}, operation="op").mode is KernelMode.TRACE
    with pytest.raises(InvalidInput) as info:
        validate_body(KernelOptions, {"mode": "diagonal"}, operation="op")
    *first, last = (f"'{name}'" for name in MODE_NAMES)  # every mode of the table, in its order
    assert str(info.value) == f"op: mode: Input should be {', '.join(first)} or {last}"
    schema = KernelOptions.model_json_schema()["properties"]["mode"]
    assert schema["enum"] == list(KernelModeValue.__args__) and schema["default"] == "full"


def test_engine_options_take_the_request_and_the_settings(tmp_path: object) -> None:
    settings = Settings(data_dir=tmp_path, memory_budget_bytes=2**30, allow_tf32=True)  # type: ignore[arg-type]
    options = reading.engine_options(settings, implementation=NtkImplementation.STRUCTURED, dtype="float64")
    assert options.implementation is NtkImplementation.STRUCTURED and options.dtype is torch.float64
    assert options.memory_budget_bytes == 2**30 and options.allow_tf32 and options.device == torch.device("cpu")


def test_moved_names_warn_and_resolve_to_their_new_home() -> None:
    old = importlib.import_module("ntk_service.server.kernel_inputs")
    with pytest.warns(DeprecationWarning, match="import it from ntk_service.server.computing"):
        assert old.load_sides is computing.load_sides
    with pytest.warns(DeprecationWarning, match="import it from ntk_service.server.reading"):
        assert old.parse_side is reading.parse_side
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        old.nope  # noqa: B018


def test_the_old_helpers_warn_and_still_name_their_operation() -> None:
    old = importlib.import_module("ntk_service.server.kernel_inputs")
    with pytest.warns(DeprecationWarning, match="import it from ntk_service.server.computing"):
        with pytest.raises(MemoryEstimateExceeded, match="^op: "):
            old.check_budget(1001, 1000, what="the spectrum", operation="op")
    with pytest.warns(DeprecationWarning, match="import it from ntk_service.server.media"):
        assert old.MIN_JSON_BYTES_PER_VALUE == media.MIN_JSON_BYTES_PER_VALUE
