"""cpu_matmul: float32 nn.Linear products on the CPU in MKL (PyTorch's default) or oneDNN.

The oneDNN path must be the same function as ``F.linear`` (forward and every gradient, up to
float rounding), keep the module's parameters and state dict, fall back to ``F.linear`` where
it does not apply, be resolved once into the run's config (a resume keeps the library), and
reach the trainer and ``load_run``. ``auto`` is decided by a measurement of both libraries on
the run's shapes (the rule on injected rates; the cache per CPU, threads and shapes: hit, miss,
corrupted file or entry) and recorded in the run's resolved block.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from rl_tformers.blocks.base import FeedForward
from rl_tformers.runtime import cpu_matmul as cm
from rl_tformers.runtime.run_config import ConfigError, compose
from tests.datafiles import write_cartpole_h5

needs_onednn = pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
TOY = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=6", "train.batch_size=4",
       "train.warmup_steps=2", "train.log_every=2", "train.checkpoint_every=3", "eval.at_end=false"]


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 5), (2, 3, 4, 5), (0, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_equals_f_linear_forward_and_gradients(shape, bias) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(5, 6, bias=bias)
    lin = nn.Linear(5, 6, bias=bias)
    lin.load_state_dict(ref.state_dict())
    assert cm.apply_cpu_matmul(lin, "onednn") == 1 and type(lin) is cm.OneDNNLinear
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = lin(x), ref(x_ref)
    assert y.shape == y_ref.shape == (*shape[:-1], 6)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("relu", [False, True])
def test_without_gradients_the_product_runs_alone_with_the_same_values(grad_mode, relu) -> None:
    """Acting and evaluation (no_grad, inference_mode) call oneDNN's product without the autograd
    Function: the output has no graph and equals the training path's bit for bit."""
    torch.manual_seed(2)
    lin = nn.Linear(6, 9)
    cm.apply_cpu_matmul(lin, "onednn")
    x = torch.randn(4, 7, 6)
    fn = lin.forward_relu if relu else lin
    with_graph = fn(x)
    with grad_mode():
        y = fn(x)
    assert with_graph.grad_fn is not None and y.grad_fn is None and not y.requires_grad
    assert torch.equal(y, with_graph.detach())


@needs_onednn
def test_onednn_linear_on_a_non_contiguous_input_and_a_frozen_weight() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(8, 3)
    ref = {k: v.clone() for k, v in lin.state_dict().items()}
    cm.apply_cpu_matmul(lin, "onednn")
    lin.weight.requires_grad_(False)
    x = torch.randn(8, 10, requires_grad=True)
    y = lin(x.t())  # (10, 8) view with strides (1, 10)
    torch.testing.assert_close(y, F.linear(x.t(), ref["weight"], ref["bias"]), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is not None
    torch.testing.assert_close(x.grad, ref["weight"].sum(0)[:, None].expand(8, 10), rtol=1e-5, atol=1e-6)


@needs_onednn
def test_other_dtypes_and_autocast_take_f_linear() -> None:
    """float64 and bf16 autocast are not oneDNN float32 work: exactly F.linear's result."""
    torch.manual_seed(2)
    lin = nn.Linear(4, 4).double()
    cm.apply_cpu_matmul(lin, "onednn")
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    lin32 = nn.Linear(4, 4)
    cm.apply_cpu_matmul(lin32, "onednn")
    x32 = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin32(x32)
        y_ref = F.linear(x32, lin32.weight, lin32.bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)


def test_the_swap_keeps_parameters_and_state_dict_and_goes_back() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)), nn.LayerNorm(2))
    params = [id(p) for p in model.parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert cm.apply_cpu_matmul(model, "onednn") == 2
    assert [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert cm.apply_cpu_matmul(model, "onednn") == 0  # already switched
    assert cm.apply_cpu_matmul(model, "mkl") == 2 and all(type(m) is not cm.OneDNNLinear for m in model.modules())
    with pytest.raises(ValueError, match="resolve auto first"):
        cm.apply_cpu_matmul(model, "auto")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of the test's own; no choice of an earlier test in this process."""
    monkeypatch.setenv("RL_TFORMERS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cm, "_CHOSEN", {})
    return tmp_path / "cache" / "cpu_matmul.json"


class _Measure:
    """An injected measurement: returns ``rates`` and counts its calls."""

    def __init__(self, mkl: float, onednn: float) -> None:
        self.rates, self.calls = {"mkl": mkl, "onednn": onednn}, []

    def __call__(self, shapes):
        self.calls.append(tuple(shapes))
        return dict(self.rates)


def test_auto_keeps_mkl_unless_onednn_is_more_than_5_percent_faster() -> None:
    assert cm.AUTO_MARGIN == 0.05
    cases = [((100.0, 100.0), "mkl"), ((100.0, 104.9), "mkl"), ((100.0, 105.0), "mkl"), ((100.0, 105.1), "onednn"),
             ((100.0, 210.0), "onednn"), ((100.0, 60.0), "mkl"), ((96.0, 228.0), "onednn"), ((106.0, 110.0), "mkl"),
             ((float("nan"), 200.0), "mkl"), ((100.0, float("inf")), "mkl"), ((0.0, 10.0), "mkl")]
    assert [cm.choose_library(m, o) for (m, o), _ in cases] == [want for _, want in cases]
    assert cm.choose_library(100.0, 104.0, margin=0.03) == "onednn"


def test_linear_shapes_are_the_run_s_products_with_rows_capped() -> None:
    dt = OmegaConf.create({"agent": {"kind": "dt", "context_len": 20}, "backbone": {"d_model": 128, "d_ff": None},
                           "train": {"batch_size": 64}})
    assert cm.linear_shapes(dt) == ((3840, 128, 512), (3840, 512, 128), (3840, 128, 128)) == cm.DEFAULT_SHAPES
    assert cm.linear_shapes(None) == cm.DEFAULT_SHAPES
    toy = compose(None, TOY)  # batch 4 x seq_len 8 rows, the toy agent's d_model 16
    assert cm.linear_shapes(toy) == ((32, 16, 64), (32, 64, 16), (32, 16, 16))
    square = OmegaConf.create({"agent": {}, "backbone": {"d_model": 16, "d_ff": 16}, "train": {"batch_size": 2}})
    assert cm.linear_shapes(square) == ((120, 16, 16),)  # 60 tokens without a context; one shape
    wide = OmegaConf.create({"agent": {"context_len": 20}, "backbone": {"d_model": 512}, "train": {"batch_size": 256}})
    assert cm.linear_shapes(wide) == ((247, 512, 2048), (247, 2048, 512), (247, 512, 512))  # 3.5e9 // (6 x 2359296)
    assert 6 * sum(m * k * n for m, k, n in cm.linear_shapes(wide)) <= cm.MAX_ROUND_FLOPS


def test_library_gflops_is_all_products_flops_over_their_summed_medians() -> None:
    ms = {(10, 20, 30, "forward", "mkl"): 1.0, (10, 20, 30, "grad_input", "mkl"): 3.0,
          (10, 20, 30, "forward", "onednn"): 0.5, (10, 20, 30, "grad_input", "onednn"): 0.5}
    assert cm.library_gflops(ms) == {"mkl": pytest.approx(2 * 2 * 6000 / 4e-3 / 1e9, rel=1e-12),
                                     "onednn": pytest.approx(2 * 2 * 6000 / 1e-3 / 1e9, rel=1e-12)}


@needs_onednn
def test_the_measurement_runs_the_same_products_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = cm.interleaved_timing

    def spy(fns, **kw):
        seen.append((sorted(fns), kw))
        return real(fns, **kw)

    monkeypatch.setattr(cm, "interleaved_timing", spy)
    shapes = ((8, 4, 6), (8, 6, 4))
    a, b = cm.measure_gflops(shapes), cm.measure_gflops(shapes)
    assert seen[0] == seen[1] and len(seen[0][0]) == 12
    assert seen[0][0] == sorted((m, k, n, p, lib) for m, k, n in shapes for p in cm.PRODUCTS for lib in ("mkl", "onednn"))
    assert seen[0][1] == {"repeats": 8, "warmup": 1, "budget_s": 1.0, "min_repeats": 3}
    assert set(a) == set(b) == {"mkl", "onednn"} and all(v > 0 for v in (*a.values(), *b.values()))


@needs_onednn
def test_auto_measures_once_per_cpu_threads_and_shapes_then_reads_the_cache(cache: Path) -> None:
    import json

    measure = _Measure(100.0, 120.0)
    first = cm.choose_cpu_matmul(cm.DEFAULT_SHAPES, 1, measure=measure)
    assert (first.library, first.source, first.gflops) == ("onednn", "measured", {"mkl": 100.0, "onednn": 120.0})
    again = cm.choose_cpu_matmul(cm.DEFAULT_SHAPES, 1, measure=_Measure(100.0, 50.0))
    assert (again.library, again.source, again.gflops) == ("onednn", "cache", {"mkl": 100.0, "onednn": 120.0})
    assert measure.calls == [cm.DEFAULT_SHAPES]
    other = cm.choose_cpu_matmul(cm.DEFAULT_SHAPES, 2, measure=_Measure(100.0, 103.0))  # another thread count
    assert (other.library, other.source) == ("mkl", "measured")
    entries = json.loads(cache.read_text())["entries"]
    key1, key2 = cm.cache_key(cm.DEFAULT_SHAPES, 1), cm.cache_key(cm.DEFAULT_SHAPES, 2)
    assert set(entries) == {key1, key2}
    assert {k: (v["gflops"], v["library"]) for k, v in entries.items()} == {
        key1: ({"mkl": 100.0, "onednn": 120.0}, "onednn"), key2: ({"mkl": 100.0, "onednn": 103.0}, "mkl")}
    ident = cm.cpu_identity()
    for part in (ident["vendor"], ident["family"], ident["model"], ident["model_name"], "threads=1",
                 f"avx512_bf16={int(ident['avx512_bf16'])},amx={int(ident['amx'])}", f"torch={torch.__version__}",
                 "3840x128x512,3840x512x128,3840x128x128"):
        assert part in key1


@needs_onednn
@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"version": 1, "entries": 3}',
                                     "__import__('pathlib').Path('EXECUTED').touch()"])
def test_a_corrupted_cache_file_is_ignored_with_a_warning_and_measured_again(
        cache: Path, content: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.chdir(tmp_path)
    cache.parent.mkdir(parents=True)
    cache.write_text(content)
    measure = _Measure(100.0, 200.0)
    with pytest.warns(UserWarning, match=r"corrupted cpu_matmul cache .*measuring again"):
        choice = cm.choose_cpu_matmul(cm.DEFAULT_SHAPES, 1, measure=measure)
    assert (choice.library, choice.source, len(measure.calls)) == ("onednn", "measured", 1)
    assert not (tmp_path / "EXECUTED").exists()
    data = json.loads(cache.read_text())  # rewritten whole
    assert data["version"] == 1 and list(data["entries"]) == [cm.cache_key(cm.DEFAULT_SHAPES, 1)]


@needs_onednn
@pytest.mark.parametrize("kind", ["deeply nested", "not utf-8", "over the size limit", "link to a device"])
def test_an_unreadable_cache_file_is_ignored_with_a_warning_and_replaced(
        cache: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    cache.parent.mkdir(parents=True)
    if kind == "deeply nested":
        cache.write_text("[" * 100_000)
    elif kind == "not utf-8":
        cache.write_bytes(b"\xff\xfe\x00{")
    elif kind == "over the size limit":
        monkeypatch.setattr(cm, "CACHE_MAX_BYTES", 64)
        cache.write_text(json.dumps({"version": 1, "entries": {"k" * 100: {}}}))
    else:
        cache.symlink_to("/dev/zero")
    measure = _Measure(100.0, 200.0)
    with pytest.warns(UserWarning, match=r"cpu_matmul cache .*measuring again"):
        choice = cm.choose_cpu_matmul(cm.DEFAULT_SHAPES, 1, measure=measure)
    assert (choice.library, choice.source, len(measure.calls)) == ("onednn", "measured", 1)
    assert not cache.is_symlink() and Path("/dev/zero").is_char_device()
    assert list(json.loads(cache.read_text())["entries"]) == [cm.cache_key(cm.DEFAULT_SHAPES, 1)]


@needs_onednn
def test_a_cache_folder_under_a_file_is_a_warning_and_the_measurement_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").write_text("kept")
    monkeypatch.setenv("RL_TFORMERS_CACHE_DIR", str(tmp_path / "afile" / "cache"))
    monkeypatch.setattr(cm, "_CHOSEN", {})
    measure = _Measure(100.0, 200.0)
    with pytest.warns(UserWarning, match=r"cpu_matmul.json: cannot write the cpu_matmul cache \(Not a directory\); "
                                         r"the next run measures again"):
        choice = cm.choose_cpu_matmul(cm.DEFAULT_SHAPES, 1, measure=measure)
    assert (choice.library, choice.source, len(measure.calls)) == ("onednn", "measured", 1)
    assert (tmp_path / "afile").read_text() == "kept"


@needs_onednn
def test_a_corrupted_cache_entry_is_measured_again_and_the_others_kept(cache: Path) -> None:
    import json

    good, bad = cm.cache_key(((4, 4, 4),), 1), cm.cache_key(cm.DEFAULT_SHAPES, 1)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"version": 1, "entries": {
        good: {"gflops": {"mkl": 10.0, "onednn": 9.0}}, bad: {"gflops": {"mkl": "fast", "onednn": -1}}}}))
    with pytest.warns(UserWarning, match=r"corrupted cpu_matmul cache entry"):
        choice = cm.choose_cpu_matmul(cm.DEFAULT_SHAPES, 1, measure=_Measure(50.0, 40.0))
    assert (choice.library, choice.source) == ("mkl", "measured")
    entries = json.loads(cache.read_text())["entries"]
    assert entries[good] == {"gflops": {"mkl": 10.0, "onednn": 9.0}} and entries[bad]["gflops"] == {"mkl": 50.0, "onednn": 40.0}
    assert cm.choose_cpu_matmul(((4, 4, 4),), 1, measure=_Measure(1.0, 1.0)).source == "cache"


def test_a_build_without_onednn_resolves_auto_to_mkl_without_measuring(cache: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cm, "onednn_linear_available", lambda: False)
    measure = _Measure(1.0, 100.0)
    choice = cm.choose_cpu_matmul(cm.DEFAULT_SHAPES, 1, measure=measure)
    assert (choice.library, choice.source, choice.gflops, measure.calls) == ("mkl", "no-onednn", {}, [])
    assert cm.resolve_cpu_matmul("auto") == "mkl" and not cache.exists()
    with pytest.raises(ValueError, match=r"^cpu_matmul=onednn, but this PyTorch build has no oneDNN linear operator"):
        cm.resolve_cpu_matmul("onednn")
    monkeypatch.setattr(cm, "onednn_linear_available", lambda: True)
    assert cm.resolve_cpu_matmul(" OneDNN ") == "onednn"


@needs_onednn
@pytest.mark.parametrize(("rates", "library"), [((100.0, 130.0), "onednn"), ((100.0, 103.0), "mkl")])
def test_compose_resolves_auto_by_the_measurement_on_the_run_s_shapes(
        cache: Path, monkeypatch: pytest.MonkeyPatch, rates, library) -> None:
    measure = _Measure(*rates)
    monkeypatch.setattr(cm, "measure_gflops", measure)
    cfg = compose(None, [*TOY, "train.batch_size=6"])
    assert cfg.cpu_matmul == library and measure.calls == [((48, 16, 64), (48, 64, 16), (48, 16, 16))]
    assert cm.recorded_choice(cfg).gflops == {"mkl": rates[0], "onednn": rates[1]}
    assert compose(None, [*TOY, "train.batch_size=6"]).cpu_matmul == library and len(measure.calls) == 1
    assert compose(None, [*TOY, "train.batch_size=6", "cpu_matmul=mkl"]).cpu_matmul == "mkl"


def _resolved(run: Path) -> dict:
    from rl_tformers.runtime.resolved import read_resolved

    return read_resolved((run / "config.yaml").read_text())


@needs_onednn
def test_the_run_records_the_measured_choice_and_resume_keeps_it(cache: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """auto chose oneDNN (120 vs 100 GFLOP/s); the host then measures MKL faster: the
    interrupted run resumes with oneDNN and its record, and ends bit for bit as the run trained
    through with oneDNN."""
    from rl_tformers.runtime.trainer import resume, train
    from tests.bitwise import same_bits

    monkeypatch.setattr(cm, "measure_gflops", _Measure(100.0, 120.0))
    train(compose(None, [*TOY, "train.steps=3"]), tmp_path / "half")
    record = {"cpu_matmul": "onednn", "cpu_matmul.gflops_mkl": 100.0, "cpu_matmul.gflops_onednn": 120.0,
              "cpu_matmul.source": "measured", "cpu_matmul.threads": torch.get_num_threads()}
    assert {k: v for k, v in _resolved(tmp_path / "half").items() if k.startswith("cpu_matmul")} == record
    assert OmegaConf.load(tmp_path / "half" / "config.yaml").cpu_matmul == "onednn"
    monkeypatch.setattr(cm, "_CHOSEN", {})  # another process
    train(compose(None, [*TOY, "cpu_matmul=onednn"]), tmp_path / "full")
    assert "cpu_matmul.source" not in _resolved(tmp_path / "full")  # given by name: nothing measured

    cache.unlink()  # another process, and now MKL measures faster here
    monkeypatch.setattr(cm, "_CHOSEN", {})
    monkeypatch.setattr(cm, "measure_gflops", _Measure(100.0, 50.0))
    assert compose(None, TOY).cpu_matmul == "mkl"
    monkeypatch.setattr(cm, "_CHOSEN", {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resume(tmp_path / "half", ["train.steps=6"]).step == 6
    assert {k: v for k, v in _resolved(tmp_path / "half").items() if k.startswith("cpu_matmul")} == record
    a = torch.load(tmp_path / "full" / "checkpoints" / "step_000000006.pt", weights_only=True)
    b = torch.load(tmp_path / "half" / "checkpoints" / "step_000000006.pt", weights_only=True)
    assert same_bits(a["model"], b["model"]) and same_bits(a["optimizer"], b["optimizer"])


def test_compose_records_the_resolved_library_and_a_saved_run_keeps_its_own() -> None:
    cfg = compose(None, TOY)
    assert cfg.cpu_matmul == cm.resolve_cpu_matmul("auto", cfg) and cfg.cpu_matmul in ("mkl", "onednn")
    assert compose(None, [*TOY, "cpu_matmul=mkl"]).cpu_matmul == "mkl"
    with pytest.raises(ConfigError, match=r"^cpu_matmul='blas'; use one of auto, mkl, onednn$"):
        compose(None, [*TOY, "cpu_matmul=blas"])
    old = OmegaConf.to_container(cfg)
    assert compose(start={**old, "cpu_matmul": "mkl"}).cpu_matmul == "mkl"
    assert compose(start={**old, "cpu_matmul": "mkl"}, overrides=["cpu_matmul=auto"]).cpu_matmul == cfg.cpu_matmul


@needs_onednn
@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_trainer_and_load_run_use_the_run_s_library_and_resume_is_exact(tmp_path: Path, library: str) -> None:
    from rl_tformers.runtime.loading import load_run
    from rl_tformers.runtime.trainer import resume, train

    data = write_cartpole_h5(tmp_path / "cp.hdf5")
    overrides = [f"dataset.path={data}", "backbone.d_model=16", "backbone.n_heads=1", "backbone.n_layers=1",
                 "agent.context_len=5", "train.batch_size=4", "train.warmup_steps=1", "train.progress=false",
                 "device=cpu", "eval.at_end=false", "train.checkpoint_every=2", "train.log_every=2",
                 f"cpu_matmul={library}"]
    train(compose("dt/cartpole_demo", [*overrides, "train.steps=4"]), tmp_path / "full")
    train(compose("dt/cartpole_demo", [*overrides, "train.steps=2"]), tmp_path / "half")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resume(tmp_path / "half", ["train.steps=4"]).step == 4
    a = torch.load(tmp_path / "full" / "checkpoints" / "step_000000004.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "half" / "checkpoints" / "step_000000004.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert OmegaConf.load(tmp_path / "half" / "config.yaml").cpu_matmul == library
    run = load_run(tmp_path / "full")
    linears = {type(m) for m in run.agent.model.modules() if isinstance(m, nn.Linear)}
    assert linears == ({cm.OneDNNLinear} if library == "onednn" else {nn.Linear})


def test_mkl_and_onednn_train_the_same_function(tmp_path: Path) -> None:
    """Same seed, both libraries: the logged losses agree to float rounding (not bit for bit)."""
    if not cm.onednn_linear_available():
        pytest.skip("this PyTorch build has no oneDNN linear op")
    import json

    from rl_tformers.runtime.trainer import train

    losses = {}
    for lib in ("mkl", "onednn"):
        train(compose(None, [*TOY, f"cpu_matmul={lib}"]), tmp_path / lib)
        rows = [json.loads(line) for line in (tmp_path / lib / "metrics.jsonl").read_text().splitlines()]
        losses[lib] = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses["mkl"]) == 3
    assert losses["onednn"] == pytest.approx(losses["mkl"], rel=1e-4)


@needs_onednn
def test_a_compiled_model_trains_with_the_compiler_s_kernels(tmp_path: Path) -> None:
    """train.compile=true with cpu_matmul=onednn: inductor could not lower oneDNN's linear in a
    training graph (LoweringException in the first update); a traced forward takes F.linear."""
    from rl_tformers.runtime.trainer import train

    res = train(compose(None, [*TOY, "cpu_matmul=onednn", "train.compile=true", "train.steps=2"]), tmp_path / "run")
    assert res.step == 2


@needs_onednn
def test_fused_relu_equals_relu_of_the_linear_and_the_feed_forward_uses_it() -> None:
    from rl_tformers.blocks.base import FeedForward

    torch.manual_seed(4)
    ref = nn.Linear(6, 9)
    lin = nn.Linear(6, 9)
    lin.load_state_dict(ref.state_dict())
    cm.apply_cpu_matmul(lin, "onednn")
    x = torch.randn(4, 5, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = lin.forward_relu(x), F.relu(ref(x_ref))
    assert (y_ref == 0).any() and torch.equal(y == 0, y_ref == 0)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    for a, b in [(x.grad, x_ref.grad), (lin.weight.grad, ref.weight.grad), (lin.bias.grad, ref.bias.grad)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the feed-forward network's first layer takes the fused path (and only with ReLU)
    for act, fused in [("relu", True), ("gelu", False)]:
        ffn = FeedForward(6, 9, act, 0.0)
        plain = FeedForward(6, 9, act, 0.0)
        plain.load_state_dict(ffn.state_dict())
        cm.apply_cpu_matmul(ffn, "onednn")
        calls = []
        original = cm.OneDNNLinear.forward_relu
        cm.OneDNNLinear.forward_relu = lambda self, x, _o=original, _c=calls: _c.append(1) or _o(self, x)
        try:
            out = ffn(x.detach())
        finally:
            cm.OneDNNLinear.forward_relu = original
        assert bool(calls) is fused
        torch.testing.assert_close(out, plain(x.detach()), rtol=1e-5, atol=1e-6)


@needs_onednn
@pytest.mark.parametrize(("k", "n"), [(3, 7), (7, 3), (5, 5)])
def test_weight_gradient_equals_g_transposed_x_in_either_operand_order(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k * 10 + n)
    g2, x2 = torch.randn(11, n, generator=g), torch.randn(11, k, generator=g)
    gw = cm.weight_grad(g2, x2)
    assert gw.shape == (n, k) and gw.is_contiguous()
    torch.testing.assert_close(gw, g2.t() @ x2, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_bench_gemm_times_every_product_of_each_shape_and_applies_auto_s_rule() -> None:
    from rl_tformers.bench import gemm

    res = gemm.run(m=64, shapes=[(8, 16), (16, 8)], repeats=2, sizes=(32,))
    assert [(r["k"], r["n"], r["product"]) for r in res["rows"]] == [
        (k, n, p) for k, n in [(8, 16), (16, 8)] for p in ("forward", "grad_input", "grad_weight")]
    for r in res["rows"]:
        assert r["mkl_ms"] > 0 and r["onednn_ms"] > 0 and r["onednn_over_mkl"] == pytest.approx(r["onednn_ms"] / r["mkl_ms"])
    assert set(res["peak_gflops"]) == {"mkl", "onednn"} and all(v[32] > 0 for v in res["peak_gflops"].values())
    # each library's rate over all products, and what auto's rule picks from them
    medians = {(64, r["k"], r["n"], r["product"], lib): r[f"{lib}_ms"] for r in res["rows"] for lib in ("mkl", "onednn")}
    assert res["gflops"] == cm.library_gflops(medians)
    assert res["auto_choice"] == cm.choose_library(res["gflops"]["mkl"], res["gflops"]["onednn"])
    assert res["machine"]["threads"] == res["threads"] and res["machine"]["cpu_model"] == cm.cpu_identity()["model"]
    md = gemm.markdown(res)
    assert "| 64 x 8 · 16 x 8 |" in md and "n x n x n peak" in md
    assert f"cpu_matmul: auto picks {res['auto_choice']} (oneDNN only when more than 5% faster)" in md
    with pytest.raises(ValueError, match=r"^--shapes: '8by16' is not KxN"):
        gemm.parse_shapes("8by16")
    # the timed oneDNN products (those auto measures) compute what MKL computes
    fns = cm.product_fns(64, 8, 16)
    for product in ("forward", "grad_input", "grad_weight"):
        torch.testing.assert_close(fns[(product, "onednn")](), fns[(product, "mkl")](), rtol=1e-5, atol=1e-5)


def _pair(k: int = 5, n: int = 6, bias: bool = True, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    """(the MKL reference, a copy switched to oneDNN) with the same weights."""
    torch.manual_seed(seed)
    ref = nn.Linear(k, n, bias=bias)
    lin = copy.deepcopy(ref)
    assert cm.apply_cpu_matmul(lin, "onednn") == 1 and type(lin) is cm.OneDNNLinear
    return ref, lin


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


@pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
def test_hessian_and_double_backward_equal_mkl_s() -> None:
    ref, lin = _pair()
    v = torch.randn(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "an autograd kernel was not registered ... silently incorrect"
        h = torch.autograd.functional.hessian(lambda x: lin(x).pow(2).sum(), v)
    h_ref = torch.autograd.functional.hessian(lambda x: ref(x).pow(2).sum(), v)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_ref, 2 * ref.weight.t() @ ref.weight, rtol=1e-5, atol=1e-5)  # d2/dx2 |W x + b|^2
    # a gradient penalty: |dL/dx|^2 differentiated w.r.t. the input and the parameters, plain and fused ReLU
    for fused in (False, True):
        grads = []
        for m in (ref, lin):
            m.zero_grad()
            x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            y = (F.relu(m(x)) if m is ref else lin.forward_relu(x)) if fused else m(x)
            (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
            gx.pow(2).sum().backward()
            grads.append((x.grad, m.weight.grad, m.bias.grad))
        assert grads[0][0].abs().sum() > 0
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 5), (5,)])
def test_in_place_ops_on_the_output_work_as_on_f_linear_s(shape) -> None:
    ref, lin = _pair()
    x = torch.randn(*shape)
    out = []
    for m in (ref, lin):
        xx = _leaf(x)
        y = m(xx)
        y.mul_(3.0)
        y.add_(1.0)
        F.relu(y, inplace=True)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        out.append((y.detach(), xx.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # the fused ReLU saves its output for backward, as F.relu does: modifying it is refused alike
    for y in (F.relu(ref(_leaf(x))), lin.forward_relu(_leaf(x))):
        y.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


@pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
@pytest.mark.parametrize("make_bias", [lambda: torch.randn(12)[::2], lambda: torch.randn(1).expand(6)],
                         ids=["strided", "expanded"])
def test_a_non_contiguous_bias_gives_f_linear_s_output_and_gradient(make_bias) -> None:
    ref, lin = _pair()
    b = make_bias()
    assert not b.is_contiguous()
    ref.bias, lin.bias = nn.Parameter(b.clone()), nn.Parameter(b)
    x = torch.randn(4, 5)
    y, y_ref = lin(x), ref(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lin.forward_relu(x), F.relu(y_ref), rtol=1e-5, atol=1e-6)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
def test_a_layer_without_output_features_trains_as_nn_linear() -> None:
    ref, lin = _pair(3, 0)
    for m in (ref, lin):
        x = torch.randn(4, 3, requires_grad=True)
        y = m(x)
        assert y.shape == (4, 0)
        y.sum().backward()
        assert torch.equal(x.grad, torch.zeros(4, 3)) and m.bias.grad.shape == (0,)


def _hooked_ffn(library: str, calls: list) -> FeedForward:
    torch.manual_seed(5)
    ffn = FeedForward(6, 9, "relu", 0.0)
    cm.apply_cpu_matmul(ffn, library)
    fc1 = ffn.fc1
    fc1.register_forward_pre_hook(lambda m, args: calls.append(("pre", tuple(args[0].shape))))
    fc1.register_forward_hook(lambda m, args, out: calls.append(("fwd", bool((out < 0).any()))))
    fc1.register_full_backward_hook(lambda m, gin, gout: calls.append(("bwd", tuple(gout[0].shape))))
    return ffn


@pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
def test_hooks_of_the_fused_relu_layer_run_and_see_the_pre_activation_output() -> None:
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(6))
    results = {}
    for library in ("mkl", "onednn"):
        calls: list = []
        ffn = _hooked_ffn(library, calls)
        xx = _leaf(x)
        y = ffn(xx)
        y.sum().backward()
        results[library] = (calls, y.detach(), xx.grad)
    assert results["mkl"][0] == [("pre", (2, 4, 6)), ("fwd", True), ("bwd", (2, 4, 9))]
    assert results["onednn"][0] == results["mkl"][0]
    for a, b in zip(results["mkl"][1:], results["onednn"][1:]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
def test_flop_counter_s_per_module_counts_equal_mkl_s() -> None:
    counts = {}
    for library in ("mkl", "onednn"):
        torch.manual_seed(7)
        ffn = FeedForward(6, 9, "relu", 0.0)
        cm.apply_cpu_matmul(ffn, library)
        with FlopCounterMode(display=False) as fc:
            ffn(torch.randn(2, 4, 6, requires_grad=True)).sum().backward()
        counts[library] = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    # fc1 (6 -> 9) and fc2 (9 -> 6) on 8 rows: 2 M K N forward, twice that backward
    assert counts["mkl"]["FeedForward.fc1"] == 3 * 2 * 8 * 6 * 9
    assert counts["onednn"] == counts["mkl"]
    # without hooks (no FlopCounterMode) the feed-forward network still takes the fused product
    torch.manual_seed(7)
    ffn = FeedForward(6, 9, "relu", 0.0)
    cm.apply_cpu_matmul(ffn, "onednn")
    used = []
    original = cm._OneDNNLinearFunction.apply
    cm._OneDNNLinearFunction.apply = lambda *a, _o=original: used.append(a[3]) or _o(*a)
    try:
        ffn(torch.randn(2, 4, 6))
    finally:
        cm._OneDNNLinearFunction.apply = original
    assert used == [True, False]  # fc1 with the ReLU fused, fc2 plain


@pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
def test_torch_func_transforms_give_mkl_s_results() -> None:
    ref, lin = _pair()
    x = torch.randn(3, 5)
    torch.testing.assert_close(torch.func.vmap(lin)(x), torch.func.vmap(ref)(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.func.grad(lambda v: lin(v).pow(2).sum())(x[0]),
                               torch.func.grad(lambda v: ref(v).pow(2).sum())(x[0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.func.jacrev(lin)(x[0]), ref.weight, rtol=0, atol=0)
    # per-sample gradients, the torch.func recipe: vmap(grad(functional_call))
    params = {k: v.detach() for k, v in lin.named_parameters()}

    def loss(m, p, xi):
        return torch.func.functional_call(m, p, (xi,)).pow(2).sum()

    per = torch.func.vmap(torch.func.grad(lambda p, xi: loss(lin, p, xi)), in_dims=(None, 0))(params, x)
    per_ref = torch.func.vmap(torch.func.grad(lambda p, xi: loss(ref, p, xi)), in_dims=(None, 0))(params, x)
    assert per["weight"].shape == (3, 6, 5)
    for k in per:
        torch.testing.assert_close(per[k], per_ref[k], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")
def test_registering_the_flop_formula_again_keeps_the_first_and_counts_alike() -> None:
    from torch.utils import flop_counter

    op = torch.ops.mkldnn._linear_pointwise
    before = flop_counter.flop_registry[op]
    cm._register_flop_formula()  # what importlib.reload(rl_tformers.runtime.cpu_matmul) runs
    assert flop_counter.flop_registry[op] is before
    ref, lin = _pair(8, 3)
    totals = []
    for m in (ref, lin):
        with FlopCounterMode(display=False) as fc:
            m(torch.randn(2, 7, 8, requires_grad=True)).sum().backward()
        totals.append(fc.get_total_flops())
    assert totals == [3 * 2 * 14 * 8 * 3] * 2  # forward + both backward products, 2 M K N each
