"""The OpenAI-compatible protocol under ``/v1``: its schemas and routes."""
