"""``ModelRegistry`` with exported models: the program stored once per model and swept with it, checkpoints checked
against it, models reloaded after a restart with their function, token models with their vocabulary."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from ntk_service.errors import InvalidInput, NameConflict, UnsupportedModel
from ntk_service.registry import ModelRegistry
from ntk_service.registry.input_contract import check_input
from tests.registry.archives import export_archive
from tests.registry.exported_models import GatedLoop
from tests.registry.sequential_models import train_steps


def _programs(data_dir: Path) -> list[str]:
    return sorted(p.name for p in (data_dir / "programs").glob("*.pt2"))


def test_program_versions_survive_a_restart_and_are_swept_with_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module, x = GatedLoop().eval(), torch.randn(4, 5)
    epoch0 = copy.deepcopy(module)
    registry = ModelRegistry(tmp_path)
    first = registry.register_program("g", export_archive(module, x), label="epoch 0")
    assert first.architecture["family"] == "exported" and first.architecture["input_shape"] == [5]
    assert first.output_dim == 2 and [p.name for p in first.parameters] == [n for n, _ in module.named_parameters()]
    assert _programs(tmp_path) == [f"{first.architecture['program_sha256']}.checked.pt2"]
    train_steps(module, x, 2)  # type: ignore[arg-type]
    second = registry.add_version("g", safetensors.torch.save(module.state_dict()), label="epoch 1")
    assert (second.version, second.architecture) == (2, first.architecture)
    with pytest.raises(NameConflict):
        registry.register_program("g", export_archive(module, x))
    registry.close()

    reopened = ModelRegistry(tmp_path, module_cache_size=0)  # a restart: everything from the files
    probe = torch.randn(3, 5)
    for version, local in ((1, epoch0), (2, module)):
        _, loaded = reopened.load_module("g", version)
        with torch.no_grad():
            assert torch.equal(loaded(probe), local(probe)), version
    reopened.delete("g")
    assert _programs(tmp_path) == []
    reopened.close()


def test_an_exported_family_sent_as_json_is_refused_with_the_route_to_use(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    with pytest.raises(InvalidInput) as info:
        registry.register("j", {"family": "exported", "program_sha256": "0" * 64, "input_shape": [3]})
    assert "is registered by uploading its torch.export archive (multipart POST /v1/models/exported" in str(info.value)
    assert _programs(tmp_path) == []
    registry.close()


class TokenClassifier(nn.Module):
    """Token ids (B, T) -> embedding -> mean over T -> Linear."""

    def __init__(self, vocab: int = 7, d: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(ids).mean(dim=1))
        return out


def test_a_token_model_records_its_vocabulary_and_out_of_range_ids_are_refused(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    record = registry.register_program("tok", export_archive(TokenClassifier(), torch.zeros(2, 3, dtype=torch.int64)))
    assert (record.input_dtype, record.input_shape, record.architecture["vocab_size"]) == ("int64", (3,), 7)
    check_input(np.array([[0, 6, 2]]), record, side="x1")
    with pytest.raises(InvalidInput, match=r"x1 has token ids in \[0, 7\], model 'tok' has a vocabulary of 7"):
        check_input(np.array([[0, 7, 2]]), record, side="x1")

    class Ids(nn.Module):  # int64 in, but no embedding reads the ids: their range cannot be checked
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(ids.float())
            return out

    with pytest.raises(UnsupportedModel, match="no embedding reads them directly"):
        registry.register_program("ids", export_archive(Ids(), torch.zeros(2, 3, dtype=torch.int64)))
    registry.close()
