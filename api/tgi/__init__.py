"""TGI 0.9.4's protocol (``POST /``, ``/generate_stream``, ``/info``, ``/health``): its schemas and routes."""
