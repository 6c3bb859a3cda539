"""Gated delta rule (Gated DeltaNet): chunked prefill and one-token recurrent decode, portable PyTorch.

Per value head, with state S [Dk, Dv], decay a_t = exp(g_t) and learning rate beta_t:
    S_t = a_t * S_{t-1} + k_t^T (beta_t * (v_t - k_t S_{t-1} a_t))        o_t = (scale * q_t) S_t
q and k are l2-normalised (eps 1e-6, as transformers and fla do); value head j reads key head
j // (Hv // Hk), as transformers' `repeat_interleave` does.

The chunked form (the WY / UT transform of DeltaNet) splits a sequence into chunks of C tokens. Within a
chunk, with G the cumulative log decay and D_ij = exp(G_i - G_j) for j <= i:
    (I + A) U = beta * V,  (I + A) W = beta * exp(G) * K,  A_ij = beta_i (k_i . k_j) D_ij  (j < i)
so that, entering the chunk with state S,
    V_new = U - W S,   O = (exp(G) * Q) S + (Q K^T * D) V_new,
    S' = exp(G_last) S + (exp(G_last - G) * K)^T V_new.
Everything but the last two lines is independent across chunks and is computed for many chunks at once;
only the state passes from chunk to chunk. On CPU in float32, once the engine has built it, the same arithmetic
runs in C++ per (sequence, value head), chunk after chunk, each chunk's matrices in L1 (fused_cpu.py): 1.2-3x
this file's speed, which stays the portable path and the reference the C++ is tested beside.
"""

from dataclasses import dataclass, fields

import torch

from deltaserve.kernels import fused_cpu

L2NORM_EPS = 1e-6
# Workspace for the chunk-local tensors of one block of chunks, reused block after block: ~256 tokens at the
# 27B shape (48 value heads x 128 x 128), the measured sweet spot; small shapes get proportionally more tokens.
WORKSPACE_BYTES = 40 * 2**20
# Chunk size the CPU path runs best at (measured: 32 beats 64 by ~10-15%, 128 is slower still).
CPU_CHUNK_SIZE = 32
# Diagonal block size of the triangular inverse: small solves, the rest is matmuls.
TRI_BLOCK = 16


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the convention of transformers' Qwen3-Next / Qwen3.5)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> int:
    """Validates [*, H, D] shapes shared by prefill and decode; returns the GQA ratio Hv // Hk."""
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [tokens, key_heads, key_dim]; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [tokens, value_heads, value_dim] with {q.shape[0]} tokens; got {tuple(v.shape)}")
    key_heads, value_heads = q.shape[1], v.shape[1]
    if value_heads % key_heads != 0:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != tuple(v.shape[:2]):
            raise ValueError(f"{name} must be [tokens, value_heads] = {tuple(v.shape[:2])}; got {tuple(t.shape)}")
    return value_heads // key_heads


def _normed_queries_keys(q, k, use_qk_l2norm: bool, scale: float | None):
    """float32 q (normalised, scaled) and k (normalised), as transformers prepares them."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def recurrent_gated_delta_rule_step(q, k, v, g, beta, state, *, use_qk_l2norm=True, scale=None):
    """One decode token for each of B sequences.

    q, k [B, Hk, Dk]; v [B, Hv, Dv]; g (log decay), beta [B, Hv]; state [B, Hv, Dk, Dv].
    Returns (o [B, Hv, Dv] in v's dtype, new_state [B, Hv, Dk, Dv] float32); `state` is not modified.
    """
    ratio = check_heads(q, k, v, g, beta)
    batch, _, key_dim = q.shape
    value_dim = v.shape[-1]
    if tuple(state.shape) != (batch, v.shape[1], key_dim, value_dim):
        raise ValueError(f"state must be [B, Hv, Dk, Dv] = {(batch, v.shape[1], key_dim, value_dim)}; "
                         f"got {tuple(state.shape)}")
    q, k = _normed_queries_keys(q, k, use_qk_l2norm, scale)
    rows = batch * v.shape[1]
    s = state.float().mul(g.float().exp()[..., None, None]).view(rows, key_dim, value_dim)
    # [k; q] S_decayed in one pass over the state; then o = q S_new = q S_decayed + (q . k) delta
    kq = torch.stack([k, q], dim=2).repeat_interleave(ratio, dim=1).view(rows, 2, key_dim)
    read = torch.bmm(kq, s)
    delta = (v.float().reshape(rows, value_dim) - read[:, 0]).mul_(beta.float().reshape(rows, 1))
    o = read[:, 1].addcmul_((kq[:, 0] * kq[:, 1]).sum(-1, keepdim=True), delta)
    s.baddbmm_(kq[:, 0, :, None], delta[:, None, :])                  # rank-one write k^T delta
    return o.view(batch, -1, value_dim).to(v.dtype), s.view(state.shape)


def _unit_lower_inverse(a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = inverse of I + strict_lower(a), a [..., C, C]: triangular solves on the diagonal blocks, then
    blocks doubled with T21 = -T22 L21 T11 (matmuls), much faster on CPU than one batched solve."""
    size = a.shape[-1]
    block = TRI_BLOCK if size % TRI_BLOCK == 0 and ((size // TRI_BLOCK) & (size // TRI_BLOCK - 1)) == 0 else size
    lead, n = a.shape[:-2], size // block
    eye = torch.eye(block, dtype=a.dtype, device=a.device)
    diag = a.reshape(*lead, n, block, n, block).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # [..., n, b, b]
    out.zero_()
    tiles = out.view(*lead, n, block, n, block)
    diag_inv = torch.linalg.solve_triangular(diag, eye.expand(diag.shape), upper=False, unitriangular=True)
    for i in range(n):
        tiles[..., i, :, i, :] = diag_inv[..., i, :, :]
    width = block
    while width < size:
        pairs = size // (2 * width)
        t = out.view(*lead, pairs, 2 * width, pairs, 2 * width)
        low = a.view(*lead, pairs, 2 * width, pairs, 2 * width)
        for i in range(pairs):
            t11, t22 = t[..., i, :width, i, :width], t[..., i, width:, i, width:]
            t[..., i, width:, i, :width] = -(t22 @ (low[..., i, width:, i, :width] @ t11))
        width *= 2
    return out


def _chunk_plan(cu_seqlens: torch.Tensor, total_tokens: int, chunk_size: int):
    """Chunks of all sequences in step-major order: step j holds chunk j of every sequence that has one.

    Sequences are sorted by chunk count (longest first), so the sequences alive at step j are a prefix of
    that order and their states a prefix of the state tensor. Returns (order [N], rows [n_chunks, C] token
    indices, valid [n_chunks, C], step_starts list of n_steps + 1 chunk offsets).
    """
    device = cu_seqlens.device
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks = (lengths + chunk_size - 1) // chunk_size
    order = torch.argsort(chunks, descending=True, stable=True)
    chunks_sorted = chunks[order]
    n_steps = int(chunks_sorted[0]) if len(order) else 0
    alive = chunks_sorted[None, :] > torch.arange(n_steps, device=device)[:, None]   # [steps, N], prefix rows
    step_idx, seq_pos = alive.nonzero(as_tuple=True)                                  # row-major = step-major
    seq = order[seq_pos]
    starts = cu_seqlens[seq] + step_idx * chunk_size
    rows = starts[:, None] + torch.arange(chunk_size, device=device)[None, :]
    valid = rows < cu_seqlens[seq + 1][:, None]
    rows = rows.clamp(max=max(total_tokens - 1, 0))
    step_starts = [0] + torch.cumsum(alive.sum(dim=1), 0).tolist()
    return order, rows, valid, step_starts


def _gather_chunks(x: torch.Tensor, rows: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """x [T, ...] -> [n, C, ...] for the block's chunks: a view when they are consecutive tokens."""
    if contiguous:
        start = int(rows[0, 0])
        return x[start:start + rows.numel()].view(*rows.shape, *x.shape[1:])
    return x[rows]


@dataclass
class _Workspace:
    """Buffers for one block of n chunks, reused block after block: freshly faulted-in memory costs more
    than the arithmetic here. Grouped layout [n, Hk, r, ...]: value head j = (j // r, j % r)."""
    queries: torch.Tensor     # [n, Hk, C, Dk]   normalised, scaled Q
    keys: torch.Tensor        # [n, Hk, C, Dk]   normalised K
    gram: torch.Tensor        # [n, Hk, C, C]    K K^T, then Q K^T
    decay: torch.Tensor       # [n, Hk, r, C, C] D, then intra = Q K^T * D
    system: torch.Tensor      # [n, Hk, r, C, C] A, then T diag(beta)
    inverse: torch.Tensor     # [n, Hk, r, C, C] T = (I + A)^-1, then T diag(beta exp(G))
    values: torch.Tensor      # [n, Hk, r, C, Dv] V, then the block's output
    new_values: torch.Tensor  # [n, Hk, r, C, Dv] U, then V_new = U - W S
    w: torch.Tensor           # [n, Hk, r, C, Dk] W
    q_decayed: torch.Tensor   # [n, Hk, r, C, Dk] exp(G) Q
    write_keys: torch.Tensor  # [n, Hk, r, C, Dk] exp(G_last - G) K

    @staticmethod
    def allocate(n, key_heads, ratio, size, key_dim, value_dim, device):
        def buf(*shape):
            return torch.empty(n, key_heads, *shape, dtype=torch.float32, device=device)
        return _Workspace(buf(size, key_dim), buf(size, key_dim), buf(size, size),
                          *(buf(ratio, size, size) for _ in range(3)), *(buf(ratio, size, value_dim) for _ in range(2)),
                          *(buf(ratio, size, key_dim) for _ in range(3)))

    @staticmethod
    def chunk_bytes(key_heads, ratio, size, key_dim, value_dim) -> int:
        per_key_head = 2 * size * key_dim + size * size
        per_value_head = 3 * size * size + 2 * size * value_dim + 3 * size * key_dim
        return 4 * key_heads * (per_key_head + ratio * per_value_head)

    def first(self, n: int) -> "_Workspace":
        return _Workspace(*(getattr(self, f.name)[:n] for f in fields(self)))


def _normalise_into(x: torch.Tensor, out: torch.Tensor, use_qk_l2norm: bool, scale: float) -> None:
    """out [n, Hk, C, D] = x [n, C, Hk, D] * scale / sqrt(|x|^2 + eps) (without the norm if not asked)."""
    x = x.float()
    if use_qk_l2norm:
        factor = torch.linalg.vector_norm(x, dim=-1).square_().add_(L2NORM_EPS).rsqrt_().mul_(scale)[..., None]
    else:
        factor = torch.full((), scale, device=x.device)
    torch.mul(x, factor, out=out.transpose(1, 2))


def _chunk_tensors(ws, q, k, v, g, beta, rows, valid, contiguous, use_qk_l2norm, scale):
    """Fills the workspace with a block's chunk-local quantities (see the module docstring).

    Returns (last_decay = exp(G_last) [n, Hk, r]). Padded slots (past a sequence's end) get beta = 0 and g = 0:
    they neither write nor decay the state, and sit after every real token of their chunk.
    """
    n, key_heads, ratio, size, value_dim = ws.values.shape
    key_dim = ws.keys.shape[-1]
    grouped = (n, key_heads, ratio, size)
    _normalise_into(_gather_chunks(q, rows, contiguous), ws.queries, use_qk_l2norm, scale)
    _normalise_into(_gather_chunks(k, rows, contiguous), ws.keys, use_qk_l2norm, 1.0)
    values = _gather_chunks(v, rows, contiguous).view(n, size, key_heads, ratio, value_dim)
    ws.values.copy_(values.permute(0, 2, 3, 1, 4))
    gc, bc = (_gather_chunks(t, rows, contiguous).float() for t in (g, beta))
    if not contiguous:
        gc, bc = gc * valid[:, :, None], bc * valid[:, :, None]
    gc, bc = (t.transpose(1, 2).reshape(grouped) for t in (gc, bc))
    cum = gc.cumsum(dim=-1)                                                   # G: log decay since chunk start
    above = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    torch.sub(cum[..., :, None], cum[..., None, :], out=ws.decay).masked_fill_(above, float("-inf")).exp_()

    per_key_head = (n * key_heads, size, key_dim)
    keys, queries = ws.keys.view(per_key_head), ws.queries.view(per_key_head)
    gram = ws.gram.view(n * key_heads, size, size)
    torch.bmm(keys, keys.transpose(1, 2), out=gram)                           # K K^T once per key head
    torch.mul(ws.decay, bc[..., :, None], out=ws.system).mul_(ws.gram[:, :, None])
    _unit_lower_inverse(ws.system, ws.inverse)
    torch.bmm(queries, keys.transpose(1, 2), out=gram)
    ws.decay.mul_(ws.gram[:, :, None])                                        # intra-chunk attention
    cum_exp = cum.exp()
    per_value_head = n * key_heads * ratio
    torch.mul(ws.inverse, bc[..., None, :], out=ws.system)
    torch.bmm(ws.system.view(per_value_head, size, size), ws.values.view(per_value_head, size, value_dim),
              out=ws.new_values.view(per_value_head, size, value_dim))        # U = T diag(beta) V
    # W = T diag(beta exp(G)) K, the group's r matrices stacked on rows so that K is read once per key head
    ws.inverse.mul_((bc * cum_exp)[..., None, :])
    torch.bmm(ws.inverse.view(n * key_heads, ratio * size, size), keys,
              out=ws.w.view(n * key_heads, ratio * size, key_dim))
    torch.mul(ws.queries[:, :, None], cum_exp[..., None], out=ws.q_decayed)
    last = cum[..., -1:]
    torch.mul(ws.keys[:, :, None], (last - cum).exp_()[..., None], out=ws.write_keys)
    return last[..., 0].exp()


def _scan_block(state, ws, last_decay, step_starts):
    """Carries the states [N, Hv, Dk, Dv] (updated in place) through a block of steps; the block's output
    [n, Hk, r, C, Dv] lands in ws.values."""
    n, key_heads, ratio, size, value_dim = ws.values.shape
    heads, key_dim = key_heads * ratio, state.shape[2]
    new_values = ws.new_values.view(n * heads, size, value_dim)
    w, q_decayed, write_keys = (t.view(n * heads, size, key_dim) for t in (ws.w, ws.q_decayed, ws.write_keys))
    last_decay = last_decay.reshape(n * heads, 1, 1)
    out = ws.values.view(n * heads, size, value_dim)
    first = step_starts[0]
    for lo, hi in zip(step_starts[:-1], step_starts[1:]):
        a, b = (lo - first) * heads, (hi - first) * heads
        s = state[: hi - lo].view((hi - lo) * heads, key_dim, value_dim)
        torch.bmm(q_decayed[a:b], s, out=out[a:b])                            # inter-chunk read
        new_values[a:b].baddbmm_(w[a:b], s, alpha=-1.0)                       # V_new = U - W S
        s.mul_(last_decay[a:b]).baddbmm_(write_keys[a:b].transpose(1, 2), new_values[a:b])
    out.baddbmm_(ws.decay.view(n * heads, size, size), new_values)           # intra-chunk attention


def chunk_gated_delta_rule(q, k, v, g, beta, *, cu_seqlens=None, initial_state=None, chunk_size=64,
                           use_qk_l2norm=True, scale=None, output_final_state=True):
    """Chunked gated delta rule over packed sequences (prefill).

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay, <= 0), beta [T, Hv]; Hv % Hk == 0.
    cu_seqlens: LongTensor [N+1] offsets of N sequences in T (None: one sequence).
    initial_state: [N, Hv, Dk, Dv] or None (zeros). Computes in float32.
    Returns (o [T, Hv, Dv] in v's dtype, final state [N, Hv, Dk, Dv] float32, or None if not requested).
    """
    ratio = check_heads(q, k, v, g, beta)
    total, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, total], device=q.device)
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    n_seqs = cu_seqlens.numel() - 1
    if n_seqs < 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((cu_seqlens.diff() < 0).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the {total} packed tokens; got {cu_seqlens.tolist()}")
    state_shape = (n_seqs, value_heads, key_dim, value_dim)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be [N, Hv, Dk, Dv] = {state_shape}; got {tuple(initial_state.shape)}")

    scale = key_dim ** -0.5 if scale is None else scale
    if fused_cpu.serves_gdn(q, k, v):
        # CPU: the same arithmetic per (sequence, value head) in C++, each chunk's matrices in L1 (fused_cpu.py)
        state = (torch.zeros(state_shape, dtype=torch.float32) if initial_state is None
                 else initial_state.to(torch.float32, copy=True).contiguous())
        out = fused_cpu.gdn_prefill(q, k, v, g, beta, cu_seqlens.tolist(), state, chunk_size, scale, use_qk_l2norm)
        return out, state if output_final_state else None
    order, rows_all, valid, step_starts = _chunk_plan(cu_seqlens, total, chunk_size)
    if initial_state is None:
        state = torch.zeros(state_shape, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32)[order].contiguous()
    out = torch.empty(total, value_heads, value_dim, dtype=v.dtype, device=v.device)
    block_chunks = max(1, WORKSPACE_BYTES // _Workspace.chunk_bytes(key_heads, ratio, chunk_size, key_dim, value_dim))
    workspace = None
    step, n_steps = 0, len(step_starts) - 1
    while step < n_steps:
        end = step + 1          # whole steps per block: at least one, more while they fit the workspace
        while end < n_steps and step_starts[end + 1] - step_starts[step] <= block_chunks:
            end += 1
        lo, hi = step_starts[step], step_starts[end]
        rows, ok = rows_all[lo:hi], valid[lo:hi]
        contiguous = bool(ok.all()) and bool((rows[:, 0].diff() == chunk_size).all())
        if workspace is None or workspace.values.shape[0] < hi - lo:
            workspace = _Workspace.allocate(max(hi - lo, min(block_chunks, step_starts[-1])), key_heads, ratio,
                                            chunk_size, key_dim, value_dim, q.device)
        ws = workspace.first(hi - lo)
        last_decay = _chunk_tensors(ws, q, k, v, g, beta, rows, ok, contiguous, use_qk_l2norm, scale)
        _scan_block(state, ws, last_decay, step_starts[step:end + 1])
        o = ws.values.view(hi - lo, value_heads, chunk_size, value_dim).transpose(1, 2)
        if contiguous:
            out[int(rows[0, 0]):int(rows[0, 0]) + rows.numel()].view(o.shape).copy_(o)
        else:
            out[rows[ok]] = o[ok].to(v.dtype)
        step = end
    if not output_final_state:
        return out, None
    final = torch.empty_like(state)
    final[order] = state
    return out, final
