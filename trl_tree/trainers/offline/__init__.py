"""Offline training on a fixed data set: SFT and DPO, with the prefix-aware sampler and the data checks."""
