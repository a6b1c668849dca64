"""The KServe v2 / Triton protocol under ``/v2``: its schemas and routes."""
