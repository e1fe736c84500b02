"""One decode step (one new token per row) of a dense Llama-family model in a few tensor calls per layer.

At a decode step the hf engine's matmuls are small (64 rows), and HF's forward spends as long again on its
machinery: per layer ~100 Python-level tensor calls (masks, the cache's bookkeeping, rotate_half's slices
and cat, three projections where one would do). `DecodeStep` runs the same computation as the model's forward
for Llama, Qwen2 and Qwen3:

- q, k and v are one matmul over their weights stacked, and gate and up another: the model's parameters are
  made views of the stacked tensors, so a weight push into the parameters lands in the stacked ones too;
- RMSNorm is `F.rms_norm` times the weight (bitwise HF's formula, in fp32 and bf16), Qwen3's per-head q and k
  norms one call over both;
- rope is q * cos + roll(q) * sin', with sin' = sin with its first half negated: roll(q, D/2) is rotate_half(q)
  without the sign, so the product is rotate_half(q) * sin exactly;
- attention is the engine's decode attention (slime/models/attention.py) on the engine's in-place KV cache;
  with `fused_attention`, on batches of 2048 (row, key) pairs or more it runs compiled (`decode_attention_fused`),
  which long responses need most: there it takes longer than all of a layer's matmuls;
- with `compiled` (rollout.hf_compile=step, auto's choice on CPU), the whole step after the embedding and rotary
  tables runs as one graph torch.compile makes (`_step_graph`): the matmuls as they are, everything between them
  fused into a few C++ loops per layer, attention included, and no Python between the layers. The graph reads
  the cache and returns the step's keys and values, which the cache's `update` then writes. On the 23.7M model of
  bench/vs_trl.py a 64-token rollout takes 0.85x the eager step's time; the first step compiles (~25 s there,
  ~6-9 s with inductor's disk cache warm);
- with `pack`, the matmuls read copies of their weights laid out for the kernel (the engine holds its matmul
  weights twice), made again by `refresh()` after every weight push and by `check()` after an in-place write into
  a parameter: "onednn" (the hf engine on oneDNN) in oneDNN's blocked layout (slime/models/onednn.py's `pack`);
  "transposed" (the hf engine on MKL's fp32 sgemm) as weight.T contiguous, so that each matmul is x @ W with
  both operands row-major. MKL's sgemm runs the transposed-weight (x @ W.T) form of a decode step's 64-row
  matmuls well below its peak: 1 thread on an AVX-512 Xeon, the 23.7M model's layer shapes, weights streaming
  from memory, 94-100 GFLOP/s as x @ W.T and 127-139 GFLOP/s as x @ W (at 448 rows and more the two are within
  5%; `python bench/cpu_matmul.py --decode`).

`python bench/hf_generation.py` measures it against the same loop over HF's forward. Other families (MoE,
sliding windows, VL) decode through the model's own forward: `DecodeStep.unsupported(model)` says why.
"""
from __future__ import annotations

import functools
import logging
import time
import types
from typing import Callable, Literal, NamedTuple

import torch
import torch.fx.experimental._config
import torch.nn.functional as F

from slime.models.attention import _decode_attention, decode_attention_fused, use_fused_decode_attention
from slime.models.onednn import _mm_nt_op, pack as onednn_pack

logger = logging.getLogger(__name__)

FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # all weight * x * rsqrt(mean(x^2) + eps)


def _stack_as_views(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the layers' weights (and biases) along their outputs and make each layer's parameters views of the
    stack; returns the stacked weight and bias."""
    stacked = []
    for name in ("weight", "bias"):
        parts = [getattr(m, name) for m in linears]
        if parts[0] is None:
            stacked.append(None)
            continue
        whole = torch.cat([p.data for p in parts])
        start = 0
        for p in parts:
            p.data = whole[start:start + p.shape[0]]
            start += p.shape[0]
        stacked.append(whole)
    return stacked[0], stacked[1]


PACKS = ("onednn", "transposed")


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """The "transposed" pack: weight (out, in) as a contiguous (in, out) copy."""
    return weight.detach().t().contiguous()


def mm_transposed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias from `packed` = transposed(weight): x (..., in) -> (..., out), a fresh tensor."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(flat, packed) if bias is None else torch.addmm(bias, flat, packed)
    return out.view(*x.shape[:-1], packed.shape[1])


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """HF's RMSNorm layer `norm` applied to x: normalised in fp32, rounded to x's dtype, then times the weight
    (F.rms_norm with the weight would round once, not twice: an ulp off HF's in bf16)."""
    return F.rms_norm(x, norm.weight.shape, None, norm.variance_epsilon) * norm.weight


class _LayerSpec(NamedTuple):
    """What the compiled step needs to know of a layer besides its tensors (constants in its graph)."""
    n_q: int
    n_kv: int
    head_dim: int
    eps: float  # the input norm's
    post_eps: float  # the post-attention norm's
    qk_eps: float | None  # Qwen3's per-head q and k norms' (None: no such norms)
    scaling: float


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return t * cos + t.roll(t.shape[-1] // 2, -1) * sin


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor,
                     mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """The compiled decode step's attention: q (B, Hkv, G, D), one query per row with the G query heads of each KV
    head; this step's key and value k, v (B, Hkv, D); the cache's L >= 1 keys and values (B, Hkv, L, D) (a decode
    step follows a prefill); mask (B, L + 1)
    -> (B, Hkv, G, D). The cache's and this step's scores go under one softmax without appending k and v to the
    cache first (no copy of it). Sums of products, which inductor turns into loops (`bench/decode_attention.py`
    times them against a plain read of the cache, the bound). In bf16 the sums and the softmax run in fp32 (inductor
    fuses the casts into its loops), as sdpa's kernel keeps them: rounded to bf16 they put the logprobs 2-3x further
    from a teacher-forced forward than HF's own decoding.

    Every reduction over the keys runs over the cache's L (this step's key is added outside them): inductor's C++
    loops guard each float sum on its length (past 4096 they sum in chunks), and a softmax over L + 1 keys beside
    a sum over L pinned the length to exactly 4097 at that width, against the dynamic size it was marked with: a
    batch reaching 4096 cached keys failed to compile (rollout.hf_compile=step) or fell back to the eager step
    for good (auto). Now the step compiles once more past 4096 keys."""
    dtype, q, k, v, cached_k, cached_v = q.dtype, q.float(), k.float(), v.float(), cached_k.float(), cached_v.float()
    cache = ((q.unsqueeze(3) * cached_k.unsqueeze(2)).sum(-1) * scaling  # (B, Hkv, G, L): the cache's scores
             ).masked_fill(~mask[:, None, None, :-1], float("-inf"))
    own = ((q * k.unsqueeze(2)).sum(-1, keepdim=True) * scaling  # (B, Hkv, G, 1): this step's
           ).masked_fill(~mask[:, None, None, -1:], float("-inf"))
    top = torch.maximum(cache.amax(-1, keepdim=True), own)  # the softmax over both, in parts
    e_cache, e_own = (cache - top).exp(), (own - top).exp()
    out = (e_cache.unsqueeze(-1) * cached_v.unsqueeze(2)).sum(3) + e_own * v.unsqueeze(2)
    return (out / (e_cache.sum(-1, keepdim=True) + e_own)).to(dtype)


@functools.lru_cache(maxsize=8)
def _step_graph(specs: tuple[_LayerSpec, ...], eps: float,
                kernel: Literal["linear", "onednn", "transposed"]) -> Callable:
    """The compiled decode step of a model whose layers `specs` describe (its sizes constants of the graph).

    `graph(x, cos, sin, mask, keys, values, weights)` runs all of a step's layers and its logits in one graph
    (inductor: one C++ loop per chain of elementwise ops between the matmuls, no Python between them). x (B, hidden),
    cos and sin (B, 1, D) as in DecodeStep.__call__; mask (B, L + 1) bool over the L cached keys and this step's;
    keys and values: per layer the cache's whole buffers (B, Hkv, capacity, D), of which the first L positions are
    read; weights: per layer 12 tensors or None (see DecodeStep._graph_weights), then the final norm's and the
    head's weight and bias, the matmul weights as `kernel` reads them (F.linear: the weights themselves; onednn and
    transposed: their packs); attention is `cached_attention`. Returns the logits and per layer the step's new keys
    and values (B, Hkv, D): the caller writes them into the cache, so the graph mutates none of its inputs. B, L and
    the capacity are dynamic: one compile serves every batch up to 4096 cached keys, a second one past that
    (`_dynamic` marks them; cached_attention says why)."""
    def linear(h, w, b):
        if kernel == "onednn":
            return _mm_nt_op(h, w, b)
        return mm_transposed(h, w, b) if kernel == "transposed" else F.linear(h, w, b)

    def norm(h, w, e):
        return F.rms_norm(h, h.shape[-1:], None, e) * w

    def graph(x, cos, sin, mask, keys, values, weights):
        rows, length, new_keys, new_values = x.shape[0], mask.shape[1] - 1, [], []
        for i, spec in enumerate(specs):
            w_in, w_qkv, b_qkv, w_qn, w_kn, w_o, b_o, w_post, w_gu, b_gu, w_down, b_down = weights[12 * i:12 * i + 12]
            n_q, n_kv, d = spec.n_q, spec.n_kv, spec.head_dim
            qkv = linear(norm(x, w_in, spec.eps), w_qkv, b_qkv).view(rows, n_q + 2 * n_kv, d)
            q, k, v = qkv[:, :n_q], qkv[:, n_q:n_q + n_kv], qkv[:, n_q + n_kv:]
            if spec.qk_eps is not None:
                q, k = norm(q, w_qn, spec.qk_eps), norm(k, w_kn, spec.qk_eps)
            q, k = _rope(q, cos, sin).view(rows, n_kv, n_q // n_kv, d), _rope(k, cos, sin)
            o = cached_attention(q, k, v, keys[i][:, :, :length], values[i][:, :, :length], mask, spec.scaling)
            x = x + linear(o.reshape(rows, n_q * d), w_o, b_o)
            gate, up = linear(norm(x, w_post, spec.post_eps), w_gu, b_gu).chunk(2, -1)
            x = x + linear(F.silu(gate) * up, w_down, b_down)
            new_keys.append(k)
            new_values.append(v)
        return linear(norm(x, weights[-3], eps), weights[-2], weights[-1]), new_keys, new_values

    # A code object of its own: Dynamo keeps its compiles, and counts them against its recompile limit (8), per code
    # object. With the one `graph` shared, the 9th model shape a process decoded hit the limit: fullgraph raises
    # there, so `auto` decoded that model eagerly (with a warning) and `step` failed.
    graph = types.FunctionType(graph.__code__.replace(co_name=f"decode_step_{len(specs)}_layers"), graph.__globals__,
                               graph.__name__, graph.__defaults__, graph.__closure__)
    return torch.compile(graph, dynamic=False, fullgraph=True)


def _distinct_sizes():
    """A context in which Dynamo traces each dynamic size as its own symbol: by default sizes equal at the first trace
    share one (rows == keys + 1, say), and the first batch where they differ compiles again."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)


def _dynamic(x, cos, sin, mask, keys, values) -> None:
    """Mark the step graph's varying sizes dynamic: rows, keys (the mask's width) and the cache's capacity."""
    for t in (x, cos, sin, mask, *keys, *values):
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.mark_dynamic(mask, 1)
    for t in (*keys, *values):
        torch._dynamo.mark_dynamic(t, 2)


class DecodeStep:
    """`step(tokens, positions, mask, cache) -> logits` for a model `unsupported(model)` accepts."""

    @staticmethod
    def unsupported(model: torch.nn.Module) -> str | None:
        """Why the step cannot run this model (None: it can)."""
        cfg = model.config
        if type(model).__name__ not in FAMILIES:
            return f"{type(model).__name__} is not one of {', '.join(FAMILIES)}"
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return "sliding-window layers"
        for layer in model.model.layers:
            attn = layer.self_attn
            norms = [layer.input_layernorm, layer.post_attention_layernorm, model.model.norm,
                     *(m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None)]
            if any(type(n).__name__ not in NORMS for n in norms):
                return "a norm other than RMSNorm"
            if getattr(attn, "sliding_window", None) is not None:
                return "sliding-window attention"
            if (getattr(attn.q_proj, "bias", None) is None) != (getattr(attn.v_proj, "bias", None) is None):
                return "biases on some of q, k, v only"
            if getattr(layer.mlp, "gate_proj", None) is None:
                return "an MLP without gate_proj"
        return None

    def __init__(self, model: torch.nn.Module, linear: Callable = torch._C._nn.linear,
                 pack: Literal["onednn", "transposed"] | None = None,
                 fused_attention: bool | Literal["fallback"] = False, compiled: bool | Literal["fallback"] = False):
        """`linear(x, weight, bias)` for the matmuls; with `pack` they read packed copies of the weights: "onednn"
        calls `linear(x, weight, bias, packed=onednn.pack(weight))` (slime/models/onednn.py's `linear` takes it),
        "transposed" `mm_transposed(x, transposed(weight), bias)`. `fused_attention`: attention runs compiled where
        `use_fused_decode_attention` says. `compiled`: the whole step runs as one compiled graph (`_step_graph`)
        on batches of 2 rows or more, its matmuls on the packed weights where `pack` is given and the model is fp32,
        else on F.linear. Where a compile fails (no C++ compiler for inductor, say), True raises and "fallback" logs
        why and goes on eagerly."""
        why = self.unsupported(model)
        if why is not None:
            raise ValueError(f"DecodeStep cannot run this model: {why}")
        if pack not in (None, *PACKS):
            raise ValueError(f"DecodeStep(pack={pack!r}): pack is one of {PACKS} or None")
        if compiled and model.config.hidden_act != "silu":
            raise ValueError(f"DecodeStep(compiled=...) runs SwiGLU MLPs; this model's hidden_act is "
                             f"{model.config.hidden_act!r}: pass compiled=False")
        self.model, self.linear, self.pack = model, linear, pack
        self.fused_attention, self.compiled = fused_attention, compiled
        self._layers: list[tuple] = []
        self._views: list[int] = []
        self._packed: dict[int, torch.Tensor] = {}  # id(weight) -> pack(weight)
        self._graph_inputs: tuple = ()
        self._compiled_once = False
        self._stack()

    def _stack(self) -> None:
        self._layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            n_kv = attn.v_proj.weight.shape[0] // attn.head_dim
            n_q = attn.q_proj.weight.shape[0] // attn.head_dim
            qk_norm = getattr(attn, "q_norm", None) is not None
            self._layers.append((*_stack_as_views([attn.q_proj, attn.k_proj, attn.v_proj]),
                                 *_stack_as_views([mlp.gate_proj, mlp.up_proj]), n_q, n_kv, qk_norm))
        self.refresh()

    def refresh(self) -> None:
        """With `pack`: pack the weights again (after a write into the parameters). Transposed copies are written
        over in place where they are there already (no second set of copies while the new ones are made)."""
        self._views = self._pointers()
        if self.pack is not None:
            weights = [self.model.lm_head.weight]
            for layer, (w_qkv, _, w_gu, *_) in zip(self.model.model.layers, self._layers):
                weights += [w_qkv, layer.self_attn.o_proj.weight, w_gu, layer.mlp.down_proj.weight]
            if self.pack == "onednn":
                self._packed = {id(w): onednn_pack(w) for w in weights}
            else:
                old, self._packed = self._packed, {}
                for w in weights:
                    p = old.get(id(w))
                    fits = p is not None and (p.shape, p.dtype, p.device) == (w.shape[::-1], w.dtype, w.device)
                    self._packed[id(w)] = p.copy_(w.detach().t()) if fits else transposed(w)
        if self.compiled:
            self._graph_inputs = self._graph_weights()

    def _graph_weights(self) -> tuple[list, tuple[_LayerSpec, ...], float, str]:
        """`_step_graph`'s weights, layer specs, final norm eps and kernel (`pack`'s on the packed weights where the
        model is fp32, else F.linear's)."""
        model = self.model
        kernel = self.pack if self.pack is not None and model.lm_head.weight.dtype == torch.float32 else "linear"

        def w(t: torch.Tensor) -> torch.Tensor:
            return t if kernel == "linear" else self._packed[id(t)]

        weights, specs = [], []
        for layer, (w_qkv, b_qkv, w_gu, b_gu, n_q, n_kv, qk_norm) in zip(model.model.layers, self._layers):
            attn, mlp = layer.self_attn, layer.mlp
            weights += [layer.input_layernorm.weight, w(w_qkv), b_qkv, attn.q_norm.weight if qk_norm else None,
                        attn.k_norm.weight if qk_norm else None, w(attn.o_proj.weight), attn.o_proj.bias,
                        layer.post_attention_layernorm.weight, w(w_gu), b_gu, w(mlp.down_proj.weight),
                        mlp.down_proj.bias]
            specs.append(_LayerSpec(n_q, n_kv, attn.head_dim, layer.input_layernorm.variance_epsilon,
                                    layer.post_attention_layernorm.variance_epsilon,
                                    attn.q_norm.variance_epsilon if qk_norm else None, attn.scaling))
        weights += [model.model.norm.weight, w(model.lm_head.weight), model.lm_head.bias]
        weights = [t.detach() if t is not None and t.requires_grad else t for t in weights]  # the packs as they are
        return weights, tuple(specs), model.model.norm.variance_epsilon, kernel

    def packed_bytes(self) -> int:
        """Memory held by the packed copies (their weights' size: oneDNN's blocked layout may pad a little more)."""
        return sum(p.numel() * p.element_size() for p in self._packed.values())

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.pack is None:
            return self.linear(x, weight, bias)
        if self.pack == "transposed":
            return mm_transposed(x, self._packed[id(weight)], bias)
        return self.linear(x, weight, bias, packed=self._packed[id(weight)])

    def _pointers(self) -> list[int]:
        """Where the stacked parameters live; with `pack`, also the version counter of every weight it packs (an
        in-place write into a parameter bumps it) and where the unstacked ones live."""
        layers = self.model.model.layers
        stacked = [p.data_ptr() for layer in layers
                   for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                             layer.mlp.gate_proj, layer.mlp.up_proj) for p in (m.weight, m.bias) if p is not None]
        if self.pack is None:
            return stacked
        weights = [self.model.lm_head.weight] + [
            m.weight for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                   layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                                                   layer.mlp.up_proj, layer.mlp.down_proj)]
        return stacked + [w.data_ptr() for w in weights] + [w._version for w in weights]

    def check(self) -> None:
        """Stack again if a parameter is no longer a view of its stack (the model was moved or cast since); with
        `pack`, pack again if a weight was written in place since (a write through `.data` is not seen: call
        `refresh()` after one, as HFEngine.update_weights does)."""
        if self._pointers() != self._views:
            self._stack()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache) -> torch.Tensor:
        """tokens, positions (B,) long; mask (B, L) bool over the L keys the cache holds after this step (None: all
        valid); cache a DynamicCache whose layers' `update(k, v)` return their whole keys and values -> the
        next-token logits (B, V)."""
        inner, linear, b = self.model.model, self._linear, tokens.shape[0]
        x = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(x, positions[:, None])  # (B, 1, D), attention scaling applied
        half = cos.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        if self.compiled and b > 1 and cache.layers[0].get_seq_length() > 1 and \
                all(hasattr(c, "buffers") for c in cache.layers):  # sizes 0 and 1 would compile again
            logits = self._compiled(x, cos, sin, mask, cache)
            if logits is not None:
                return logits
        mask = mask[:, None, None] if mask is not None else None
        for layer, (w_qkv, b_qkv, w_gu, b_gu, n_q, n_kv, qk_norm), cache_layer in zip(inner.layers, self._layers,
                                                                                       cache.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = rms_norm(x, layer.input_layernorm)
            qkv = linear(h, w_qkv, b_qkv).view(b, n_q + 2 * n_kv, attn.head_dim)
            qk, v = qkv[:, :n_q + n_kv], qkv[:, n_q + n_kv:]
            if qk_norm:
                weight = torch.cat([attn.q_norm.weight.expand(n_q, -1), attn.k_norm.weight.expand(n_kv, -1)])
                qk = F.rms_norm(qk, weight.shape[-1:], None, attn.q_norm.variance_epsilon) * weight
            qk = qk * cos + qk.roll(half, -1) * sin
            keys, values = cache_layer.update(qk[:, n_q:, None], v[:, :, None])
            o = self._attention(qk[:, :n_q, None], keys, values, mask, attn.scaling)  # (B, 1, H, D)
            x = x + linear(o.reshape(b, -1), attn.o_proj.weight, attn.o_proj.bias)
            h = rms_norm(x, layer.post_attention_layernorm)
            gate, up = linear(h, w_gu, b_gu).chunk(2, -1)
            x = x + linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        x = rms_norm(x, inner.norm)
        return linear(x, self.model.lm_head.weight, self.model.lm_head.bias)

    def _compiled(self, x, cos, sin, mask, cache) -> torch.Tensor | None:
        """The step through `_step_graph`, its new keys and values written into the cache; None where the compile
        failed and `compiled` is "fallback" (the step then runs eagerly, and every later one)."""
        weights, specs, eps, kernel = self._graph_inputs
        if mask is None:
            mask = torch.ones(x.shape[0], cache.layers[0].get_seq_length() + 1, dtype=torch.bool, device=x.device)
        buffers = [c.buffers() for c in cache.layers]
        keys, values = [k for k, _ in buffers], [v for _, v in buffers]
        first, start = not self._compiled_once, time.perf_counter()
        if first:
            logger.info("hf engine: compiling the decode step of %d layers (torch.compile, once per process; the "
                        "compiled code is cached on disk)", len(specs))
        try:
            _dynamic(x, cos, sin, mask, keys, values)
            with _distinct_sizes():
                logits, new_keys, new_values = _step_graph(specs, eps, kernel)(x, cos, sin, mask, keys, values, weights)
        except Exception as e:  # inductor raises many kinds (CppCompileError, InvalidCxxCompiler, ...)
            self.compiled = self._compile_failed(self.compiled, e, "decode step", "eagerly")
            return None
        if first:
            self._compiled_once = True
            logger.info("hf engine: the first compiled decode step took %.1f s", time.perf_counter() - start)
        for cache_layer, k, v in zip(cache.layers, new_keys, new_values):
            cache_layer.update(k[:, :, None], v[:, :, None])
        return logits

    def _attention(self, query, keys, values, mask, scaling) -> torch.Tensor:
        if not self.fused_attention or not use_fused_decode_attention(keys.shape[0], keys.shape[2]):
            return _decode_attention(query, keys, values, mask, scaling)
        try:
            return decode_attention_fused(query, keys, values, mask, scaling)
        except Exception as e:  # inductor raises many kinds (CppCompileError, InvalidCxxCompiler, ...)
            self.fused_attention = self._compile_failed(self.fused_attention, e, "decode attention",
                                                        "with the batched matmuls")
            return _decode_attention(query, keys, values, mask, scaling)

    @staticmethod
    def _compile_failed(setting: bool | str, error: Exception, what: str, instead: str) -> bool:
        """A compiled call raised: with the setting True, raise on; with "fallback", say why once and turn it off
        (returns the new setting, False)."""
        if setting is True:
            raise error
        why = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        logger.warning("hf engine: the compiled %s failed (%s: %s); decoding goes on %s (rollout.hf_compile=false "
                       "skips the attempt)", what, type(error).__name__, why, instead)
        return False
