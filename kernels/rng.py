"""Counter-based random numbers keyed by (seed, element index).

Stochastic rounding must give the same bits on the CPU and on a GPU for the same seed, and
the same bits again on a rerun, whatever the chunking or launch configuration. So there is
no generator state: the random number of element ``i`` is a hash of ``(key, i)``, where
``key = rng_key(seed)``.

The hash is two rounds of the "lowbias32" integer mixer (xor-shift, multiply, xor-shift,
multiply, xor-shift) over the two 32-bit words of the index. Every intermediate value is
kept below 2**49, so the same plain-Python function gives identical results as Python
integers, as NumPy int64 scalars (the CUDA simulator) and as Numba int64 (CPU and CUDA)
without ever overflowing: multiplications by 32-bit constants are split into two 16-bit
halves. A uniform number in [0, 1) is ``(rng_bits(key, i) >> 8) * 2**-24`` (exact in
float32). ``cuda.py`` compiles these very functions and ``cpu/scalar.py`` computes them in
32-bit lanes (``rng_bits32``); ``reference.py`` has a vectorised NumPy twin that a test
checks against them.

CGX's stochastic rounding takes 16 random bits per element, from one hash per pair of
elements: element ``i`` gets half ``i % 2`` (low half first) of ``rng_bits(key, i // 2)``,
a uniform number ``half * 2**-16`` (half the hashing of one hash per element).
"""

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MUL_A = 0x7FEB352D
MUL_B = 0x846CA68B


def rng_bits(key, index):
    """Return a 32-bit hash of ``(key, index)`` (both non-negative, index < 2**63)."""
    h = key & MASK32
    for r in range(2):
        h = h ^ ((index >> (32 * r)) & MASK32)
        h = h ^ (h >> 16)
        h = ((h * (MUL_A & 0xFFFF)) + (((h * (MUL_A >> 16)) & 0xFFFF) << 16)) & MASK32
        h = h ^ (h >> 15)
        h = ((h * (MUL_B & 0xFFFF)) + (((h * (MUL_B >> 16)) & 0xFFFF) << 16)) & MASK32
        h = h ^ (h >> 16)
    return h


def rng_key(seed):
    """Return the 32-bit stream key of a non-negative seed (< 2**63)."""
    return rng_bits(GOLDEN, seed)
