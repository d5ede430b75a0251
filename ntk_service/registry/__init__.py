"""Model registry, data sets and built-in architectures: the persistence and model layer under the HTTP service.

    >>> from ntk_service.registry import ModelRegistry, DatasetStore, list_architectures
    >>> registry = ModelRegistry(data_dir)            # <data_dir>/registry.sqlite3 + weights/<sha256>.safetensors
    >>> record = registry.register("m", {"family": "mlp", "input_dim": 4, "hidden": [8], "output_dim": 2}, seed=0)
    >>> record, module = registry.load_module("m")    # eval mode, (N, 4) -> (N, 2)
    >>> registry.register_weights("r", sequential_spec, safetensors_bytes, label="epoch 0")  # trained version 1
    >>> registry.add_version("r", safetensors_bytes, label="epoch 1")                         # version 2
    >>> registry.register_program("g", torch_export_archive_bytes)   # any nn.Module, loaded without pickle
    >>> datasets = DatasetStore(data_dir)             # <data_dir>/datasets/<id>.npy
    >>> x = datasets.load(datasets.create(array).id, 0, 10)

Architectures: docs/architectures.md (the ``sequential`` family: layer_specs.py, sequential.py; exported programs:
exported.py with archive.py, payloads.py, program_checks.py, op_allowlist.py and NOTE [archive threat model]).
Crash safety: NOTE [crash safety] in files.py. Tied weights: NOTE [tied
weights] in weights.py. Seeds: NOTE [seeded initialisation] in families.py.
"""

from __future__ import annotations

from ntk_service.registry.architectures import ArchitectureField, ArchitectureInfo, list_architectures
from ntk_service.registry.datasets import DatasetArray, DatasetStore, NamedDatasetRecord
from ntk_service.registry.records import DatasetRecord, ModelRecord, ParameterInfo
from ntk_service.registry.store import ModelRegistry
from ntk_service.registry.zoo import MAX_PARAMS, ModelSpec, build_model

__all__ = [
    "ArchitectureField",
    "ArchitectureInfo",
    "DatasetArray",
    "DatasetRecord",
    "DatasetStore",
    "MAX_PARAMS",
    "ModelRecord",
    "ModelRegistry",
    "ModelSpec",
    "NamedDatasetRecord",
    "ParameterInfo",
    "build_model",
    "list_architectures",
]
