"""ppolm.cpu_linear: fp32 CPU linear layers on oneDNN give F.linear's values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ppolm import cpu_linear
from ppolm.errors import PPOLMError

onednn = pytest.mark.skipif(cpu_linear.backend() != "onednn", reason="no oneDNN linear kernel on this machine")


@pytest.fixture
def backend_env(monkeypatch):
    """Set $PPOLM_CPU_LINEAR for one test; the cached choice is cleared before and after."""
    def set_(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(cpu_linear.ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_linear.ENV, value)
        cpu_linear.backend.cache_clear()
    yield set_
    cpu_linear.backend.cache_clear()


@onednn
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_match_float64(bias):
    torch.manual_seed(0)
    layer = cpu_linear.install(nn.Sequential(nn.Linear(48, 40, bias=bias)))[0]
    assert type(layer) is cpu_linear.Linear
    x = torch.randn(3, 5, 48, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    # the same products in float64 by hand: y = x Wᵀ + b, dx = g W, dW = Σ gᵀ x, db = Σ g
    w64, x64, g64 = layer.weight.double(), x.detach().double(), g.double()
    want = x64 @ w64.t() + (layer.bias.double() if bias else 0)
    assert y.shape == (3, 5, 40)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), g64 @ w64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), g64.reshape(-1, 40).t() @ x64.reshape(-1, 48),
                               rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(layer.bias.grad.double(), g64.sum((0, 1)), rtol=1e-5, atol=1e-5)


@onednn
def test_frozen_weight_gets_no_gradient_and_the_input_does():
    torch.manual_seed(1)
    layer = cpu_linear.install(nn.Sequential(nn.Linear(16, 8)))[0]
    layer.requires_grad_(False)
    x = torch.randn(7, 16, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(7, 16))  # d/dx Σ (x Wᵀ) = Σ_rows W
    graph = layer(x)
    assert graph.grad_fn is not None
    with torch.no_grad():  # no graph: the kernel is called directly, the same numbers
        assert torch.equal(layer(x), graph.detach())
        assert torch.equal(layer(x.view(7, 1, 16)).view(7, 8), graph.detach())


@onednn
def test_install_keeps_parameters_state_dict_and_copies():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    want = model(x)
    cpu_linear.install(model)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert all(type(m) is cpu_linear.Linear for m in (model[0], model[2]))
    assert before.keys() == model.state_dict().keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(model(x), want)
    twin = copy.deepcopy(model)
    assert type(twin[0]) is cpu_linear.Linear and twin[0].weight is not model[0].weight


@onednn
def test_bf16_and_autocast_take_f_linear():
    w32 = torch.randn(8, 16)
    x32 = torch.randn(4, 16)
    assert cpu_linear.routed(x32, w32)
    assert not cpu_linear.routed(x32.bfloat16(), w32.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_linear.routed(x32, w32)
        y = cpu_linear.linear(x32, w32)
    assert y.dtype == torch.bfloat16  # autocast applied, as F.linear would
    assert not cpu_linear.routed(torch.empty(0, 16), w32)


def test_env_aten_turns_routing_off_and_a_bad_value_is_one_error(backend_env):
    backend_env("aten")
    model = cpu_linear.install(nn.Sequential(nn.Linear(4, 4)))
    assert type(model[0]) is nn.Linear
    assert not cpu_linear.routed(torch.randn(2, 4), model[0].weight)
    backend_env("mkl")
    with pytest.raises(PPOLMError, match="PPOLM_CPU_LINEAR='mkl'"):
        cpu_linear.backend()


@onednn
def test_tiny_model_loss_and_gradients_match_aten(tmp_path, backend_env):
    """The loaded tiny Llama computes the same loss and gradients on both backends (float rounding apart)."""
    from ppolm import models
    from ppolm.tiny import build_tiny_model_dir

    path = build_tiny_model_dir(tmp_path / "tiny")
    ids = torch.randint(0, 1000, (2, 9))
    results = {}
    for name in ("aten", "onednn"):
        backend_env(name)
        model = models.load_causal_lm(path)
        assert any(type(m) is cpu_linear.Linear for m in model.modules()) == (name == "onednn")
        hidden = model.model(input_ids=ids).last_hidden_state
        loss = models.output_logits(model, hidden).log_softmax(-1)[..., 5].mean()
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (la, ga), (lo, go) = results["aten"], results["onednn"]
    torch.testing.assert_close(lo, la, rtol=1e-5, atol=1e-6)
    assert ga.keys() == go.keys()
    for n in ga:
        torch.testing.assert_close(go[n], ga[n], rtol=1e-4, atol=1e-6, msg=n)
