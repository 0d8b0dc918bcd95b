"""The lookup contract, pure: which boundary every layer group can resume from.

Given what each level holds — the device's cached KV and images, and what
the tiers below hold — the answer is the longest prefix EVERY group can
resume from:

- a full-attention group (every paged layer: one kvarena block holds all of
  them) needs every block up to the boundary;
- a state group needs a READY image taken exactly at that boundary. Sliding
  windows are such state here: kvarena keeps a window as a per-request ring,
  so "the blocks of the last window" are the ring's bytes in the image.

The groups' answers are combined by repeating until none shrinks; no
boundary that satisfies every group means 0, never a partial restore. Nothing
here touches a device cache: the holdings are asked through predicates, so
an engine that keeps its own device cache (a connector) uses the same
contract and the same tier walk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

from ..checks import check_count
from ..errors import InvalidValueError
from ..tiers.names import ImageKind, object_name


def resume_point(cand: int, has_state: bool, image_at: Callable[[int], bool]) -> int:
    """The resume point: the largest block boundary ``<= cand`` that every
    group can resume from, given that KV is held up to ``cand`` and ``image_at(b)`` says whether
    some level holds a state image at boundary ``b``."""
    while True:
        new = cand
        if has_state:
            while new > 0 and not image_at(new):
                new -= 1
        if new == cand:
            return cand
        cand = new


class Keys(Protocol):
    """A prompt's chained keys by block index: a list, or a chain hashed as far
    as it is asked for."""

    def __getitem__(self, i: int, /) -> bytes: ...


class Names(Protocol):
    """Object names of a run of a prompt's keys: ``kind``'s names of keys
    ``start`` to ``stop`` (a chain keeps them: a waiting request is looked up
    step after step)."""

    def __call__(self, kind: ImageKind, start: int, stop: int, /) -> list[str]: ...


class Locates(Protocol):
    """What the tier walk asks of the tiers: a :class:`~kvarena.tiers.TierStack`,
    or an engine's catalogue of tiers another process owns."""

    def locate(self, names: Sequence[str]) -> list[int | None]: ...


@dataclass(frozen=True, kw_only=True)
class ImagesWalked:
    """What an earlier walk of a prefix's boundaries found, for a caller that
    knows no image has joined a tier there since and the one found is still
    held: no image at boundaries ``image + 1`` to ``top``, and one at
    ``image`` (0: none down to boundary 1), in tier ``level``. A waiting
    hybrid request whose run holds no image is then asked again at the cost
    of the boundaries past ``top``, not of one name per boundary."""

    top: int
    image: int
    level: int | None = None


@dataclass(frozen=True, kw_only=True)
class TierFinds:
    """What the tiers add to the device's answer: the KV run's new end, the
    tier serving each block the device lacks, and the deepest boundary up to
    that end whose image a tier holds, where the device holds none as deep
    (the only one a resume point can be: :func:`resume_point`)."""

    kv_end: int
    kv: dict[int, int]  # block index -> tier index
    state: dict[int, int]  # resume point -> level of the tier holding its image
    walked: ImagesWalked | None = None  # what the walk of the tiers' images covered


def locate_in_tiers(
    tiers: Locates,
    keys: Keys,
    *,
    kv_end: int,
    limit: int,
    has_kv: bool,
    has_state: bool,
    device_kv: Callable[[bytes], bool] | None,
    device_image: Callable[[int], bool] | None,
    skip: Set[str] = frozenset(),
    names: Names | None = None,
    window: int = 32,
    known: int = 0,
    walked: ImagesWalked | None = None,
    below: dict[int, int] | None = None,
) -> TierFinds:
    """Extend the device's KV run (``kv_end`` blocks) with blocks the tiers
    hold, then find the boundaries up to it whose image a tier holds.

    KV is probed in windows that double while every block is found (``window``
    blocks first: 32, 64, 128...): a prompt that misses costs one small probe
    per tier, not one name per block of the prompt; a long hit costs log2(its
    length) probes. The first ``known`` keys cost no hashing (a caller that
    remembers them): the first window reaches to them at least, and the
    windows past them start over at ``window`` blocks, so a miss there (where
    what the caller remembers ends, most often) hashes ``window`` keys. Names in
    ``skip`` (objects that failed their checks) count as absent. ``device_kv``
    and ``device_image`` None: the device holds nothing past ``kv_end`` (an
    engine's scheduler, whose device cache vLLM has already matched).
    ``names``: where the keys' object names are kept (else made here).

    Images are probed from the run's end down, in windows of the same sizes,
    until one window holds an image (the device's or a tier's): only the
    deepest is a resume point, and a prompt holding one near its run's end
    (a turn's end, most often) costs a window, not a name per boundary.
    ``walked``: what a walk of the same boundaries found before
    (:class:`ImagesWalked`; a caller with no device images): the boundaries
    it covers are not probed again. The answer's ``walked`` is this walk's,
    for the next (None where no state is asked, or the device's images are).
    ``below``: the tiers of blocks below ``kv_end`` a caller found before (a
    waiting request's last run), in the answer's ``kv`` with this walk's; the
    caller's dict itself where the walk adds none (it is never changed)."""

    def named(kind: ImageKind, at: list[int]) -> list[str]:
        if names is not None and at and at[-1] - at[0] == len(at) - 1:  # a run
            return names(kind, at[0], at[-1] + 1)
        return [object_name(kind, keys[i]) for i in at]

    window = first = check_count(window, "locate_in_tiers: window (blocks)", lo=1)
    known = check_count(known, "locate_in_tiers: known (keys)")
    if walked is not None:
        _check_walked(walked, device_image)
    if below and (min(below) < 0 or max(below) >= kv_end):  # C-level passes: on every ask
        raise InvalidValueError(
            f"locate_in_tiers: below holds blocks {min(below)}..{max(below)}; "
            f"blocks under kv_end ({kv_end}), 0..{kv_end - 1}, are legal"
        )
    full = kv_end
    tier_kv: dict[int, int] = {}
    tier_state: dict[int, int] = {}
    if has_kv:
        stop = max(known, full + window)
        past_known = stop > full + window  # the first window stretched to the known keys
        while full < limit:
            todo = range(full, min(limit, stop))
            wanted = (
                list(todo) if device_kv is None else [i for i in todo if not device_kv(keys[i])]
            )
            asked = named(ImageKind.KV_BLOCK, wanted)
            for i, name, where in zip(wanted, asked, tiers.locate(asked), strict=True):
                if where is not None and name not in skip:
                    tier_kv[i] = where
            start = full
            if device_kv is None:
                while full < limit and full in tier_kv:
                    full += 1
            else:
                while full < limit and (full in tier_kv or device_kv(keys[full])):
                    full += 1
            if full < start + len(todo):
                break  # a gap: the run ends here
            if past_known:  # past the known keys the windows start over, small
                past_known = False
            else:
                window *= 2
            stop = full + window
    for i in [i for i in tier_kv if i >= full]:
        del tier_kv[i]
    hi, size = (full if has_kv else limit) if has_state else 0, first
    top, floor = hi, 0  # boundaries up to here are known from ``walked``
    if walked is not None and walked.image <= hi:
        floor = min(walked.top, hi)
    while hi > floor:  # boundaries hi, hi - 1, ... down to the first with an image
        lo = max(floor + 1, hi - size + 1)
        # a device image ends the walk: boundaries below it need no probe
        device = next(
            (b for b in range(hi, lo - 1, -1) if device_image is not None and device_image(b)),
            None,
        )
        at = list(range(lo if device is None else device + 1, hi + 1))
        asked = named(ImageKind.STATE, [b - 1 for b in at])
        held = [
            (b, where)
            for b, name, where in zip(at, asked, tiers.locate(asked), strict=True)
            if where is not None and name not in skip
        ]
        if held:
            b, where = held[-1]
            tier_state[b] = where
            break
        if device is not None:
            break
        hi, size = lo - 1, size * 2
    else:  # no image above the floor: the walk before found the deepest
        if floor and walked is not None and walked.level is not None:
            tier_state[walked.image] = walked.level
    now = None
    if has_state and device_image is None:
        image = max(tier_state, default=0)
        now = ImagesWalked(top=top, image=image, level=tier_state.get(image))
    if below:
        tier_kv = {**below, **tier_kv} if tier_kv else below
    return TierFinds(kv_end=full, kv=tier_kv, state=tier_state, walked=now)


def _check_walked(walked: ImagesWalked, device_image: Callable[[int], bool] | None) -> None:
    top = check_count(walked.top, "locate_in_tiers: walked.top (boundaries)")
    image = check_count(walked.image, "locate_in_tiers: walked.image (boundary)")
    if device_image is not None:
        raise InvalidValueError(
            "locate_in_tiers: walked (a walk of the tiers alone) with device_image; "
            "pass one or the other"
        )
    if image > top or (image > 0) != (walked.level is not None):
        raise InvalidValueError(
            f"locate_in_tiers: walked found an image at boundary {image} of the {top} it "
            f"walked, in tier {walked.level}: an image lies at or below the top, and has a "
            "tier exactly where it is not 0"
        )
