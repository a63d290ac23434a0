"""PPO-GTrXL resumes bit-identically: the environments (as plain data, nothing unpickled), the
running episodes and the rollout in progress are checkpointed (``GTrXLPPO.process_state``), so a
run stopped at any update and resumed gives the uninterrupted run's weights, logged values and
final state. Environments that only unpickling restores are unpickled only when asked."""

from __future__ import annotations

import logging
import pickle
import threading
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from rl_tformers.agents.gtrxl.env_state import fifo_decode, fifo_encode
from rl_tformers.agents.gtrxl.ppo import GTrXLPPO
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.checkpoint import allow_unpickling, save_checkpoint
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train
from tests.bitwise import same_bits
from tests.runtime.ddp_helpers import read_metrics, two_ranks

SHORT = "rl_tformers_test/ShortCartPole-v1"  # time limit 10: truncations (bootstrapped) and resets in every rollout
UNPICKLABLE = "rl_tformers_test/UnpicklableCartPole-v1"
OPAQUE = "rl_tformers_test/OpaqueCartPole-v1"


class StepCounter:
    """State of an environment's own class: not plain data, pickles."""

    def __init__(self) -> None:
        self.steps = 0


class OpaqueCartPole(CartPoleEnv):
    """CartPole whose observation's velocity is offset by a counter object (only unpickling restores it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.counter = StepCounter()

    def step(self, action):
        self.counter.steps += 1
        obs, r, term, trunc, info = super().step(action)
        obs = obs.copy()
        obs[1] += np.float32(1e-3 * self.counter.steps)
        return obs, r, term, trunc, info


class UnpicklableCartPole(CartPoleEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lock = threading.Lock()  # not plain data, and a lock does not pickle


for _id, _entry in ((SHORT, CartPoleEnv), (UNPICKLABLE, UnpicklableCartPole), (OPAQUE, OpaqueCartPole)):
    if _id not in gym.registry:
        gym.register(_id, entry_point=_entry, max_episode_steps=10)

TINY = ["agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=16", "agent.n_epochs=2", "agent.n_minibatches=2",
        "train.steps=12", "train.progress=false", "train.log_every=1", "eval.at_end=false", "eval.every=0",
        "device=cpu", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
        "backbone.memory.mem_len=4"]  # U = 4 updates per rollout, 3 rollouts
# No dropout: PPO builds its model without any (a config that sets it is warned and overridden,
# agents/gtrxl/ppo.py without_dropout). Exact resume still depends on the restored random state:
# every rollout samples its actions from torch's global generator (and the environments' own).


def _cfg(env_id: str = SHORT, *extra: str):
    return compose(overrides=[*TINY, f"agent.env_id={env_id}", *extra])


def _metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith("perf/")} for m in read_metrics(run)]


def _final(run: Path, step: int = 12) -> dict:
    return torch.load(run / "checkpoints" / f"step_{step:09d}.pt", weights_only=True)


_same = same_bits


def _same_process_states(a: list[dict], b: list[dict]) -> bool:
    """Every rank's process state equal: tensors bit for bit, the environments' saved attributes
    (random generators and MuJoCo's integration state included) value for value."""
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ppo") / "full"
    train(_cfg(), run)
    return run


@pytest.mark.parametrize("stops", [(5,), (8,), (3, 9)], ids=["inside-a-rollout", "at-a-rollout-end", "twice"])
def test_stopped_run_resumes_bit_identically(full_run: Path, tmp_path: Path, stops, caplog) -> None:
    split = tmp_path / "split"
    assert train(_cfg(), split, stop_at=stops[0]).step == stops[0]
    with caplog.at_level(logging.WARNING):
        for stop in stops[1:]:
            assert resume(split, stop_at=stop).step == stop
        assert resume(split).step == 12
    assert not [r for r in caplog.records if "bit-identical" in r.getMessage()]  # no warning: it is exact
    assert _metrics(split) == _metrics(full_run)
    assert len(_metrics(split)) == 12 and all("train/episodic_return" in m for m in _metrics(split)[4:])
    a, b = _final(full_run), _final(split)
    for key in ("model", "optimizer", "extra", "rng"):
        assert _same(a[key], b[key]), key
    pa, pb = a["trainer"]["process_ranks"], b["trainer"]["process_ranks"]
    assert len(pa) == 1 and pa[0]["rollout"] is None  # the end is a rollout boundary
    assert pa[0]["env_states"] is not None and pa[0]["envs"] is None  # plain data only: nothing pickled
    assert _same_process_states(pa, pb)  # the same environments, episodes and memory


def test_checkpoint_inside_a_rollout_holds_that_rollout(tmp_path: Path) -> None:
    train(_cfg(), tmp_path / "run", stop_at=6)
    st = _final(tmp_path / "run", 6)["trainer"]["process_ranks"][0]
    assert st["rollout"]["served"] == 2 and set(st["rollout"]["fifo"]) == {"mem", "mem_pos", "mem_valid", "mem_seg"}
    assert st["rollout"]["tensors"]["actions"].shape == (16, 2)


def test_a_plain_window_run_stopped_inside_a_rollout_resumes_bit_identically(tmp_path: Path) -> None:
    """``agent.window=4`` (no memory): the checkpoint holds the running windows and the rollout's
    per-step windows (FIFO-encoded like the memory); the resumed run ends as the uninterrupted one."""
    window = [o for o in TINY if not o.startswith("backbone.memory")] + ["agent.window=4", "backbone.memory.kind=none"]
    st = _stopped_at_6_resumes_as_the_full_run(compose(overrides=[*window, f"agent.env_id={SHORT}"]), tmp_path)
    assert set(st["rollout"]["fifo"]) == {"window_x", "window_pos", "window_valid"}
    assert "episode" not in st["rollout"]["tensors"] and set(st["running"]["memory"]) == {"window"}


def test_a_compressive_memory_run_stopped_inside_a_rollout_resumes_bit_identically(tmp_path: Path) -> None:
    """The compressive memory (mean compression) grows its FIFO in a stream's first steps: the
    checkpoint holds the running memory at full width with the slots it held, and the resumed
    run ends as the uninterrupted one."""
    mem = ["backbone.memory.kind=compressive", "backbone.memory.mem_len=4", "backbone.memory.compressed_len=2",
           "backbone.memory.rate=2", "backbone.memory.compression=mean"]
    cfg = compose(overrides=[*[o for o in TINY if not o.startswith("backbone.memory")], *mem, f"agent.env_id={SHORT}"])
    st = _stopped_at_6_resumes_as_the_full_run(cfg, tmp_path)
    assert int(st["running"]["memory_slots"]) == 7 and st["running"]["memory"]["pos"].shape == (2, 7)


def _stopped_at_6_resumes_as_the_full_run(cfg, tmp_path: Path) -> dict:
    """Train ``cfg`` whole, and stopped after update 6 (inside the second rollout) then resumed:
    the same metrics, weights, optimiser, RNG and process states. Returns the process state
    the stop saved."""
    full, split = tmp_path / "full", tmp_path / "split"
    train(cfg, full)
    assert train(cfg, split, stop_at=6).step == 6
    st = _final(split, 6)["trainer"]["process_ranks"][0]
    assert resume(split).step == 12
    assert _metrics(split) == _metrics(full)
    a, b = _final(full), _final(split)
    for key in ("model", "optimizer", "extra", "rng"):
        assert _same(a[key], b[key]), key
    assert _same_process_states(a["trainer"]["process_ranks"], b["trainer"]["process_ranks"])
    return st


@pytest.mark.parametrize("env_id", [
    "CartPole-v1", SHORT, "rl_tformers/PositionOnlyCartPole-v1", "rl_tformers/PositionOnlyPendulum-v1",
    "rl_tformers/Recall-d2-v0", "Hopper-v5", "rl_tformers/PositionOnlyHopper-v5",
])
def test_restored_environments_continue_exactly(env_id: str) -> None:
    if "Hopper" in env_id:
        pytest.importorskip("mujoco")
    cfg = _cfg(env_id, "agent.n_steps=8", "agent.prev_action=true", "agent.prev_reward=true")
    torch.manual_seed(0)
    a = GTrXLPPO.for_training(cfg, None, "cpu")
    for _ in range(2):
        a.collector.collect()  # mid-episode: running memory, counters and (Hopper) simulator state
    b = GTrXLPPO.for_training(cfg, None, "cpu")
    b.model.load_state_dict(a.model.state_dict())
    b.load_extra_state(a.extra_state())
    b.load_process_state([a.process_state()])
    assert b.resume_note(8) is None
    fresh = GTrXLPPO.for_training(cfg, None, "cpu")
    fresh.model.load_state_dict(a.model.state_dict())
    fresh.load_extra_state(a.extra_state())  # counters and statistics only: fresh environments
    outs = []
    for agent in (a, b, fresh):
        torch.manual_seed(1)
        ro = agent.collector.collect()
        outs.append(({k: v for k, v in ro.items() if k != "stats"}, ro["stats"]))
    assert _same(outs[0], outs[1])
    assert not _same(outs[0][0]["x"], outs[2][0]["x"])  # without the saved state: other observations
    assert _same_process_states([a.process_state()], [b.process_state()])


def test_an_environment_that_cannot_be_saved_restarts_and_says_so(tmp_path: Path, caplog) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    with caplog.at_level(logging.WARNING):
        train(_cfg(UNPICKLABLE), full)
    saved = [r.getMessage() for r in caplog.records if "not plain data" in r.getMessage()]
    assert len(saved) == 1 and "UnpicklableCartPole.lock (lock)" in saved[0] and "cannot be pickled (" in saved[0]
    train(_cfg(UNPICKLABLE), split, stop_at=5)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resume(split)
    notes = [r.getMessage() for r in caplog.records if "resume of gtrxl_ppo" in r.getMessage()]
    assert len(notes) == 1 and "not bit-identical" in notes[0] and "cannot be pickled (" in notes[0]
    assert ("after updates 6..8, which learn from the last 3 minibatches of the checkpointed rollout 2 exactly"
            in notes[0])
    ma, mb = _metrics(full), _metrics(split)
    assert ma[:8] == mb[:8]  # the checkpointed rollout is finished exactly
    assert ma[8:] != mb[8:]  # then fresh environments
    assert [m["train/env_steps"] for m in mb] == [m["train/env_steps"] for m in ma]  # nothing counted twice


@pytest.fixture(scope="module")
def opaque_runs(tmp_path_factory) -> tuple[Path, Path]:
    """``(full, split)``: an uninterrupted run of OpaqueCartPole and one stopped at update 5."""
    base = tmp_path_factory.mktemp("opaque")
    train(_cfg(OPAQUE), base / "full")
    train(_cfg(OPAQUE), base / "split", stop_at=5)
    return base / "full", base / "split"


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_environments_that_only_unpickling_restores_restart_unless_unpickling_is_allowed(
        opaque_runs, tmp_path: Path, caplog) -> None:
    full, split = opaque_runs
    st = _final(split, 5)["trainer"]["process_ranks"][0]
    assert st["envs_problem"] == ("the environments of rl_tformers_test/OpaqueCartPole-v1 hold state that is not "
                                  "plain data (OpaqueCartPole.counter (StepCounter))")
    assert st["envs"] is not None  # pickled too, for --unsafe-unpickle-envs
    refused = _copy_run(split, tmp_path / "refused")
    with caplog.at_level(logging.WARNING):
        resume(refused)
    notes = [r.getMessage() for r in caplog.records if "resume of gtrxl_ppo" in r.getMessage()]
    assert len(notes) == 1 and ("OpaqueCartPole.counter (StepCounter)): only unpickling restores them, which runs "
                                "code stored in the checkpoint; resume with --unsafe-unpickle-envs to do it, for "
                                "a run you trust") in notes[0]
    assert _metrics(refused)[8:] != _metrics(full)[8:]  # fresh environments
    allowed = _copy_run(split, tmp_path / "allowed")
    caplog.clear()
    with caplog.at_level(logging.WARNING), allow_unpickling():
        resume(allowed)
    assert not [r for r in caplog.records if "resume of gtrxl_ppo" in r.getMessage()]
    assert _metrics(allowed) == _metrics(full)  # unpickled: exact


class WritesAFile:
    """A pickle payload: unpickling it writes ``path`` (what a hostile checkpoint could do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').write('unpickled')",)


def _plant_payload(run: Path, marker: Path, step: int = 5) -> None:
    """Replace the pickled environments of ``run``'s checkpoint at ``step`` by :class:`WritesAFile`."""
    path = run / "checkpoints" / f"step_{step:09d}.pt"
    state = torch.load(path, weights_only=True)
    blob = pickle.dumps(WritesAFile(marker))
    for st in state["trainer"]["process_ranks"]:
        st["envs"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    path.unlink()
    save_checkpoint(run, {k: v for k, v in state.items() if k not in ("format", "version", "sha256")})


def test_resume_never_unpickles_a_planted_environment_payload(opaque_runs, tmp_path: Path) -> None:
    """A checkpoint whose pickled environments are a payload that writes a file: ``--resume``
    (Python and CLI) writes nothing and says the environments restart; only the opt-in unpickles."""
    marker = tmp_path / "written-by-the-checkpoint"
    run, opted_in = _copy_run(opaque_runs[1], tmp_path / "run"), _copy_run(opaque_runs[1], tmp_path / "opted-in")
    for r in (run, opted_in):
        _plant_payload(r, marker)
    res = CliRunner().invoke(app, ["train", "--resume", str(run), "train.steps=6"])
    assert res.exit_code == 0, res.output
    assert not marker.exists()
    # a plain-data environment (CartPole) never reads the pickled bytes, even when allowed
    plain = tmp_path / "plain"
    train(_cfg(), plain, stop_at=5)
    _plant_payload(plain, marker)
    with allow_unpickling():
        resume(plain, ["train.steps=6"])
    assert not marker.exists()
    # the opt-in is what unpickles (so it runs the payload): its name and help say so
    CliRunner().invoke(app, ["train", "--resume", str(opted_in), "--unsafe-unpickle-envs", "train.steps=6"])
    assert marker.read_text() == "unpickled"
    import typer

    params = {p.name: p for p in typer.main.get_command(app).commands["train"].params}
    assert "UNSAFE: unpickling runs any code the checkpoint holds" in params["unsafe_unpickle_envs"].help


def test_unsafe_unpickle_envs_needs_resume() -> None:
    res = CliRunner().invoke(app, ["train", "agent.kind=toy", "--unsafe-unpickle-envs"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == ("error: --unsafe-unpickle-envs is for --resume RUN_DIR (a new run "
                                                   "lists its modules in plugins=[...], which records them)")


def test_a_checkpoint_without_process_state_resumes_as_before(tmp_path: Path, caplog) -> None:
    run = tmp_path / "run"
    train(_cfg(), run, stop_at=5)
    path = run / "checkpoints" / "step_000000005.pt"
    state = torch.load(path, weights_only=True)
    del state["trainer"]["process_ranks"]  # as written before the environments were saved
    from rl_tformers.runtime.checkpoint import save_checkpoint

    path.unlink()
    save_checkpoint(run, {k: v for k, v in state.items() if k not in ("format", "version", "sha256")})
    with caplog.at_level(logging.WARNING):
        resume(run)
    notes = [r.getMessage() for r in caplog.records if "resume of gtrxl_ppo" in r.getMessage()]
    assert len(notes) == 1 and "not bit-identical" in notes[0] and "holds no environment state" in notes[0]
    assert "updates 6..8 learn from the last 3 minibatches of a fresh rollout" in notes[0]


def test_another_number_of_processes_restarts_the_environments_and_says_so() -> None:
    a = GTrXLPPO.for_training(_cfg(), None, "cpu")
    a.collector.collect()
    b = GTrXLPPO.for_training(_cfg(), None, "cpu")
    b.load_extra_state(a.extra_state())
    b.load_process_state([a.process_state(), a.process_state()])  # written by 2 processes
    note = b.resume_note(4)
    assert b.collector.envs is None and "written by 2 process(es) and this run has 1" in note
    assert note.endswith("restart with fresh resets (and empty backbone memory) and a fresh rollout")


def test_fifo_encoding_is_lossless_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    s, n, layers, m, d = 9, 3, 2, 4, 5
    x = torch.empty(s, n, layers, m, d)
    x[0] = torch.randn(n, layers, m, d, generator=g)
    for t in range(1, s):  # a FIFO: shift by one slot, new last slot
        x[t] = torch.cat([x[t - 1][:, :, 1:], torch.randn(n, layers, 1, d, generator=g)], 2)
        if t == 4:
            x[t, 1] = 0.0  # row 1 reset (zeroed): stored whole
        if t == 5:
            x[t, 2, 0, 0, 0] = float("nan")  # anything else: stored whole
        if t == 6:
            x[t, 0, 1, 3, 2] = -0.0  # a new slot of -0.0 ...
        if t == 7:
            x[t, 0, 1, 2, 2] = 0.0  # ... then +0.0 where the shifted copy has -0.0: equal floats, other bits
    enc = fifo_encode(x, 3)
    assert _same(fifo_decode(enc, 3), x)
    assert (~enc["ok"]).nonzero().tolist() == [[3, 1], [4, 2], [6, 0]]  # steps 4, 5, 7 (ok[t - 1])
    assert enc["new"].shape == ((s - 1) * n - 3, layers, 1, d) and enc["rows"].shape == (3, layers, m, d)
    pos = torch.arange(s)[:, None, None] + torch.arange(m)[None, None, :].expand(s, n, m)
    assert _same(fifo_decode(fifo_encode(pos, 2), 2), pos)
    one = torch.randn(1, n, layers, m, d, generator=g)
    assert _same(fifo_decode(fifo_encode(one, 3), 3), one)


def test_two_processes_resume_their_own_environments_bit_identically(tmp_path: Path) -> None:
    overrides = [*TINY, "agent.env_id=CartPole-v1", "train.steps=8"]
    two_ranks(tmp_path, f"""
        from pathlib import Path
        from rl_tformers.runtime.run_config import compose
        from rl_tformers.runtime.trainer import resume, train
        cfg = compose(None, {overrides!r})
        base = Path({str(tmp_path)!r})
        train(cfg, base / "full")
        assert train(cfg, base / "split", stop_at=5).step == 5
        resume(base / "split")
    """)
    assert _metrics(tmp_path / "split") == _metrics(tmp_path / "full")
    a, b = _final(tmp_path / "full", 8), _final(tmp_path / "split", 8)
    assert _same(a["model"], b["model"])
    assert _same_process_states(a["trainer"]["process_ranks"], b["trainer"]["process_ranks"])
    ranks = b["trainer"]["process_ranks"]
    assert len(ranks) == 2 and not _same(ranks[0]["running"]["obs"], ranks[1]["running"]["obs"])  # each its own
    assert _metrics(tmp_path / "split")[-1]["train/env_steps"] == 128.0  # 2 rollouts x 2 ranks x 2 envs x 16 steps


def test_a_hostile_environment_snapshot_is_refused_and_the_environments_restart(tmp_path: Path) -> None:
    """Snapshots naming a constructed or dunder attribute, an unknown bit generator or an object
    dtype: the resume runs nothing of them, the environments restart, and the note says why."""
    a = GTrXLPPO.for_training(_cfg(), None, "cpu")
    a.collector.collect()
    st = a.process_state()
    layers = st["env_states"][0]
    base = layers[-1]["attrs"]
    cases = {
        "attribute": lambda: base.__setitem__("spec", None),
        "dunder": lambda: base.__setitem__("__class__", 1),
        "generator": lambda: base["_np_random"]["state"]["items"][0].__setitem__(1, "os.system"),
        "dtype": lambda: base["state"].__setitem__("dtype", "|O"),
    }
    import copy

    for name, spoil in cases.items():
        saved = copy.deepcopy(base)
        spoil()
        b = GTrXLPPO.for_training(_cfg(), None, "cpu")
        b.load_extra_state(a.extra_state())
        b.load_process_state([st])
        note = b.resume_note(4)
        assert b.collector.envs is None and "the checkpointed environments could not be restored (" in note, name
        base.clear()
        base.update(saved)


def _spoil_array(enc: dict, dtype: str, shape: list[int]) -> None:
    enc.update(dtype=dtype, shape=shape, bytes=torch.zeros(int(np.prod(shape)) * np.dtype(dtype).itemsize,
                                                           dtype=torch.uint8))


@pytest.mark.parametrize(("spoil", "said"), [
    (lambda st: _spoil_array(st["env_states"][0][-1]["attrs"]["state"], "<f4", [1]),
     "CartPoleEnv.state: the checkpoint holds a float32 array of shape (1,) where the environment holds float64 (4,)"),
    (lambda st: st["env_states"][0][-1]["attrs"].__setitem__("state", "hello"),
     "CartPoleEnv.state: the checkpoint holds a str where the environment holds a ndarray"),
    (lambda st: st["running"].__setitem__("obs", torch.zeros(2, 7)),
     "running.obs: torch.float32 (2, 7), expected torch.float32 (2, 4)"),
    (lambda st: st["running"].__setitem__("obs", st["running"]["obs"].double()),
     "running.obs: torch.float64 (2, 4), expected torch.float32 (2, 4)"),
    (lambda st: st["running"].__setitem__("prev_a", torch.zeros(5, dtype=torch.long)),
     "running.prev_a: torch.int64 (5,), expected torch.int64 (2,)"),
    (lambda st: st["running"]["t"].fill_(-5), "running.t holds a negative count"),
    (lambda st: st["running"]["memory"].pop("pos"), "running.memory.pos: missing"),
    (lambda st: st["running"]["memory"]["memory"].append(None), "running.memory.memory: expected a list of 1"),
    (lambda st: st.pop("vector"), "vector: missing"),
    (lambda st: st["vector"].__setitem__("_autoreset_envs", torch.zeros(9, dtype=torch.bool)),
     "vector._autoreset_envs: torch.bool (9,), expected torch.bool (2,)"),
    (lambda st: st.__setitem__("recent_returns", ["x"]), "the checkpoint's recent episodes are not numbers"),
])
def test_a_snapshot_of_another_layout_restarts_the_environments_naming_the_value(spoil, said) -> None:
    """A snapshot whose environment attributes, running episodes or vector flags are of another
    kind, dtype or shape than this run's (or missing, or negative counts) restarts the
    environments, naming the value, instead of failing later in a rollout or running on."""
    a = GTrXLPPO.for_training(_cfg(), None, "cpu")
    a.collector.collect()
    st = a.process_state()
    spoil(st)
    b = GTrXLPPO.for_training(_cfg(), None, "cpu")
    b.load_extra_state(a.extra_state())
    b.load_process_state([st])
    note = b.resume_note(4)
    assert b.collector.envs is None and said in note
    b.collector.collect()  # the environments restart


@pytest.mark.parametrize(("spoil", "said"), [
    (lambda ro: ro["tensors"].pop("adv"), "the saved rollout is incomplete or malformed (KeyError: 'adv')"),
    (lambda ro: ro["tensors"].__setitem__("x", torch.zeros(3, 2, 4)), "rollout.x: (3, 2, 4), expected (16, 2, ...)"),
    (lambda ro: ro["fifo"].pop("mem"), "the saved rollout is incomplete or malformed (KeyError: 'mem')"),
    (lambda ro: ro.__setitem__("served", 10**9), "rollout.served=1000000000 is not a count in [1, 4)"),
    (lambda ro: ro["stats"].__setitem__("env_steps", "x"), "the saved rollout is incomplete or malformed"),
])
def test_a_malformed_rollout_in_progress_restarts_the_run_naming_it(spoil, said) -> None:
    a = GTrXLPPO.for_training(_cfg(), None, "cpu")
    next(a.batches(0))  # one minibatch of the first rollout served: the checkpoint holds that rollout
    st = a.process_state()
    spoil(st["rollout"])
    b = GTrXLPPO.for_training(_cfg(), None, "cpu")
    b.load_extra_state(a.extra_state())
    b.load_process_state([st])
    note = b.resume_note(1)
    assert b.collector.envs is None and b._rollout is None
    assert f"the checkpoint's rollout in progress does not fit this run ({said}" in note
