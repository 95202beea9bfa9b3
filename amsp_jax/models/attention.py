"""Causal grouped-query attention for `amsp_jax.models.llama`: materialised, blockwise, or cuDNN's.

All take `q` (batch, seq, heads, head_dim) and `k`, `v` (batch, seq, kv_heads, head_dim), heads a
multiple of kv_heads, and return (batch, seq, heads, head_dim) in `q`'s dtype:

- `xla_attention`: XLA's dot / softmax / dot. It materialises the (batch, heads, seq, seq) fp32
  scores and their bf16 probabilities, and its backward the score-sized gradients.
- `blockwise_attention`: online softmax over query and key blocks (FlashAttention's algorithm, in
  plain JAX loops), a `jax.custom_vjp` whose forward keeps only the output and the log-sum-exp of
  each row (fp32) and whose backward recomputes each block's scores. Blocks above the diagonal are
  skipped. Memory beyond the inputs: the fp32 row statistics, the fp32 output or dQ accumulator, and
  one block of scores. Runs on any backend.
- `cudnn_attention`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash
  attention (custom calls `__cudnn$fmhaSoftmax` and `__cudnn$fmhaSoftmaxBackward`): bf16/fp16 only,
  head_dim a multiple of 8 up to 128. Its forward keeps the softmax statistics (fp32 per row) and its
  backward allocates an fp32 dQ accumulator; the scores stay in on-chip memory.

`attention(..., kind="auto")` picks cuDNN where the program is lowered for CUDA and cuDNN applies
(`jax.lax.platform_dependent`, so an ahead-of-time compile for a GPU target on a CPU-only machine
picks it too) and the blockwise attention everywhere else.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

KINDS = ("auto", "xla", "blockwise", "cudnn")
"""`LlamaConfig.attention` values."""

MEMORY_EFFICIENT = ("auto", "blockwise", "cudnn")
"""The kinds that never hold a (seq, seq) score matrix in device memory."""

SCOPE = "blockwise_attention"
"""The name scope of the blockwise attention's ops (in the compiled HLO's op_name metadata)."""

_MASKED = -1e30  # a finite "minus infinity": exp(_MASKED - m) is 0 and never NaN


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention through the full score matrix (what the model did before blockwise)."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q, k).astype(jnp.float32) / jnp.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bgrts,bsgk->btgrk", probs, v).reshape(batch, seq, heads, head_dim)


@functools.cache
def cudnn_version() -> int | None:
    """The cuDNN version JAX finds (None: no cuDNN library, so its attention cannot be traced)."""
    jax.devices()  # the CUDA plugin loads cuDNN when JAX starts its backends
    try:
        from jax._src.cudnn import fused_attention_stablehlo

        return int(fused_attention_stablehlo.check_cudnn_version())
    except Exception:
        return None


def cudnn_applies(q: jax.Array, k: jax.Array) -> str:
    """Why cuDNN's flash attention cannot take these inputs ("" when it can)."""
    head_dim = q.shape[-1]
    if cudnn_version() is None:
        return "no cuDNN library found (install jax[cuda12], or nvidia-cudnn-cu12 for the gpu-aot extra)"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"cuDNN's flash attention takes bf16 or fp16, got {q.dtype}"
    if head_dim % 8 or head_dim > 128:
        return f"cuDNN's flash attention needs head_dim a multiple of 8 up to 128, got {head_dim}"
    return ""


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """cuDNN's fused causal flash attention (lowers for CUDA only)."""
    reason = cudnn_applies(q, k)
    if reason:
        raise ValueError(f"attention 'cudnn': {reason}; use attention 'auto' or 'blockwise'")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x` typed as varying over the manual mesh axes `ref` varies over (loop carries in `shard_map`)."""
    varying = jax.typeof(ref).manual_axis_type.varying
    missing = tuple(a for a in varying if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _tiling(seq: int, block: int) -> tuple[int, int]:
    """(blocks, block size): the fewest blocks of at most `block` rows, equal-sized, covering `seq`."""
    blocks = -(-seq // block)
    return blocks, -(-seq // blocks)


def _split(x: jax.Array, blocks: int, kv_heads: int) -> jax.Array:
    """(B, n·blk, H, D) → (B, n, blk, kv_heads, H // kv_heads, D), padded with zeros at the end."""
    batch, seq, heads, head_dim = x.shape
    pad = blocks * -(-seq // blocks) - seq
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x.reshape(batch, blocks, -1, kv_heads, heads // kv_heads, head_dim)


def _merge(x: jax.Array, seq: int) -> jax.Array:
    """Inverse of `_split`: (B, n, blk, K, G, D) → (B, seq, K·G, D)."""
    batch, blocks, block, kv_heads, groups, head_dim = x.shape
    return x.reshape(batch, blocks * block, kv_heads * groups, head_dim)[:, :seq]


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`einsum` accumulated and returned in fp32."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _scores(q_i: jax.Array, k_j: jax.Array, i: jax.Array, j: jax.Array, scale: float) -> jax.Array:
    """Block (i, j)'s scaled fp32 scores (B, K, G, blk_q, blk_k), causal mask on the diagonal block."""
    s = _dot("bqkgd,bskd->bkgqs", q_i, k_j) * scale
    block = q_i.shape[1]
    below = jnp.arange(block)[:, None] >= jnp.arange(block)[None, :]
    return jnp.where((i != j) | below, s, _MASKED)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Output (B, T, H, D) and the rows' log-sum-exp (B, n, K, G, blk) in fp32."""
    seq, kv_heads, head_dim = q.shape[1], k.shape[2], q.shape[3]
    blocks, block = _tiling(seq, block)
    scale = 1.0 / math.sqrt(head_dim)
    qb, kb, vb = (_split(x, blocks, kv_heads) for x in (q, k, v))
    kb, vb = kb[:, :, :, :, 0], vb[:, :, :, :, 0]  # (B, n, blk, K, D)

    def query_block(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        q_i = qb[:, i]
        batch, _, _, groups, _ = q_i.shape
        stats = (batch, kv_heads, groups, block)

        def key_block(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            m, l, acc = carry
            s = _scores(q_i, kb[:, j], i, j, scale)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            pv = _dot("bkgqs,bskd->bkgqd", p.astype(v.dtype), vb[:, j])
            return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + pv

        init = (
            jnp.full(stats, _MASKED, jnp.float32),
            jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, head_dim), jnp.float32),
        )
        init = tuple(_varying_like(x, q_i) for x in init)
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)  # causal: keys up to block i
        out = (acc / l[..., None]).astype(q.dtype)  # (B, K, G, blk, D)
        return jnp.moveaxis(out, 3, 1), m + jnp.log(l)

    out, lse = jax.lax.map(query_block, jnp.arange(blocks))  # (n, B, blk, K, G, D), (n, B, K, G, blk)
    return _merge(jnp.moveaxis(out, 0, 1), seq), jnp.moveaxis(lse, 0, 1)


def _backward(
    q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, d_out: jax.Array, block: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv by FlashAttention-2's backward: each block's probabilities rebuilt from `lse`."""
    seq, kv_heads, head_dim = q.shape[1], k.shape[2], q.shape[3]
    blocks, block = _tiling(seq, block)
    scale = 1.0 / math.sqrt(head_dim)
    qb, ob, dob = (_split(x, blocks, kv_heads) for x in (q, out, d_out))
    kb, vb = (_split(x, blocks, kv_heads)[:, :, :, :, 0] for x in (k, v))
    # delta_i = rowsum(dO_i * O_i): the softmax backward's correction, (B, n, K, G, blk) like lse.
    delta = _dot("bnqkgd,bnqkgd->bnkgq", dob.astype(jnp.float32), ob.astype(jnp.float32))

    def key_block(dq: jax.Array, j: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        k_j, v_j = kb[:, j], vb[:, j]

        def query_block(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dk, dv, dq = carry
            q_i, do_i = qb[:, i], dob[:, i]
            p = jnp.exp(_scores(q_i, k_j, i, j, scale) - lse[:, i][..., None])  # (B, K, G, q, s)
            dv = dv + _dot("bkgqs,bqkgd->bskd", p.astype(v.dtype), do_i)
            dp = _dot("bqkgd,bskd->bkgqs", do_i, v_j)
            ds = (p * (dp - delta[:, i][..., None]) * scale).astype(q.dtype)
            dk = dk + _dot("bkgqs,bqkgd->bskd", ds, q_i)
            dq_i = _dot("bkgqs,bskd->bqkgd", ds, k_j)
            return dk, dv, dq.at[:, i].add(dq_i)

        zeros = _varying_like(jnp.zeros(k_j.shape, jnp.float32), k_j)
        dk, dv, dq = jax.lax.fori_loop(j, blocks, query_block, (zeros, zeros, dq))  # causal: queries from j
        return dq, (dk, dv)

    dq0 = _varying_like(jnp.zeros(qb.shape, jnp.float32), qb)
    dq, (dk, dv) = jax.lax.scan(key_block, dq0, jnp.arange(blocks))  # dk, dv: (n, B, blk, K, D)

    def keys(x: jax.Array, like: jax.Array) -> jax.Array:
        return _merge(jnp.moveaxis(x, 0, 1)[:, :, :, :, None], seq).astype(like.dtype)

    return _merge(dq, seq).astype(q.dtype), keys(dk, k), keys(dv, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = 512) -> jax.Array:
    """Causal attention by online softmax over `block`-sized query and key blocks (no score matrix)."""
    with jax.named_scope(SCOPE):
        return _forward(q, k, v, block)[0]


def _blockwise_fwd(q, k, v, block):
    with jax.named_scope(SCOPE):
        out, lse = _forward(q, k, v, block)
    return out, (q, k, v, out, lse)


def _blockwise_bwd(block, residuals, d_out):
    with jax.named_scope(SCOPE):
        return _backward(*residuals, d_out, block)


blockwise_attention.defvjp(_blockwise_fwd, _blockwise_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kind: str = "auto", block: int = 512) -> jax.Array:
    """Causal GQA attention of `kind` (module docstring); `block` is the blockwise block size."""
    if kind == "xla":
        return xla_attention(q, k, v)
    if kind == "blockwise":
        return blockwise_attention(q, k, v, block)
    if kind == "cudnn":
        return cudnn_attention(q, k, v)
    if kind != "auto":
        raise ValueError(f"unknown attention {kind!r}; one of {', '.join(KINDS)}")
    blockwise = functools.partial(blockwise_attention, block=block)
    if cudnn_applies(q, k):
        return blockwise(q, k, v)
    # Both branches are traced; lowering keeps the one of the platform compiled for.
    return jax.lax.platform_dependent(q, k, v, cuda=cudnn_attention, default=blockwise)
