/* rng.h: the one splitmix64 of the tree (Steele, Lea, Flood 2014): a small, seedable generator
 * with the same sequence everywhere, and its finaliser as a 64-bit mixer for hashes.
 * Header-only; no state of its own (the caller owns the 64-bit state). No errors. */
#ifndef KVS_BASE_RNG_H
#define KVS_BASE_RNG_H

#include <stdint.h>

/* the splitmix64 finaliser: full avalanche over 64 bits */
static inline uint64_t kvs_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* the next value of the sequence whose state is *s (advances it) */
static inline uint64_t kvs_splitmix64(uint64_t *s)
{
    return kvs_mix64(*s += 0x9E3779B97F4A7C15ull);
}

#endif
