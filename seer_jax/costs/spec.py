"""What a step of one model costs per token (`ModelSpec`), and the functions that build one from
a model's architecture shapes: GQA decoders with routed experts (`gqa_moe_spec`, Qwen3-MoE) and
DeepSeek-V3-style models with multi-head latent attention (`mla_moe_spec`), or from a Hugging
Face config (`spec_from_hf_config`). Parameter totals are computed from the shapes.

Mixture of experts: a token uses `experts_per_tok` of the `num_experts` routed experts of each
MoE layer. B tokens routed uniformly touch on average `expected_distinct_experts(E, k, B)` =
E·(1 − (1 − k/E)^B) distinct experts per layer, and a step reads each touched expert's weights
once; the shared weights (attention, embeddings, dense MLPs, shared experts, routers) are read
every step.

The dispatch to the experts also moves activations, per (token, expert) pair, as
`moe.routed_experts` (and, on GPUs, `grouped_matmul.blocked_experts`) run a batch too large for
the decode formulations; counted in rows of the model's dtype, d (hidden) and f (expert hidden)
wide: the token's row gathered into expert order (read d, write d); the gate and up projections
(read the gathered row twice, 2d; write 2f); silu(gate) * up (read 2f, write f); the down
projection (read f, write d); the outputs back in token order (a zeroed [N k, d] written, the
outputs read and scattered into it: 3d); the weighted sum over the k slots (read d). So
`EXPERT_ROW_PASSES` = 9 d-wide and `EXPERT_HIDDEN_PASSES` = 6 f-wide rows per pair, and the sum's
float32 [N, d] output per token (`ModelSpec.expert_activation_bytes_per_token`). The decode
formulations (`moe.dense_experts`, `moe.sparse_experts`) move less per token; at decode sizes
either is small next to the weights and the KV.

Multi-head latent attention in the absorbed form: the cache holds, per token and layer, the
compressed latent (`kv_lora_rank`) and the shared RoPE key (`qk_rope_head_dim`); each query head
scores over kv_lora_rank + qk_rope_head_dim dims and sums values over kv_lora_rank dims. The
absorption (q_nope into the latent space) and unabsorption (latent back to v_head_dim) matmuls
are the `kv_b_proj` weights applied once per query token, so `2 · active_params` counts them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from seer_jax.errors import ConfigError

# rows of activations the expert dispatch reads or writes per (token, expert) pair (module doc)
EXPERT_ROW_PASSES = 9  # hidden-wide (d)
EXPERT_HIDDEN_PASSES = 6  # expert-hidden-wide (f)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a step costs per token for one model.

    `shared_params` are the parameters every token uses (attention, embeddings, dense FFNs and
    shared experts); for a dense model it equals `total_params`. The routed experts hold the rest,
    of which a token activates `active_params - shared_params`. `kv_elems_per_layer` is the number
    of cached elements per token per layer (2·kv_heads·head_dim for GQA, the latent width for MLA).
    Attention FLOPs per (query, key) pair per layer: 2 · num_q_heads · (attn_head_dim +
    attn_value_dim), the score and the weighted-sum dot products (`attn_value_dim` 0 = the same
    as attn_head_dim, as in GQA).

    Routed-expert layout (0 where unknown: the experts are then treated as one pool of which a
    token activates the fraction (active − shared) / (total − shared)): `num_experts` routed
    experts per MoE layer, `experts_per_tok` chosen per token, `num_moe_layers` layers with
    them, `params_per_expert` the parameters of one expert of one layer. `lookup_params`: the
    input embedding table, read by row lookup (no FLOPs). `hidden_size` and
    `expert_intermediate_size` (0 where unknown: no activation term) size the expert dispatch's
    activation rows.
    """

    name: str
    total_params: float
    active_params: float
    shared_params: float
    num_layers: int
    num_q_heads: int
    attn_head_dim: int
    kv_elems_per_layer: int
    bytes_per_param: float = 2.0
    kv_bytes_per_elem: float = 2.0
    num_experts: int = 0
    experts_per_tok: int = 0
    num_moe_layers: int = 0
    params_per_expert: float = 0.0
    attn_value_dim: int = 0
    lookup_params: float = 0.0
    hidden_size: int = 0
    expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.num_experts and not (0 < self.experts_per_tok <= self.num_experts):
            raise ConfigError(f"model {self.name}: experts_per_tok={self.experts_per_tok} must "
                              f"be in [1, num_experts={self.num_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.total_params > self.active_params

    @property
    def has_expert_layout(self) -> bool:
        return self.num_experts > 0 and self.num_moe_layers > 0 and self.params_per_expert > 0

    @property
    def expert_activation_bytes_per_token(self) -> float:
        """Activation bytes the expert dispatch moves per token over all MoE layers (module
        doc): k pairs of EXPERT_ROW_PASSES d-wide and EXPERT_HIDDEN_PASSES f-wide rows in the
        model's dtype, and the float32 d-wide sum."""
        d, f = self.hidden_size, self.expert_intermediate_size
        if not (self.has_expert_layout and d and f):
            return 0.0
        pair = (EXPERT_ROW_PASSES * d + EXPERT_HIDDEN_PASSES * f) * self.bytes_per_param
        return self.num_moe_layers * (self.experts_per_tok * pair + 4.0 * d)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * self.kv_elems_per_layer * self.kv_bytes_per_elem

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query token, key token) pair over all layers and heads."""
        value = self.attn_value_dim or self.attn_head_dim
        return 2.0 * self.num_layers * self.num_q_heads * (self.attn_head_dim + value)

    @property
    def matmul_params(self) -> float:
        """Parameters a token multiplies by (2 FLOPs each): the active ones but the lookup."""
        return self.active_params - self.lookup_params


def expected_distinct_experts(num_experts: float, experts_per_tok: float, tokens: float) -> float:
    """Expected distinct experts hit in one layer by `tokens` tokens, each choosing
    `experts_per_tok` of `num_experts` uniformly: E · (1 − (1 − k/E)^tokens)."""
    if tokens <= 0 or num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_tok / num_experts) ** tokens)


def _assemble(name: str, *, num_layers: int, hidden: int, vocab: int, tie_embeddings: bool,
              attn_params: int, num_heads: int, score_dim: int, value_dim: int,
              kv_elems: int, num_experts: int, experts_per_tok: int, moe_intermediate: int,
              num_shared_experts: int, shared_intermediate: int, dense_intermediate: int,
              num_dense_layers: int, router_bias: bool, bytes_per_param: float,
              kv_bytes_per_elem: float) -> ModelSpec:
    """A MoE decoder's ModelSpec from per-layer pieces (SwiGLU MLPs: 3 matrices each)."""
    if not 0 <= num_dense_layers <= num_layers:
        raise ConfigError(f"model {name}: {num_dense_layers} dense layers of {num_layers}")
    norms = 2 * hidden  # the two RMSNorms of a layer
    expert = 3 * hidden * moe_intermediate
    shared_expert = 3 * hidden * shared_intermediate * num_shared_experts
    router = hidden * num_experts + (num_experts if router_bias else 0)
    moe_layers = num_layers - num_dense_layers
    embed = vocab * hidden
    head = 0 if tie_embeddings else vocab * hidden
    shared = (num_layers * (attn_params + norms) + num_dense_layers * 3 * hidden * dense_intermediate
              + moe_layers * (shared_expert + router) + embed + head + hidden)
    routed = moe_layers * num_experts * expert
    active = shared + moe_layers * experts_per_tok * expert
    return ModelSpec(name, float(shared + routed), float(active), float(shared), num_layers,
                     num_heads, score_dim, kv_elems, bytes_per_param, kv_bytes_per_elem,
                     num_experts=num_experts, experts_per_tok=experts_per_tok,
                     num_moe_layers=moe_layers if num_experts else 0,
                     params_per_expert=float(expert), attn_value_dim=value_dim,
                     lookup_params=float(embed), hidden_size=hidden,
                     expert_intermediate_size=moe_intermediate if num_experts else 0)


def gqa_moe_spec(name: str, *, num_layers: int, hidden: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, num_experts: int, experts_per_tok: int, moe_intermediate: int,
                 vocab: int, tie_embeddings: bool = False, qk_norm: bool = True,
                 num_shared_experts: int = 0, shared_intermediate: int = 0,
                 dense_intermediate: int = 0, num_dense_layers: int = 0,
                 bytes_per_param: float = 2.0, kv_bytes_per_elem: float = 2.0) -> ModelSpec:
    """A GQA decoder with routed experts (Qwen3-MoE, Mixtral, Qwen2-MoE shapes)."""
    q, kv = num_q_heads * head_dim, num_kv_heads * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden + (2 * head_dim if qk_norm else 0)
    return _assemble(name, num_layers=num_layers, hidden=hidden, vocab=vocab,
                     tie_embeddings=tie_embeddings, attn_params=attn, num_heads=num_q_heads,
                     score_dim=head_dim, value_dim=head_dim, kv_elems=2 * kv,
                     num_experts=num_experts, experts_per_tok=experts_per_tok,
                     moe_intermediate=moe_intermediate, num_shared_experts=num_shared_experts,
                     shared_intermediate=shared_intermediate or moe_intermediate,
                     dense_intermediate=dense_intermediate, num_dense_layers=num_dense_layers,
                     router_bias=False, bytes_per_param=bytes_per_param,
                     kv_bytes_per_elem=kv_bytes_per_elem)


def mla_moe_spec(name: str, *, num_layers: int, hidden: int, num_heads: int, kv_lora_rank: int,
                 q_lora_rank: int | None, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, num_experts: int, experts_per_tok: int,
                 num_shared_experts: int, moe_intermediate: int, intermediate: int,
                 first_k_dense_replace: int, vocab: int, tie_embeddings: bool = False,
                 bytes_per_param: float = 2.0, kv_bytes_per_elem: float = 2.0) -> ModelSpec:
    """A DeepSeek-V3-style model: MLA (absorbed), routed + shared experts, the first
    `first_k_dense_replace` layers dense. Cache per token-layer: kv_lora_rank + qk_rope_head_dim."""
    qk = qk_nope_head_dim + qk_rope_head_dim
    if q_lora_rank:
        q_proj = hidden * q_lora_rank + q_lora_rank + q_lora_rank * num_heads * qk
    else:
        q_proj = hidden * num_heads * qk
    attn = (q_proj + hidden * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank
            + kv_lora_rank * num_heads * (qk_nope_head_dim + v_head_dim)
            + num_heads * v_head_dim * hidden)
    return _assemble(name, num_layers=num_layers, hidden=hidden, vocab=vocab,
                     tie_embeddings=tie_embeddings, attn_params=attn, num_heads=num_heads,
                     score_dim=kv_lora_rank + qk_rope_head_dim, value_dim=kv_lora_rank,
                     kv_elems=kv_lora_rank + qk_rope_head_dim, num_experts=num_experts,
                     experts_per_tok=experts_per_tok, moe_intermediate=moe_intermediate,
                     num_shared_experts=num_shared_experts, shared_intermediate=moe_intermediate,
                     dense_intermediate=intermediate, num_dense_layers=first_k_dense_replace,
                     router_bias=True, bytes_per_param=bytes_per_param,
                     kv_bytes_per_elem=kv_bytes_per_elem)


def spec_from_hf_config(cfg: Mapping, name: str = "", bytes_per_param: float = 2.0,
                        kv_bytes_per_elem: float = 2.0) -> ModelSpec:
    """A ModelSpec from a Hugging Face `config.json` of a Qwen3-MoE, Mixtral, Qwen2-MoE or
    DeepSeek-V2/V3 (Kimi-K2, Moonlight) model."""
    arch = str(cfg.get("model_type", ""))
    name = name or arch
    get = cfg.get
    try:
        if arch in ("deepseek_v3", "deepseek_v2", "kimi_k2"):
            return mla_moe_spec(
                name, num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                num_heads=cfg["num_attention_heads"], kv_lora_rank=cfg["kv_lora_rank"],
                q_lora_rank=get("q_lora_rank"), qk_nope_head_dim=cfg["qk_nope_head_dim"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                num_experts=cfg["n_routed_experts"], experts_per_tok=cfg["num_experts_per_tok"],
                num_shared_experts=get("n_shared_experts") or 0,
                moe_intermediate=cfg["moe_intermediate_size"],
                intermediate=cfg["intermediate_size"],
                first_k_dense_replace=get("first_k_dense_replace", 0), vocab=cfg["vocab_size"],
                tie_embeddings=bool(get("tie_word_embeddings", False)),
                bytes_per_param=bytes_per_param, kv_bytes_per_elem=kv_bytes_per_elem)
        if arch in ("qwen3_moe", "qwen2_moe", "mixtral"):
            heads = cfg["num_attention_heads"]
            head_dim = get("head_dim") or cfg["hidden_size"] // heads
            experts = get("num_experts") or get("num_local_experts")
            moe_inter = get("moe_intermediate_size") or cfg["intermediate_size"]
            shared_inter = get("shared_expert_intermediate_size") or 0
            return gqa_moe_spec(
                name, num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                num_q_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
                head_dim=head_dim, num_experts=experts, experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate=moe_inter, vocab=cfg["vocab_size"],
                tie_embeddings=bool(get("tie_word_embeddings", False)),
                qk_norm=arch == "qwen3_moe", num_shared_experts=1 if shared_inter else 0,
                shared_intermediate=shared_inter, bytes_per_param=bytes_per_param,
                kv_bytes_per_elem=kv_bytes_per_elem)
    except KeyError as e:
        raise ConfigError(f"{arch} config lacks {e.args[0]!r}") from None
    raise ConfigError(f"no cost spec for model_type {arch!r}; known: deepseek_v2, deepseek_v3, "
                      "kimi_k2, mixtral, qwen2_moe, qwen3_moe")
