"""Schemathesis hooks for ``test_fuzz.py`` (loaded by the schemathesis CLI through ``SCHEMATHESIS_HOOKS``).

The binary request types have no built-in serializer: send the generated value as raw bytes, as for
``application/octet-stream``, so the fuzzer exercises the .npy and safetensors decoders with garbage.
"""

from __future__ import annotations

import schemathesis

schemathesis.serializer.alias(["application/x-npy", "application/x-safetensors"], "application/octet-stream")
