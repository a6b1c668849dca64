"""MindIE's native protocol (``/generate``'s vLLM dialect, ``/infer``, status, timed health): its schemas
and routes."""
