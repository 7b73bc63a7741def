"""Built-in compressors of kvcompress (imported as ``kvcompress.plugins``).

One compressor per module.  Each module is registered through the
``kvcompress`` entry-point group, exactly like a third-party plugin.
"""
