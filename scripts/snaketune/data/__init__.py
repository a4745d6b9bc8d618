"""Datasets to tokens to shards: the config's dataset formats, chat templates,
conversations and preference pairs, tokenization, dataset sources, shards, packing and the
attention kernels it needs, batches. Imports only the core."""
