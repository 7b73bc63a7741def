"""Settings of LeanK mask training (light: no transformers import, so the CLI parser stays cheap)."""

from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError
from . import data
from .masks import check_align, check_ratio


@dataclasses.dataclass(frozen=True)
class LeanKSettings:
    """Training settings (all recorded in the mask file's ``settings`` metadata).

    Attributes:
        ratio: fraction of K channels to prune.
        align: every head keeps a multiple of ``align`` channels.
        sinks, local: unscaled leading keys and local window used while training.
        context, tail: context and question/answer tokens per training sample.
        samples: training samples (contexts prefilled once, cycled through).
        batch: samples per step.
        steps, ft_steps: stage-1 and stage-2 steps.
        lr, ft_lr: AdamW learning rates of stage 1 and stage 2.
        reg: weight of the L1 term mean|alpha| in stage 1.
        seed: samples, their order, and everything random.
        data: sample kinds, cycled through (see :func:`kvcompress.calibration.data.retrieval_samples`).
    """

    ratio: float
    align: int
    sinks: int = 16
    local: int = 128
    context: int = 768
    tail: int = 32
    samples: int = 16
    batch: int = 2
    steps: int = 200
    ft_steps: int = 40
    lr: float = 0.02
    ft_lr: float = 0.01
    reg: float = 0.06
    seed: int = 0
    data: tuple[str, ...] = ("passkey", "key-value", "text")

    def validate(self, head_dim: int | None = None) -> "LeanKSettings":
        """Check every value (``align`` against ``head_dim`` when given); raise ConfigError naming the option."""
        check_ratio(self.ratio, "--ratio")
        if head_dim is not None:
            check_align(self.align, head_dim, "--align")
        elif isinstance(self.align, bool) or not isinstance(self.align, int) or self.align < 1:
            raise ConfigError("--align", "a positive integer dividing head_dim", self.align)
        for name, lo in (("sinks", 0), ("local", 0), ("context", 64), ("tail", 1), ("samples", 1), ("batch", 1),
                         ("steps", 0), ("ft_steps", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"--{name.replace('_', '-')}", f"an integer >= {lo}", value)
        for name in ("lr", "ft_lr", "reg"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < 10 or math.isnan(value):
                raise ConfigError(f"--{name.replace('_', '-')}", "a number in [0, 10)", value)
        if self.sinks + self.local + 1 >= self.context:
            raise ConfigError("--context", f"more than sinks + local + 1 = {self.sinks + self.local + 1} tokens "
                              "(the middle region must be non-empty)", self.context)
        if not self.data or any(k not in data.KINDS for k in self.data) or len(set(self.data)) != len(self.data):
            raise ConfigError("--data", f"a comma-separated subset of {','.join(data.KINDS)}", ",".join(self.data))
        if self.batch > self.samples:
            raise ConfigError("--batch", f"at most --samples ({self.samples})", self.batch)
        return self

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["data"] = list(self.data)
        return out
