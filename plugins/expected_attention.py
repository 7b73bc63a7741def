"""Expected attention: score tokens by the attention future queries are expected to pay them.

Devoto, Jeblick, Jégou. *Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution.* arXiv:2510.00636 (kvpress' ``ExpectedAttentionPress``).

No attention weights are needed (so it runs where the read kernels return none): the queries are modelled as a
Gaussian whose mean and covariance come from recent queries *before* RoPE, rotated by the RoPE rotation
averaged over the next ``n_future`` positions (``mu' = R mu``, ``S' = R S R^T``); for a Gaussian query the
expected attention logit of a post-RoPE key ``k`` is ``mu'.k / sqrt(d) + k^T S' k / (2 d)``.  A softmax over
the candidate tokens per query head, averaged over the query heads of each kv head, rescaled by ``||V||``
(``(score + epsilon) * ||V||``) gives the score; each kv head keeps its top tokens
(:class:`kvcompress.ScoreEvictor`).

Query statistics: the observation's queries are post-RoPE; each is rotated back by its own position (the
layer's ``rope_inv_freq``, rotate-half convention), and the last ``window`` of them are kept in a ring per
layer - the prompt's last ``window`` queries, then every decoded query (kvpress' ``DecodingPress`` buffers
hidden states the same way).  kvpress uses every prompt query but the first ``n_sink``; the softmax here runs
over the tokens that may be evicted (the block leaving the window; while decoding, the stored tokens and the
block together, rescored with the current statistics at every flush, dequantizing a KIVI middle), where
kvpress' runs over the whole prompt but its sinks.

Parameters: ``ratio`` or ``budget``, ``window`` (256 queries), ``n_future`` (512), ``covariance`` (true),
``vnorm`` (true), ``epsilon`` (0), ``sinks`` (4, kvpress' n_sink), ``recent`` (64), ``phase`` ("prefill";
"both" holds the budget while decoding), ``schedule`` ("uniform", "pyramid" or "adaptive": AdaKV's per-head budgets,
with ``alpha``, phase "prefill" only; see :class:`kvcompress.scoring.ScoreConfig`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvcompress import CompressorSpec, hookimpl, param
from kvcompress.errors import ConfigError
from kvcompress.scoring import ScoreConfig, ScoreEvictor
from kvcompress.static import mark_static, remap_rows


@dataclasses.dataclass(frozen=True)
class ExpectedAttentionConfig(ScoreConfig):
    window: int = param(256, "recent queries whose statistics model the future ones (the prompt's last ones, "
                        "then the decoded ones)", min=2, max=1 << 14)
    n_future: int = param(512, "future positions the RoPE rotation is averaged over (kvpress n_future_positions)",
                          min=1, max=1 << 20)
    covariance: bool = param(True, "use the queries' covariance, not only their mean (kvpress use_covariance)")
    vnorm: bool = param(True, "rescale the expected attention by ||V|| (kvpress use_vnorm)")
    epsilon: float = param(0.0, "added to the expected attention before the ||V|| rescaling", min=0.0, max=1.0)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE (rotate-half) of ``x`` ``[..., n, d]`` at ``positions`` ``[n]``; ``inverse``: undo it."""
    half = inv_freq.shape[0]
    angle = positions.float().unsqueeze(-1) * inv_freq.to(x.device)  # [n, half]
    cos, sin = angle.cos(), angle.sin()
    if inverse:
        sin = -sin
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def average_rotation(first: torch.Tensor, n: int, inv_freq: torch.Tensor, d: int) -> torch.Tensor:
    """``[d, d]``: the RoPE rotation averaged over positions ``first .. first + n - 1`` (``first`` a 0-dim tensor)."""
    half = inv_freq.shape[0]
    inv_freq = inv_freq.to(first.device)
    angle = (first + torch.arange(n, device=first.device)).float().unsqueeze(-1) * inv_freq  # [n, half]
    c, s = angle.cos().mean(0), angle.sin().mean(0)
    i = torch.arange(half, device=first.device)
    out = torch.eye(d, device=first.device)
    out = out.index_put((i, i), c).index_put((i + half, i + half), c)
    return out.index_put((i, i + half), -s).index_put((i + half, i), s)


class QueryRing:
    """The last ``size`` pre-RoPE queries of a layer ``[batch, q_heads, size, d]`` float32, their validity and a
    device counter (``layer.state``; static caches write it inside the compiled decode step)."""

    def __init__(self, static: bool) -> None:
        self.static = static
        self.q: torch.Tensor | None = None
        self.ok: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.stored: torch.Tensor | None = None  # the stored slots' scores of the current flush, until used

    def allocate(self, batch: int, heads: int, size: int, d: int, device) -> None:
        self.q = torch.zeros(batch, heads, size, d, device=device)
        self.ok = torch.zeros(batch, size, dtype=torch.bool, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)
        if self.static:
            mark_static(self.q, self.ok, self.count)

    def push(self, q: torch.Tensor, ok: torch.Tensor) -> None:
        size, w = self.q.shape[2], q.shape[2]
        if w > size:
            q, ok, w = q[:, :, -size:], ok[:, -size:], size
        slots = (self.count + torch.arange(w, device=q.device)).remainder(size)
        self.q.index_copy_(2, slots, q.float())
        self.ok.index_copy_(1, slots, ok)
        self.count.add_(w)

    def stats(self, covariance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean ``[b, hq, d]`` and covariance ``[b, hq, d, d]`` of the valid queries (zeros when there are none)."""
        w = self.ok.float()[:, None, :, None]  # [b, 1, size, 1]
        n = w.sum(2).clamp(min=1)  # [b, 1, 1]
        mu = (self.q * w).sum(2) / n
        if not covariance:
            return mu, None
        centred = (self.q - mu.unsqueeze(2)) * w
        return mu, torch.einsum("bhsi,bhsj->bhij", centred, centred) / n.unsqueeze(-1)

    def map_batch(self, fn) -> None:
        if self.q is None:
            return
        if self.static:  # in place unless the row count changes
            self.q, self.ok = remap_rows(self.q, fn), remap_rows(self.ok, fn)
        else:
            self.q, self.ok = fn(self.q), fn(self.ok)

    def reset(self) -> None:
        self.stored = None
        if self.q is not None:
            self.q.zero_()
            self.ok.zero_()
            self.count.zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.ok, self.count) if t is not None)

    def row_nbytes(self) -> int:
        """The part of :meth:`nbytes` held per row (which slots hold a query, the count; the queries are per head)."""
        return sum(t.numel() * t.element_size() for t in (self.ok, self.count) if t is not None)


class ExpectedAttentionCompressor(ScoreEvictor):
    name = "expected_attention"

    def release_queries(self, layer) -> None:
        """Phase prefill, a decode step of a dynamic cache: decoding appends and scores nothing, so the prompt's
        queries are dropped (on the default model the 256-query window is 17.7 MB in fp32, half the dense bytes of
        a 1.6k-token prompt); a later prompt (another turn) is scored from its own queries, as kvpress scores each
        prompt.  A static cache keeps its preallocated ring (its buffers are fixed for the compiled step)."""
        layer.state.pop(self._ring_key, None)

    @property
    def _ring_key(self) -> str:
        return f"{self.name}:queries"

    def _ring(self, layer) -> QueryRing:
        ring = layer.state.get(self._ring_key)
        if ring is None:
            ring = layer.state[self._ring_key] = QueryRing(bool(layer.static))
        return ring

    @hookimpl
    def kvcompress_observe(self, layer, obs):
        if not obs.prefill and self.config.phase == "prefill" and not layer.static:
            self.release_queries(layer)
        if obs.prefill or self.config.phase != "prefill":  # decoded queries matter only while decoding evicts
            freq = layer.info.rope_inv_freq
            if freq is None:
                raise ConfigError(f"{self.name}", "a model with rotary position embeddings (the query statistics "
                                  "are rotated to future positions)", "a model whose rotary embedding kvcompress "
                                  "did not find")
            ring = self._ring(layer)
            if ring.q is None:
                b, hq, _, d = obs.query.shape
                ring.allocate(b, hq, self.config.window, d, obs.query.device)
            ok = obs.valid[:, -obs.query.shape[2]:] if obs.valid is not None else torch.ones(
                obs.query.shape[0], obs.query.shape[2], dtype=torch.bool, device=obs.query.device)
            ring.push(rotate(obs.query.float(), obs.query_positions, freq, inverse=True), ok)
        super().kvcompress_observe(layer, obs)

    # -- scoring ----------------------------------------------------------------------------------------------
    def _statistics(self, layer, obs):
        c = self.config
        mu, cov = self._ring(layer).stats(c.covariance)
        d = mu.shape[-1]
        rot = average_rotation(obs.positions[-1] + 1, c.n_future, layer.info.rope_inv_freq, d)
        mu = mu @ rot.T
        if cov is not None:
            cov = rot @ cov @ rot.T
        return mu, cov

    def _logits(self, keys: torch.Tensor, mu: torch.Tensor, cov: torch.Tensor | None) -> torch.Tensor:
        """``[b, hq, n]`` expected logits of ``keys`` ``[b, h, n, d]`` (post-RoPE) for each query head."""
        b, hq, d = mu.shape
        k = keys.float().repeat_interleave(hq // keys.shape[1], dim=1)
        out = torch.einsum("bhnd,bhd->bhn", k, mu) / math.sqrt(d)
        if cov is not None:
            out = out + torch.einsum("bhnd,bhde,bhne->bhn", k, cov, k) / (2 * d)
        return out

    def _score(self, logits: torch.Tensor, valid: torch.Tensor, values: torch.Tensor, heads: int) -> torch.Tensor:
        """Softmax per query head over the valid tokens, averaged over each kv head's group, times ||V||."""
        b, hq, n = logits.shape
        p = torch.softmax(logits.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1).nan_to_num(0.0)
        p = p.view(b, heads, hq // heads, n).mean(dim=2)
        if self.config.vnorm:
            p = (p + self.config.epsilon) * values.float().norm(dim=-1)
        return p

    def score(self, layer, block, obs):
        h = layer.info.num_kv_heads
        mu, cov = self._statistics(layer, obs)
        valid = block.valid if block.due is None else block.valid & block.due
        logits = self._logits(block.k, mu, cov)
        stored = self.stored_tokens(layer, block, obs)
        if stored is None:
            return self._score(logits, valid, block.v, h)
        keys, values, ok = stored  # decoding under a budget: the stored tokens compete under the same statistics
        n = keys.shape[2]
        joint = self._score(torch.cat([self._logits(keys, mu, cov), logits], dim=-1), torch.cat([ok, valid], 1),
                            torch.cat([values, block.v.to(values.dtype)], dim=2), h)
        self._ring(layer).stored = joint[..., :n]
        return joint[..., n:]

    def stored_scores(self, layer, obs):
        ring = self._ring(layer)
        out, ring.stored = ring.stored, None
        return out


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="expected_attention", axis="evict", config=ExpectedAttentionConfig, factory=ExpectedAttentionCompressor,
        summary="Expected attention of future queries (query statistics, averaged RoPE), per-head top tokens "
                "(arXiv:2510.00636, kvpress ExpectedAttentionPress)",
    ))
