"""Contract tests of every registered observation encoder (rl_tformers.agents.common.encoders).

The parameter lists come from the registry, so a new kind is tested the moment it registers;
tests select kinds by their declared capabilities (image or flat)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rl_tformers.agents.common.encoders import ENCODERS, EncoderConfig, check_observations, is_image
from rl_tformers.agents.common.encoders.impala_cnn import ImpalaCNN
from rl_tformers.agents.common.encoders.minatar_cnn import MinAtarCNN
from rl_tformers.agents.common.encoders.nature_cnn import NatureCNN

from rl_tformers.typed_config import ConfigFieldError

IMAGE = (4, 36, 40)  # (C, H, W): stacked grey frames, H != W to catch a swapped axis
FLAT = (3, 2)  # a 2-D Box observation, flattened to 6 values

ALL = [e.kind for e in ENCODERS]
IMAGE_KINDS = [e.kind for e in ENCODERS if e.capabilities.image]
FLAT_KINDS = [e.kind for e in ENCODERS if e.capabilities.flat]


def _small(kind: str) -> EncoderConfig:
    """The kind's config with small widths where it has them (contract sizes)."""
    fields = {"features": 32} if "features" in ENCODERS.get(kind).fields() else {}
    if kind == "mlp":
        fields = {"hidden": (16, 8)}
    return EncoderConfig.from_dict({"kind": kind, **fields})


def _input(kind: str, lead: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Observations (*lead, *obs_shape) of the kind's space: uint8 pixels, or float vectors."""
    g = torch.Generator().manual_seed(seed)
    if ENCODERS.get(kind).capabilities.image:
        return torch.randint(0, 256, (*lead, *IMAGE), generator=g, dtype=torch.uint8)
    return torch.randn(*lead, *FLAT, generator=g)


def _shape(kind: str) -> tuple[int, ...]:
    return IMAGE if ENCODERS.get(kind).capabilities.image else FLAT


def _build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return _small(kind).build(_shape(kind)).eval()


def test_the_registry_holds_the_five_kinds_with_their_capabilities() -> None:
    assert ALL == ["impala_cnn", "linear", "minatar_cnn", "mlp", "nature_cnn"]
    assert IMAGE_KINDS == ["impala_cnn", "minatar_cnn", "nature_cnn"] and FLAT_KINDS == ["linear", "mlp"]
    assert [e.kind for e in ENCODERS if e.capabilities.passthrough] == ["linear"]
    assert ENCODERS.get("nature_cnn").capabilities.min_size == 36
    assert ENCODERS.get("minatar_cnn").capabilities.min_size == 3


@pytest.mark.parametrize("kind", ALL)
def test_features_keep_any_leading_axes(kind: str) -> None:
    enc = _build(kind)
    f = _small(kind).out_features(_shape(kind))
    assert enc.out_features == f
    for lead in [(5,), (2, 3), (2, 1, 3)]:
        assert tuple(enc(_input(kind, lead)).shape) == (*lead, f)


@pytest.mark.parametrize("kind", ALL)
def test_batch_and_time_axes_are_folded_without_changing_a_sample(kind: str) -> None:
    enc = _build(kind)
    x = _input(kind, (2, 3))  # (B, T, *obs_shape)
    y = enc(x)  # (B, T, F)
    flat = enc(x.reshape(6, *x.shape[2:]))  # (B T, F)
    assert torch.equal(y.reshape(6, -1), flat)
    one = torch.stack([enc(x[b, t]) for b in range(2) for t in range(3)])  # each step alone, (F,)
    torch.testing.assert_close(one, flat, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ALL)
def test_flat_input_of_the_observation_is_unflattened(kind: str) -> None:
    enc = _build(kind)
    x = _input(kind, (2, 3))
    assert torch.equal(enc(x.reshape(2, 3, -1)), enc(x))


@pytest.mark.parametrize("kind", ALL)
def test_an_observation_of_another_shape_is_refused(kind: str) -> None:
    enc = _build(kind)
    with pytest.raises(ValueError, match=r"^encoder: observations must be"):
        enc(torch.zeros(2, 7, dtype=torch.uint8))


@pytest.mark.parametrize("kind", ALL)
def test_the_same_input_and_seed_give_the_same_features(kind: str) -> None:
    a, b = _build(kind, seed=3), _build(kind, seed=3)
    x = _input(kind, (4,))
    assert torch.equal(a(x), a(x)) and torch.equal(a(x), b(x))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_image_kinds_take_uint8_and_scale_by_one_over_255(kind: str) -> None:
    enc = _build(kind)
    x = _input(kind, (3,))
    seen = []
    first_conv = next(m for m in enc.modules() if isinstance(m, torch.nn.Conv2d))
    first_conv.register_forward_hook(lambda _m, inp, _out: seen.append(inp[0]))
    y_u8 = enc(x)
    assert torch.equal(seen[0], x.to(torch.float32) * (1.0 / 255.0))  # the conv reads [0, 1] floats
    assert float(seen[0].max()) <= 1.0 and seen[0].dtype == torch.float32
    assert torch.equal(y_u8, enc(x.to(torch.float32)))  # floats in pixel units: the same features
    assert x.dtype == torch.uint8  # the caller's tensor is not converted in place


@pytest.mark.parametrize("kind", FLAT_KINDS)
def test_flat_kinds_cast_integer_observations_without_scaling(kind: str) -> None:
    enc = _build(kind)
    x = torch.randint(0, 256, (3, *FLAT), dtype=torch.uint8)
    assert torch.equal(enc(x), enc(x.to(torch.float32)))


def test_linear_returns_the_flat_observation_itself() -> None:
    enc = _build("linear")
    x = torch.randn(2, 3, *FLAT)
    assert torch.equal(enc(x), x.reshape(2, 3, 6)) and list(enc.parameters()) == []


@pytest.mark.parametrize("kind", [k for k in ALL if k != "linear"])
def test_every_parameter_gets_a_finite_nonzero_gradient(kind: str) -> None:
    enc = _build(kind).train()
    y = enc(_input(kind, (2, 3)))
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert float(p.grad.abs().sum()) > 0, name


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_bf16_autocast_and_channels_last_give_the_float32_features(kind: str) -> None:
    assert _small(kind).channels_last  # the default: faster on CPU (docs/encoders.md)
    torch.manual_seed(0)
    plain = _small(kind).replace(channels_last=False).build(IMAGE).eval()
    torch.manual_seed(0)
    last = _small(kind).build(IMAGE).eval()
    x = _input(kind, (2, 3))
    y = plain(x)
    torch.testing.assert_close(last(x), y, rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb = plain(x)
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb).all()
    torch.testing.assert_close(yb.float(), y, rtol=0.05, atol=0.05)


def test_the_papers_shapes_at_84_by_84() -> None:
    nature = NatureCNN((4, 84, 84))
    assert nature.fc[0].in_features == 64 * 7 * 7 and nature.out_features == 512
    assert [(c.out_channels, c.kernel_size, c.stride) for c in nature.convs if isinstance(c, torch.nn.Conv2d)] == [
        (32, (8, 8), (4, 4)), (64, (4, 4), (2, 2)), (64, (3, 3), (1, 1))]
    impala = ImpalaCNN((4, 84, 84))
    assert impala.fc[0].in_features == 32 * 11 * 11 and impala.out_features == 256
    assert [s.conv.out_channels for s in impala.stages] == [16, 32, 32]
    x = torch.zeros(1, 4, 84, 84, dtype=torch.uint8)
    assert tuple(impala.stages[0](x.float()).shape) == (1, 16, 42, 42)
    assert tuple(nature(x).shape) == (1, 512) and tuple(impala(x).shape) == (1, 256)


def test_the_minatar_network_on_its_10_by_10_frames() -> None:
    """Young and Tian 2019: 16 filters 3x3 stride 1, then 128 units, on (C, 10, 10) frames of 0 or
    255; one filter's output at a position is exactly its weighted sum over the 3x3 window."""
    net = MinAtarCNN((4, 10, 10))
    conv = net.conv[0]
    assert (conv.out_channels, conv.kernel_size, conv.stride) == (16, (3, 3), (1, 1))
    assert net.fc[0].in_features == 16 * 8 * 8 and net.out_features == 128
    x = torch.zeros(1, 4, 10, 10, dtype=torch.uint8)
    x[0, 1, 2, 3] = 255
    h = net.conv(x.float() / 255)
    w, b = conv.weight.detach(), conv.bias.detach()
    assert torch.equal(h[0, :, 1, 2], torch.relu(w[:, 1, 1, 1] + b))  # the set pixel at the window's centre
    assert torch.equal(h[0, :, 5, 5], torch.relu(b))  # a window of zeros
    assert tuple(net(x).shape) == (1, 128)


@pytest.mark.parametrize("kind", ALL)
def test_the_config_round_trips_through_its_dict(kind: str) -> None:
    cfg = _small(kind)
    d = cfg.to_dict()
    assert d["kind"] == kind and list(d)[0] == "kind"
    assert EncoderConfig.from_dict(d) == cfg


def test_config_errors_name_the_option() -> None:
    def refused(data) -> str:
        with pytest.raises(ConfigFieldError) as exc:
            EncoderConfig.from_dict(data, "agent.encoder")
        return str(exc.value)

    assert refused({"kind": "nature"}) == (
        "agent.encoder: unknown encoder kind 'nature'; registered kinds: impala_cnn, linear, minatar_cnn, mlp, nature_cnn")
    assert refused({"kind": "nature_cnn", "features": 0}) == "agent.encoder.features must be an integer >= 1, got 0"
    assert refused({"features": 64}).startswith(
        "agent.encoder.features: unknown key: encoder kind 'linear' (the default: agent.encoder.kind is not set) "
        "has no field 'features'; set agent.encoder.kind to a kind that has it (encoder kinds with a 'features' "
        "field: impala_cnn, minatar_cnn, nature_cnn)")
    assert refused({"kind": "mlp", "hidden": []}) == (
        "agent.encoder: hidden must be a non-empty list of integers >= 1 (e.g. [256]), got []")
    assert EncoderConfig.from_dict(None).kind == "linear"


def test_observations_an_encoder_cannot_take_are_refused_in_one_line() -> None:
    nature, linear = EncoderConfig.from_dict({"kind": "nature_cnn"}), EncoderConfig.from_dict({})
    with pytest.raises(ConfigFieldError) as exc:
        check_observations(linear, (4, 84, 84), np.uint8, "the dataset px.hdf5")
    assert str(exc.value) == (
        "agent.encoder.kind=linear takes flat observations, but the dataset px.hdf5 has image observations of shape "
        "(4, 84, 84) uint8 (uint8 (C, H, W)); use an image encoder: agent.encoder.kind=impala_cnn or minatar_cnn or nature_cnn")
    with pytest.raises(ConfigFieldError) as exc:
        check_observations(nature, (4,), np.float32, "the environment CartPole-v1")
    assert str(exc.value) == (
        "agent.encoder.kind=nature_cnn takes image observations (uint8 (C, H, W)), but the environment CartPole-v1 "
        "has observations of shape (4,) float32; use a flat encoder: agent.encoder.kind=linear or mlp")
    with pytest.raises(ConfigFieldError, match=r"needs frames of at least 36x36 pixels, but x has observations of "
                                               r"shape \(4, 35, 84\) uint8"):
        check_observations(nature, (4, 35, 84), np.uint8, "x")
    with pytest.raises(ConfigFieldError) as exc:
        check_observations(nature, (4, 10, 10), np.uint8, "MinAtar/Breakout-v1")
    assert str(exc.value) == (
        "agent.encoder.kind=nature_cnn needs frames of at least 36x36 pixels, but MinAtar/Breakout-v1 has observations "
        "of shape (4, 10, 10) uint8; use agent.encoder.kind=impala_cnn or minatar_cnn (which take these frames) or "
        "larger frames")
    minatar = EncoderConfig.from_dict({"kind": "minatar_cnn"})
    with pytest.raises(ConfigFieldError, match=r"at least 3x3 pixels, but x has .*; use agent\.encoder\.kind=impala_cnn "
                                               r"\(which take these frames\) or larger frames$"):
        check_observations(minatar, (4, 2, 9), np.uint8, "x")
    check_observations(EncoderConfig.from_dict({"kind": "impala_cnn"}), (1, 10, 10), np.uint8, "x")
    check_observations(minatar, (4, 10, 10), np.uint8, "x")
    assert is_image((3, 8, 8), np.uint8) and not is_image((3, 8, 8), np.float32) and not is_image((8, 8), np.uint8)
