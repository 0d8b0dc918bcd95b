"""Rolling linear-attention states back for ``crop``: the mixers' inputs recorded
during a draft's verification, replayed over the accepted tokens."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch

from ...errors import InvalidValueError
from .layers import _cropped
from .linear import LinearLayer
from .rows import Rows


class _Recording(Protocol):
    """What the replay reads of the cache it serves (the cache owns the replay)."""

    layers: list[Any]
    rows: Rows
    recording: bool


def linear_mixers(model: Any, layers: set[int]) -> dict[int, Any]:
    """The module of each linear-attention layer that takes ``(hidden_states,
    cache, attention_mask)`` and keeps the layer's state: the deepest module
    carrying that ``layer_idx`` (the mixer, not the block around it)."""
    found: dict[int, tuple[int, Any]] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if idx not in layers:
            continue
        params = inspect.signature(module.forward).parameters
        if not {"hidden_states", "cache", "attention_mask"} <= set(params):
            continue
        depth = name.count(".")
        if idx not in found or depth > found[idx][0]:
            found[idx] = (depth, module)
    missing = sorted(layers - set(found))
    if missing:
        raise InvalidValueError(
            f"the model has no linear-attention mixer for layers {missing[:4]}: is it the "
            "model this pool was built for?"
        )
    return {i: m for i, (_, m) in found.items()}


class MixerReplay:
    """Rolls linear-attention states back by replaying accepted tokens.

    transformers' kernels hand the cache only a layer's final state, never
    one per token, so a crop cannot pick an earlier state out of a forward.
    Instead, while the cache records (assisted decoding), each mixer's input
    of the last forward is kept and its state from before that forward is
    copied into the request's rollback entry (one slot per request, kvarena's
    rollback copy). ``crop`` restores that entry and runs the mixer over the
    tokens that were accepted: the state the forward would have left had it
    stopped there. Hooks sit on the model's own mixers and are removed on
    release."""

    def __init__(self, cache: _Recording, model: Any) -> None:
        self.cache = cache
        self.linear = {
            layer.layer_idx: layer for layer in cache.layers if isinstance(layer, LinearLayer)
        }
        self.mixers = linear_mixers(model, set(self.linear))
        self.inputs: dict[int, tuple[torch.Tensor, Any, bool]] = {}
        self.replaying = False
        self.handles = [
            m.register_forward_pre_hook(self._before, with_kwargs=True)
            for m in self.mixers.values()
        ]

    def _before(self, module: Any, args: tuple, kwargs: dict) -> None:
        names = ("hidden_states", "cache", "attention_mask")
        bound = dict(zip(names, args, strict=False)) | {k: kwargs[k] for k in names if k in kwargs}
        if bound.get("cache") is not self.cache or not self.cache.recording or self.replaying:
            return
        layer = self.linear[module.layer_idx]
        rows = self.cache.rows
        saved = rows.rollback_index
        assert saved is not None  # a replay is made only over rollback entries
        for name in layer.fields:
            live = rows.state(name)[layer.group]  # [B, ...]
            rows.cache.state_view(name)[layer.group].index_copy_(0, saved, live)
        hidden = bound["hidden_states"]
        self.inputs[module.layer_idx] = (
            hidden.detach().clone(),
            bound.get("attention_mask"),
            bool(layer.has_previous_state[0]),
        )

    def check(self, tokens_to_remove: int) -> None:
        """Refuse (nothing changed) a bad crop, or one longer than the last forward."""
        _cropped(1 << 62, tokens_to_remove)
        unrecorded = sorted(set(self.linear) - set(self.inputs))
        if tokens_to_remove and unrecorded:
            raise InvalidValueError(
                f"crop({tokens_to_remove}): layer {unrecorded[0]} kept no state from before its "
                "last forward (recording was off, or that forward was cropped already)"
            )
        for idx, (hidden, _, _) in self.inputs.items():
            if -tokens_to_remove > hidden.shape[1]:
                raise InvalidValueError(
                    f"crop({tokens_to_remove}): layer {idx} can roll back only the "
                    f"{hidden.shape[1]} tokens of its last forward"
                )

    def roll_back(self, remove: int) -> None:
        rows = self.cache.rows
        index = rows.rollback_index
        assert index is not None
        for idx, (hidden, mask, started) in self.inputs.items():
            if remove == 0:
                continue
            layer = self.linear[idx]
            for name in layer.fields:
                saved = rows.cache.state_view(name)[layer.group].index_select(0, index)
                rows.state(name)[layer.group].copy_(saved)
            layer.has_previous_state[0] = started
            keep = hidden.shape[1] - remove
            if keep:
                if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                    mask = mask[:, -hidden.shape[1] :][:, :keep]
                self.replaying = True
                try:
                    with torch.no_grad():
                        self.mixers[idx](
                            hidden_states=hidden[:, :keep], cache=self.cache, attention_mask=mask
                        )
                finally:
                    self.replaying = False
        self.inputs.clear()

    def forget(self) -> None:
        """Drop the recorded inputs (the crop was served without a replay)."""
        self.inputs.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.inputs.clear()
