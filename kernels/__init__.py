"""Attention and compression kernels of kvcompress (imported as ``kvcompress.kernels``).

Each op lives in its own subpackage with ``reference.py`` - a pure-PyTorch
implementation that is the CPU path, the test oracle and the benchmark
baseline - next to its GPU implementations with the same signature.  Nothing
is compiled or probed at import.
"""
