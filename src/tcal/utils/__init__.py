"""The ground floor: errors, atomic file output, the cache and fetching, runtime (device, dtype,
autocast, RNG), the transformers compatibility layer and config dataclass <-> argparse."""
