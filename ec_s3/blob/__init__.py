"""The blob: its format constants, its safetensors codec and the keys it lives at.

Imports neither vLLM nor anything of ec-s3 above it; ``format`` and ``keys`` are
torch-free so the store and the CLI can use them without importing torch.
"""
