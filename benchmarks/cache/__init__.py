"""The radix tree and the cache tiers (host, storage)."""
