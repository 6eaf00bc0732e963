"""bpcompile: draft + verifier checkpoints -> INT4/FP8-outlier KV cache, tree speculative decoding, Triton repository."""

__version__ = "0.1.0"
