"""The seeds of pipeflow's random draws: a splitmix64 chain (Steele et al., OOPSLA'14) of the run's seed and what
draws, so that a draw depends on them alone, never on the plan, the replica or the rank (docs/reproducibility.md)::

    h = mix(seed mod 2**64); h = mix(h ^ t); h = mix(h ^ i); seed = h >> 1   (63 bits)

with t the global microbatch and i the global layer (stage.py: dropout), or SAMPLES for the samples of microbatch t
(data/loader.py: a dataset drawing random numbers in __getitem__)."""
from __future__ import annotations

_MASK64 = (1 << 64) - 1
SAMPLES = -1  # the index i of a microbatch's sample reads: no layer's


def _splitmix64(x: int) -> int:
    """One splitmix64 step: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def layer_seed(seed: int, microbatch: int, layer: int) -> int:
    """The 63-bit seed of global layer `layer` (or SAMPLES) on global microbatch `microbatch`."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (microbatch & _MASK64))
    return _splitmix64(h ^ (layer & _MASK64)) >> 1
