"""The single-command launcher (``ferry-server``): embedded Redis, the API pod and the workers under one
process. It sits above :mod:`api` and :mod:`worker`, which never import each other."""
