"""HTTP API pods: protocol adapters (TGI, KServe v2) over one Redis Streams pipeline."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ferry-llm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"
