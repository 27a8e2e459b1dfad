"""The service's commands (as MLServer's ``cli/``), each a parser and a ``run`` thin over
the code it runs; ``orthornn.cli`` composes them. Torch-free, and each imports its heavy
modules only when it runs; the offline ones (labels, capture, monitor, trigger) import
neither FastAPI, pydantic nor prometheus_client, so they run in the training image.

- ``serve``: ``orthornn serve``, one flag per setting (``server.launch``);
- ``predict``: ``orthornn predict``, a standard-library client of /predict;
- ``rollout``: ``orthornn rollout start/status/promote/abort/run`` (the controller);
- ``labels``: ``orthornn labels import`` (``loop.labels``'s store);
- ``capture``: ``orthornn capture dataset`` (``export.artifacts.loop.dataset``);
- ``monitor``: ``orthornn monitor`` (``export.artifacts.loop.monitor``): table, plot, exit;
- ``trigger``: ``orthornn retrain-trigger`` (``export.artifacts.loop.trigger``);
- ``flags``: what their flags share.
"""
