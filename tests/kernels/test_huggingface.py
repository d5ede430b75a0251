"""Tiny Hugging Face models built from configs (no download, default settings: sdpa attention, tied embeddings)
through compute_ntk with mapping inputs and ``output=``, against the float64 reference."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ntk_service.errors import InvalidInput, UnsupportedModel
from ntk_service.kernels import NtkImplementation, compute_ntk
from ntk_service.kernels.choice import ALGORITHMS
from tests.reference import assert_matches, reference_ntk

transformers = pytest.importorskip("transformers")

IMPLEMENTATIONS = [*ALGORITHMS, NtkImplementation.AUTO]
VOCAB = 30


def _quiet(build):  # transformers warns about config ids outside a tiny vocabulary; -W error would fail on it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build()


@pytest.fixture(scope="module")
def bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    return _quiet(lambda: transformers.BertForMaskedLM(config)).eval()


def _tokens(n: int, seed: int, *, padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 5, dtype=torch.int64)
    if padded:
        mask[0, 3:] = 0  # example 0 is padded: BERT's masking branches on padding_mask.all()
    return {"input_ids": torch.randint(0, VOCAB, (n, 5), generator=g), "attention_mask": mask}


def _masked_logits(out: object) -> torch.Tensor:  # the reference's selection, written by hand
    return out.logits[:, 2, :4]  # type: ignore[attr-defined]


def test_bert_with_an_attention_mask_takes_the_per_example_loop(bert: nn.Module) -> None:
    x1, x2 = _tokens(3, 1, padded=True), _tokens(2, 2, padded=False)  # a mask of ones branches as well
    expected = reference_ntk(bert, x1, x2, output=_masked_logits)
    for implementation in ("auto", "jacobian_contraction"):
        result = compute_ntk(
            bert, x1, x2, output="logits[:, 2, :4]", implementation=implementation, dtype=torch.float64
        )
        assert result.per_example_loop and result.implementation is NtkImplementation.JACOBIAN_CONTRACTION
        assert_matches(result.theta, expected, 1e-10)
    symmetric = compute_ntk(bert, x1, output="logits[:, 2, :4]", mode="trace", dtype=torch.float64)
    assert_matches(symmetric.theta, reference_ntk(bert, x1, mode="trace", output=_masked_logits), 1e-10)
    for implementation in ("ntk_vector_products", "structured"):  # they vmap over examples: refused, named
        with pytest.raises(UnsupportedModel, match="data-dependent control flow"):
            compute_ntk(bert, x1, x2, output="logits[:, 2, :4]", implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_bert_without_an_attention_mask(bert: nn.Module, implementation: NtkImplementation) -> None:
    # with no attention_mask BERT never branches on its values: every implementation runs batched
    x1, x2 = ({"input_ids": _tokens(n, seed, padded=False)["input_ids"]} for n, seed in ((3, 3), (2, 4)))
    result = compute_ntk(bert, x1, x2, output="logits[:, 2, :4]", implementation=implementation, dtype=torch.float64)
    assert not result.per_example_loop
    assert_matches(result.theta, reference_ntk(bert, x1, x2, output=_masked_logits), 1e-10)


def test_bert_ids_beyond_the_vocabulary(bert: nn.Module) -> None:
    x1 = _tokens(6, 5, padded=False)
    x1["input_ids"][5, 1] = VOCAB
    with pytest.raises(InvalidInput, match=rf"x1\['input_ids'\] has token id {VOCAB} in example 5"):
        compute_ntk(bert, x1, output="logits[:, 2, :4]")


class LabelWords(nn.Module):
    """The prompt-based fine-tuning model (Malladi et al. 2023): the logits of the label words at each example's
    mask position, f(x) = logits[mask_pos(x), label_words]."""

    def __init__(self, lm: nn.Module, label_words: list[int]) -> None:
        super().__init__()
        self.lm = lm
        self.register_buffer("label_words", torch.tensor(label_words), persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask_pos: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask).logits  # (n, T, V)
        at_mask = logits[torch.arange(logits.shape[0]), mask_pos]  # (n, V)
        return at_mask[:, self.label_words]  # (n, C)


def test_label_word_kernel(bert: nn.Module) -> None:
    model = LabelWords(bert, [3, 7])
    x1, x2 = _tokens(3, 6, padded=True), _tokens(2, 7, padded=False)
    x1["mask_pos"], x2["mask_pos"] = torch.tensor([1, 4, 2]), torch.tensor([0, 3])
    result = compute_ntk(model, x1, x2, dtype=torch.float64)
    assert result.theta.shape == (3, 2, 2, 2)
    assert_matches(result.theta, reference_ntk(model, x1, x2), 1e-10)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_gpt2(implementation: NtkImplementation) -> None:
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    model = _quiet(lambda: transformers.GPT2LMHeadModel(config)).eval()
    g = torch.Generator().manual_seed(8)
    x1, x2 = ({"input_ids": torch.randint(0, VOCAB, (n, 5), generator=g)} for n in (3, 2))
    result = compute_ntk(model, x1, x2, output="logits[:, -1, :4]", implementation=implementation, dtype=torch.float64)
    expected = reference_ntk(model, x1, x2, output=lambda out: out.logits[:, -1, :4])
    assert_matches(result.theta, expected, 1e-10)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_vit(implementation: NtkImplementation) -> None:
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
    model = _quiet(lambda: transformers.ViTForImageClassification(config)).eval()
    g = torch.Generator().manual_seed(9)
    x1, x2 = ({"pixel_values": torch.randn(n, 3, 8, 8, generator=g)} for n in (3, 2))
    result = compute_ntk(model, x1, x2, output="logits", implementation=implementation, dtype=torch.float64)
    assert_matches(result.theta, reference_ntk(model, x1, x2, output=lambda out: out.logits), 1e-10)
