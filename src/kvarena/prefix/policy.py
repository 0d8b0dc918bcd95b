"""Where a request keeps checkpoint images of its state.

Four rules, combinable: the end of the prompt (the last full block boundary
of it), the last multiple of N tokens before the prompt end (``end:N``: where
prompts are known to share, e.g. a chat template's turn boundary, or the 512
tokens of a Mooncake trace's hash blocks), every N tokens, and branch points — a boundary where a lookup found
matching KV but no image, so the next request to compute through it keeps
one there. The last rule is what lets a shared system prompt followed by
unique suffixes hit at all: the end-of-prompt images of earlier requests lie
past the shared part, and only a checkpoint AT the shared boundary serves it.

A fifth rule, ``learn`` (on by default), takes from the trace what the others
must be told (:mod:`~kvarena.prefix.placement`): ``end:N`` with N the grain on
which prompts were seen to diverge (:class:`~kvarena.prefix.grain.DivergenceGrain`);
where they diverge anywhere, an image the learned unique-suffix length before
the end (:class:`~kvarena.prefix.grain.SuffixLength`); and, where no interval is
named, an interval sized by what an image costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_count
from ..errors import InvalidValueError


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    end: bool = True
    end_align_tokens: int = 0
    interval_tokens: int = 0
    branch: bool = True
    learn: bool = True

    def __post_init__(self) -> None:
        for name in ("end", "branch", "learn"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidValueError(
                    f"CheckpointPolicy: {name} must be True or False, got {value!r}"
                )
        check_count(self.interval_tokens, "CheckpointPolicy: interval_tokens")
        check_count(self.end_align_tokens, "CheckpointPolicy: end_align_tokens")
        if not (
            self.end or self.end_align_tokens or self.interval_tokens or self.branch or self.learn
        ):
            raise InvalidValueError(
                "CheckpointPolicy keeps no checkpoint at all; enable end, interval, branch or learn"
            )

    @classmethod
    def parse(cls, text: str) -> CheckpointPolicy:
        """``"end"``, ``"end:512"``, ``"interval:4096"``, ``"branch"``, ``"learn"``,
        combined with commas."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidValueError(
                f"checkpoint policy {text!r}: use end, end:N, interval:N, branch, learn "
                "(comma-separated)"
            )
        end = branch = learn = False
        interval = align = 0
        for part in (p.strip() for p in text.split(",")):
            name, _, number = part.partition(":")
            if part == "end":
                end = True
            elif part == "branch":
                branch = True
            elif part == "learn":
                learn = True
            elif (
                name in ("end", "interval")
                and number.isascii()  # str.isdigit() also takes "５１２" and "²"
                and number.isdigit()
                and 0 < int(number) <= 1 << 24
            ):
                if name == "end":
                    align = int(number)
                else:
                    interval = int(number)
            else:
                raise InvalidValueError(
                    f"checkpoint policy part {part!r} unknown; legal: end, end:N, interval:N "
                    "(N tokens, 1..16777216), branch, learn"
                )
        return cls(
            end=end, end_align_tokens=align, interval_tokens=interval, branch=branch, learn=learn
        )

    def describe(self) -> str:
        parts = ["end"] if self.end else []
        if self.end_align_tokens:
            parts.append(f"end:{self.end_align_tokens}")
        if self.interval_tokens:
            parts.append(f"interval:{self.interval_tokens}")
        if self.branch:
            parts.append("branch")
        if self.learn:
            parts.append("learn")
        return ",".join(parts)

    def check_block_size(self, block_size: int) -> None:
        for what, n in (("interval", self.interval_tokens), ("end", self.end_align_tokens)):
            if n % block_size:
                raise InvalidValueError(
                    f"checkpoint {what}:{n} is not a multiple of the block size {block_size} "
                    "tokens: images lie on block boundaries"
                )

    def boundaries(
        self,
        prompt_tokens: int,
        block_size: int,
        hit_blocks: int,
        learned_grain: int = 0,
        back_off_tokens: int = 0,
        learned_interval: int = 0,
    ) -> list[int]:
        """Block counts past the hit at which the end, interval and learn rules keep an
        image (for ``learn``: ``learned_grain``, the divergence grain in tokens;
        ``back_off_tokens``, how far before its end a prompt is seen to part from
        others where they part anywhere; ``learned_interval``, the interval in tokens
        where the policy names none)."""
        full = prompt_tokens // block_size
        out = set()
        learned = self.learn and learned_grain > block_size
        if learned:
            out.add(prompt_tokens // learned_grain * learned_grain // block_size)
        elif self.learn and back_off_tokens:
            out.add(max(0, prompt_tokens - back_off_tokens) // block_size)
        # Once a grain is learned the prompt's own end lies inside the piece the next
        # prompt changes: its image would never be read, so ``learn`` replaces ``end``.
        if self.end and full > hit_blocks and not learned:
            out.add(full)
        if self.end_align_tokens:
            out.add(prompt_tokens // self.end_align_tokens * self.end_align_tokens // block_size)
        interval = self.interval_tokens or (learned_interval if self.learn else 0)
        if interval:
            step = interval // block_size
            out.update(range((hit_blocks // step + 1) * step, full + 1, step))
        return sorted(b for b in out if b > hit_blocks)


DEFAULT_POLICY = CheckpointPolicy().describe()
"""The default policy's text (``end,branch,learn``), for ``kvarena replay`` and the
benchmarks: the prompt's end until a grain is learned, then its last multiple of
the grain (or, where prompts part anywhere, a learned distance before its end);
images inside long prompts at an interval sized by what an image costs; branch
points."""
