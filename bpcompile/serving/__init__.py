"""Triton Inference Server side of bpcompile: emit a model repository from engine versions (emit.py), serve it
with tritonserver (serve.py), talk to it (client.py). The Python-backend models copied into the repository are
in models/; protocol.py is their shared contract."""
