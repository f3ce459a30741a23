import pytest
import torch

from benchmarks.models import DEFAULT_BATCH, MODELS, get_model, loss_fn, param_count


@pytest.mark.parametrize("name,low,high", [
    ("vgg", 33e6, 36e6), ("gpt", 26e6, 29e6), ("resnet18", 10.5e6, 12e6), ("tiny", 1, 1e5),
])
def test_parameter_counts(name, low, high):
    assert low <= param_count(get_model(name).build()) <= high


def test_vgg_is_dominated_by_its_fc_layers():
    model = get_model("vgg").build()
    fc = sum(p.numel() for p in model.classifier.parameters())
    assert fc / param_count(model) > 0.7


@pytest.mark.parametrize("name", ["vgg", "resnet18", "gpt", "tiny"])
def test_one_step_on_a_small_batch(name):
    spec = get_model(name)
    torch.manual_seed(0)
    model = spec.build()
    x, y = spec.make_batch(2, torch.Generator().manual_seed(0))
    loss = loss_fn(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_batches_are_deterministic_per_seed():
    spec = get_model("gpt")
    a = spec.make_batch(2, torch.Generator().manual_seed(5))
    b = spec.make_batch(2, torch.Generator().manual_seed(5))
    c = spec.make_batch(2, torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    # Language-model targets are the inputs shifted by one token.
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])


def test_defaults_cover_every_model():
    assert set(DEFAULT_BATCH) == set(MODELS)
    assert all(spec.default_batch == DEFAULT_BATCH[n] for n, spec in MODELS.items())


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        get_model("alexnet")
