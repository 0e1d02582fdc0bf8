"""numpy's PCG64 generators, many at once: the streams of ``example_rng(seed, epoch, example_id)`` for a batch of
rows, computed with whole-array numpy instead of one ``Generator`` per row.

``albert_core.examples.masking.example_rng`` seeds ``np.random.Generator(PCG64(SeedSequence(seed, spawn_key=(epoch,
id))))``. Every draw such a generator makes is a function of its 128-bit PCG state and increment and of how many 64-bit
outputs came before it, so a batch's draws can be computed directly:

1. ``SeedSequence``: the entropy words [seed words, zero-padded to 4] + [epoch words] + [id words] (each integer as
   little-endian 32-bit words, 0 as one word) are hashed into a pool of four uint32 (``mix_entropy``), and
   ``generate_state(4, uint64)`` expands the pool into PCG64's seed and sequence (numpy/random/bit_generator.pyx).
   The hash constants advance the same way for every row, so each step is one uint32 operation over the batch.
2. ``PCG64``: state' = state * MULTIPLIER + inc (mod 2**128); output k is XSL-RR of the state after k + 1 steps,
   and that state is MULTIPLIER**(k+1) * s0 + (MULTIPLIER**k + ... + 1) * inc, so any output of any row is two
   128-bit multiply-adds with precomputed powers (numpy/random/src/pcg64).
3. What ``Generator`` makes of the outputs: ``random()`` is (output >> 11) * 2**-53, one output each; 32-bit draws
   (bounded integers, ``choice``, ``permutation``) take the low half of an output and keep its high half for the
   next 32-bit draw, and doubles in between leave that kept half alone (``pcg64_next32``). `u32` addresses 32-bit
   draws by a virtual index v: the low half of output v // 2 when v is even, its high half when odd.

Equality with numpy's generators is what tests/test_masking_batch.py checks, draw by draw.
"""

from __future__ import annotations

import functools

import numpy as np

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
MULTIPLIER = (0x2360ED051FC65DA4 << 64) | 0x4385DF649FCCF645  # PCG_DEFAULT_MULTIPLIER_128

# SeedSequence's hash constants (numpy/random/bit_generator.pyx)
INIT_A, MULT_A = 0x43B0D7E5, 0x931E8875
INIT_B, MULT_B = 0x8B51F9DD, 0x58F38DED
MIX_MULT_L, MIX_MULT_R = 0xCA01F9DD, 0x4973F715
POOL_SIZE = 4

_M32 = np.uint64(MASK32)
_CHUNK = 8192  # outputs computed together
_U32 = np.uint32


def uint32_words(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative int64 values as SeedSequence words: (low word, high word) and the count, 1 or 2, per value."""
    values = np.asarray(values, dtype=np.int64).astype(np.uint64)
    return np.stack([values & _M32, values >> np.uint64(32)], axis=1).astype(np.uint32), 1 + (values > _M32)


def _int_words(n: int) -> list[int]:
    words = [0] if n == 0 else []
    while n > 0:
        words.append(n & MASK32)
        n >>= 32
    return words


def _hash_constants(init: int, mult: int, count: int) -> list[int]:
    """The multiplier used by each of `count` successive hashmix calls (hash_const after its update)."""
    out, const = [], init
    for _ in range(count):
        const = (const * mult) & MASK32
        out.append(const)
    return out


def _hashmix(value, before: int, after: int):
    """SeedSequence's hashmix with the hash constant before and after its update (uint32 arrays or ints)."""
    value = (value ^ _U32(before)) * _U32(after)
    return value ^ (value >> _U32(16))


def _mix(x, y):
    result = _U32(MIX_MULT_L) * x - _U32(MIX_MULT_R) * y
    return result ^ (result >> _U32(16))


@functools.cache
def _common_pool(seed: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The pool after the first POOL_SIZE entropy words (the seed's, the same for every row), the seed's words past
    them, and how many hashmix calls were made."""
    run = _int_words(seed)
    run += [0] * (POOL_SIZE - len(run))  # a spawn key is given: the run entropy is padded to the pool size
    consts = _hash_constants(INIT_A, MULT_A, 64)
    calls = 0
    with np.errstate(over="ignore"):
        pool = []
        for i in range(POOL_SIZE):
            pool.append(_hashmix(_U32(run[i]), ([INIT_A] + consts)[calls], consts[calls]))
            calls += 1
        for i_src in range(POOL_SIZE):
            for i_dst in range(POOL_SIZE):
                if i_src != i_dst:
                    pool[i_dst] = _mix(pool[i_dst], _hashmix(pool[i_src], ([INIT_A] + consts)[calls], consts[calls]))
                    calls += 1
    return tuple(int(p) for p in pool), tuple(run[POOL_SIZE:]), calls


def seed_pools(seed: int, epochs: np.ndarray, example_ids: np.ndarray) -> np.ndarray:
    """SeedSequence(seed, spawn_key=(epoch, id)).pool for each row: (rows, 4) uint32."""
    if seed < 0 or np.any(epochs < 0) or np.any(example_ids < 0):
        raise ValueError("seed_pools: seed, epochs and example ids must be non-negative")
    first, extra_seed, calls = _common_pool(int(seed))
    rows = len(example_ids)
    epoch_words, epoch_n = uint32_words(epochs)
    id_words, id_n = uint32_words(example_ids)
    # the words past the pool, per row: the seed's extra words, then the epoch's 1-2, then the id's 1-2
    n_extra = len(extra_seed) + epoch_n + id_n
    width = int(n_extra.max())
    extra = np.zeros((rows, width), dtype=np.uint32)
    extra[:, : len(extra_seed)] = np.asarray(extra_seed, dtype=np.uint32)
    at = np.full(rows, len(extra_seed))
    r = np.arange(rows)
    for words, n in ((epoch_words, epoch_n), (id_words, id_n)):
        extra[r, at] = words[:, 0]
        extra[r[n == 2], at[n == 2] + 1] = words[n == 2, 1]
        at = at + n
    consts = _hash_constants(INIT_A, MULT_A, calls + POOL_SIZE * width)
    before = [INIT_A] + consts
    pool = np.tile(np.asarray(first, dtype=np.uint32), (rows, 1))
    with np.errstate(over="ignore"):
        for k in range(width):
            live = n_extra > k
            for i_dst in range(POOL_SIZE):
                c = calls + k * POOL_SIZE + i_dst
                mixed = _mix(pool[:, i_dst], _hashmix(extra[:, k], before[c], consts[c]))
                pool[:, i_dst] = np.where(live, mixed, pool[:, i_dst])
    return pool


def generate_state64(pool: np.ndarray, n_words: int = 4) -> np.ndarray:
    """SeedSequence.generate_state(n_words, np.uint64) for each row's pool: (rows, n_words) uint64."""
    consts = _hash_constants(INIT_B, MULT_B, 2 * n_words)
    before = [INIT_B] + consts
    words = []
    with np.errstate(over="ignore"):
        for i in range(2 * n_words):
            value = (pool[:, i % POOL_SIZE] ^ _U32(before[i])) * _U32(consts[i])
            words.append((value ^ (value >> _U32(16))).astype(np.uint64))
    return np.stack([words[2 * k] | (words[2 * k + 1] << np.uint64(32)) for k in range(n_words)], axis=1)


# --- 128-bit arithmetic on (high, low) uint64 arrays -------------------------------------------------------------
#
# The state after n steps from s is M**n s + (M**(n-1) + ... + 1) inc. M - 1 = 4q with q odd, so with
# D_n = (M**n - 1) / 4 and y = inc / q (q is invertible mod 2**128) this is s + D_n (4s + y): one 128-bit product per
# output, of a constant of the output's number and a constant of the row.

_MOD128 = (1 << 128) - 1
_Q = (MULTIPLIER - 1) >> 2
_Q_INVERSE = pow(_Q, -1, 1 << 128)
_CHUNK = 8192  # outputs computed together: numpy's many temporaries then stay in the cache


def _split(values) -> tuple[np.ndarray, np.ndarray]:
    values = [int(v) for v in values]
    return (
        np.asarray([v >> 64 for v in values], dtype=np.uint64),
        np.asarray([v & MASK64 for v in values], dtype=np.uint64),
    )


@functools.cache
def _steps_table(size: int) -> tuple[np.ndarray, np.ndarray]:
    """D_n = (M**n - 1) / 4 mod 2**128 for n < size, as (high, low) uint64 arrays."""
    values, power = [], 1
    for _ in range(size):
        values.append(((power - 1) % (1 << 130)) >> 2)
        power = (power * MULTIPLIER) % (1 << 130)
    return _split(values)


def _constant(value: int) -> tuple[np.uint64, np.uint64]:
    return np.uint64(value >> 64), np.uint64(value & MASK64)


def _table(needed: int) -> tuple[np.ndarray, np.ndarray]:
    return _steps_table(max(64, 1 << (int(needed) - 1).bit_length()))


def _mulhi64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The high 64 bits of the 128-bit product of uint64 arrays."""
    a0, a1, b0, b1 = a & _M32, a >> np.uint64(32), b & _M32, b >> np.uint64(32)
    p01, p10 = a0 * b1, a1 * b0
    mid = ((a0 * b0) >> np.uint64(32)) + (p01 & _M32) + (p10 & _M32)
    return a1 * b1 + (p01 >> np.uint64(32)) + (p10 >> np.uint64(32)) + (mid >> np.uint64(32))


def _outputs(state, steps, z) -> np.ndarray:
    """XSL-RR (PCG64's output function) of state + steps * z (mod 2**128), (high, low) uint64 arrays broadcast
    together."""
    high, low = _advance(state, steps, z)
    x = high ^ low
    rot = high >> np.uint64(58)
    return (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))


class RowStreams:
    """The PCG64 output streams of ``example_rng(seed, epoch, example_id)`` for a batch of rows."""

    def __init__(self, seed: int, epochs: np.ndarray, example_ids: np.ndarray):
        words = generate_state64(seed_pools(seed, np.asarray(epochs), np.asarray(example_ids)))
        one, zero = np.uint64(1), np.zeros(len(words), dtype=np.uint64)
        with np.errstate(over="ignore"):
            # pcg64_set_seed: state = 0, inc = (initseq << 1) | 1; step; state += initstate; step. Output k is then
            # made from the state k + 1 steps further.
            inc = ((words[:, 2] << one) | (words[:, 3] >> np.uint64(63)), (words[:, 3] << one) | one)
            state = _advance(inc, (zero, zero + one), (words[:, 0], words[:, 1]))  # 0 * M + inc + initstate
            self._state = _advance(inc, state, _constant(MULTIPLIER))
            self._y = _advance((zero, zero), inc, _constant(_Q_INVERSE))  # y = inc / q
            self._z = _plus_4x(self._state, self._y)

    def u64(self, rows: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Output number `index` (0 = the first) of each row in `rows` (arrays of the same shape), uint64."""
        rows, index = np.asarray(rows), np.asarray(index)
        out = np.empty(index.shape, dtype=np.uint64)
        if index.size == 0:
            return out
        dh, dl = _table(int(index.max()) + 2)
        flat_rows, flat_steps, flat_out = rows.ravel(), index.ravel() + 1, out.ravel()
        for at in range(0, flat_out.size, _CHUNK):
            r, n = flat_rows[at : at + _CHUNK], flat_steps[at : at + _CHUNK]
            with np.errstate(over="ignore"):
                flat_out[at : at + _CHUNK] = _outputs(
                    (self._state[0][r], self._state[1][r]), (dh[n], dl[n]), (self._z[0][r], self._z[1][r])
                )
        return out

    def block(self, start: np.ndarray, width: int) -> np.ndarray:
        """Outputs start[b], start[b] + 1, ..., start[b] + width - 1 of every row: rows x width uint64."""
        start = np.asarray(start, dtype=np.int64)
        out = np.empty((start.size, width), dtype=np.uint64)
        if out.size == 0:
            return out
        # rebase each row on the state `start` steps on: its own (state, z), then one product per output
        dh, dl = _table(int(start.max()) + width + 1)
        with np.errstate(over="ignore"):
            high, low = _advance(self._state, (dh[start], dl[start]), self._z)
            z_high, z_low = _plus_4x((high, low), self._y)
        steps = (dh[1 : width + 1][None, :], dl[1 : width + 1][None, :])
        rows_per_chunk = max(1, _CHUNK // width)
        for at in range(0, start.size, rows_per_chunk):
            part = slice(at, at + rows_per_chunk)
            with np.errstate(over="ignore"):
                out[part] = _outputs(
                    (high[part, None], low[part, None]), steps, (z_high[part, None], z_low[part, None])
                )
        return out

    def doubles(self, rows: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Generator.random(): the double made from output `index` of each row."""
        return to_doubles(self.u64(rows, index))

    def u32(self, rows: np.ndarray, virtual: np.ndarray) -> np.ndarray:
        """32-bit draws by virtual index: the low half of output v // 2 for even v, its high half for odd v."""
        virtual = np.asarray(virtual, dtype=np.int64)
        out = self.u64(rows, virtual >> 1)
        return (out >> ((virtual & 1).astype(np.uint64) * np.uint64(32))) & _M32

    def u32_block(self, virtual: np.ndarray, width: int) -> np.ndarray:
        """32-bit draws virtual[b], virtual[b] + 1, ... of every row: rows x width uint64 (values below 2**32)."""
        virtual = np.asarray(virtual, dtype=np.int64)
        outputs = self.block(virtual >> 1, (width + 2) // 2)
        halves = np.empty((virtual.size, 2 * outputs.shape[1]), dtype=np.uint64)
        halves[:, 0::2] = outputs & _M32
        halves[:, 1::2] = outputs >> np.uint64(32)
        odd = (virtual & 1).astype(bool)[:, None]
        return np.where(odd, halves[:, 1 : width + 1], halves[:, :width])


def to_doubles(outputs: np.ndarray) -> np.ndarray:
    """Generator.random() of 64-bit outputs: (output >> 11) * 2**-53."""
    return (outputs >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def _advance(state, steps, z):
    """state + steps * z (mod 2**128), without the output function."""
    (sh, sl), (dh, dl), (zh, zl) = state, steps, z
    low = dl * zl
    high = _mulhi64(dl, zl) + dl * zh + dh * zl
    out_low = low + sl
    return high + sh + (out_low < low), out_low


def _plus_4x(x, y):
    """4 x + y (mod 2**128) for (high, low) uint64 arrays."""
    (xh, xl), (yh, yl) = x, y
    with np.errstate(over="ignore"):
        four_h, four_l = (xh << np.uint64(2)) | (xl >> np.uint64(62)), xl << np.uint64(2)
        low = four_l + yl
        return four_h + yh + (low < four_l), low
