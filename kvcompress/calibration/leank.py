"""LeanK mask training (arXiv 2508.02215): learned scaling factors, then an aligned binary mask.

Stage 1 learns ``alpha[layer, kv_head, channel]`` in [0, 1] (initialised at 1, clamped after every
step; AdamW, weight decay 0) minimising

    mean_tokens mean_hidden (h_full - h_alpha)^2  +  reg * mean |alpha|

where ``h`` are the final hidden states (after the final norm) at the *tail* (question and answer)
tokens of retrieval samples, and ``h_alpha`` comes from the model whose middle keys
(``sinks <= j < t - local`` for a query at ``t``) are scaled by alpha (plain scaling, as the
authors do: a head whose alpha reaches 0 scores its middle keys 0 and still gets gradients).  As in the authors' code and
in kvcompress' deployment (prefill is exact, pruning applies to what later queries read), context
tokens attend exactly: each sample's context is prefilled **once** (its per-layer K/V kept in
memory) and every step runs only the tail tokens, with gradients into alpha alone (the model's
weights are frozen).  The learning rate follows the authors' trapezoid (warm-up and cool-down over
a fifth of the steps each, floor 0.1x).

Stage 2 (and every score of a binary mask) uses the deployment semantics instead: a head keeping
no channel does not read the middle at all, since the compressor stores no middle K/V for it.

Stage 2 binarizes alpha (:func:`~kvcompress.calibration.masks.binarize`: global threshold at the
ratio, per-head counts rounded half-up to ``align``), then fine-tunes with the L1 term off: the
forward uses the hard mask recomputed from alpha every step, the backward passes the gradient
straight through to alpha.  The binary mask is scored on every training sample (tail MSE) before
stage 2, every ``checkpoint_every`` steps and at the end; the best-scoring alpha gives the final
mask (so a noisy fine-tune can never make the result worse than plain binarization).

Progress and losses go to stderr; alpha and the optimizer state are checkpointed to a safetensors
sidecar so an interrupted run continues with ``resume=True``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, TextIO

import torch

from ..adapters import hf
from ..errors import ConfigError
from . import data
from .attention import ScaledKeys, check_calibratable, compressed_layers, scaled_keys
from .masks import binarize, config_hash, geometry
from .settings import LeanKSettings

CHECKPOINT_FORMAT = "kvcompress.leank-checkpoint/1"


def lr_factor(step: int, steps: int) -> float:
    """The authors' trapezoid: linear warm-up and cool-down over steps/5 each, floor 0.1."""
    span = max(1, steps // 5)
    return min(1.0, max((step + 1) / span, 0.1), max((steps - step) / span, 0.1))


class _Log:
    def __init__(self, stream: TextIO | None):
        self.stream = stream
        self.start = time.monotonic()

    def __call__(self, msg: str) -> None:
        if self.stream is not None:
            print(f"[leank {time.monotonic() - self.start:6.0f}s] {msg}", file=self.stream, flush=True)


def checkpoint_path(out: str | os.PathLike) -> str:
    """The resumable-state sidecar of a mask file: ``x.safetensors`` -> ``x.ckpt.safetensors``."""
    out = os.fspath(out)
    stem = out[: -len(".safetensors")] if out.endswith(".safetensors") else out
    return stem + ".ckpt.safetensors"


class LeanKTrainer:
    """Two-stage LeanK training of one model.

    Args:
        model: a transformers causal LM (frozen here; its attention implementation is switched only
            inside each forward and restored).
        tokenizer: its tokenizer.
        settings: :class:`LeanKSettings`.
        checkpoint: optional path of the resumable-state sidecar.
        log: stream for progress lines (None: silent).
    """

    def __init__(self, model: Any, tokenizer: Any, settings: LeanKSettings, checkpoint: str | None = None,
                 log: TextIO | None = sys.stderr):
        check_calibratable(model)
        self.model = model
        self.tokenizer = tokenizer
        self.shape = geometry(model.config)
        self.layers = compressed_layers(model)  # hybrids: only these layers are trained and pruned
        self.settings = settings.validate(self.shape[2])
        self.checkpoint = checkpoint
        self.log = _Log(log)
        self.config_hash = config_hash(model.config)
        self.history: dict[str, Any] = {}
        self.checkpoint_every = 10
        self.best: dict[str, Any] | None = None  # stage 2: lowest pool MSE so far (alpha, mse, step)
        self.pool_k: list[torch.Tensor] = []
        self.pool_v: list[torch.Tensor] = []
        self.tails = torch.empty(0)
        self.targets = torch.empty(0)
        self.samples: list[data.Sample] = []

    # ------------------------------------------------------------------ data

    def prepare(self, samples: list[data.Sample] | None = None) -> None:
        """Prefill every sample's context once (exact attention) and record the tail targets."""
        s = self.settings
        if samples is None:
            tokens = data.split_tokens(self.tokenizer, "train")
            samples = data.retrieval_samples(self.tokenizer, tokens, s.samples, s.context, s.tail, seed=s.seed,
                                             kinds=tuple(s.data))
        self.samples = samples
        layers = self.shape[0]
        ks: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        vs: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        tails, targets = [], []
        t0 = time.monotonic()
        self.model.requires_grad_(False)
        for i, sample in enumerate(samples):
            ids = torch.tensor([sample.ids])
            captured: dict = {}
            with torch.no_grad(), scaled_keys(self.model, ScaledKeys(capture=captured)):
                hidden = hf.final_hidden_states(self.model, ids)
            for layer in range(layers):
                k, v = captured[layer]
                ks[layer].append(k[:, :, : sample.context].contiguous())
                vs[layer].append(v[:, :, : sample.context].contiguous())
            tails.append(ids[:, sample.context:])
            targets.append(hidden[:, sample.context:].float())
            done = i + 1
            if done == len(samples) or done % 4 == 0:
                rate = (time.monotonic() - t0) / done
                self.log(f"prefill {done}/{len(samples)} samples ({rate:.1f} s/sample)")
        self.pool_k = [torch.cat(k) for k in ks]
        self.pool_v = [torch.cat(v) for v in vs]
        self.tails = torch.cat(tails)
        self.targets = torch.cat(targets)
        self.context = samples[0].context

    def batch_indices(self, step: int, stage: int) -> torch.Tensor:
        """Deterministic sample order: a fresh permutation of the pool per epoch."""
        n, b = len(self.samples), self.settings.batch
        out = []
        for p in range(step * b, step * b + b):
            epoch, k = divmod(p, n)
            g = torch.Generator().manual_seed(self.settings.seed * 1000003 + stage * 7919 + epoch)
            out.append(int(torch.randperm(n, generator=g)[k]))
        return torch.tensor(out)

    def tail_mse(self, alpha: Any, idx: torch.Tensor, drop_empty_heads: bool = True) -> torch.Tensor:
        """MSE of the tail hidden states of samples ``idx`` with middle keys scaled by ``alpha``.

        ``drop_empty_heads``: see :class:`~kvcompress.calibration.attention.ScaledKeys`.
        """
        s = self.settings
        prefix = [(k[idx], v[idx]) for k, v in zip(self.pool_k, self.pool_v)]
        tail = self.tails[idx]
        positions = torch.arange(self.context, self.context + tail.shape[1])[None].expand(len(idx), -1)
        state = ScaledKeys(alpha=alpha, sinks=s.sinks, local=s.local, prefix=prefix, drop_empty_heads=drop_empty_heads)
        with scaled_keys(self.model, state):
            hidden = hf.final_hidden_states(self.model, tail, positions)
        return (hidden.float() - self.targets[idx]).pow(2).mean(-1).mean()

    @torch.no_grad()
    def pool_mse(self, keep: torch.Tensor) -> float:
        """Mean tail MSE of the binary mask ``keep`` over every training sample."""
        alpha = keep.to(torch.float32)
        n, b = len(self.samples), self.settings.batch
        total = 0.0
        for i in range(0, n, b):
            idx = torch.arange(i, min(n, i + b))
            total += self.tail_mse(alpha, idx).item() * len(idx)
        return total / n

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, stage: int, step: int, alpha: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        if not self.checkpoint:
            return
        from safetensors.torch import save_file

        state = opt.state.get(alpha, {})
        tensors = {"alpha": alpha.detach().clone()}
        if self.best is not None:
            tensors["best_alpha"] = self.best["alpha"].clone()
        if state:
            tensors["exp_avg"] = state["exp_avg"].clone()
            tensors["exp_avg_sq"] = state["exp_avg_sq"].clone()
        meta = {"format": CHECKPOINT_FORMAT, "settings": json.dumps(self.settings.to_dict(), sort_keys=True),
                "model_config_hash": self.config_hash, "stage": str(stage), "step": str(step),
                "adam_step": str(float(state["step"])) if state else "0", "history": json.dumps(self.history)}
        os.makedirs(os.path.dirname(os.path.abspath(self.checkpoint)), exist_ok=True)
        tmp = self.checkpoint + ".tmp"
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, self.checkpoint)

    def load_checkpoint(self) -> tuple[int, int, dict] | None:
        """(stage, completed steps, tensors) from the sidecar, or None if there is none."""
        if not self.checkpoint or not os.path.isfile(self.checkpoint):
            return None
        from safetensors import safe_open

        with safe_open(self.checkpoint, framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError("--resume", f"a {CHECKPOINT_FORMAT} checkpoint", self.checkpoint)
        if meta.get("model_config_hash") != self.config_hash or \
                json.loads(meta.get("settings", "{}")) != self.settings.to_dict():
            raise ConfigError("--resume", "a checkpoint made with the same model and settings",
                              self.checkpoint, hint="delete it, or rerun with the settings it was made with: "
                              f"{meta.get('settings')}")
        self.history = json.loads(meta.get("history", "{}"))
        if "best_alpha" in tensors:
            self.best = {"alpha": tensors["best_alpha"], "mse": self.history["stage2_best_mse"],
                         "step": self.history["stage2_best_step"]}
        tensors["adam_step"] = torch.tensor(float(meta.get("adam_step", "0")))
        return int(meta["stage"]), int(meta["step"]), tensors

    @staticmethod
    def _restore(alpha: torch.Tensor, opt: torch.optim.Optimizer, tensors: dict) -> None:
        with torch.no_grad():
            alpha.copy_(tensors["alpha"])
        if "exp_avg" in tensors:
            opt.state[alpha] = {"step": tensors["adam_step"].clone(), "exp_avg": tensors["exp_avg"].clone(),
                                "exp_avg_sq": tensors["exp_avg_sq"].clone()}

    # ------------------------------------------------------------------ training

    def _loop(self, stage: int, alpha: torch.Tensor, opt: torch.optim.Optimizer, start: int, steps: int,
              base_lr: float, loss_fn: Callable[[int], tuple[torch.Tensor, str]],
              evaluate: Callable[[int], None] | None = None) -> None:
        t0, ckpt_every = time.monotonic(), self.checkpoint_every
        first = None
        for step in range(start, steps):
            for group in opt.param_groups:
                group["lr"] = base_lr * lr_factor(step, steps)
            loss, parts = loss_fn(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                alpha.clamp_(0.0, 1.0)
            value = loss.detach().item()
            first = value if first is None else first
            self.history.setdefault(f"stage{stage}_loss_first", value)
            self.history[f"stage{stage}_loss_last"] = value
            done = step + 1
            per_step = (time.monotonic() - t0) / (done - start)
            a = alpha.detach()
            self.log(f"stage {stage} step {done}/{steps} loss {value:.5f} ({parts}) "
                     f"alpha mean {float(a.mean()):.3f} at0 {float((a == 0).float().mean()):.2f} "
                     f"at1 {float((a == 1).float().mean()):.2f} | {per_step:.1f} s/step, "
                     f"eta {per_step * (steps - done):.0f} s")
            if done % ckpt_every == 0 or done == steps:
                if evaluate is not None:
                    evaluate(done)
                self._save_checkpoint(stage, done, alpha, opt)

    def train(self, resume: bool = False, init_alpha: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run both stages; returns ``(keep, alpha)``.

        Args:
            resume: continue from the checkpoint sidecar if there is one.
            init_alpha: start of stage 1 (default: all ones, as LeanK does).
        """
        s = self.settings
        if not self.samples:
            self.prepare()
        alpha = torch.ones(self.shape, dtype=torch.float32)
        if init_alpha is not None:
            alpha.copy_(init_alpha)
        alpha.requires_grad_(True)
        restored = self.load_checkpoint() if resume else None
        stage, done = (restored[0], restored[1]) if restored else (1, 0)
        if restored:
            self.log(f"resuming stage {stage} after step {done} from {self.checkpoint}")

        # ---- stage 1: continuous alpha with the L1 term
        if stage == 1:
            opt = torch.optim.AdamW([alpha], lr=s.lr, weight_decay=0.0)
            if restored:
                self._restore(alpha, opt, restored[2])

            def stage1_loss(step: int) -> tuple[torch.Tensor, str]:
                mse = self.tail_mse(alpha, self.batch_indices(step, 1), drop_empty_heads=False)
                l1 = (alpha if self.layers is None else alpha[self.layers]).abs().mean()
                return mse + s.reg * l1, f"mse {mse.detach().item():.5f} + {s.reg}*l1 {l1.detach().item():.3f}"

            self._loop(1, alpha, opt, done, s.steps, s.lr, stage1_loss)
            stage, done, restored = 2, 0, None
            self._save_checkpoint(2, 0, alpha, torch.optim.AdamW([alpha], lr=s.ft_lr))
        self.history["stage1_alpha"] = {"mean": float(alpha.detach().mean()),
                                        "at0": float((alpha.detach() == 0).float().mean()),
                                        "at1": float((alpha.detach() == 1).float().mean())}

        # ---- stage 2: straight-through binary mask, no L1
        opt = torch.optim.AdamW([alpha], lr=s.ft_lr, weight_decay=0.0)
        if restored:
            self._restore(alpha, opt, restored[2])
        self.history.setdefault("stage2_initial_keep_fraction",
                                float(self.binarize(alpha.detach()).float().mean()))

        def stage2_loss(step: int) -> tuple[torch.Tensor, str]:
            hard = self.binarize(alpha.detach()).to(alpha.dtype)
            mse = self.tail_mse(hard + alpha - alpha.detach(), self.batch_indices(step, 2))
            return mse, f"mse {mse.detach().item():.5f}, keep {hard.mean().item():.3f}"

        def evaluate(step: int) -> None:
            keep = self.binarize(alpha.detach())
            mse = self.pool_mse(keep)
            self.history[f"stage2_pool_mse_step{step}"] = mse
            if self.best is None or mse < self.best["mse"]:
                self.best = {"alpha": alpha.detach().clone(), "mse": mse, "step": step}
                self.history["stage2_best_mse"], self.history["stage2_best_step"] = mse, step
            self.log(f"stage 2 after step {step}: mask MSE over all {len(self.samples)} samples {mse:.5f} "
                     f"(best {self.best['mse']:.5f} after step {self.best['step']})")

        if self.best is None:
            evaluate(0)
        self._loop(2, alpha, opt, done, s.ft_steps, s.ft_lr, stage2_loss, evaluate)
        best = self.best["alpha"] if self.best is not None else alpha.detach()
        return self.binarize(best), best

    def binarize(self, alpha: torch.Tensor) -> torch.Tensor:
        """The keep mask of ``alpha`` at the settings' ratio and alignment, over the compressed layers."""
        return binarize(alpha, self.settings.ratio, self.settings.align, self.layers)


def _histogram(keep: torch.Tensor) -> dict[str, int]:
    values, n = keep.sum(-1).flatten().unique(return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(values, n)}


def calibrate(method: str, settings: LeanKSettings, *, model: Any = None, tokenizer: Any = None,
              model_name: str | None = None, out: str | None = None, resume: bool = False,
              log: TextIO | None = sys.stderr) -> "MaskFile":
    """Make a mask with ``method`` (``"trained"``, ``"rope"`` or ``"qk"``) and optionally save it.

    Args:
        method: ``trained`` (two-stage LeanK training), ``rope`` (lowest-frequency RoPE pairs) or
            ``qk`` (mean |q.k| over ``settings.samples`` windows of ``settings.context`` tokens).
        settings: :class:`LeanKSettings` (``ratio``, ``align``, ``sinks``/``local`` and training sizes).
        model: a loaded transformers model, or a name/path for :func:`kvcompress.models.load_model`
            (None: the default model).  ``tokenizer`` must come with a loaded model.
        model_name: recorded in the file (default: the model's ``name_or_path``).
        out: mask file to write (and, for ``trained``, its checkpoint sidecar); None: don't write.
        resume: continue a ``trained`` run from the sidecar.
        log: progress stream (None: silent).

    Returns:
        the :class:`~kvcompress.calibration.masks.MaskFile` (as saved).
    """
    from .masks import METHODS, MaskFile, rope_mask, save_mask
    from .qk import qk_mask

    if method not in METHODS:
        raise ConfigError("--method", f"one of {list(METHODS)}", method)
    settings.validate()
    if model is None or isinstance(model, (str, os.PathLike)):
        from ..models import load_model

        model, tokenizer = load_model(None if model is None else os.fspath(model))
    model.requires_grad_(False)
    _, kv_heads, head_dim = geometry(model.config)
    settings = settings.validate(head_dim)
    t0 = time.monotonic()
    alpha = None
    extra: dict[str, Any] = {}
    if method == "trained":
        trainer = LeanKTrainer(model, tokenizer, settings, checkpoint=checkpoint_path(out) if out else None, log=log)
        keep, alpha = trainer.train(resume=resume)
        details = settings.to_dict()
        details["text"] = "pydoc_data.topics (training split)"
        extra["history"] = trainer.history
    elif method == "rope":
        keep = rope_mask(model.config, settings.ratio, settings.align)
        layers = compressed_layers(model)
        if layers is not None:  # a hybrid's sliding-window layers are never compressed
            keep[~layers] = True
        details = {"heuristic": "lowest-frequency RoPE pairs (rotate_half layout), same count in every head"}
    else:
        check_calibratable(model)
        windows = data.windows(data.split_tokens(tokenizer, "train"), settings.context, settings.samples,
                               seed=settings.seed)
        keep = qk_mask(model, torch.tensor(windows), settings.ratio, settings.align)
        details = {"calibration": "mean |q_c k_c| over causal pairs, post-RoPE, summed over query heads",
                   "windows": settings.samples, "context": settings.context, "seed": settings.seed,
                   "text": "pydoc_data.topics (training split)"}
    extra["seconds"] = round(time.monotonic() - t0, 1)
    config = hf.text_config(model)
    meta = {"model": model_name or getattr(config, "_name_or_path", "") or "unknown",
            "model_config_hash": config_hash(model.config),
            "model_geometry": {"model_type": getattr(config, "model_type", "?"), "layers": keep.shape[0],
                               "kv_heads": kv_heads, "head_dim": head_dim},
            "ratio": settings.ratio, "align": settings.align, "sinks": settings.sinks, "local": settings.local,
            "method": method, "settings": details, "kept_fraction": round(float(keep.float().mean()), 6),
            "count_histogram": _histogram(keep), **extra}
    if out:
        save_mask(out, keep, meta, alpha=alpha)
        if method == "trained" and os.path.isfile(checkpoint_path(out)):
            os.remove(checkpoint_path(out))
        from .masks import load_mask

        return load_mask(out, model.config)
    return MaskFile(keep=keep, alpha=alpha, meta=meta)
