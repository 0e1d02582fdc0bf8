"""Counter-based random draws, keyed per example: albert's own generator for the masks.

A draw is a pure function of (key, stream, counter): no state advances, so a batch's draws are computed all at once,
as arrays, and any row's draws are the same in any batch, on any worker, in any order. The function is SplitMix64's
output function (Steele, Lea and Flood 2014; Java's SplittableRandom) evaluated at key + counter x golden gamma:

    mix(z)  = z ^ z >> 31 of (z ^ z >> 27) * 0x94D049BB133111EB of (z ^ z >> 30) * 0xBF58476D1CE4E5B9
    draw    = mix(key + (stream * 2**32 + counter + 1) * 0x9E3779B97F4A7C15)           (all mod 2**64)
    key     = mix((mix((mix(SALT ^ seed) + G) ^ epoch) + G) ^ example_id)              (G: the golden gamma)

Why this and not numpy's Philox or a Threefry: SplitMix64's sequence passes BigCrush, and it is 9 uint64 array
operations a draw in plain numpy (Philox-4x32 needs 10 rounds of 32 x 32 -> 64-bit products, about 10x the work
written over arrays; numpy's own Philox is one generator object per row, the per-row cost this module removes).
Its weakness, streams of nearby keys overlapping, does not arise: keys are themselves mixed, so two examples share
draws only when their keys differ by a multiple of the gamma, a chance of about 2**-64 a pair. Nothing here depends
on numpy's generators, so the draws are the same under any numpy version and on any platform.
"""

from __future__ import annotations

import numpy as np

GAMMA = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / the golden ratio, odd: SplitMix64's increment
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SALT = np.uint64(0xA1BE127A5C0FFEE1)  # the masks' keys differ from any other use of the same seed
LOW32 = np.uint64(0xFFFFFFFF)


def mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of uint64 values, in place (z is returned)."""
    z ^= z >> np.uint64(30)
    z *= _C1
    z ^= z >> np.uint64(27)
    z *= _C2
    z ^= z >> np.uint64(31)
    return z


def example_keys(seed: int, epochs: np.ndarray, example_ids: np.ndarray) -> np.ndarray:
    """The key of each example in its epoch (uint64, one per row): from the run's seed (taken modulo 2**64), the
    epoch and the example id, all non-negative integers."""
    epochs, example_ids = np.asarray(epochs), np.asarray(example_ids)
    for name, values in (("seed", np.asarray(seed)), ("epoch", epochs), ("example_id", example_ids)):
        if values.size and int(values.min()) < 0:
            raise ValueError(f"masks: {name} must be a non-negative integer, got {int(values.min())}")
    salted = _SALT ^ np.uint64(int(seed) % 2**64)
    with np.errstate(over="ignore"):
        key = mix(np.full(np.broadcast(epochs, example_ids).shape, salted, dtype=np.uint64))
        key = mix((key + GAMMA) ^ epochs.astype(np.uint64))
        return mix((key + GAMMA) ^ example_ids.astype(np.uint64))


def draws(keys: np.ndarray, stream: int, counters: np.ndarray) -> np.ndarray:
    """Draw number `counters` of `stream` under each key (uint64; keys and counters broadcast together): 64
    uniformly distributed bits each."""
    base = np.uint64(stream << 32) + np.uint64(1)
    z = (np.asarray(counters).astype(np.uint64) + base) * GAMMA + keys
    return mix(z)


def high_unit(bits: np.ndarray) -> np.ndarray:
    """The high 32 bits of each draw as a uniform number in [0, 1) (float64; multiples of 2**-32)."""
    return (bits >> np.uint64(32)).astype(np.float64) * 2.0**-32


def below(bits: np.ndarray, n: np.ndarray | int) -> np.ndarray:
    """The low 32 bits of each draw mapped to [0, n) by multiply-shift (int64; n < 2**32). Each value's probability
    is within n / 2**32 of 1/n (under 1e-5 relative for a 30,000-piece vocabulary)."""
    return (((bits & LOW32) * np.asarray(n).astype(np.uint64)) >> np.uint64(32)).astype(np.int64)
