"""The backbone: embeddings in, hidden states out, any registered variant in each slot."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rl_tformers.backbone_config import BackboneConfig, BuildContext, IncompatibleConfig
from rl_tformers.depth.base import DepthOutput
from rl_tformers.memory.base import SegmentRecord
from rl_tformers.position.base import check_position_dtype
from rl_tformers.registry import REGISTRIES, SLOTS, Capabilities
from rl_tformers.types import (
    AttnContext,
    BackboneOutput,
    BackboneState,
    TokenIndex,
    _map,
    merge_into,
    take_tokens,
)


def kinds_with(slot: str, capability: str, position: str | None = None) -> list[str]:
    """The registered kinds of ``slot`` whose declared :class:`~rl_tformers.registry.Capabilities`
    have ``capability`` true (``"causal"``, ``"memory"``, ``"incremental"``...), in registry
    order; with ``position``, only those that can apply that positional kind (``positions`` None
    or listing it). What a refusal names as the kinds that would work."""
    return [e.kind for e in REGISTRIES[slot] if getattr(e.capabilities, capability)
            and (position is None or e.capabilities.positions is None or position in e.capabilities.positions)]


def _check_direction(cfg: BackboneConfig, att: Capabilities) -> None:
    """Refuse a kernel without the direction ``backbone.causal`` asks for (naming the kinds with it)."""
    a = cfg.attention.kind
    if cfg.causal and not att.causal:
        raise IncompatibleConfig(
            f"backbone.attention.kind={a!r} has no causal form; set backbone.causal=false (for the Decision "
            f"Transformer both backbone.causal=false and agent.mode=last_action, which predicts only the last "
            f"action of each window, so no step attends to a later one), or use a kind that has one (with "
            f"backbone.position.kind={cfg.position.kind!r}): "
            f"{', '.join(kinds_with('attention', 'causal', position=cfg.position.kind))}"
        )
    if not cfg.causal and not att.bidirectional:
        raise IncompatibleConfig(
            f"backbone.attention.kind={a!r} is causal-only; set backbone.causal=true, or use a kind with a "
            f"bidirectional form (with backbone.position.kind={cfg.position.kind!r}): "
            f"{', '.join(kinds_with('attention', 'bidirectional', position=cfg.position.kind))}"
        )


def _check_memory(cfg: BackboneConfig, att: Capabilities) -> None:
    """Refuse a stateful memory kind with a kernel that takes no memory keys, or with a block or
    depth kind that keeps no per-layer state (naming the kinds that would work)."""
    a = cfg.attention.kind
    mem = cfg.memory.config_capabilities()
    blk = cfg.block.config_capabilities()
    dep = cfg.depth.config_capabilities()
    if mem.stateful and not att.memory:
        fits = [
            e.kind for e in REGISTRIES["attention"]
            if e.capabilities.memory and (e.capabilities.causal if cfg.causal else e.capabilities.bidirectional)
            and (e.capabilities.positions is None or cfg.position.kind in e.capabilities.positions)
        ]
        raise IncompatibleConfig(
            f"backbone.memory.kind={cfg.memory.kind!r} needs an attention kernel that accepts memory keys; "
            f"backbone.attention.kind={a!r} does not; kernels that do (with backbone.position.kind="
            f"{cfg.position.kind!r}): {', '.join(fits)}"
        )
    if mem.stateful and not (blk.memory and dep.memory):
        bad = "block" if not blk.memory else "depth"
        hint = ""
        if bad == "block":  # e.g. reversible: the whole stack is one function of its input, no per-layer memory
            fits = [e.kind for e in REGISTRIES["block"] if e.capabilities.memory]
            hint = (f" (it keeps no per-layer memory); blocks that do: {', '.join(fits)}; or use "
                    f"backbone.memory.kind=none (GTrXL then runs in its plain-window mode: agent.window=W "
                    f"backbone.memory.kind=none agent.burn_in=0 agent.seq_len=W)")
        if bad == "depth":  # e.g. universal: a halting loop over one shared block, recomputed per call
            hint = (f"; backbone.depth.kind={cfg.depth.kind!r} keeps no state between calls; depth kinds that "
                    f"do: {', '.join(kinds_with('depth', 'memory'))}; or use backbone.memory.kind=none (GTrXL then "
                    f"runs it in its plain-window mode: agent.window=W backbone.memory.kind=none agent.burn_in=0 "
                    f"agent.seq_len=W)")
        raise IncompatibleConfig(
            f"backbone.memory.kind={cfg.memory.kind!r} is not supported by "
            f"backbone.{bad}.kind={getattr(cfg, bad).kind!r}{hint}"
        )


def _check_stack(cfg: BackboneConfig) -> None:
    """Refuse what a per-layer stack (``backbone.layers``) cannot be as a whole: a depth kind
    that runs one shared block (its layers cannot differ), or a stack of reversible blocks
    (run as one reversible function) mixed with other block kinds."""
    if not getattr(cfg.depth, "block_per_layer", True):
        fits = [e.kind for e in REGISTRIES["depth"] if getattr(e.config_cls, "block_per_layer", True)]
        raise IncompatibleConfig(
            f"backbone.layers: backbone.depth.kind={cfg.depth.kind!r} runs one shared block at every step, so its "
            f"layers cannot differ; remove backbone.layers, or use a depth kind with a block per layer: {', '.join(fits)}"
        )
    blocks = cfg.per_layer("block")
    whole = [bool(getattr(b, "runs_stack", False)) for _, b in blocks]
    if any(whole) and not all(whole):
        i = whole.index(not whole[0])
        (where0, b0), (where, b) = blocks[0], blocks[i]
        one = b0.kind if whole[0] else b.kind
        raise IncompatibleConfig(
            f"{where}.kind={b.kind!r} at layer {i} and {where0}.kind={b0.kind!r} at layer 0: a stack of {one!r} "
            f"blocks runs as one function of its input, so either every layer or none uses it"
        )


def check_compatible(cfg: BackboneConfig) -> None:
    """Refuse combinations a component declares it cannot do, naming the option at fault.

    A per-layer stack (``backbone.layers``) is checked layer by layer
    (:meth:`BackboneConfig.layer_config`), each message naming the layer's entry
    (``backbone.layers[2].attention.kind='routing' ...``), and as a whole (:func:`_check_stack`).

    Raises:
        IncompatibleConfig: e.g. a kernel without a causal form used causally, a memory kind
            with a kernel that takes no prefix keys, a positional kind a kernel cannot apply, or
            whatever a slot config's own ``check(backbone_cfg)`` hook refuses (every slot's
            hook is called, attention first).
    """
    if cfg.layers:
        _check_stack(cfg)
        for i in range(cfg.n_layers):
            try:
                check_compatible(cfg.layer_config(i))
            except IncompatibleConfig as exc:
                raise IncompatibleConfig(cfg.at_layer_message(i, str(exc))) from exc
        return
    att = cfg.attention.config_capabilities()
    a = cfg.attention.kind
    _check_direction(cfg, att)
    _check_memory(cfg, att)
    if att.positions is not None and cfg.position.kind not in att.positions:
        others = kinds_with("attention", "causal" if cfg.causal else "bidirectional", position=cfg.position.kind)
        raise IncompatibleConfig(
            f"backbone.position.kind={cfg.position.kind!r} cannot be used with backbone.attention.kind={a!r}; "
            f"it supports: {', '.join(att.positions)}; attention kinds that apply {cfg.position.kind!r}: "
            f"{', '.join(others)}"
        )
    for slot in SLOTS:  # each slot config may refuse combinations itself: check(backbone_cfg)
        hook = getattr(getattr(cfg, slot), "check", None)
        if hook is not None:
            hook(cfg)


def _check_layer_positions(cfg: BackboneConfig, blocks: nn.ModuleList) -> None:
    """Refuse a per-layer positional kind that would do nothing at its layer: an absolute kind
    (``sinusoidal``, ``learned``) adds its encoding to the first layer's input only, so set at
    layer i > 0 by ``backbone.layers`` it adds nothing (found by calling its ``embed`` hook)."""
    for i, block in enumerate(blocks):
        entry = cfg.layer_entry(i)
        pos = block.attn.position
        if i == 0 or entry is None or entry.position is None or not pos.absolute:
            continue
        x = torch.zeros(1, 1, cfg.d_model)
        if pos.embed(x, torch.zeros(1, 1, dtype=torch.long)) is x and not (pos.additive_bias or pos.rotates
                                                                            or pos.transforms_scores or pos.value_bias):
            raise IncompatibleConfig(cfg.at_layer_message(i, (
                f"{cfg.layer_path(i, 'position')}.kind={entry.position.kind!r} adds its encoding to the first "
                f"layer's input only, so at layer {i} it adds nothing; set it backbone-wide or in the entry of "
                f"layer 0 (learned: per_layer: true adds a table at every layer)")))


class Backbone(nn.Module):
    """A Transformer stack assembled from the five slots of a :class:`BackboneConfig`.

    ``forward(x, positions, mask, state) -> BackboneOutput(hidden, state, aux, metrics)``.

    Args:
        config: a :class:`BackboneConfig` or a dict accepted by ``BackboneConfig.from_dict``.

    Raises:
        IncompatibleConfig: for combinations a component declares unsupported.
        RegistryError: for unknown kinds or fields.
    """

    def __init__(self, config: BackboneConfig | Mapping[str, Any]) -> None:
        super().__init__()
        cfg = config if isinstance(config, BackboneConfig) else BackboneConfig.from_dict(config)
        check_compatible(cfg)
        self.config = cfg
        ctx = BuildContext(cfg)
        self.depth = cfg.depth.build(ctx)
        self.memory = cfg.memory.build(ctx)
        if cfg.layers:
            _check_layer_positions(cfg, self.blocks)
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.final_norm else nn.Identity()
        # output_tokens can skip work in the last layer: depth, blocks and kernels all support it
        self.query_subset = bool(getattr(self.depth, "query_subset", False)) and not self.memory.reads_output and all(
            getattr(b, "query_subset", False) and getattr(b.attn, "query_subset", False) for b in self.blocks
        )

    @property
    def blocks(self) -> nn.ModuleList:
        """The blocks the depth module runs (N for ``fixed``, one shared for ``universal``)."""
        return self.depth.blocks

    # -- state ---------------------------------------------------------------------------------
    def initial_state(self, batch: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> BackboneState:
        """Empty state for ``batch`` streams: every memory slot invalid, episode ids 0.

        Args:
            batch: number of streams B (0 allowed).
            device: default the parameters' device.
            dtype: of the memory / cache tensors; default the parameters' dtype. Another dtype
                is for autocast (a bfloat16 state of a float32 model). Outside autocast the
                forward refuses, naming both dtypes, a memory state (``xl``, ``compressive``,
                ``knn``) of another dtype; a KV cache (memory ``none``) of a narrower dtype
                runs (float32 in a float64 model), a float64 one of a float32 model is refused
                by every kernel.

        With memory kind ``none`` this is an incremental-decoding cache.

        Raises:
            NotImplementedError: memory kind ``none`` with an attention kernel that has no
                incremental form; the message names ``backbone.attention.kind`` and the kernels
                that have one.
        """
        p = next(self.parameters())
        device = torch.device(device) if device is not None else p.device
        try:
            return self.memory.initial_state(self.blocks, batch, device, dtype or p.dtype)
        except NotImplementedError as exc:
            cfg = self.config
            if cfg.memory.kind != "none":
                raise
            fits = kinds_with("attention", "incremental")
            layers = cfg.per_layer("attention")
            at = next((i for i, (_, a) in enumerate(layers) if not a.config_capabilities().incremental), 0)
            where, att = layers[at]
            which = f" (layer {at} of {cfg.n_layers}: a stack decodes incrementally only if every layer can)" \
                if cfg.layers else ""
            raise NotImplementedError(
                f"Backbone.initial_state: with backbone.memory.kind='none' the state is a key/value cache for "
                f"incremental decoding, which {where}.kind={att.kind!r}{which} cannot keep here "
                f"({exc}); call the backbone without a state (re-run the context window), or use a kernel with "
                f"an incremental form: {', '.join(fits)}"
            ) from exc

    def reset_state(self, state: BackboneState, episode_start: Tensor | Any) -> BackboneState:
        """Clear the rows whose episode starts now.

        Args:
            episode_start: (B,) bool, a tensor on any device or an array-like (a NumPy
                ``terminated | truncated`` of a vector environment, a list).

        Raises:
            ValueError: ``episode_start`` is not of shape (B,) (the message names both shapes).
        """
        if not isinstance(episode_start, Tensor):
            episode_start = torch.as_tensor(episode_start, dtype=torch.bool, device=state.valid.device)
        return self.memory.reset(state, episode_start)

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        state: BackboneState | None = None,
        episode_start: Tensor | None = None,
        *,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        output_tokens: TokenIndex | None = None,
        **depth_kwargs: Any,
    ) -> BackboneOutput:
        """Run the stack.

        Args:
            x: (B, T, D) input embeddings.
            positions: (B, T) integer positions (int64, or any integer dtype) in the caller's
                units (token index, environment step...). Default: ``state.next_pos + arange(T)``
                or ``arange(T)``.
            mask: (B, T) bool, True = real token, False = padding. Padded tokens are never
                attended to; their outputs are unspecified. Default: all real.
            state: :class:`BackboneState` from :meth:`initial_state` or a previous call.
            episode_start: (B, T) bool, True where a token begins a new episode: it and later
                tokens never attend to anything before it (segment or memory).
            need_weights: ask kernels for attention probabilities (slower path); they come back
                in ``BackboneOutput.attentions``, one (B, H, T, S) tensor per layer run.
            output_hidden_states: return every layer's output.
            output_tokens: a slice along T (e.g. ``slice(1, None, 3)``) or a (B, P) integer tensor
                of per-row token indices in [0, T) (row b keeps ``output_tokens[b]``): ``hidden``
                is then (B, T', D), those tokens only (``hidden_states``, the state and the weights
                still cover every token), the values of the full output sliced (gathered). When
                nothing else needs the last layer's other outputs (no state, weights, hidden states
                or depth arguments), fewer than T tokens are asked for and the stack allows it
                (:attr:`query_subset`: fixed depth, pre/post-norm blocks, dense attention), the
                last layer computes only those tokens' queries, feed-forward and final norm (a
                Decision Transformer trains on 1 token in 3 and acts on 1 in 3K).
            depth_kwargs: passed to the depth module (e.g. an exit head for early exit).

        Returns:
            :class:`BackboneOutput`; ``state`` is the next state when one was given. An empty
            segment (T = 0) returns ``hidden`` (B, 0, D) and the given state unchanged.

        Raises:
            ValueError: on shape mismatches (the message names the argument; a ``state`` of
                another batch size names both); ``positions`` of a float, complex or bool dtype
                (never truncated silently: the message names its dtype and the expected integer
                dtype); outside autocast, an ``x`` or ``state`` whose dtype the parameters cannot
                take (the message names both dtypes and how to convert).
            ValueError: an ``output_tokens`` tensor not (B, P), not integer or outside [0, T) (named).
            TypeError: ``output_tokens`` is neither a slice nor a tensor.
        """
        positions, output_tokens = self._checked_inputs(x, positions, mask, state, episode_start, output_tokens)
        return self._run(x, positions, mask, state, episode_start, need_weights, output_hidden_states, output_tokens,
                         depth_kwargs)

    def _checked_inputs(self, x: Tensor, positions: Tensor | None, mask: Tensor | None, state: BackboneState | None,
                        episode_start: Tensor | None,
                        output_tokens: TokenIndex | None) -> tuple[Tensor, TokenIndex | None]:
        """Check the shapes and types of :meth:`forward`'s inputs; returns the (B, T) int64
        positions (given or default) and ``output_tokens`` (a tensor: int64 on x's device).

        Raises:
            ValueError / TypeError: as :meth:`forward`.
        """
        if x.dim() != 3 or x.shape[-1] != self.config.d_model:
            raise ValueError(f"backbone: x must be (B, T, {self.config.d_model}), got {tuple(x.shape)}")
        b, t, _ = x.shape
        dev = x.device
        if positions is None:
            base = state.next_pos[:, None] if state is not None else torch.zeros(b, 1, dtype=torch.long, device=dev)
            positions = base + torch.arange(t, device=dev)
        elif positions.shape != (b, t):
            raise ValueError(f"backbone: positions must be ({b}, {t}), got {tuple(positions.shape)}")
        else:
            check_position_dtype(positions, "backbone")
        positions = positions.long()  # any integer dtype: exact
        if mask is not None and mask.shape != (b, t):
            raise ValueError(f"backbone: mask must be ({b}, {t}), got {tuple(mask.shape)}")
        if output_tokens is not None and _check_output_tokens(output_tokens, b, t):
            output_tokens = output_tokens.to(device=dev, dtype=torch.long)
        if episode_start is not None and episode_start.shape != (b, t):
            raise ValueError(f"backbone: episode_start must be ({b}, {t}), got {tuple(episode_start.shape)}")
        if state is not None and state.batch_size != b:  # before anything broadcasts one against the other
            raise ValueError(f"backbone: state is for batch {state.batch_size}, x has batch {b}")
        return positions, output_tokens

    def _run(self, x: Tensor, positions: Tensor, mask: Tensor | None, state: BackboneState | None,
             episode_start: Tensor | None, need_weights: bool, output_hidden_states: bool,
             output_tokens: TokenIndex | None, depth_kwargs: dict[str, Any]) -> BackboneOutput:
        """:meth:`forward` on checked inputs: the attention context, the depth module's call over
        the blocks and, with a ``state``, the memory update."""
        b, t, _ = x.shape
        dev = x.device
        if t == 0:  # an empty segment: no token to compute, the state (memory, cache) is unchanged
            hidden = x if output_tokens is None else take_tokens(x, output_tokens)  # (B, 0, D)
            return BackboneOutput(
                hidden=self.final_norm(hidden),
                state=state,
                hidden_states=tuple(x for _ in self.blocks) if output_hidden_states else None,
                attentions=tuple(None for _ in self.blocks) if need_weights else None,
            )

        seg_q = None
        if episode_start is not None or state is not None:
            starts = torch.zeros(b, t, dtype=torch.long, device=dev) if episode_start is None else episode_start.long()
            base_ep = state.episode[:, None] if state is not None else torch.zeros(b, 1, dtype=torch.long, device=dev)
            seg_q = base_ep + starts.cumsum(1)  # (B, T)
        valid_q = mask.bool() if mask is not None else None
        ctx = self._attn_context(positions, valid_q, seg_q, state, need_weights, dev)

        subset = (output_tokens is not None and self.query_subset and state is None and not need_weights
                  and not output_hidden_states and not depth_kwargs and _n_tokens(output_tokens, t) < t)
        if subset:
            depth_kwargs["queries"] = output_tokens
        dout = self._call_depth(x, ctx, state, output_hidden_states, depth_kwargs)
        aux, metrics = dict(dout.aux), dict(dout.metrics)
        hidden, readout = _final_output(self.memory, self.final_norm, dout.hidden, x, valid_q, seg_q, state,
                                        None if subset else output_tokens, metrics)  # (B, T', D)
        new_state = None
        if state is not None:
            rec = SegmentRecord(
                layer_inputs=dout.layer_inputs,
                pos=positions,
                valid=valid_q if valid_q is not None else torch.ones(b, t, dtype=torch.bool, device=dev),
                seg=seg_q,
                caches=dout.caches,
                weights=dout.weights,
                extras=dout.extras,
                blocks=list(self.blocks),
                readout=readout,
            )
            new_state, m_aux, m_metrics = self.memory.update(state, rec)
            new_state.episode = seg_q[:, -1] if t > 0 else state.episode
            new_state.next_pos = positions[:, -1] + 1 if t > 0 else state.next_pos
            merge_into(aux, m_aux)
            merge_into(metrics, m_metrics)
        return BackboneOutput(
            hidden=hidden,
            state=new_state,
            aux=aux,
            metrics=metrics,
            hidden_states=dout.hidden_states,
            attentions=tuple(dout.weights) if need_weights else None,
        )

    def _attn_context(self, positions: Tensor, valid_q: Tensor | None, seg_q: Tensor | None,
                      state: BackboneState | None, need_weights: bool, dev: torch.device) -> AttnContext:
        """The attention context of a segment: its (B, T) positions, validity and episode
        segments as queries; as keys, the state's (memory or cache) followed by the segment's
        (``dev``: the device of the segment's inputs)."""
        if state is not None:
            b, t = positions.shape
            vq = valid_q if valid_q is not None else torch.ones(b, t, dtype=torch.bool, device=dev)
            return AttnContext(
                pos_q=positions,
                pos_k=torch.cat([state.pos, positions], 1),
                key_valid=torch.cat([state.valid, vq], 1),
                seg_q=seg_q,
                seg_k=torch.cat([state.seg, seg_q], 1),
                causal=self.config.causal,
                need_weights=need_weights,
                key_offset=state.key_offset,
            )
        return AttnContext(
            pos_q=positions, pos_k=positions, key_valid=valid_q, seg_q=seg_q, seg_k=seg_q,
            causal=self.config.causal, need_weights=need_weights,
        )

    def _call_depth(self, x: Tensor, ctx: AttnContext, state: BackboneState | None, output_hidden_states: bool,
                    depth_kwargs: dict[str, Any]) -> DepthOutput:
        """The depth module over the blocks; a dtype mismatch of ``x`` or ``state`` with the
        parameters is reported as a ``ValueError`` naming both (outside autocast)."""
        if state is not None and not torch.is_autocast_enabled(x.device.type) and self._holds_float64(state):
            raise ValueError(self._dtype_mismatch(x, state))
        try:
            return self.depth(x, ctx, None if state is None else state.layers, output_hidden_states, **depth_kwargs)
        except RuntimeError as exc:  # torch's "mixed dtype" / "expected ... same dtype": say which input
            text = str(exc).lower()
            why = self._dtype_mismatch(x, state) if "dtype" in text or "scalar type" in text else None
            if why is None:
                raise
            raise ValueError(why) from exc

    def _holds_float64(self, state: BackboneState) -> bool:
        """True if ``state`` holds float64 tensors and the parameters are not float64 (a float64
        cache of a float32 model): some kernels would promote the whole layer to float64, others
        fail, so the forward refuses it for every kernel alike, outside autocast. (A narrower
        cache, float32 in a float64 model, is promoted losslessly and runs; float32 accumulators
        of a bf16/fp16 model, the linear kernels' running sums, are by design.)"""
        return next(self.parameters()).dtype != torch.float64 and torch.float64 in _float_dtypes(state)

    def _dtype_mismatch(self, x: Tensor, state: BackboneState | None) -> str | None:
        """Why a forward that raised cannot run, when the reason is the dtype of ``x`` or of the
        state's tensors against the parameters' (outside autocast); None when they agree."""
        if torch.is_autocast_enabled(x.device.type):
            return None
        p = next(self.parameters()).dtype
        fix = "state.map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t)"
        if x.dtype != p:
            return (f"backbone: x is {x.dtype} but the backbone's parameters are {p}; pass x as {p} "
                    f"(x.to({p})), convert the model (model.to({x.dtype})), or run under torch.autocast")
        if state is not None:
            other = sorted(str(d) for d in _float_dtypes(state) - {p})
            if other:
                return (f"backbone: the state holds {', '.join(other)} tensors but x and the backbone's parameters "
                        f"are {p} (a state from initial_state(..., dtype=...) or from before the model was "
                        f"converted); make a new one with initial_state(batch) or convert it: {fix}")
        return None


def _final_output(memory: nn.Module, norm: nn.Module, h: Tensor, x: Tensor, valid_q: Tensor | None,
                  seg_q: Tensor | None, state: BackboneState | None, tokens: TokenIndex | None,
                  metrics: dict[str, Any]) -> tuple[Tensor, Any]:
    """The backbone's output from the last layer's ``h`` (B, T, D): the final norm, then the
    memory's :meth:`~rl_tformers.memory.base.MemoryModule.read` when it ``reads_output`` (SPALM's
    long-term read, over every token; its metrics merged into ``metrics``), then the ``tokens``
    kept (None: all; :func:`~rl_tformers.types.take_tokens`). Returns (hidden (B, T', D), what
    the read hands to the memory update)."""
    if not memory.reads_output:
        return norm(h if tokens is None else take_tokens(h, tokens)), None
    b, t, _ = x.shape
    valid = valid_q if valid_q is not None else torch.ones(b, t, dtype=torch.bool, device=x.device)
    seg = seg_q if seg_q is not None else torch.zeros(b, t, dtype=torch.long, device=x.device)
    z, readout, read_metrics = memory.read(norm(h), x, valid, seg, state)
    merge_into(metrics, read_metrics)
    return (z if tokens is None else take_tokens(z, tokens)), readout


def _n_tokens(tokens: TokenIndex, t: int) -> int:
    """How many tokens of T ``tokens`` selects per row (a slice's length, a tensor's P)."""
    return len(range(t)[tokens]) if isinstance(tokens, slice) else tokens.shape[1]


def _check_output_tokens(tokens: Any, b: int, t: int) -> bool:
    """Refuse an ``output_tokens`` that is neither a slice nor a (B, P) integer tensor of indices
    in [0, T); True for a tensor.

    Raises:
        TypeError: neither a slice nor a tensor.
        ValueError: a tensor of another shape or a non-integer dtype, or an index outside [0, T)
            (one host read of its minimum and maximum; not checked under ``torch.compile``).
    """
    if isinstance(tokens, slice):
        return False
    if not isinstance(tokens, Tensor):
        raise TypeError(f"backbone: output_tokens must be a slice or a ({b}, P) integer tensor, "
                        f"got {type(tokens).__name__}")
    if tokens.dim() != 2 or tokens.shape[0] != b:
        raise ValueError(f"backbone: output_tokens must be a slice or a ({b}, P) tensor of token indices, "
                         f"got shape {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"backbone: output_tokens must hold integer token indices, got {tokens.dtype}")
    if tokens.numel() and not torch.compiler.is_compiling():
        lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one host read
        if lo < 0 or hi >= t:
            raise ValueError(f"backbone: output_tokens holds index {lo if lo < 0 else hi}, outside [0, {t}) "
                             f"(T = {t} tokens)")
    return True


def _float_dtypes(state: BackboneState) -> set[torch.dtype]:
    """The dtypes of the floating tensors held by ``state.layers`` (memories, caches)."""
    found: set[torch.dtype] = set()
    for ls in state.layers:
        _map(ls, lambda t: found.add(t.dtype) if t.is_floating_point() else None)
    return found
