"""HTTP API pods: protocol adapters (TGI, KServe v2) over one Redis Streams pipeline."""

from common.process import ferry_version

__version__ = ferry_version()
