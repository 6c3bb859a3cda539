"""Depthwise causal conv1d (+ SiLU) over packed sequences, as Gated DeltaNet layers apply it to q|k|v.

y[t, c] = act(bias[c] + sum_w weight[c, w] * x[t - (W - 1) + w, c]), where positions before a sequence's
start read its conv state (the previous W - 1 inputs, zeros for a fresh sequence). Computed in float32.
"""

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", None)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    return F.silu(y) if activation == "silu" else y


def causal_conv1d(x, weight, bias=None, *, cu_seqlens=None, initial_state=None, activation="silu"):
    """Causal depthwise conv over packed sequences (prefill).

    x [T, C]; weight [C, W]; bias [C] or None; cu_seqlens LongTensor [N+1] (None: one sequence);
    initial_state [N, C, W-1] (the inputs before each sequence, oldest first; None: zeros).
    Returns (y [T, C] in x's dtype, final_state [N, C, W-1] in x's dtype: the last W-1 inputs of each
    sequence, reaching into its initial state when the sequence is shorter than W-1).
    """
    total, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight must be [channels={channels}, width]; got {tuple(weight.shape)}")
    history = weight.shape[1] - 1
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, total], device=x.device)
    cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.long)
    n_seqs = cu_seqlens.numel() - 1
    if n_seqs < 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((cu_seqlens.diff() < 0).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the {total} packed tokens; got {cu_seqlens.tolist()}")
    if initial_state is not None and tuple(initial_state.shape) != (n_seqs, channels, history):
        raise ValueError(f"initial_state must be [N, C, W-1] = {(n_seqs, channels, history)}; "
                         f"got {tuple(initial_state.shape)}")

    # Lay each sequence out after its own history: [h_0 | x_0 | h_1 | x_1 | ...], then one sliding sum.
    lengths = cu_seqlens.diff()
    seq_of_token = torch.repeat_interleave(torch.arange(n_seqs, device=x.device), lengths, output_size=total)
    token_pos = torch.arange(total, device=x.device) + (seq_of_token + 1) * history
    offsets = torch.arange(history, device=x.device)
    history_pos = (cu_seqlens[:-1] + torch.arange(n_seqs, device=x.device) * history)[:, None] + offsets
    extended = torch.zeros(total + n_seqs * history, channels, dtype=torch.float32, device=x.device)
    extended[token_pos] = x.float()
    if initial_state is not None:
        extended[history_pos] = initial_state.float().transpose(1, 2)
    weight = weight.float()
    windows = extended.shape[0] - history
    summed = extended[:windows] * weight[:, 0]
    for w in range(1, history + 1):
        summed.addcmul_(extended[w:windows + w], weight[:, w])
    y = summed[token_pos - history]
    if bias is not None:
        y += bias.float()
    final_pos = (cu_seqlens[1:] + torch.arange(1, n_seqs + 1, device=x.device) * history)[:, None] - history + offsets
    final_state = extended[final_pos].transpose(1, 2).to(x.dtype)
    return _activate(y, activation).to(x.dtype), final_state


def causal_conv1d_step(x, weight, bias, state, activation="silu"):
    """One decode token for each of B sequences: x [B, C], state [B, C, W-1] (not modified).

    Returns (y [B, C] in x's dtype, new_state [B, C, W-1] in state's dtype).
    """
    batch, channels = x.shape
    if tuple(state.shape) != (batch, channels, weight.shape[1] - 1):
        raise ValueError(f"state must be [B, C, W-1] = {(batch, channels, weight.shape[1] - 1)}; "
                         f"got {tuple(state.shape)}")
    window = torch.cat([state.float(), x.float()[:, :, None]], dim=-1)       # [B, C, W]
    y = (window * weight.float()).sum(dim=-1)
    if bias is not None:
        y += bias.float()
    return _activate(y, activation).to(x.dtype), window[:, :, 1:].to(state.dtype)
